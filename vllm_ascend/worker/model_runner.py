"""NPUModelRunner: vLLM's V1 GPUModelRunner on an Ascend device (npu or sim)."""

import contextlib
import time

import numpy as np
import torch
from vllm.compilation.counter import compilation_counter
from vllm.compilation.cuda_graph import CUDAGraphWrapper
from vllm.compilation.monitor import set_cudagraph_capturing_enabled
from vllm.config import CUDAGraphMode, set_current_vllm_config
from vllm.distributed import get_pp_group, get_tp_group
from vllm.forward_context import get_forward_context
from vllm.utils.platform_utils import is_pin_memory_available
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.utils import bind_kv_cache
from vllm.v1.worker.workspace import lock_workspace

from vllm_ascend import device
from vllm_ascend.attention.mla import profiling_prefill
from vllm_ascend.compilation.acl_graph import GRAPH_STATE, ACLGraphWrapper, GraphHooks, GraphState
from vllm_ascend.device import torch_npu
from vllm_ascend.logger import get_logger
from vllm_ascend.ops import gdn  # noqa: F401  (registers the Ascend Gated DeltaNet layer)
from vllm_ascend.ops import mla  # noqa: F401  (registers the Ascend MLA layer)
from vllm_ascend.ops.fused_moe import method as fused_moe  # (registers the MoE CustomOp)
from vllm_ascend.ops.qkv import StepRope
from vllm_ascend.ops.rotary_embedding import share_step_ropes
from vllm_ascend.worker.kv_cache import npu_kv_cache_views
from vllm_ascend.worker.padding import StepPadding, decide_padding

logger = get_logger(__name__)
GiB = float(1 << 30)


def point_torch_cuda_at_npu() -> None:
    """vLLM's runners create torch.cuda streams and events (in __init__, and later for async
    outputs; V2's switch streams with set_stream): point torch.cuda at torch.npu, as upstream
    vllm-ascend does, for good (the runner keeps creating events after its construction)."""
    npu = torch_npu.npu
    torch.Event = npu.Event
    for name in ("Event", "Stream", "default_stream", "current_stream", "stream", "set_stream",
                 "synchronize", "mem_get_info", "is_current_stream_capturing"):
        setattr(torch.cuda, name, getattr(npu, name))


def rank_label() -> str:
    """Which rank a summary is for, when the model is split across ranks."""
    groups = (("TP", get_tp_group()), ("PP", get_pp_group()))
    parts = [f"{name} rank {g.rank_in_group} of {g.world_size}" for name, g in groups
             if g.world_size > 1]
    return f" on {', '.join(parts)}" if parts else ""


def log_capture(state: GraphState, mode: CUDAGraphMode, sizes: dict[str, list[int]],
                elapsed: float, used: int) -> None:
    """The capture's log line: graphs per mode and size, time, memory and streams used."""
    backend = device.current
    graphs = sum(state.captured.values())
    drafter = sum(state.drafter_captured.values())
    streams = backend.streams_in_use()
    logger.info(
        "vllm-ascend: graph mode %s%s: captured %d graphs%s (%s) in %.1f s, %.2f GiB; streams "
        "used %s of %d", mode.name, rank_label(), graphs,
        f", {drafter} of them the speculative drafter's" if drafter else "",
        "; ".join(f"{m} sizes {sorted(set(v))}" for m, v in sizes.items()), elapsed,
        used / (1 << 30), streams if streams is not None else f"{graphs} (one per graph)",
        backend.stream_budget())


class FIAGraphHooks(GraphHooks):
    """FULL graphs: keep each layer's FIA task group at capture; order the update stream after
    the previous replay before each replay is launched, and right after, re-issue the step's
    host lists (cumulative query lengths, KV lengths) through task updates, whose events the
    replay's attention nodes wait for."""

    def __init__(self, state: GraphState):
        self.fia = state.fia

    def capture_begin(self, desc) -> None:
        self.fia.begin_capture(desc)

    def capture_end(self) -> None:
        self.fia.end_capture()

    def before_replay(self, desc) -> None:
        self.fia.before_replay()

    def after_replay(self, desc) -> None:
        metadata = get_forward_context().attn_metadata
        if isinstance(metadata, list):  # micro-batches are not used on Ascend
            raise NotImplementedError("micro-batched FULL graphs are not supported")
        # (a hybrid model's dict also holds its Gated DeltaNet layers', which call no FIA)
        self.fia.update(desc, next(m for m in metadata.values()
                                   if not isinstance(m, GDNAttentionMetadata)))


