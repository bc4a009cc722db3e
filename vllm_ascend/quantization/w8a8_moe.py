"""W8A8_DYNAMIC MoE experts (the experts of DeepSeek's and Qwen3-MoE's ModelSlim exports) on
torch_npu's quantized grouped matmul, as upstream's quantization/methods/w8a8_dynamic.py
(``AscendW8A8DynamicFusedMoEMethod``) and ops/fused_moe/moe_mlp.py (``quant_apply_mlp``, its
all-gather path) call it: the tokens sorted by expert are quantized per token
(``npu_dynamic_quant``), multiplied by each expert's int8 gate/up weights and dequantized by the
weight's per-channel scale and the token's scale in one ``npu_grouped_matmul``, then SwiGLU,
quantized per token again, and the down projection the same way. Contracts in
docs/torch_npu_calls.md.

Routing, the data-parallel gather and the unpermute are the unquantized layer's
(ops/fused_moe/method.py ``AscendMoEExperts``). Every tensor an expert loads is checked (dtype,
and that each local expert's projections arrived), naming the layer, with the fix.
"""

import torch
from vllm.model_executor.layers.fused_moe import MoEActivation
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.routed_experts import FusedMoeWeightScaleSupported
from vllm.model_executor.utils import set_weight_attrs

from vllm_ascend.device import torch_npu
from vllm_ascend.ops.fused_moe.method import AscendMoEExperts
from vllm_ascend.quantization.w8a8 import FLOATS, CheckpointError, refuse_weight_offsets

# The weight scale's dtype npu_grouped_matmul takes for each output dtype with a per-token scale
# (torch_npu's table: bfloat16 for bfloat16 output, float32 for float16 output).
GMM_SCALE_DTYPE = {torch.bfloat16: torch.bfloat16, torch.float16: torch.float32}
PROJECTIONS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}  # vLLM's shard ids
FIX = ("Re-export the model with ModelSlim, or export its experts FLOAT (ModelSlim's "
       "disable_names)")


class AscendW8A8DynamicFusedMoEMethod(AscendMoEExperts, FusedMoEMethodBase):
    """int8 experts per output channel, symmetric; activations quantized per token."""

    activations = {MoEActivation.SILU: None}  # SwiGLU (npu_swiglu) only
    experts_kind = "W8A8_DYNAMIC (int8 per channel, activations quantized per token)"

    def __init__(self, moe, prefix: str):
        super().__init__(moe)
        self.prefix = prefix

    def create_weights(self, layer, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype,
                       **extra_weight_attrs):
        loader = extra_weight_attrs.pop("weight_loader")
        inter = intermediate_size_per_partition
        # vLLM's layouts ([E, N, K] weights), scales and offsets per output channel [E, N, 1]
        shapes = {"w13_weight": (num_experts, 2 * inter, hidden_size),
                  "w2_weight": (num_experts, hidden_size, inter),
                  "w13_weight_scale": (num_experts, 2 * inter, 1),
                  "w13_weight_offset": (num_experts, 2 * inter, 1),
                  "w2_weight_scale": (num_experts, hidden_size, 1),
                  "w2_weight_offset": (num_experts, hidden_size, 1)}
        for name, shape in shapes.items():
            weight = name.endswith("_weight")
            param = torch.nn.Parameter(
                torch.empty(shape, dtype=torch.int8 if weight else torch.float32),
                requires_grad=False)
            layer.register_parameter(name, param)
            attrs = {"weight_loader": self._checked(loader, layer, name, weight)}
            if not weight:  # vLLM loads them per output channel, split as their weight
                attrs["quant_method"] = FusedMoeWeightScaleSupported.CHANNEL.value
            set_weight_attrs(param, attrs)
        layer.ascend_loaded = {}

    def _checked(self, loader, layer, name, weight: bool):
        accepted = (torch.int8,) if weight else FLOATS

        def load(param, loaded_weight, weight_name, shard_id, expert_id, return_success=False):
            if loaded_weight.dtype not in accepted:
                tensor = f"{PROJECTIONS.get(shard_id, shard_id)}.{name.split('_', 1)[1]}"
                raise CheckpointError(
                    f"{self.prefix}: expert {expert_id}'s {tensor} is {loaded_weight.dtype} in "
                    f"the checkpoint; a W8A8_DYNAMIC expert's weight must be int8 and its scale "
                    f"and offset float. {FIX}")
            if layer._map_global_expert_id_to_local_expert_id(expert_id) >= 0:
                layer.ascend_loaded.setdefault(name, set()).add((expert_id, shard_id))
            return loader(param, loaded_weight, weight_name, shard_id=shard_id,
                          expert_id=expert_id, return_success=return_success)

        return load

    def get_fused_moe_quant_config(self, layer):
        return None  # no modular kernel: the layer runs its own grouped matmuls

    def check_loaded(self, layer) -> None:
        for name in ("w13_weight", "w13_weight_scale", "w13_weight_offset", "w2_weight",
                     "w2_weight_scale", "w2_weight_offset"):
            shards = 2 if name.startswith("w13") else 1  # gate and up; down
            got = len(layer.ascend_loaded.get(name, ()))
            if got < layer.local_num_experts * shards:
                tensor = name.split("_", 1)[1]
                raise CheckpointError(
                    f"{self.prefix}: the checkpoint has {got} of the "
                    f"{layer.local_num_experts * shards} {tensor} tensors of this rank's "
                    f"{'gate/up' if shards == 2 else 'down'} projections (a W8A8_DYNAMIC "
                    f"expert carries weight, weight_scale and weight_offset). {FIX}")
        refuse_weight_offsets(self.prefix, [layer.w13_weight_offset, layer.w2_weight_offset],
                              "experts", "npu_grouped_matmul")
        layer.ascend_loaded = {}

    def process_weights_after_loading(self, layer) -> None:
        self.check_layer(layer)
        self.check_loaded(layer)
        # [E, K, N] int8 weights, and [E, N] scales in the dtype the grouped matmul takes with
        # the model's dtype, once, as upstream does after loading.
        scale_dtype = GMM_SCALE_DTYPE[self.moe.in_dtype]
        for name in ("w13", "w2"):
            weight = getattr(layer, f"{name}_weight")
            weight.data = weight.data.transpose(1, 2).contiguous()
            scale = getattr(layer, f"{name}_weight_scale")
            scale.data = scale.data.view(scale.shape[0], -1).to(scale_dtype)
        self.place(layer)

    def _mlp(self, layer, sorted_x: torch.Tensor, expert_tokens: torch.Tensor) -> torch.Tensor:
        def grouped_matmul(x, name):
            x, scale = torch_npu.npu_dynamic_quant(x)
            return torch_npu.npu_grouped_matmul(
                x=[x], weight=[getattr(layer, f"{name}_weight")],
                scale=[getattr(layer, f"{name}_weight_scale")], per_token_scale=[scale],
                split_item=2, group_list_type=1, group_type=0, group_list=expert_tokens,
                output_dtype=sorted_x.dtype)[0]

        return grouped_matmul(torch_npu.npu_swiglu(grouped_matmul(sorted_x, "w13")), "w2")
