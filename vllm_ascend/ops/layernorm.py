from vllm.model_executor.layers.layernorm import RMSNorm

from vllm_ascend.device import torch_npu


@RMSNorm.register_oot(name="RMSNorm")
class AscendRMSNorm(RMSNorm):
    """RMSNorm with the residual add fused in, as upstream's layernorm.py. Before a quantized
    linear layer (``quantized_for``, set by the family files: models/common.py), the
    activation's quantization is fused in too, as upstream's norm-quant fusion pass does: the
    norm then returns the quantized activation, which that layer takes as is."""

    quantized_for = None  # the linear layer this norm feeds, when fused (not a submodule)

    def forward_oot(self, x, residual=None):
        if self.variance_size_override is not None or not self.has_weight:
            return self.forward_native(x, residual)
        if residual is None:
            return torch_npu.npu_rms_norm(x, self.weight, self.variance_epsilon)[0]
        if self.quantized_for is not None:
            layer = self.quantized_for
            return layer.quant_method.add_norm_quant(layer, x, residual, self.weight,
                                                     self.variance_epsilon)
        x, _, residual = torch_npu.npu_add_rms_norm(x, residual, self.weight,
                                                    self.variance_epsilon)
        return x, residual
