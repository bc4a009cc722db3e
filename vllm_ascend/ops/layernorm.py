from vllm.model_executor.layers.layernorm import RMSNorm

from vllm_ascend.device import torch_npu


@RMSNorm.register_oot(name="RMSNorm")
class AscendRMSNorm(RMSNorm):
    """RMSNorm with the residual add fused in, as upstream's layernorm.py."""

    def forward_oot(self, x, residual=None):
        if self.variance_size_override is not None or not self.has_weight:
            return self.forward_native(x, residual)
        if residual is None:
            return torch_npu.npu_rms_norm(x, self.weight, self.variance_epsilon)[0]
        x, _, residual = torch_npu.npu_add_rms_norm(x, residual, self.weight,
                                                    self.variance_epsilon)
        return x, residual
