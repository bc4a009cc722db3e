"""What the Ascend attention operators accept, checked against an engine's config at start-up.

The platform runs ``check`` in the process that builds the config (before any worker starts, so
within seconds of the command), so that a model or setting the chip's kernels refuse fails at
once with the limit, its source and the fix, not with an operator error at the first request
or during graph capture. Each row here is one limit of docs/torch_npu_calls.md's table "Limits
checked at start-up"; the simulator enforces the same limits in the operators themselves
(device/sim/), with the chip's messages.
"""

import dataclasses

from vllm_ascend.attention.hybrid import gdn_layout

FIA_MAX_HEAD_SIZE = 256  # F8: TND head dim at most 256
FIA_HEAD_ALIGN = 16  # F9: 16-element aligned for fp16/bf16
FIA_MAX_HEADS = 256  # F10: Nq and Nkv at most 256
FIA_MAX_GROUP = 64  # F10: Nq / Nkv at most 64
FIA_MAX_BATCH = 4096  # F2: actual_seq_lengths holds at most 4096 requests
FIA_MAX_QUERY_PER_REQUEST = 16  # F16: TND decode with speculation (upstream asserts it)
BLOCK_SIZE_ALIGN, BLOCK_SIZE_BELOW = 16, 512  # F6: paged KV block size
# The fused MLA kernels (npu_kv_rmsnorm_rope_cache, npu_interleave_rope, FIA v2's MLA path and
# the prefill's FIA with Q/K D 192 and V D 128): DeepSeek's shapes only.
MLA_SHAPE = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
             "v_head_dim": 128}
MLA_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)  # FIA v2 with query_rope: numHeads per rank


@dataclasses.dataclass(frozen=True)
class Violation:
    what: str  # the setting or model property, with its value
    limit: str  # the operator's rule and its source
    fix: str

    def __str__(self) -> str:
        return f"{self.what}: {self.limit}. {self.fix}"


class OperatorLimitError(ValueError):
    pass


def _tp_for(heads_ok, tp: int, total_heads: int) -> str:
    """A tensor parallel size that brings the per-rank heads within the limit, if one does."""
    for size in (2, 4, 8, 16, 32, 64):
        if size > tp and total_heads % size == 0 and heads_ok(size):
            return f"Use --tensor-parallel-size {size} (or another size that splits the heads)."
    return "No tensor parallel size brings it within the limit: this model cannot run on Ascend."


def dense_attention(head_size: int, num_heads: int, num_kv_heads: int, tp: int) -> list:
    """FIA v1 in TND layout (attention/backend.py); heads are the totals, split over ``tp``."""
    found = []
    if head_size > FIA_MAX_HEAD_SIZE or head_size % FIA_HEAD_ALIGN:
        found.append(Violation(
            f"head size {head_size}",
            f"the fused infer attention operator takes head sizes that are multiples of "
            f"{FIA_HEAD_ALIGN} up to {FIA_MAX_HEAD_SIZE} in TND layout (561002 'D should be 16 "
            "elements aligned' / 'headDim shall not exceed 256')",
            "This model's attention cannot run on Ascend's fused attention."))

    def per_rank(size):
        return num_heads // size, max(1, num_kv_heads // size)

    def heads_ok(size):
        q, kv = per_rank(size)
        return q <= FIA_MAX_HEADS and kv <= FIA_MAX_HEADS and q % kv == 0 and \
            q // kv <= FIA_MAX_GROUP

    q, kv = per_rank(tp)
    if not heads_ok(tp):
        found.append(Violation(
            f"{q} query heads and {kv} key/value heads per rank (tensor_parallel_size {tp})",
            f"the fused infer attention operator takes at most {FIA_MAX_HEADS} query and "
            f"{FIA_MAX_HEADS} key/value heads, query heads a multiple of key/value heads, at "
            f"most {FIA_MAX_GROUP} query heads per key/value head (TORCH_NPU_CONTRACTS F10)",
            _tp_for(heads_ok, tp, num_heads)))
    return found


