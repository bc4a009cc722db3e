"""NPUModelRunnerV2: vLLM's Model Runner V2 (vllm/v1/worker/gpu/) on an Ascend device."""

import dataclasses
import time

import numpy as np
import torch
from vllm.compilation.monitor import set_cudagraph_capturing_enabled
from vllm.v1.worker.gpu.attn_utils import get_shared_kv_cache_layers
from vllm.v1.worker.gpu.input_batch import InputBatch
from vllm.v1.worker.gpu.model_runner import GPUModelRunner
from vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator import (
    TargetDependentARSpeculator)
from vllm.v1.worker.utils import bind_kv_cache

from vllm_ascend.compilation.acl_graph import GRAPH_STATE, GraphState
from vllm_ascend import device
from vllm_ascend.logger import get_logger
from vllm_ascend.ops.fused_moe import method as fused_moe
from vllm_ascend.worker.kv_cache import npu_kv_cache_views
from vllm_ascend.worker.model_runner import (fill_step_ropes_before_forward, log_capture,
                                             point_torch_cuda_at_npu)
from vllm_ascend.worker.padding import decide_padding
from vllm_ascend.worker.v2.drafter import on_npu
from vllm_ascend.worker.v2.graphs import NPUModelGraphManager

logger = get_logger(__name__)


class NPUModelRunnerV2(GPUModelRunner):
    """vLLM's V2 runner, owning what Ascend graphs need: the engine's graph state, the FULL
    graph manager, a FULL step's padding (FIA's fake requests), the step RoPE tables, and the
    NPU drafter (worker/v2/drafter.py) when an EAGLE head drafts."""

    def __init__(self, vllm_config, device_: torch.device):
        point_torch_cuda_at_npu()
        super().__init__(vllm_config, device_)
        self.graph_state = GraphState()
        self.compilation_config.static_forward_context[GRAPH_STATE] = self.graph_state
        if isinstance(self.speculator, TargetDependentARSpeculator):  # EAGLE, EAGLE-3 (MTP)
            self.speculator = on_npu(self.speculator, self.graph_state)
        # One request row more than vLLM's buffers, for the dummy request of a mixed FULL
        # graph (worker/padding.py): vLLM's steps see its rows, FIA's padded batch all of them.
        buffers = self.input_buffers
        self.request_rows = RequestRows(
            torch.zeros(self.max_num_reqs + 2, dtype=torch.int32, device=self.device),
            torch.zeros(self.max_num_reqs + 1, dtype=torch.int32, device=self.device))
        buffers.query_start_loc = self.request_rows.query_start_loc[:-1]
        buffers.seq_lens = self.request_rows.seq_lens[:-1]

    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        model = self.get_model()
        # The RoPE rows of the step's positions, gathered in the model's call as under V1
        # (inside a FULL graph: V2 calls the model only to capture it, each replay gathers).
        if fill_step_ropes_before_forward(model):
            raise NotImplementedError(
                f"{type(model).__name__} runs no hooks (vLLM compiles its class at the top "
                "level), so Model Runner V2 on Ascend cannot gather its RoPE rows: set "
                "VLLM_USE_V2_MODEL_RUNNER=0 (V1 gathers them before the call)")
        fused_moe.log_layout(model)

    def initialize_kv_cache(self, kv_cache_config, *args, **kwargs) -> None:
        """vLLM's, with int32 slots, the ACL FULL-graph manager, and the backing allocation
        viewed per layer as FIA and MLA read it (V2 has no hook for either: vLLM's manager and
        views are replaced before anything captures or writes)."""
        super().initialize_kv_cache(kv_cache_config, *args, **kwargs)
        # FIA's KV write (npu_scatter_pa_kv_cache) takes int32 slots; vLLM's are int64. The
        # slot-mapping kernel writes either (as upstream's AscendBlockTables).
        tables = self.block_tables
        tables.slot_mappings = torch.zeros_like(tables.slot_mappings, dtype=torch.int32)
        self.cudagraph_manager = NPUModelGraphManager.replacing(
            self.cudagraph_manager, state=self.graph_state, step_metadata=self._step_metadata,
            request_rows=self.request_rows)
        if not self.kv_caches:
            return
        storage = self.kv_caches[0].untyped_storage()
        if storage.nbytes() != kv_cache_config.kv_cache_tensors[0].size:
            raise RuntimeError("vLLM's KV cache is not one backing allocation")
        raw = torch.empty(0, dtype=torch.int8, device=self.device).set_(storage)
        kv_caches = npu_kv_cache_views(raw, self.kv_cache_config)
        for name, target in get_shared_kv_cache_layers(self.vllm_config).items():
            kv_caches[name] = kv_caches[target]
        self.kv_caches = []
        bind_kv_cache(kv_caches, self.compilation_config.static_forward_context, self.kv_caches,
                      kv_cache_groups=self.kv_cache_config.kv_cache_groups)

    def profile_cudagraph_memory(self) -> int:
        """vLLM's estimate (it captures samples into a pool it throws away), then this engine's
        graphs and counts dropped, as V1's does: the real capture starts from none."""
        try:
            return super().profile_cudagraph_memory()
        finally:
            self.graph_state.clear()

    def capture_model(self, *, profile_only: bool = False) -> int:
        start, mem_before = time.perf_counter(), device.current.memory_in_use()
        # The piecewise wrappers capture only while vLLM's flag allows (V1's runner turns it on
        # around its capture and off after; V2's leaves it as it finds it).
        set_cudagraph_capturing_enabled(True)
        try:
            used = super().capture_model(profile_only=profile_only)
        finally:
            set_cudagraph_capturing_enabled(False)
        if not profile_only and self.cudagraph_manager is not None:
            sizes = {mode.name: [d.num_tokens for d in descs]
                     for mode, descs in self.cudagraph_manager._capture_descs.items()}
            log_capture(self.graph_state, self.compilation_config.cudagraph_mode, sizes,
                        time.perf_counter() - start,
                        max(device.current.memory_in_use() - mem_before, 0))
        return used

    def _step_metadata(self):
        """The attention metadata of the step being run (what its FULL replay re-issues)."""
        return self.attn_groups[0][0].get_metadata_builder().latest

    def prepare_inputs(self, scheduler_output, batch_req_state, batch_desc, *args, **kwargs):
        """vLLM's, then a FULL step's padding requests made whole fake requests: V2 pads a FULL
        step with empty requests, and FIA in TND layout needs every padding token to belong to
        one (worker/padding.py)."""
        batch = super().prepare_inputs(scheduler_output, batch_req_state, batch_desc, *args,
                                       **kwargs)
        padding = decide_padding(
            batch_desc.cg_mode, batch.num_tokens, batch.num_reqs,
            batch.num_tokens_after_padding, batch_desc.num_reqs,
            batch_desc.uniform_token_count is not None, self.decode_query_len,
            self.max_model_len)
        self.graph_state.recent_steps.append(padding)
        if not padding.pads_attention:
            return batch
        real, total = padding.num_reqs, padding.num_reqs_padded
        if total != batch.num_reqs_after_padding:  # a mixed FULL graph: its dummy request
            batch = self.request_rows.padded(batch, total)
        lens = np.asarray(padding.padding_query_lens, dtype=np.int32)
        starts = batch.query_start_loc_np
        starts[real + 1: total + 1] = starts[real] + np.cumsum(lens)
        batch.query_start_loc[real + 1: total + 1].copy_(
            torch.from_numpy(starts[real + 1: total + 1]))
        batch.seq_lens[real:total].copy_(torch.from_numpy(lens))
        batch.seq_lens_cpu_upper_bound[real:total] = torch.from_numpy(lens)
        return batch

    def shutdown(self) -> None:
        # As V1's runner: free this engine's graphs and the streams they hold.
        self.graph_state.release()
        super().shutdown()


