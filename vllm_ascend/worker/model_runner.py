"""NPUModelRunner: vLLM's V1 GPUModelRunner on an Ascend device (npu or sim)."""

import time

import torch
from vllm.compilation.monitor import set_cudagraph_capturing_enabled
from vllm.compilation.cuda_graph import CUDAGraphWrapper
from vllm.config import CUDAGraphMode
from vllm.forward_context import get_forward_context
from vllm.v1.worker.workspace import lock_workspace
from vllm_ascend.logger import get_logger
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_ascend import device
from vllm_ascend.attention.graph_params import GRAPH_PARAMS
from vllm_ascend.ops.qkv import STEP_ROPE
from vllm_ascend.compilation.acl_graph import STATS, ACLGraphWrapper, GraphHooks

logger = get_logger(__name__)


class FIAGraphHooks(GraphHooks):
    """FULL graphs: keep each layer's FIA handle at capture; re-issue the step's host lists
    (cumulative query lengths, KV lengths) through task updates before every replay."""

    def __init__(self, runner: "NPUModelRunner"):
        self.skip_update = bool((runner.vllm_config.additional_config or {}).get(
            "debug_skip_fia_update", False))
        if self.skip_update:
            logger.warning("vllm-ascend: debug_skip_fia_update is set: FULL graphs replay the "
                           "capture's attention lengths and will produce wrong tokens")

    def capture_begin(self, desc) -> None:
        GRAPH_PARAMS.begin_capture(desc)

    def capture_end(self) -> None:
        GRAPH_PARAMS.end_capture()

    def before_replay(self, desc) -> None:
        if self.skip_update:
            return
        metadata = get_forward_context().attn_metadata
        if isinstance(metadata, list):  # micro-batches are not used on Ascend
            raise NotImplementedError("micro-batched FULL graphs are not supported")
        GRAPH_PARAMS.update(desc, next(iter(metadata.values())))


class NPUModelRunner(GPUModelRunner):
    def __init__(self, vllm_config, device_: torch.device):
        with device.current.runner_init_context():
            super().__init__(vllm_config, device_)

    def load_model(self, load_dummy_weights: bool = False) -> None:
        super().load_model(load_dummy_weights=load_dummy_weights)
        # Upstream hard-codes its CUDA graph wrapper for FULL modes: swap in the ACL one, whose
        # hooks record each layer's FIA task group at capture and update it before each replay.
        if isinstance(self.model, CUDAGraphWrapper):
            self.model = ACLGraphWrapper(self.model.runnable, self.vllm_config,
                                         CUDAGraphMode.FULL, hooks=FIAGraphHooks(self))

    def get_model(self):
        # Upstream unwraps only its own wrapper types.
        model = super().get_model()
        return model.unwrap() if isinstance(model, ACLGraphWrapper) else model

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

    def _model_forward(self, input_ids=None, positions=None, intermediate_tensors=None,
                       inputs_embeds=None, **model_kwargs):
        # Gather RoPE cos/sin once per step, outside any graph, for every layer to read.
        if positions is not None:
            STEP_ROPE.update(positions)
        return super()._model_forward(input_ids, positions, intermediate_tensors,
                                      inputs_embeds, **model_kwargs)

    def _sync_device(self) -> None:
        # Upstream calls torch.accelerator.synchronize(), which has no CPU accelerator.
        device.current.synchronize()
