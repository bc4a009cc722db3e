"""W8A8 linear layers on torch_npu's quantized API, as upstream's quantization/methods/
w8a8_dynamic.py and w8a8_static.py call it (contracts in docs/torch_npu_calls.md).

Weights are int8 per output channel, symmetric. Activations are quantized per token at run time
(W8A8_DYNAMIC: ``npu_dynamic_quant``) or with the checkpoint's calibrated scale and offset
(W8A8: ``npu_quantize``); ``npu_quant_matmul`` multiplies and dequantizes. A norm before the
layer may hand it an already quantized activation (``add_norm_quant``, the fusion the family
files wire up), which ``apply`` takes as is; in compiled pieces the norm-quant fusion pass
(compilation/passes.py) makes the same fusion for any family.

Every tensor a layer loads is checked (dtype, and that it arrived) and the layer's name is in
each error, with the fix: a malformed checkpoint fails at load, not with wrong output.
"""

import torch
from torch.library import Library
from vllm.model_executor.layers.linear import LinearMethodBase, RowParallelLinear
from vllm.model_executor.utils import set_weight_attrs
from vllm.utils.torch_utils import direct_register_custom_op

from vllm_ascend.device import torch_npu

FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _quantize(x: torch.Tensor, scale: torch.Tensor, scale_reciprocal: torch.Tensor,
              offset: torch.Tensor) -> torch.Tensor:
    """W8A8's activation quantization, multiplying by the reciprocal (upstream's
    ``_quantize_impl``). One op that also takes ``scale``, as upstream's ``vllm.quantize``: the
    norm-quant fusion pass hands it to npu_add_rms_norm_quant, which divides by it."""
    return torch_npu.npu_quantize(x, scale_reciprocal, offset, torch.qint8, -1, False)


def _quantize_fake(x, scale, scale_reciprocal, offset):
    return torch.empty_like(x, dtype=torch.int8)


_lib = Library("vllm_ascend", "FRAGMENT")
direct_register_custom_op("quantize", _quantize, fake_impl=_quantize_fake, target_lib=_lib)


class CheckpointError(ValueError):
    pass


def refuse_weight_offsets(prefix: str, offsets, what: str, op: str) -> None:
    """Refuse asymmetric int8 weights: ``op`` takes no weight offset, so every offset must be
    zero."""
    if any(bool(offset.ne(0).any()) for offset in offsets):
        raise CheckpointError(
            f"{prefix}: weight_offset is not zero; vllm-ascend runs symmetric int8 {what} only "
            f"({op} takes no weight offset). Quantize the weights symmetrically with ModelSlim "
            "(w_sym=True)")


class _Tensor:
    """One tensor a scheme loads: its shape kind, the dtypes a checkpoint may hold it in, the
    dtype it is kept in here, and whether a layer must carry it."""

    def __init__(self, kind: str, accepted: tuple, kept: torch.dtype, required: bool = True):
        self.kind, self.accepted, self.kept, self.required = kind, accepted, kept, required


