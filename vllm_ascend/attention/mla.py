"""AscendMLABackend: DeepSeek's multi-head latent attention on torch_npu, as upstream vllm-ascend
calls it (attention/mla_v1.py).

Each layer's KV cache is the compressed latent: per token ``kv_lora_rank`` normed latent values
and ``qk_rope_head_dim`` roped key values, one head. vLLM hands a layer one contiguous region of
``[num_blocks, block_size, kv_lora_rank + rope]``; it is read as two separate, contiguous paged
caches, ``[num_blocks, block_size, 1, kv_lora_rank]`` then ``[num_blocks, block_size, 1, rope]``,
which is what ``npu_kv_rmsnorm_rope_cache`` writes and FIA reads.

* The KV write fuses the latent's RMSNorm, the key's RoPE and the cache scatter
  (``npu_kv_rmsnorm_rope_cache``); the query's RoPE is ``npu_interleave_rope``.
* Decode (requests with at most 1 + num_speculative_tokens new tokens) absorbs the key
  up-projection into the query (``W_UK_T``), attends on the latent cache with FIA v2 and its
  ``query_rope``/``key_rope`` parts (BNSD, or TND with speculative decoding), and projects the
  latent result to the value heads (``npu_transpose_batchmatmul`` with ``W_UV``). In a FULL graph
  the FIA call is captured as the dense backend's is, and its host lists are re-issued before
  each replay.
* Prefill up-projects the new tokens' latent with ``kv_b_proj`` and runs FIA in TND over
  query/key heads of nope + rope dims, causal (the prefill backend below). A request's cached
  context (earlier chunks of its prompt, prefix-cache hits) is attended to in chunks of at most
  ``chunk_tokens`` tokens over the step's prefill requests, each gathered and up-projected on
  its own, and merged into the running result by the softmax LSE (``npu_attention_update``),
  as upstream does: the prefill's memory depends on the chunk size, not on the context length.
"""

import contextlib
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from vllm.config import get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.v1.attention.backend import (
    AttentionCGSupport,
    CommonAttentionMetadata,
    MLAAttentionImpl,
)
from vllm.v1.attention.backends.mla.prefill.base import MLAPrefillBackend
from vllm.v1.attention.backends.registry import register_backend
from vllm.v1.attention.backends.utils import split_decodes_and_prefills

from vllm_ascend.attention.backend import (CAUSAL, AscendAttentionBackend,
                                           AscendAttentionMetadataBuilder)
from vllm_ascend.attention.graph_params import GRAPH_STATE
from vllm_ascend.device import torch_npu

BACKEND_NAME = "ASCEND_MLA"
CHUNK_SETTING = "mla_prefill_chunk_tokens"  # additional_config
# FIA in TND with query/key head dim 192 and value 128 takes bfloat16 only (upstream's
# _forward_prefill casts).
PREFILL_DTYPE = torch.bfloat16


_PROFILING = [False]


@contextlib.contextmanager
def profiling_prefill():
    """vLLM's profile run: MLA layers reserve their prefill's memory (AscendMLAImpl.
    reserve_prefill) where other dummy runs attend to nothing."""
    _PROFILING[0] = True
    try:
        yield
    finally:
        _PROFILING[0] = False


def is_profiling_prefill() -> bool:
    return _PROFILING[0]


def prefill_chunk_tokens(vllm_config) -> int:
    """The most context tokens a prefill step gathers and up-projects at once: the scheduler's
    token budget (what the step's new tokens may take), unless additional_config sets it."""
    value = (vllm_config.additional_config or {}).get(
        CHUNK_SETTING, vllm_config.scheduler_config.max_num_batched_tokens)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"additional_config {CHUNK_SETTING}={value!r} must be an integer >= 1 "
                         "(context tokens an MLA prefill attends to at once)")
    return value


@dataclass
class MLADecodeMetadata:
    block_table: torch.Tensor  # int32 [num_decodes, max_blocks_per_req]
    seq_lens_list: list[int]  # KV lengths (host): FIA's actual_seq_kvlen
    actual_seq_lengths_q: list[int]  # cumulative query lengths (host), TND only
    atten_mask: torch.Tensor  # the causal mask, TND only


