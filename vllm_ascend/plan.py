"""The start-up plan: what an engine's ranks will hold, computed from the config alone.

Before any weight loads, for one rank: the graphs it will capture and the streams they hold
against the chip's budget; its device memory at the requested utilization (weights from the
checkpoint's tensor headers, activations of the profile run, graph memory, the communicators'
buffers) and what remains for the KV cache. The worker logs it at device set-up and refuses a
plan that cannot fit, with the fix, instead of failing at capture minutes later; after start-up
it logs the plan beside what it measured. ``vllm-ascend plan <model> [vllm serve args]``
(vllm_ascend/cli.py) prints it without starting an engine.

The activation and graph-memory figures are estimates from the model's shapes (the tensors live
at once at the peak of a forward pass); ``MARGIN`` is how far from the measurement they are
allowed to be (tests/e2e/test_startup_plan.py checks it).
"""

import dataclasses
import json
import os
import pathlib
import struct

from vllm.config import CUDAGraphMode

GiB = float(1 << 30)
# How far the plan may be from what the engine measures, for each figure: a fraction of the
# measurement or a number of bytes, whichever is larger.
MARGIN = {"weights": (0.05, 16 << 20), "activations": (0.5, 64 << 20),
          "graphs": (0.5, 64 << 20), "kv_cache": (0.05, 128 << 20)}
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
                "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
_FLOAT = {"F64", "F32", "F16", "BF16"}


class StartupPlanError(ValueError):
    pass


# -- graphs ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class GraphPlan:
    mode: str
    graphs: dict  # runtime mode -> ACL graphs one rank captures for the model
    drafter_graphs: int  # the speculative drafter's, on the rank that holds it
    streams: int  # streams they hold (each graph one, plus one per communication group)
    budget: int  # streams the graphs may use (the chip's, minus a reserve for the stack)
    largest: dict  # runtime mode -> the largest capture size (tokens)

    @property
    def total(self) -> int:
        return sum(self.graphs.values()) + self.drafter_graphs


def capture_descriptors(compilation_config, max_num_seqs: int, decode_query_len: int) -> dict:
    """Runtime mode -> capture sizes, as vLLM's CudagraphDispatcher makes its keys: every size
    in the mixed mode (PIECEWISE or FULL), and FULL for uniform decode batches of up to
    ``max_num_seqs`` requests where decode has a routine of its own."""
    mode = compilation_config.cudagraph_mode
    sizes = sorted(compilation_config.cudagraph_capture_sizes or [])
    descs = {}
    if mode == CUDAGraphMode.NONE or not sizes:
        return descs
    if mode.mixed_mode() != CUDAGraphMode.NONE:
        descs[mode.mixed_mode().name] = sizes
    if mode.decode_mode() == CUDAGraphMode.FULL and mode.separate_routine():
        decode = [s for s in sizes if decode_query_len <= s <= decode_query_len * max_num_seqs]
        descs["FULL"] = sorted(set(descs.get("FULL", [])) | set(decode))
    return descs


def graph_plan(vllm_config, stream_budget: int) -> GraphPlan:
    from vllm_ascend.compilation.capture_sizes import lora_graph_cases, streams_per_graph

    cc, model = vllm_config.compilation_config, vllm_config.model_config
    parallel, spec = vllm_config.parallel_config, vllm_config.speculative_config
    k = (spec.num_speculative_tokens or 0) if spec is not None else 0
    descs = capture_descriptors(cc, vllm_config.scheduler_config.max_num_seqs, 1 + k)
    layers = model.get_num_layers(parallel)
    pieces = {"PIECEWISE": layers + 1, "FULL": 1}
    cases = lora_graph_cases(vllm_config)  # LoRA: each size once per count of active adapters
    graphs = {mode: len(sizes) * pieces[mode] * cases for mode, sizes in descs.items()}
    draft = getattr(spec, "draft_model_config", None) if spec is not None else None
    drafter = 0
    if draft is not None and "PIECEWISE" in descs:  # V1 captures drafters piecewise only
        drafter = len(descs["PIECEWISE"]) * (draft.get_num_layers(parallel) + 1)
    if draft is not None and getattr(vllm_config, "use_v2_model_runner", False) and \
            cc.cudagraph_mode.decode_mode() == CUDAGraphMode.FULL:
        # V2's drafter (worker/v2/drafter.py): FULL graphs of its prefill (the verify step's
        # uniform batches) and, drafting more than one token, of its decode steps (one a request)
        decode = capture_descriptors(cc, vllm_config.scheduler_config.max_num_seqs, 1)
        drafter += len(descs.get("FULL", [])) + (len(decode.get("FULL", [])) if k > 1 else 0)
    per_graph = streams_per_graph(parallel.tensor_parallel_size,
                                  parallel.data_parallel_size if model.is_moe else 1)
    return GraphPlan(mode=cc.cudagraph_mode.name, graphs=graphs, drafter_graphs=drafter,
                     streams=(sum(graphs.values()) + drafter) * per_graph, budget=stream_budget,
                     largest={mode: max(sizes) for mode, sizes in descs.items()})