def step_ropes_of(model) -> list[StepRope]:
    if not isinstance(model, torch.nn.Module):
        return []
    return list({id(m.step_rope): m.step_rope for m in model.modules()
                 if isinstance(getattr(m, "step_rope", None), StepRope)}.values())


def fill_step_ropes_before_forward(model) -> list[StepRope]:
    """Gather the RoPE rows of each forward's positions once, for every layer to read: in a
    hook of the model's call, so that a FULL graph captures the gather and each replay runs it
    on the device (no launches outside the graph). Returns the ropes no hook can fill: a model
    whose class replaces nn.Module's call (vLLM's support_torch_compile on the top-level class,
    as Ernie 4.5's) never runs its hooks, and its caller must fill them."""
    ropes = step_ropes_of(model)
    if getattr(model, "fills_step_ropes", False):  # a model file that fills them in its call
        return []
    if not ropes or type(model).__call__ is not torch.nn.Module.__call__:
        return ropes

    def fill_step_ropes(_module, _args, kwargs):
        for rope in ropes:
            rope.update(kwargs["positions"])

    model.register_forward_pre_hook(fill_step_ropes, with_kwargs=True)
    return []


class NPUModelRunner(GPUModelRunner):
    """vLLM's runner, owning what Ascend graphs need: the step's padding (FIA's fake and dummy
    requests), the engine's graph state, and its release at shutdown."""

    def __init__(self, vllm_config, device_: torch.device):
        point_torch_cuda_at_npu()
        super().__init__(vllm_config, device_)
        self.graph_state = GraphState()
        self.compilation_config.static_forward_context[GRAPH_STATE] = self.graph_state
        self.padding: StepPadding | None = None  # the current step's
        self.ropes_filled_before_call: list[StepRope] = []
        # One more request row than vLLM's, for the dummy request of a full mixed FULL batch.
        self.query_start_loc = self._make_buffer(self.max_num_reqs + 2, dtype=torch.int32)
        self.seq_lens = torch.zeros(self.max_num_reqs + 1, dtype=torch.int32,
                                    device=self.device)
        self.optimistic_seq_lens_cpu = torch.zeros(self.max_num_reqs + 1, dtype=torch.int32,
                                                   pin_memory=is_pin_memory_available())

    def load_model(self, load_dummy_weights: bool = False) -> None:
        super().load_model(load_dummy_weights=load_dummy_weights)
        # Upstream hard-codes its CUDA graph wrapper for FULL modes: swap in the ACL one, whose
        # hooks record each layer's FIA task group at capture and update it after each replay.
        if isinstance(self.model, CUDAGraphWrapper):
            self.model = ACLGraphWrapper(self.model.runnable, self.vllm_config,
                                         CUDAGraphMode.FULL,
                                         hooks=FIAGraphHooks(self.graph_state))
        drafter = getattr(self, "drafter", None)
        if isinstance(getattr(drafter, "_slot_mapping_buffer", None), torch.Tensor):
            # The drafter's KV slots: int32, as the KV write takes them (vLLM keeps int64), and
            # -1 (write nothing) until a step fills them, since its capture runs read them.
            drafter._slot_mapping_buffer = torch.full_like(
                drafter._slot_mapping_buffer, -1, dtype=torch.int32)
        # The model's step RoPE buffers (models/common.py, ops/rotary_embedding.py), filled
        # before each forward. Not with a drafter: vLLM's get_rope gives a draft model the
        # target's rotary module, which the draft would then call with the target's rows.
        model = self.get_model()
        if self.speculative_config is None:
            share_step_ropes(model, self.scheduler_config.max_num_batched_tokens,
                             self.model_config.dtype, step_ropes_of(model))
        self.ropes_filled_before_call = fill_step_ropes_before_forward(model)
        fused_moe.log_layout(self.get_model())
        # A draft model of our families: vLLM's proposer calls it directly.
        if fill_step_ropes_before_forward(getattr(drafter, "model", None)):
            raise NotImplementedError(f"vllm-ascend cannot fill the RoPE rows of the draft "
                                      f"model {type(drafter.model).__name__}: its class is "
                                      "compiled at the top level, which runs no hooks")

    def get_model(self):
        # Upstream unwraps only its own wrapper types.
        model = super().get_model()
        return model.unwrap() if isinstance(model, ACLGraphWrapper) else model

    def initialize_kv_cache(self, kv_cache_config, **kwargs) -> None:
        super().initialize_kv_cache(kv_cache_config, **kwargs)
        # FIA's KV write (npu_scatter_pa_kv_cache) takes int32 slots; vLLM's block tables
        # compute int64 ones. The slot-mapping kernel (worker/kernels.py) writes either.
        for table in self.input_batch.block_table.block_tables:
            if table.slot_mapping.gpu.dtype != torch.int32:
                table.slot_mapping = table._make_buffer(table.slot_mapping.gpu.shape[0],
                                                        dtype=torch.int32)

    def initialize_kv_cache_tensors(self, kv_cache_config, kernel_block_sizes,
                                    kv_cache_allocation_context=None) -> dict[str, torch.Tensor]:
        """One backing allocation, viewed per layer as FIA and MLA read it (worker/kv_cache.py)."""
        if not kv_cache_config.kv_cache_tensors:
            return {}
        sizes = {t.size for t in kv_cache_config.kv_cache_tensors}
        assert len(sizes) == 1, "KV cache tensors must share one backing allocation."
        context = kv_cache_allocation_context or contextlib.nullcontext()
        with context:
            raw = torch.zeros(sizes.pop(), dtype=torch.int8, device=self.device)
        kv_caches = npu_kv_cache_views(raw, kv_cache_config, kernel_block_sizes)
        for name, target in self.shared_kv_cache_layers.items():
            kv_caches[name] = kv_caches[target]
        bind_kv_cache(kv_caches, self.compilation_config.static_forward_context, self.kv_caches,
                      kv_cache_groups=kv_cache_config.kv_cache_groups)
        return kv_caches

    def _init_kv_zero_meta(self) -> None:
        # vLLM zeroes a hybrid model's newly allocated blocks with a Triton kernel over its
        # pages; here each layer's views are zeroed by block (attention/hybrid.py's lanes).
        self._kv_zero_views = []
        context = self.compilation_config.static_forward_context
        for group in self.kv_cache_config.kv_cache_groups:
            for name in group.layer_names:
                cache = context[name].kv_cache
                if isinstance(cache, tuple):  # a GDN layer's (conv, recurrent) [blocks, ...]
                    self._kv_zero_views += [(view, 0, 1) for view in cache]
                else:  # attention's [2, kernel blocks, ...]: one block is `split` of them
                    split = group.kv_cache_spec.block_size // cache.shape[2]
                    self._kv_zero_views.append((cache, 1, split))

    def _zero_block_ids(self, block_ids: list[int]) -> None:
        if not block_ids or not getattr(self, "_kv_zero_views", None):
            return
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for view, dim, split in self._kv_zero_views:
            kernel_ids = ids if split == 1 else (
                ids[:, None] * split + torch.arange(split, device=self.device)).flatten()
            view.index_fill_(dim, kernel_ids, 0)

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
        log_capture(self.graph_state, mode, sizes, elapsed, used)
        return used

    def profile_run(self, randomize_inputs: bool = False) -> None:
        # vLLM's profile run builds no attention metadata: MLA layers reserve their prefill's
        # memory meanwhile (AscendMLAImpl.reserve_prefill).
        with profiling_prefill():
            super().profile_run(randomize_inputs)

    def profile_cudagraph_memory(self) -> int:
        """What the graphs will hold, measured before the KV cache takes the device, as vLLM's
        estimate does (its version captures inside CUDA's graph_capture() and swaps only its
        own wrappers' pools): the two largest captures of each mode, with a minimal KV cache,
        in a pool of their own. The first capture of a mode gives the pool's size (the largest
        capture's live tensors; smaller ones reuse them, in one pool for all modes), the
        second what each further capture adds; graphs and counts are dropped afterwards."""
        with set_current_vllm_config(self.vllm_config):
            self._init_minimal_kv_cache_for_profiling()
        state, backend = self.graph_state, device.current
        pool, state.pool = state.pool, torch_npu.npu.graph_pool_handle()
        captured = compilation_counter.num_cudagraph_captured
        first, further = {}, 0
        try:
            set_cudagraph_capturing_enabled(True)
            with self._freeze_gc():
                for mode, descs in self.cudagraph_dispatcher.get_capture_descs():
                    samples = []
                    for desc in descs[:2]:
                        before = backend.memory_in_use()
                        self._warmup_and_capture(desc, cudagraph_runtime_mode=mode)
                        torch.accelerator.synchronize()
                        samples.append(max(backend.memory_in_use() - before, 0))
                    first[mode.name] = samples[0]
                    further += (samples[-1] if len(samples) > 1 else 0) * (len(descs) - 1)
        finally:
            set_cudagraph_capturing_enabled(False)
            state.clear()
            state.pool = pool
            compilation_counter.num_cudagraph_captured = captured
            self.maybe_remove_all_loras(self.lora_config)
            for keys in self.cudagraph_dispatcher.cudagraph_keys.values():
                keys.clear()
            self.cudagraph_dispatcher.keys_initialized = False
            self._cleanup_profiling_kv_cache()
        estimate = max(first.values(), default=0) + further
        logger.info("vllm-ascend: graph memory estimate %.3f GiB (the largest capture of each "
                    "mode: %s; the further captures %.3f GiB)", estimate / GiB,
                    ", ".join(f"{m} {b / GiB:.3f} GiB" for m, b in first.items()),
                    further / GiB)
        return estimate

    def _determine_batch_execution_and_padding(self, num_tokens, num_reqs,
                                               num_scheduled_tokens_np,
                                               max_num_scheduled_tokens, *args, **kwargs):
        """vLLM's dispatch (runtime mode, graph, data-parallel padding), then the step's FIA
        padding, which _build_attention_metadata applies."""
        result = super()._determine_batch_execution_and_padding(
            num_tokens, num_reqs, num_scheduled_tokens_np, max_num_scheduled_tokens, *args,
            **kwargs)
        mode, desc = result[0], result[1]
        self.padding = decide_padding(
            mode, num_tokens, num_reqs, desc.num_tokens, desc.num_reqs, desc.uniform,
            self.uniform_decode_query_len, self.max_model_len)
        self.graph_state.recent_steps.append(self.padding)
        return result

    def _build_attention_metadata(self, num_tokens, num_reqs, max_query_len,
                                  num_tokens_padded=None, num_reqs_padded=None, **kwargs):
        """vLLM pads a FULL step with empty requests; write the step's fake and dummy requests
        (their query lengths, and KV lengths equal to them) into the request buffers instead,
        and build the metadata for every request FIA sees."""
        padding = self.padding
        if num_tokens_padded is None or padding is None or not padding.pads_attention:
            return super()._build_attention_metadata(
                num_tokens, num_reqs, max_query_len, num_tokens_padded=num_tokens_padded,
                num_reqs_padded=num_reqs_padded, **kwargs)
        assert padding.num_tokens_padded == num_tokens_padded, "padding of another step"
        lens = np.asarray(padding.padding_query_lens, dtype=np.int32)
        real, total = padding.num_reqs, padding.num_reqs_padded
        starts = self.query_start_loc.np
        starts[real + 1: total + 1] = starts[real] + np.cumsum(lens)
        starts[total + 1:] = starts[total]
        self.query_start_loc.copy_to_gpu()
        self.optimistic_seq_lens_cpu[real:total] = torch.from_numpy(lens)
        self.seq_lens[real:total].copy_(self.optimistic_seq_lens_cpu[real:total])
        return super()._build_attention_metadata(
            num_tokens, real, max_query_len, num_tokens_padded=num_tokens_padded,
            num_reqs_padded=total, **kwargs)

    def _model_forward(self, input_ids=None, positions=None, intermediate_tensors=None,
                       inputs_embeds=None, **model_kwargs):
        # The RoPE rows of a model that runs no hooks, gathered outside any graph.
        for rope in self.ropes_filled_before_call:
            rope.update(positions)
        return super()._model_forward(input_ids, positions, intermediate_tensors,
                                      inputs_embeds, **model_kwargs)

    def shutdown(self) -> None:
        # Upstream frees graphs only on ROCm (CUDAGraphWrapper.clear_all_graphs): free this
        # engine's, and the streams they hold, so that another engine in the process has them.
        self.graph_state.release()
        super().shutdown()
