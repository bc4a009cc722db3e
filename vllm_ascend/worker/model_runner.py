"""NPUModelRunner: vLLM's V1 GPUModelRunner on an Ascend device (npu or sim)."""

import time

import torch
from vllm.compilation.monitor import set_cudagraph_capturing_enabled
from vllm.config import CUDAGraphMode
from vllm.v1.worker.workspace import lock_workspace
from vllm_ascend.logger import get_logger
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_ascend import device
from vllm_ascend.compilation.acl_graph import STATS

logger = get_logger(__name__)


class NPUModelRunner(GPUModelRunner):
    def __init__(self, vllm_config, device_: torch.device):
        with device.current.runner_init_context():
            super().__init__(vllm_config, device_)

    def capture_model(self) -> int:
        """Capture every (mode, batch descriptor) the dispatcher asks for, largest first.

        Upstream's version enters a CUDA-stream capture context and reads CUDA memory; the loop
        itself (_capture_cudagraphs: warm-up, then capture per descriptor) is reused as is.
        """
        mode = self.compilation_config.cudagraph_mode
        if mode == CUDAGraphMode.NONE:
            return 0
        backend = device.current
        start, mem_before = time.perf_counter(), backend.memory_in_use()
        streams_before = backend.streams_in_use()
        set_cudagraph_capturing_enabled(True)
        sizes: dict[str, list[int]] = {}
        with self._freeze_gc():
            for runtime_mode, descs in self.cudagraph_dispatcher.get_capture_descs():
                sizes.setdefault(runtime_mode.name, []).extend(d.num_tokens for d in descs)
                self._capture_cudagraphs(batch_descriptors=descs,
                                         cudagraph_runtime_mode=runtime_mode)
        set_cudagraph_capturing_enabled(False)
        lock_workspace()
        elapsed = time.perf_counter() - start
        used = max(backend.memory_in_use() - mem_before, 0)
        graphs = sum(STATS.captured.values())
        logger.info(
            "vllm-ascend: graph mode %s: captured %d graphs (%s) in %.1f s, %.2f GiB; streams "
            "used %d of %d", mode.name, graphs,
            "; ".join(f"{m} sizes {sorted(set(v))}" for m, v in sizes.items()), elapsed,
            used / (1 << 30), backend.streams_in_use() - streams_before + max(streams_before, 0),
            backend.stream_budget())
        return used

    def _sync_device(self) -> None:
        # Upstream calls torch.accelerator.synchronize(), which has no CPU accelerator.
        device.current.synchronize()