# -- memory ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    total: int  # the device's memory
    requested: int  # total x gpu_memory_utilization
    communicators: int  # their buffers, outside torch's allocator
    weights: "int | None"  # None: the checkpoint is not on this machine yet
    activations: int  # the profile run's peak
    graphs: int
    block_bytes: int  # one KV cache block, all layers of this rank
    max_model_len_blocks: int  # blocks one request of max_model_len needs
    memory_setting: "str | None" = None  # what sets the device's memory (the simulator's)
    states: "StatePlan | None" = None  # a hybrid model's recurrent states, in the KV cache

    @property
    def kv_cache(self) -> "int | None":
        if self.weights is None:
            return None
        return self.requested - self.weights - self.activations - self.graphs

    @property
    def kv_blocks(self) -> "int | None":
        kv = self.kv_cache
        return None if kv is None else max(kv, 0) // self.block_bytes


def _safetensors_headers(path: pathlib.Path) -> dict:
    """Tensor name -> (dtype, shape) from the safetensors files' headers (no tensor is read)."""
    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        tensors.update({name: (meta["dtype"], meta["shape"]) for name, meta in header.items()
                        if name != "__metadata__"})
    return tensors


def _local_dir(model: str) -> "pathlib.Path | None":
    path = pathlib.Path(model)
    if path.is_dir():
        return path
    try:  # a hub model already downloaded
        from huggingface_hub import snapshot_download

        return pathlib.Path(snapshot_download(model, local_files_only=True))
    except Exception:
        return None


def checkpoint_weights(model_config, parallel, stage: int, with_mtp: bool = False
                       ) -> "int | None":
    """Bytes of the weights one rank of pipeline ``stage`` holds, in the dtype it runs in:
    floating tensors in the model's dtype, quantized ones as stored; layers split by pipeline
    stage; attention, MLP, embedding and LM head by tensor parallel rank; routed experts by
    expert parallel rank when expert parallelism is on. None when the checkpoint is not here."""
    path = _local_dir(model_config.model)
    tensors = _safetensors_headers(path) if path is not None else {}
    if not tensors:
        return None
    from vllm.distributed.utils import get_pp_indices

    pp, tp = parallel.pipeline_parallel_size, parallel.tensor_parallel_size
    layers = model_config.get_total_num_hidden_layers()
    start, end = get_pp_indices(layers, stage, pp)
    experts_split = tp * parallel.data_parallel_size if parallel.enable_expert_parallel else tp
    dtype_bytes = model_config.dtype.itemsize
    total = 0
    for name, (dtype, shape) in tensors.items():
        size = 1
        for n in shape:
            size *= n
        size *= dtype_bytes if dtype in _FLOAT else _DTYPE_BYTES.get(dtype, 1)
        layer = _layer_index(name)
        if layer is not None:
            if layer >= layers and not (with_mtp and stage == pp - 1):
                continue  # MTP layers load with the mtp method only, on the last stage
            if layer < layers and not start <= layer < end:
                continue
        elif "embed_tokens" in name or "wte" in name:
            if stage != 0 and not (model_config.hf_text_config.tie_word_embeddings and
                                   stage == pp - 1):
                continue
        elif name.startswith("lm_head") and stage != pp - 1:
            continue
        if len(shape) < 2 or name.endswith(".gate.weight") or "norm" in name:
            total += size  # norms, biases, routers: every rank holds them whole
        elif ".experts." in name:
            total += size // experts_split
        else:
            total += size // tp
    return total