class W8A8Method(LinearMethodBase):
    """What the two schemes share: int8 weights per output channel, the loading checks, the
    transposed weight layout npu_quant_matmul takes (x2 is [k, n])."""

    quant_type = ""
    tensors: dict[str, _Tensor] = {}

    def __init__(self, prefix: str):
        self.prefix = prefix

    def tensor_specs(self, params_dtype: torch.dtype) -> dict[str, _Tensor]:
        return self.tensors

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size,
                       output_size, params_dtype, **extra_weight_attrs):
        out = sum(output_partition_sizes)
        layer.ascend_shards = len(output_partition_sizes)
        layer.ascend_loaded = {}
        loader = extra_weight_attrs.pop("weight_loader")
        for name, spec in self.tensor_specs(params_dtype).items():
            shape = {"weight": (out, input_size_per_partition), "channel": (out,),
                     "channel2d": (out, 1), "tensor": (1,)}[spec.kind]
            param = torch.nn.Parameter(torch.empty(shape, dtype=spec.kept),
                                       requires_grad=False)
            attrs = {"input_dim": 1, "output_dim": 0} if spec.kind == "weight" else (
                {"output_dim": 0} if spec.kind.startswith("channel") else {"ignore_warning": True})
            set_weight_attrs(param, {**attrs, **extra_weight_attrs,
                                     "weight_loader": self._checked(loader, layer, name, spec)})
            layer.register_parameter(name, param)

    def _checked(self, loader, layer, name, spec):
        def load(param, loaded_weight, *args, **kwargs):
            if loaded_weight.dtype not in spec.accepted:
                raise CheckpointError(
                    f"{self.prefix}.{name} is {loaded_weight.dtype} in the checkpoint; a "
                    f"{self.quant_type} layer's {name} must be "
                    f"{' or '.join(str(d).removeprefix('torch.') for d in spec.accepted)}"
                    f"{self.dtype_hint(name, loaded_weight.dtype)}. Re-export the model with "
                    "ModelSlim, or mark the layer FLOAT in quant_model_description.json with "
                    "its float weights")
            layer.ascend_loaded.setdefault(name, set()).add(args[0] if args else None)
            return loader(param, loaded_weight, *args, **kwargs)

        return load

    def dtype_hint(self, name: str, got: torch.dtype) -> str:
        return ""

    def check_loaded(self, layer) -> None:
        for name, spec in self.tensor_specs(layer.params_dtype).items():
            got = len(layer.ascend_loaded.get(name, ()))
            if spec.required and got < layer.ascend_shards:
                carried = ", ".join(n for n, s in self.tensors.items() if s.required)
                raise CheckpointError(
                    f"{self.prefix}: the checkpoint has no {name} for "
                    f"{'it' if layer.ascend_shards == 1 else 'each of its merged projections'}"
                    f" (a {self.quant_type} layer carries {carried}). Re-export the model with "
                    "ModelSlim, or mark the layer FLOAT in quant_model_description.json with "
                    "its float weights")
        if "weight_offset" in layer.ascend_loaded:
            refuse_weight_offsets(self.prefix, [layer.weight_offset], "weights",
                                  "npu_quant_matmul")
        layer.ascend_loaded = {}  # a reload (vLLM's reload_weights, sleep mode) counts afresh

    def process_weights_after_loading(self, layer) -> None:
        self.check_loaded(layer)
        layer.weight = torch.nn.Parameter(layer.weight.data.t().contiguous(),
                                          requires_grad=False)  # [k, n]

    @staticmethod
    def is_first_rank_of_row_split(layer) -> bool:
        """A row-parallel layer's partial sums are all-reduced: a bias goes on one rank only."""
        return not isinstance(layer, RowParallelLinear) or layer.tp_rank == 0


class W8A8DynamicMethod(W8A8Method):
    """W8A8_DYNAMIC: per-token activation scales, computed at run time."""

    quant_type = "W8A8_DYNAMIC"
    tensors = {"weight": _Tensor("weight", (torch.int8,), torch.int8),
               "weight_scale": _Tensor("channel2d", FLOATS, torch.float32),
               "weight_offset": _Tensor("channel2d", FLOATS, torch.float32)}

    def process_weights_after_loading(self, layer) -> None:
        super().process_weights_after_loading(layer)
        # float32: the one scale dtype npu_quant_matmul takes with a per-token scale for both
        # float16 and bfloat16 outputs.
        layer.weight_scale = torch.nn.Parameter(layer.weight_scale.data.flatten(),
                                                requires_grad=False)

    def add_norm_quant(self, layer, x, residual, gamma, eps):
        """Add + RMSNorm + per-token quantization in one op: ((x_int8, scale), x + residual)."""
        y, _, added, scale, _ = torch_npu.npu_add_rms_norm_dynamic_quant(
            x, residual, gamma, epsilon=eps, output_mask=[True, False])
        return (y, scale), added

    def apply(self, layer, x, bias=None):
        x, scale = x if isinstance(x, tuple) else torch_npu.npu_dynamic_quant(
            x, dst_type=torch.int8)  # a tuple: quantized by the norm before (add_norm_quant)
        return torch_npu.npu_quant_matmul(x, layer.weight, layer.weight_scale,
                                          pertoken_scale=scale, bias=bias,
                                          output_dtype=layer.params_dtype)