@dataclasses.dataclass
class RequestRows:
    """The step's request rows (cumulative query lengths, KV lengths), one more than vLLM's
    buffers hold: vLLM's InputBuffers view all but the last."""
    query_start_loc: torch.Tensor  # [max_num_reqs + 2]
    seq_lens: torch.Tensor  # [max_num_reqs + 1]

    def padded(self, batch: InputBatch, num_reqs: int, scheduled: bool = False) -> InputBatch:
        """``batch`` with ``num_reqs`` request rows, the new ones empty on the host (their query
        ends where the batch's does, their KV length is 0). ``scheduled``: as requests of the
        batch (a capture's dummy batch, whose attention metadata is built from them; its device
        rows written too); else as padding, whose device rows the step's padding writes."""
        n = batch.num_reqs_after_padding
        if self.seq_lens.shape[0] < num_reqs:  # (a slice past the end would drop the row)
            raise ValueError(f"{num_reqs} request rows asked of {self.seq_lens.shape[0]}")
        starts = np.empty(num_reqs + 1, dtype=np.int32)
        starts[:n + 1] = batch.query_start_loc_np[:n + 1]
        starts[n + 1:] = starts[n]
        upper = torch.zeros(num_reqs, dtype=batch.seq_lens_cpu_upper_bound.dtype)
        upper[:n] = batch.seq_lens_cpu_upper_bound[:n]
        changes = dict(num_reqs_after_padding=num_reqs, query_start_loc_np=starts,
                       query_start_loc=self.query_start_loc[:num_reqs + 1],
                       seq_lens=self.seq_lens[:num_reqs], seq_lens_cpu_upper_bound=upper)
        if scheduled:
            self.query_start_loc[n + 1:num_reqs + 1].fill_(int(starts[n]))
            self.seq_lens[n:num_reqs].zero_()
            scheduled_tokens = np.zeros(num_reqs, dtype=batch.num_scheduled_tokens.dtype)
            scheduled_tokens[:batch.num_reqs] = batch.num_scheduled_tokens
            changes.update(num_reqs=num_reqs, num_scheduled_tokens=scheduled_tokens)
        return dataclasses.replace(batch, **changes)