def _layer_index(name: str) -> "int | None":
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "layers" and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


def _forward_bytes(model_config, parallel, tokens: int) -> int:
    """The tensors alive at the peak of a forward of ``tokens`` tokens on one rank, from the
    model's shapes: the residual stream and its normalised copy, a layer's query/key/value and
    attention output, its MLP's gate/up and activation (each routed token's, for experts)."""
    text = model_config.hf_text_config
    tp = parallel.tensor_parallel_size
    hidden = model_config.get_hidden_size()
    heads = max(model_config.get_num_attention_heads(parallel), 1)
    kv_heads = model_config.get_num_kv_heads(parallel)
    if model_config.use_mla:
        head = text.qk_nope_head_dim + text.qk_rope_head_dim
        attention = heads * (head + text.qk_nope_head_dim + text.v_head_dim) + \
            text.kv_lora_rank + text.qk_rope_head_dim + heads * text.v_head_dim
    else:
        head = model_config.get_head_size()
        attention = (2 * heads + 2 * kv_heads) * head
    intermediate = getattr(text, "intermediate_size", 4 * hidden) // tp
    mlp = 3 * intermediate
    if model_config.is_moe:
        moe = (getattr(text, "moe_intermediate_size", None) or intermediate) // tp
        topk = model_config.get_num_experts_per_tok()
        mlp = max(mlp, topk * (2 * hidden + 3 * moe))
    return tokens * (4 * hidden + attention + mlp) * model_config.dtype.itemsize


def startup_plan(vllm_config, backend, device_total: int) -> "StartupPlan":
    """The plan of one rank on ``backend`` (device/), whose device has ``device_total``."""
    graphs = graph_plan(vllm_config, backend.stream_budget() - (backend.streams_in_use() or 0))
    memory = memory_plan(vllm_config, device_total, graphs, backend.graph_bytes_per_layer(),
                         backend.communicator_bytes(device_total))
    return StartupPlan(graphs, dataclasses.replace(memory,
                                                   memory_setting=backend.memory_setting()))


def activation_bytes(vllm_config) -> int:
    """The profile run's peak: a forward of max_num_batched_tokens, then the sampler's float32
    logits for max_num_seqs requests."""
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    sched = vllm_config.scheduler_config
    sampler = sched.max_num_seqs * model.get_vocab_size() * 4
    forward = _forward_bytes(model, parallel, sched.max_num_batched_tokens)
    if model.use_mla:
        from vllm_ascend.attention.mla import prefill_chunk_tokens

        forward += _mla_context_bytes(model, parallel, sched.max_num_batched_tokens,
                                      prefill_chunk_tokens(vllm_config))
    return max(forward, sampler)


def _mla_context_bytes(model_config, parallel, tokens: int, chunk: int) -> int:
    """What MLA's prefill adds while it attends to a chunk of cached context (attention/mla.py,
    reserved by the profile run): the chunk's gathered latent and its keys and values, and the
    queries' float32 running result, the chunk's result and their merge."""
    text = model_config.hf_text_config
    heads = max(model_config.get_num_attention_heads(parallel), 1)
    head = text.qk_nope_head_dim + text.qk_rope_head_dim
    per_chunk_token = text.kv_lora_rank + text.qk_rope_head_dim + heads * (
        text.qk_nope_head_dim + 2 * text.v_head_dim + head)
    per_query = heads * (head + text.v_head_dim) * model_config.dtype.itemsize + \
        heads * (3 * text.v_head_dim + 3) * 4
    return chunk * per_chunk_token * model_config.dtype.itemsize + tokens * per_query


def graph_bytes(vllm_config, graphs: GraphPlan, per_layer: int) -> int:
    """The graph pool (the largest capture's live tensors: smaller captures reuse them, all
    modes share one pool) and what each captured graph holds of its own, ``per_layer`` for each
    decoder layer it covers (a PIECEWISE piece covers one, a FULL graph all of the rank's)."""
    if not graphs.largest:
        return 0
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    tokens = max(graphs.largest.values())
    layer_graphs = (graphs.graphs.get("PIECEWISE", 0) + graphs.drafter_graphs
                    + graphs.graphs.get("FULL", 0) * model.get_num_layers(parallel))
    return _forward_bytes(model, parallel, tokens) + layer_graphs * per_layer


