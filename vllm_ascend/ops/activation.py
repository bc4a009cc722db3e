from vllm.model_executor.layers.activation import SiluAndMul

from vllm_ascend.device import torch_npu


@SiluAndMul.register_oot(name="SiluAndMul")
class AscendSiluAndMul(SiluAndMul):
    """SwiGLU: silu(gate) * up in one kernel, as upstream's activation.py."""

    def forward_oot(self, x):
        return torch_npu.npu_swiglu(x)
