"""NPUModelRunner: vLLM's V1 GPUModelRunner on an Ascend device (npu or sim)."""

import torch
from vllm_ascend.logger import get_logger
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_ascend import device

logger = get_logger(__name__)


class NPUModelRunner(GPUModelRunner):
    def __init__(self, vllm_config, device_: torch.device):
        with device.current.runner_init_context():
            super().__init__(vllm_config, device_)

    def _sync_device(self) -> None:
        # Upstream calls torch.accelerator.synchronize(), which has no CPU accelerator.
        device.current.synchronize()