@dataclass
class ContextChunk:
    """At most chunk_tokens tokens of the prefill requests' cached context, in request order;
    the requests it covers each have at least one token in it."""
    slots: torch.Tensor  # int64 cache slots of its tokens
    query_rows: torch.Tensor  # int64: the covered requests' query tokens among the prefill's
    query_lens_cu: list[int]  # their cumulative query lengths (host)
    kv_lens_cu: list[int]  # their tokens in this chunk, cumulative (host)


@dataclass
class MLAPrefillMetadata:
    query_lens_cu: list[int]  # cumulative query lengths of the prefill requests (host)
    new_slots: torch.Tensor  # int64 cache slots of their query tokens' positions
    chunks: list[ContextChunk]  # their cached context; none when no request has any
    atten_mask: torch.Tensor


@dataclass
class AscendMLAMetadata:
    num_actual_tokens: int
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    decode: MLADecodeMetadata | None
    prefill: MLAPrefillMetadata | None


class AscendMLAMetadataBuilder(AscendAttentionMetadataBuilder):
    """Decodes first (vLLM reorders the batch), then prefills. In a FULL step every request is
    a decode of the same query length: the runner pads with whole fake requests. The dense
    builder's causal mask, persistent block table and drafting metadata serve as they are."""

    # As upstream: FULL graphs hold uniform decode batches only (the prefill path gathers
    # variable-length sequences); mixed batches run eagerly or in PIECEWISE graphs.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device_):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device_)
        spec = vllm_config.speculative_config  # a verify step's requests are decodes too
        self._init_reorder_batch_threshold(1 + (spec.num_speculative_tokens if spec else 0))
        self.block_size = kv_cache_spec.block_size
        self.chunk_tokens = prefill_chunk_tokens(vllm_config)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> AscendMLAMetadata:
        cam = common_attn_metadata
        n = cam.num_reqs
        num_decodes, num_prefills, num_decode_tokens, _ = split_decodes_and_prefills(
            cam, decode_threshold=self.reorder_batch_threshold)
        cu_q = cam.query_start_loc_cpu[: n + 1]
        kv_lens = cam.seq_lens_cpu_upper_bound[:n]
        tables = cam.block_table_tensor
        decode = prefill = None
        if num_decodes:
            rows = min(num_decodes, tables.shape[0])
            block_table = self.block_table[:num_decodes]
            block_table[:rows].copy_(tables[:rows])
            block_table[rows:].zero_()  # a fake request reads the null block
            decode = MLADecodeMetadata(
                block_table=block_table, seq_lens_list=kv_lens[:num_decodes].tolist(),
                actual_seq_lengths_q=cu_q[1: num_decodes + 1].tolist(),
                atten_mask=self.atten_mask)
        if num_prefills:
            q_cu = (cu_q[num_decodes: n + 1] - cu_q[num_decodes]).numpy().astype(np.int64)
            context = kv_lens[num_decodes:n].numpy().astype(np.int64) - np.diff(q_cu)
            tables = tables[num_decodes:n]
            prefill = MLAPrefillMetadata(
                query_lens_cu=q_cu[1:].tolist(),
                new_slots=self._slots(tables, context, np.diff(q_cu)),
                chunks=self._context_chunks(tables, q_cu, context),
                atten_mask=self.atten_mask)
        self.latest = AscendMLAMetadata(
            num_actual_tokens=cam.num_actual_tokens, num_decodes=num_decodes,
            num_decode_tokens=num_decode_tokens, num_prefills=num_prefills, decode=decode,
            prefill=prefill)
        return self.latest

    def _slots(self, tables: torch.Tensor, starts: np.ndarray, lens: np.ndarray):
        """The int64 cache slots of positions starts[i] .. starts[i] + lens[i] - 1 of each
        request i, in order, from its block table row. (Read by position, not from the step's
        slot mapping: a token that writes nothing, slot -1, still has its position's slot.)"""
        req = np.repeat(np.arange(len(lens)), lens)
        pos = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens) + starts[req]
        req_t, pos_t = (torch.from_numpy(x).to(tables.device) for x in (req, pos))
        blocks = tables[req_t, pos_t // self.block_size].to(torch.int64)
        return blocks * self.block_size + pos_t % self.block_size

    def _context_chunks(self, tables: torch.Tensor, q_cu: np.ndarray,
                        context: np.ndarray) -> list[ContextChunk]:
        """The prefill requests' cached context (``context[i]`` tokens before request i's
        queries), cut into chunks of at most chunk_tokens tokens."""
        total = int(context.sum())
        if not total:
            return []
        dev = tables.device
        ctx_cu = np.concatenate(([0], np.cumsum(context)))
        slots = self._slots(tables, np.zeros_like(context), context)
        chunks = []
        for lo in range(0, total, self.chunk_tokens):
            hi = min(lo + self.chunk_tokens, total)
            taken = np.minimum(ctx_cu[1:], hi) - np.maximum(ctx_cu[:-1], lo)
            covered = np.flatnonzero(taken > 0)
            q_lens = q_cu[covered + 1] - q_cu[covered]
            rows = np.concatenate([np.arange(q_cu[r], q_cu[r + 1]) for r in covered])
            chunks.append(ContextChunk(
                slots=slots[lo:hi], query_rows=torch.from_numpy(rows).to(dev),
                query_lens_cu=np.cumsum(q_lens).tolist(),
                kv_lens_cu=np.cumsum(taken[covered]).tolist()))
        return chunks


class AscendMLAPrefillBackend(MLAPrefillBackend):
    """vLLM's MLA prefill hook (Platform.get_mla_prefill_backend_cls): FIA in TND over the
    prefill requests' new tokens, and over each chunk of their cached context."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]

    @staticmethod
    def get_name() -> str:
        return "ASCEND_FIA"

    def prepare_metadata(self, prefill_metadata: MLAPrefillMetadata) -> None:
        self.metadata = prefill_metadata

    def run_prefill_new_tokens(self, q, k, v, return_softmax_lse: bool):
        """The new tokens over themselves, causal; with their LSE [T, N, 1] when asked."""
        m = self.metadata
        out, lse = self._attend(q, k, v, atten_mask=m.atten_mask, sparse_mode=CAUSAL,
                                actual_seq_lengths=m.query_lens_cu,
                                actual_seq_lengths_kv=m.query_lens_cu,
                                softmax_lse_flag=return_softmax_lse)
        return (out, lse) if return_softmax_lse else out

    def run_prefill_context_chunk(self, chunk: ContextChunk, q, k, v):
        """The chunk's requests' query tokens over their context in it: all of it lies before
        them, so no mask (upstream's sparse_mode 0); with their LSE."""
        return self._attend(q, k, v, atten_mask=None, sparse_mode=0,
                            actual_seq_lengths=chunk.query_lens_cu,
                            actual_seq_lengths_kv=chunk.kv_lens_cu, softmax_lse_flag=True)

    def _attend(self, q, k, v, **kwargs):
        # q, k and v come in PREFILL_DTYPE, contiguous (AscendMLAImpl._up_project).
        return torch_npu.npu_fused_infer_attention_score(
            q, k, v, num_heads=q.shape[1], num_key_value_heads=k.shape[1], input_layout="TND",
            scale=self.scale, **kwargs)


class _ZeroAttention:
    """The profile run's stand-in for the prefill backend: zeros of FIA's output shapes."""

    def __init__(self, num_heads: int, v_head_dim: int):
        self.shape = (num_heads, v_head_dim)

    def run_prefill_new_tokens(self, q, k, v, return_softmax_lse: bool):
        return self.run_prefill_context_chunk(None, q, k, v)

    def run_prefill_context_chunk(self, chunk, q, k, v):
        return (q.new_zeros(q.shape[0], *self.shape, dtype=torch.bfloat16),
                q.new_zeros(q.shape[0], self.shape[0], 1, dtype=torch.float32))


class AscendMLAImpl(MLAAttentionImpl):
    """The MLA computation between the projections: RoPE, the KV write, attention, and the
    value up-projection. vllm_ascend.ops.mla calls ``forward``; vLLM's own MLAAttention.forward
    (forward_mqa) is replaced there and never reaches this class."""

    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
                 kv_cache_dtype, logits_soft_cap, attn_type, kv_sharing_target_layer_name,
                 q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, qk_head_dim,
                 v_head_dim, kv_b_proj, indexer=None, q_pad_num_heads=None, **kwargs):
        if indexer is not None or kwargs.get("topk_indices_buffer") is not None:
            raise NotImplementedError("sparse MLA (DeepSeek-V3.2's indexer) is not supported "
                                      "by vllm-ascend yet")
        if kv_cache_dtype != "auto":
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not supported by the Ascend "
                             "MLA backend: leave it 'auto'")
        self.num_heads = num_heads
        self.scale = float(scale)
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.kv_b_proj = kv_b_proj
        # FIA's MLA path takes a power-of-two head count: pad the query heads, as upstream.
        self.num_heads_padded = 1 << (num_heads - 1).bit_length()
        # Speculative decoding's verify steps have several tokens a request: TND, as upstream.
        config = get_current_vllm_config()
        self.speculative = config.speculative_config is not None
        self.chunk_tokens = prefill_chunk_tokens(config)  # what the profile run reserves
        self.dcp_world_size = 1

    def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
        raise RuntimeError("vLLM's MLAAttention.forward reached the Ascend MLA backend; the "
                           "Ascend MLA layer (vllm_ascend.ops.mla) should have replaced it")

    def caches(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's [num_blocks, block_size, L + R] region -> its latent and rope caches,
        [num_blocks, block_size, 1, L] and [num_blocks, block_size, 1, R], each contiguous."""
        num_blocks, block_size = kv_cache.shape[:2]
        flat = kv_cache.view(-1)
        split = num_blocks * block_size * self.kv_lora_rank
        return (flat[:split].view(num_blocks, block_size, 1, self.kv_lora_rank),
                flat[split:].view(num_blocks, block_size, 1, self.qk_rope_head_dim))

    def forward(self, layer, q: torch.Tensor, kv_no_split: torch.Tensor, kv_a_layernorm,
                cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                attn_metadata: AscendMLAMetadata, output: torch.Tensor) -> None:
        """q [T, N, nope + rope] (before RoPE), kv_no_split [T, L + R] (before the norm and
        RoPE), cos/sin [T, 1, 1, R] in half layout -> output [T, N * V]."""
        m = attn_metadata
        nd, na = m.num_decode_tokens, m.num_actual_tokens
        nope_cache, rope_cache = self.caches(layer.kv_cache)
        gamma, eps = kv_a_layernorm.weight, kv_a_layernorm.variance_epsilon

        def kv_write(lo, hi):
            """Norm, RoPE and scatter tokens lo..hi into the caches; returns the caches."""
            t = hi - lo
            return torch_npu.npu_kv_rmsnorm_rope_cache(
                kv_no_split[lo:hi].view(t, 1, 1, -1), gamma, cos[lo:hi], sin[lo:hi],
                slots[lo:hi].to(torch.int64), rope_cache, nope_cache, c_kv_scale=None,
                epsilon=eps, cache_mode="PA")[:2]

        def q_rope(lo, hi):
            t = hi - lo
            q_pe = q[lo:hi, :, self.qk_nope_head_dim:].contiguous()
            roped = torch_npu.npu_interleave_rope(q_pe.view(t, self.num_heads, 1, -1),
                                                  cos[lo:hi], sin[lo:hi])
            return roped.view(t, self.num_heads, -1)

        if nd:
            k_pe, k_nope = kv_write(0, nd)
            # Absorb W_UK: (N, B, P) x (N, P, L) -> (B, N, L), as upstream.
            ql_nope = torch.bmm(q[:nd, :, : self.qk_nope_head_dim].transpose(0, 1),
                                layer.W_UK_T).transpose(0, 1)
            out = self._forward_decode(layer, ql_nope, q_rope(0, nd), k_nope, k_pe, m.decode)
            output[:nd].copy_(out)
        if m.num_prefills:
            kv_write(nd, na)
            backend = layer.prefill_backend
            backend.prepare_metadata(m.prefill)
            qp = torch.cat((q[nd:na, :, : self.qk_nope_head_dim], q_rope(nd, na)),
                           dim=-1).to(PREFILL_DTYPE)

            def up_project(cache_slots):
                return self._up_project(
                    nope_cache.view(-1, self.kv_lora_rank).index_select(0, cache_slots),
                    rope_cache.view(-1, self.qk_rope_head_dim).index_select(0, cache_slots))

            out = self._prefill(backend, qp, up_project(m.prefill.new_slots),
                                m.prefill.chunks, lambda chunk: up_project(chunk.slots))
            output[nd:na].copy_(out.reshape(na - nd, -1))
        if na < output.shape[0]:
            output[na:].zero_()  # padding tokens of a PIECEWISE step

    def _up_project(self, latent, k_pe) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens' normed latent [S, L] and roped key part [S, R] -> their keys
        [S, N, nope + rope] and values [S, N, V], contiguous, in PREFILL_DTYPE."""
        kv = self.kv_b_proj(latent)[0].view(-1, self.num_heads,
                                            self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k = torch.cat((k_nope, k_pe.unsqueeze(1).expand(-1, self.num_heads, -1)), -1)
        return k.to(PREFILL_DTYPE), v.to(PREFILL_DTYPE).contiguous()

    def _prefill(self, backend, qp, new_kv, chunks: list[ContextChunk], context):
        """Attention of the prefill's queries ``qp`` [T, N, nope + rope] over their new tokens
        and, chunk by chunk, their context (``context(chunk)`` up-projects one), merged by
        the softmax LSE in float32 as upstream -> [T, N, V] (bfloat16, float32 if merged)."""
        if not chunks:
            return backend.run_prefill_new_tokens(qp, *new_kv, False)
        out, lse = backend.run_prefill_new_tokens(qp, *new_kv, True)
        del new_kv
        out, lse = out.float(), lse.view(qp.shape[:2])  # [T, N, V] and [T, N] float32
        for chunk in chunks:
            self._merge_context_chunk(backend, chunk, qp, out, lse, *context(chunk))
        return out

    def _merge_context_chunk(self, backend, chunk: ContextChunk, qp, out, lse, k, v) -> None:
        """The chunk's requests' queries over its keys ``k`` and values ``v``, merged into
        their rows of the running result ``out`` [T, N, V] and ``lse`` [T, N] (float32). What
        it allocates lives until it returns: every chunk's peak is the same, one chunk's."""
        rows = chunk.query_rows
        part, part_lse = backend.run_prefill_context_chunk(chunk, qp.index_select(0, rows), k, v)
        merged, merged_lse = torch_npu.npu_attention_update(
            (lse.index_select(0, rows).view(-1), part_lse.view(-1)),
            (out.index_select(0, rows).view(-1, self.v_head_dim),
             part.float().view(-1, self.v_head_dim)), 1)
        out.index_copy_(0, rows, merged.view(-1, self.num_heads, self.v_head_dim))
        lse.index_copy_(0, rows, merged_lse.view(-1, self.num_heads))

    def reserve_prefill(self, q: torch.Tensor) -> None:
        """vLLM's profile run builds no attention metadata. So that the peak it measures (and
        the KV cache leaves room for) holds the prefill's tensors, a step of q's tokens with a
        whole chunk of context runs through the prefill on zeros: the up-projections, the
        running result and the merge; attention's own results are zeros of FIA's shapes."""
        t, n, dv, c = q.shape[0], self.num_heads, self.v_head_dim, self.chunk_tokens

        def up_project(tokens):
            return self._up_project(q.new_zeros(tokens, self.kv_lora_rank),
                                    q.new_zeros(tokens, self.qk_rope_head_dim))

        rows = torch.arange(t, device=q.device)
        chunk = ContextChunk(slots=rows, query_rows=rows, query_lens_cu=[t], kv_lens_cu=[c])
        qp = q.new_zeros(t, n, self.qk_nope_head_dim + self.qk_rope_head_dim,
                         dtype=PREFILL_DTYPE)
        self._prefill(_ZeroAttention(n, dv), qp, up_project(t), [chunk],
                      lambda _chunk: up_project(c))

    def _forward_decode(self, layer, ql_nope, q_pe, k_nope, k_pe, decode: MLADecodeMetadata):
        tokens = ql_nope.shape[0]
        nope_cache = k_nope.view(-1, 1, k_nope.shape[1], self.kv_lora_rank)  # [nb, 1, bs, L]
        block_size = nope_cache.shape[2]
        pad = self.num_heads_padded - self.num_heads
        if pad:
            ql_nope = F.pad(ql_nope, (0, 0, 0, pad))
            q_pe = F.pad(q_pe, (0, 0, 0, pad))
        n = self.num_heads_padded
        if self.speculative:  # several tokens per request: TND in, NTD out (upstream)
            query, query_rope = ql_nope.contiguous(), q_pe.contiguous()
            layout, out_shape = "TND_NTD", (n, tokens, self.kv_lora_rank)
            mask, sparse_mode = decode.atten_mask, CAUSAL
            qlen = decode.actual_seq_lengths_q
        else:
            query = ql_nope.reshape(tokens, n, 1, -1).contiguous()
            query_rope = q_pe.reshape(tokens, n, 1, -1).contiguous()
            layout, out_shape = "BNSD_NBSD", (n, tokens, 1, self.kv_lora_rank)
            mask, sparse_mode, qlen = None, 0, None
        inputs = (query, nope_cache, nope_cache)
        args = dict(query_rope=query_rope, key_rope=k_pe.view(-1, 1, block_size,
                                                              self.qk_rope_head_dim),
                    num_query_heads=n, num_key_value_heads=1, input_layout=layout,
                    atten_mask=mask, sparse_mode=sparse_mode, softmax_scale=self.scale,
                    block_table=decode.block_table, block_size=block_size,
                    actual_seq_qlen=qlen, actual_seq_kvlen=decode.seq_lens_list)
        if torch_npu.npu.is_current_stream_capturing():
            attn_out = torch.empty(out_shape, dtype=query.dtype, device=query.device)
            self._capture_fia(inputs, args, attn_out)
        else:
            attn_out, _ = torch_npu.npu_fused_infer_attention_score_v2(*inputs, **args)
        latent = attn_out.view(n, tokens, self.kv_lora_rank)[: self.num_heads]
        # (N, B, L) x (N, L, V) -> (B, N, V)
        out = torch_npu.npu_transpose_batchmatmul(latent.contiguous(), layer.W_UV,
                                                  perm_y=(1, 0, 2))
        return out.reshape(tokens, self.num_heads * self.v_head_dim)

    def step_args(self, metadata: AscendMLAMetadata) -> dict:
        """What a FULL replay re-issues: the step's KV lengths (and, in TND, query lengths)."""
        d = metadata.decode
        return dict(block_table=d.block_table, actual_seq_kvlen=d.seq_lens_list,
                    actual_seq_qlen=d.actual_seq_lengths_q if self.speculative else None)

    def _capture_fia(self, inputs, args, attn_out) -> None:
        """The dense backend's FULL-graph protocol (graph_params.GraphParams.capture), FIA v2."""
        get_forward_context().no_compile_layers[GRAPH_STATE].fia.capture(
            torch_npu.npu_fused_infer_attention_score_v2.out, inputs, args, attn_out,
            lambda: torch_npu._npu_fused_infer_attention_score_v2_get_max_workspace(
                *inputs, **args),
            self.step_args)


class AscendMLABackend(AscendAttentionBackend):
    """The dense backend's dtypes and cache layout; MLA's own cache, builder and impl."""

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls():
        return AscendMLAImpl

    @staticmethod
    def get_builder_cls():
        return AscendMLAMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size,
                           cache_dtype_str="auto"):
        return (num_blocks, block_size, head_size)  # one latent head: read as two caches

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None):
        return [128]  # upstream's AscendMLABackend

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [576]  # kv_lora_rank 512 + rope 64: npu_kv_rmsnorm_rope_cache's only shape

    @classmethod
    def is_mla(cls) -> bool:
        return True


register_backend(BACKEND_NAME, f"{__name__}.AscendMLABackend")