def latent_attention(hf_config, num_heads: int, tp: int) -> list:
    """The fused MLA kernels (attention/mla.py, ops/mla.py)."""
    found = []
    shape = {name: getattr(hf_config, name, None) for name in MLA_SHAPE}
    wrong = {name: value for name, value in shape.items() if value != MLA_SHAPE[name]}
    if wrong:
        found.append(Violation(
            "multi-head latent attention with " + ", ".join(f"{k}={v}" for k, v in
                                                            wrong.items()),
            "the fused MLA kernels take DeepSeek's shapes only: " + ", ".join(
                f"{k}={v}" for k, v in MLA_SHAPE.items()) + " (npu_kv_rmsnorm_rope_cache: "
            "kv [B, 1, S, 576]; FIA prefill: Q/K head 192, V head 128)",
            "vllm-ascend has no unfused MLA path for other shapes yet."))
    if num_heads % tp or num_heads // tp not in MLA_HEADS:
        found.append(Violation(
            f"{num_heads} attention heads over tensor_parallel_size {tp}",
            f"the MLA decode (FIA v2 with query_rope) takes {', '.join(map(str, MLA_HEADS))} "
            "query heads per rank",
            _tp_for(lambda size: num_heads // size in MLA_HEADS, tp, num_heads)))
    return found


# The recurrent-state layers of the hybrid and state-space families vLLM serves, by model type.
STATE_LAYERS = {
    "qwen3_next": "Gated DeltaNet", "qwen3_5": "Gated DeltaNet", "qwen3_5_text": "Gated DeltaNet",
    "qwen3_5_moe": "Gated DeltaNet", "qwen3_5_moe_text": "Gated DeltaNet",
    "mamba": "Mamba", "mamba2": "Mamba-2", "jamba": "Mamba", "nemotron_h": "Mamba-2",
    "falcon_h1": "Mamba-2", "granitemoehybrid": "Mamba-2", "zamba2": "Mamba-2",
    "lfm2": "short convolution", "lfm2_moe": "short convolution"}


def state_space_layers(vllm_config, model) -> list:
    """A model with layers that keep a recurrent state (linear attention, Mamba, short
    convolutions): none has an Ascend path in vllm-ascend yet, and vLLM's own kernels for them
    are Triton or CUDA, which would fail in the engine's first (profile) run."""
    if not (model.is_hybrid or model.is_attention_free or model.has_inner_state):
        return []
    kind = STATE_LAYERS.get(model.hf_text_config.model_type, "recurrent-state")
    if serves_gated_deltanet(model):
        return gated_deltanet(vllm_config)
    return [Violation(
        f"{model.architecture}'s {kind} layers",
        "vllm-ascend has no Ascend path for layers that keep a recurrent state yet (vLLM runs "
        "them with Triton or CUDA kernels; torch_npu's Gated DeltaNet operators are in the "
        "simulator already, docs/torch_npu_calls.md 'Gated DeltaNet')",
        "Serve a model of full, sliding-window or latent (MLA) attention: "
        "docs/supported_models.md lists the families that run.")]


# (Qwen3.5's vision-language class shares the text model type: images are refused in check())
GDN_SERVED = {"qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"}


def serves_gated_deltanet(model) -> bool:
    return model.hf_text_config.model_type in GDN_SERVED


def gated_deltanet(vllm_config) -> list:
    """Qwen3-Next's and Qwen3.5's Gated DeltaNet layers (ops/gdn.py): their states must fit the
    KV cache's lanes (attention/hybrid.py); speculative decoding on them is not served yet."""
    model, found = vllm_config.model_config, []
    layout = gdn_layout(vllm_config, (BLOCK_SIZE_ALIGN, BLOCK_SIZE_BELOW))
    if isinstance(layout, str):
        found.append(Violation(f"{model.architecture}'s Gated DeltaNet states", layout,
                               "This model's layer sizes cannot run on vllm-ascend yet."))
    if vllm_config.speculative_config is not None:
        found.append(Violation(
            f"speculative decoding on {model.architecture}'s Gated DeltaNet layers",
            "the recurrent states of drafted tokens (their slots, the accepted count) are not "
            "served yet", "Leave speculative_config unset for this model."))
    return found


def check(vllm_config) -> None:
    """Raise ``OperatorLimitError`` naming every limit ``vllm_config`` exceeds, and the fixes."""
    model = vllm_config.model_config
    if model is None or model.runner_type == "pooling":
        return
    parallel, cache = vllm_config.parallel_config, vllm_config.cache_config
    tp = parallel.tensor_parallel_size
    found = []
    spec = vllm_config.speculative_config
    draft = getattr(spec, "draft_model_config", None) if spec is not None else None
    # (a draft model that is the target itself, as n-gram's draft config is, is checked once)
    others = [draft] if draft is not None and draft is not model and \
        draft.model != model.model else []
    if model.is_multimodal_model and model.supports_multimodal_inputs:
        found.append(Violation(
            f"{model.architecture}'s image and video inputs",
            "vllm-ascend has no Ascend path for a vision encoder yet (upstream's: "
            "ops/mm_encoder_attention.py)",
            "Serve its language model for text with --language-model-only (or "
            "--limit-mm-per-prompt with 0 for every modality)."))
    for config in [model, *others]:
        found += state_space_layers(vllm_config, config)
        if config.is_attention_free:
            continue
        heads = config.model_arch_config.total_num_attention_heads
        if config.use_mla:
            found += latent_attention(config.hf_text_config, heads, tp)
        else:
            found += dense_attention(config.get_head_size(), heads,
                                     config.get_total_num_kv_heads(), tp)
    if cache is not None and cache.user_specified_block_size and (
            cache.block_size % BLOCK_SIZE_ALIGN or cache.block_size >= BLOCK_SIZE_BELOW):
        found.append(Violation(
            f"block_size {cache.block_size}",
            f"paged attention takes block sizes that are multiples of {BLOCK_SIZE_ALIGN} below "
            f"{BLOCK_SIZE_BELOW} (F6; the tiling's 'must be less than 512')",
            "Leave --block-size unset (vllm-ascend uses 128), or pick such a size."))
    max_seqs = vllm_config.scheduler_config.max_num_seqs
    if max_seqs + 1 > FIA_MAX_BATCH:  # a full FULL batch carries one dummy request more
        found.append(Violation(
            f"max_num_seqs {max_seqs}",
            f"the fused infer attention operator takes at most {FIA_MAX_BATCH} requests per "
            "call (F2), and a full batch in a FULL graph carries a dummy request",
            f"Use --max-num-seqs {FIA_MAX_BATCH - 1} or fewer."))
    k = spec.num_speculative_tokens if spec is not None else None
    if k and 1 + k > FIA_MAX_QUERY_PER_REQUEST:
        found.append(Violation(
            f"num_speculative_tokens {k}",
            f"the verify step gives each request 1 + {k} = {1 + k} query tokens, and the "
            f"fused infer attention operator takes at most {FIA_MAX_QUERY_PER_REQUEST} per "
            "request in TND layout (F16)",
            f"Use num_speculative_tokens <= {FIA_MAX_QUERY_PER_REQUEST - 1}."))
    if found:
        raise OperatorLimitError(
            "This configuration exceeds what Ascend's attention operators accept:\n" +
            "\n".join(f"  - {v}" for v in found))