def communicators(vllm_config) -> int:
    """The communicators one rank holds (a device communicator per group of two or more ranks:
    vLLM's tensor, pipeline, data and, for MoE models, expert parallel groups)."""
    parallel, model = vllm_config.parallel_config, vllm_config.model_config
    tp, pp, dp = (parallel.tensor_parallel_size, parallel.pipeline_parallel_size,
                  parallel.data_parallel_size)
    groups = [tp, pp, parallel.decode_context_parallel_size]
    if model.is_moe:
        groups += [dp, tp * dp]
    return sum(size > 1 for size in groups)


@dataclasses.dataclass(frozen=True)
class StatePlan:
    """A hybrid model's Gated DeltaNet states on this rank (attention/hybrid.py): each lives in
    a KV cache block, one block a request in each state group."""
    layers: int  # GDN layers of this rank
    groups: int  # vLLM's KV cache groups of them: blocks a request holds for its states
    recurrent: int  # bytes of one layer's recurrent state
    conv: int  # and of its conv state
    block_size: int  # tokens of an attention block (one block's K is one recurrent state)
    group_size: int  # layers per KV cache group: the KV cache's tensors


def state_plan(vllm_config) -> "StatePlan | None":
    from vllm_ascend.attention.hybrid import gdn_layout, state_bytes
    from vllm_ascend.attention.limits import (BLOCK_SIZE_ALIGN, BLOCK_SIZE_BELOW,
                                              serves_gated_deltanet)
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    if not model.is_hybrid or not serves_gated_deltanet(model):
        return None
    layout = gdn_layout(vllm_config, (BLOCK_SIZE_ALIGN, BLOCK_SIZE_BELOW))
    start, end = model.get_layers_start_end_indices(parallel)
    types = model.hf_text_config.layer_types[start:end]
    gdn, attention = types.count("linear_attention"), len(types) - types.count("linear_attention")
    # vLLM's grouping of layers of two kinds (kv_cache_utils: the smaller count, or the larger
    # when it is under 1.5 times the smaller)
    small, large = min(gdn, attention) or max(gdn, attention), max(gdn, attention)
    group = large if large < small * 1.5 else small
    conv, recurrent = state_bytes(vllm_config)
    return StatePlan(layers=gdn, groups=-(-gdn // group), recurrent=recurrent, conv=conv,
                     block_size=layout.block_size, group_size=group)


def kv_block_bytes(vllm_config, states: "StatePlan | None") -> int:
    """One KV cache block of every attention layer this rank holds (of a hybrid model's, whose
    ``states`` are given: of every KV cache tensor, each a page of an attention layer's K and V,
    or of a GDN layer's states)."""
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    if states is not None:
        return states.group_size * 2 * states.recurrent
    block = vllm_config.cache_config.block_size
    layers = model.get_num_layers(parallel)
    if model.use_mla:
        text = model.hf_text_config
        per_token = text.kv_lora_rank + text.qk_rope_head_dim
    else:
        per_token = 2 * model.get_num_kv_heads(parallel) * model.get_head_size()
    return layers * block * per_token * model.dtype.itemsize


def memory_plan(vllm_config, device_total: int, graphs: GraphPlan, per_layer: int,
                communicator_bytes: int) -> MemoryPlan:
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    spec = vllm_config.speculative_config
    with_mtp = spec is not None and spec.method == "mtp"
    weights = [checkpoint_weights(model, parallel, stage, with_mtp)
               for stage in range(parallel.pipeline_parallel_size)]
    weights = None if None in weights else max(weights)
    draft = getattr(spec, "draft_model_config", None) if spec is not None else None
    if weights is not None and draft is not None and draft.model != model.model:
        drafter = checkpoint_weights(draft, parallel, parallel.pipeline_parallel_size - 1)
        weights = None if drafter is None else weights + drafter
    states = state_plan(vllm_config)
    block_bytes = kv_block_bytes(vllm_config, states)
    block = vllm_config.cache_config.block_size if states is None else states.block_size
    return MemoryPlan(
        total=device_total,
        requested=int(device_total * vllm_config.cache_config.gpu_memory_utilization),
        communicators=communicators(vllm_config) * communicator_bytes, weights=weights,
        activations=activation_bytes(vllm_config),
        graphs=graph_bytes(vllm_config, graphs, per_layer), block_bytes=block_bytes,
        max_model_len_blocks=-(-model.max_model_len // block) + (states.groups if states else 0),
        states=states)


# -- the plan, its refusals and its log ------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class StartupPlan:
    graphs: GraphPlan
    memory: MemoryPlan

    def problems(self) -> list[str]:
        """Why this plan cannot start, each with its fix (empty when it can)."""
        g, m = self.graphs, self.memory
        found = []
        if g.streams > g.budget:
            found.append(
                f"the graphs need {g.streams} streams and the device has {g.budget} for them. "
                "Capture fewer graphs: smaller capture sizes (--compilation-config "
                "'{\"max_cudagraph_capture_size\": 64}'), or FULL_DECODE_ONLY "
                "('{\"cudagraph_mode\": \"FULL_DECODE_ONLY\"}'), or --enforce-eager")
        if m.communicators > m.total - m.requested:
            found.append(
                f"the communicators' buffers ({m.communicators / GiB:.2f} GiB) do not fit in "
                f"the {(m.total - m.requested) / GiB:.2f} GiB gpu_memory_utilization leaves "
                "outside the engine's budget. Lower HCCL_BUFFSIZE (MB per buffer; each "
                "communicator holds two) or lower --gpu-memory-utilization"
                + (f", or set {m.memory_setting} higher" if m.memory_setting else ""))
        kv = m.kv_cache
        if kv is not None and kv // m.block_bytes < m.max_model_len_blocks:
            fixes = ["raise --gpu-memory-utilization", "lower --max-model-len"]
            if m.activations > m.requested // 8:
                fixes.append("lower --max-num-batched-tokens")
            if m.graphs > m.requested // 8:
                fixes.append("capture fewer or smaller graphs (--compilation-config "
                             "'{\"max_cudagraph_capture_size\": 64}')")
            if m.memory_setting:
                fixes.append(f"set {m.memory_setting} higher")
            found.append(
                f"the KV cache would get {max(kv, 0) / GiB:.2f} GiB of the "
                f"{m.requested / GiB:.2f} GiB budget (weights {m.weights / GiB:.2f}, "
                f"activations {m.activations / GiB:.2f}, graphs {m.graphs / GiB:.2f}), less "
                f"than one request of max_model_len needs "
                f"({m.max_model_len_blocks * m.block_bytes / GiB:.2f} GiB). Fix: "
                + ", or ".join(fixes))
        return found

    def lines(self) -> list[str]:
        g, m = self.graphs, self.memory
        graphs = ", ".join(f"{n} {mode}" for mode, n in g.graphs.items()) or "none"
        if g.drafter_graphs:
            graphs += f", {g.drafter_graphs} of the drafter"
        weights = "unknown (checkpoint not on this machine)" if m.weights is None else \
            f"{m.weights / GiB:.2f} GiB"
        kv = "unknown until the weights load" if m.kv_cache is None else \
            f"{m.kv_cache / GiB:.2f} GiB ({m.kv_blocks} blocks)"
        return [
            f"graphs: {g.mode}, {g.total} graphs ({graphs}), {g.streams} of {g.budget} streams",
            f"memory: {m.total / GiB:.2f} GiB device, {m.requested / GiB:.2f} GiB requested; "
            f"weights {weights}, activations {m.activations / GiB:.2f} GiB, graphs "
            f"{m.graphs / GiB:.2f} GiB, communicators {m.communicators / GiB:.2f} GiB (outside "
            f"the request); KV cache {kv}"] + ([] if m.states is None else [
            f"states: Gated DeltaNet in {m.states.layers} layer(s), per request and layer a "
            f"recurrent state of {m.states.recurrent / 1024:.1f} KiB and a conv state of "
            f"{m.states.conv / 1024:.1f} KiB, held in the KV cache's blocks ({m.states.groups} "
            f"block(s) a request; blocks of {m.states.block_size} tokens: one block's K is one "
            "recurrent state)"])


def within(name: str, planned: float, measured: float) -> bool:
    fraction, floor = MARGIN[name]
    return abs(planned - measured) <= max(fraction * abs(measured), floor)