class W8A8StaticMethod(W8A8Method):
    """W8A8: one calibrated activation scale and offset per layer; the float bias and the
    activation offset are folded into an int32 ``quant_bias``, and ``deq_scale`` (input scale
    times weight scale) dequantizes the int32 product."""

    quant_type = "W8A8"
    tensors = {"weight": _Tensor("weight", (torch.int8,), torch.int8),
               "input_scale": _Tensor("tensor", FLOATS, torch.float32),
               "input_offset": _Tensor("tensor", FLOATS + (torch.int8,), torch.float32),
               "quant_bias": _Tensor("channel", (torch.int32,), torch.int32),
               "deq_scale": _Tensor("channel", (torch.int64, torch.float32), torch.float32),
               # Carried by some exports, unused at run time (deq_scale holds the scale).
               "weight_scale": _Tensor("channel2d", FLOATS, torch.float32, required=False),
               "weight_offset": _Tensor("channel2d", FLOATS, torch.float32, required=False)}

    def tensor_specs(self, params_dtype):
        # ModelSlim writes deq_scale as int64 (npu_trans_quant_param's encoding) for float16
        # models and as float32 for bfloat16 ones: the scale dtypes npu_quant_matmul takes for
        # each output dtype without a per-token scale.
        kept = torch.int64 if params_dtype == torch.float16 else torch.float32
        return {**self.tensors, "deq_scale": _Tensor("channel", (kept,), kept)}

    def dtype_hint(self, name, got):
        if name == "deq_scale" and got in (torch.int64, torch.float32):
            made_for = "float16" if got == torch.int64 else "bfloat16"
            return (f" for this model's dtype (this checkpoint was exported for {made_for}: "
                    f"run it with --dtype {made_for})")
        return ""

    def process_weights_after_loading(self, layer) -> None:
        super().process_weights_after_loading(layer)
        width, dtype = layer.weight.shape[0], layer.params_dtype
        scale, offset = layer.input_scale.data, layer.input_offset.data
        # npu_quantize multiplies (div_mode=False, as upstream's _quantize_impl), the fused norm
        # divides (npu_add_rms_norm_quant's div_mode=True): both get per-channel vectors in the
        # activation's dtype, the offset in the scale's dtype.
        for name, value in (("aclnn_input_scale", scale), ("aclnn_input_scale_reciprocal",
                                                          1 / scale),
                            ("aclnn_input_offset", offset)):
            value = value.repeat(width).to(dtype)
            if hasattr(layer, name):  # a reload (sleep mode): captured graphs read the old one
                getattr(layer, name).copy_(value)
            else:
                setattr(layer, name, value)

    def add_norm_quant(self, layer, x, residual, gamma, eps):
        y, _, added = torch_npu.npu_add_rms_norm_quant(
            x, residual, gamma, layer.aclnn_input_scale, layer.aclnn_input_offset, epsilon=eps)
        return y, added

    def apply(self, layer, x, bias=None):
        if x.dtype != torch.int8:
            x = torch.ops.vllm_ascend.quantize.default(x, layer.aclnn_input_scale,
                                                       layer.aclnn_input_scale_reciprocal,
                                                       layer.aclnn_input_offset)
        # The float bias is folded into quant_bias (vLLM's own bias is left unused, as upstream).
        quant_bias = layer.quant_bias if self.is_first_rank_of_row_split(layer) else None
        return torch_npu.npu_quant_matmul(x, layer.weight, layer.deq_scale, bias=quant_bias,
                                          output_dtype=layer.params_dtype)


SCHEMES = {"W8A8_DYNAMIC": W8A8DynamicMethod, "W8A8": W8A8StaticMethod}
