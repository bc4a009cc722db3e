from vllm.model_executor.layers.layernorm import RMSNorm

from vllm_ascend import device


@RMSNorm.register_oot(name="RMSNorm")
class AscendRMSNorm(RMSNorm):
    """RMSNorm with the residual add fused in (npu_add_rms_norm on the chip)."""

    def forward_oot(self, x, residual=None):
        if self.variance_size_override is not None or not self.has_weight:
            return self.forward_native(x, residual)
        if residual is None:
            return device.current.rms_norm(x, self.weight, self.variance_epsilon)
        return device.current.add_rms_norm(x, residual, self.weight, self.variance_epsilon)
