from vllm.model_executor.layers.activation import SiluAndMul

from vllm_ascend import device


@SiluAndMul.register_oot(name="SiluAndMul")
class AscendSiluAndMul(SiluAndMul):
    """SwiGLU: silu(gate) * up in one kernel (npu_swiglu on the chip)."""

    def forward_oot(self, x):
        return device.current.swiglu(x)
