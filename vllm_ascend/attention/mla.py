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
* Prefill gathers each request's whole latent sequence from the cache (earlier chunks and
  prefix-cache hits included), up-projects it with ``kv_b_proj`` and runs FIA in TND over
  query/key heads of nope + rope dims (the prefill backend below). Upstream runs the new tokens
  and each context chunk separately and merges them with their softmax LSE; one call over the
  whole sequence with the bottom-right causal mask gives the same attention.
"""

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
from vllm_ascend.compilation.acl_graph import GRAPH_STATE
from vllm_ascend.device import torch_npu

BACKEND_NAME = "ASCEND_MLA"


@dataclass
class MLADecodeMetadata:
    block_table: torch.Tensor  # int32 [num_decodes, max_blocks_per_req]
    seq_lens_list: list[int]  # KV lengths (host): FIA's actual_seq_kvlen
    actual_seq_lengths_q: list[int]  # cumulative query lengths (host), TND only
    atten_mask: torch.Tensor  # the causal mask, TND only


@dataclass
class MLAPrefillMetadata:
    query_lens_cu: list[int]  # cumulative query lengths of the prefill requests (host)
    kv_lens_cu: list[int]  # cumulative KV lengths (host): whole sequences
    kv_slots: torch.Tensor  # int64 cache slots of every prefill request's whole sequence
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
            lens = kv_lens[num_decodes:n].numpy().astype(np.int64)
            starts = np.cumsum(lens) - lens
            req = np.repeat(np.arange(num_prefills), lens)
            pos = np.arange(lens.sum()) - np.repeat(starts, lens)
            req_t = torch.from_numpy(req).to(tables.device) + num_decodes
            pos_t = torch.from_numpy(pos).to(tables.device)
            blocks = tables[req_t, pos_t // self.block_size].to(torch.int64)
            q0 = int(cu_q[num_decodes])
            prefill = MLAPrefillMetadata(
                query_lens_cu=(cu_q[num_decodes + 1: n + 1] - q0).tolist(),
                kv_lens_cu=np.cumsum(lens).tolist(),
                kv_slots=blocks * self.block_size + pos_t % self.block_size,
                atten_mask=self.atten_mask)
        return AscendMLAMetadata(
            num_actual_tokens=cam.num_actual_tokens, num_decodes=num_decodes,
            num_decode_tokens=num_decode_tokens, num_prefills=num_prefills, decode=decode,
            prefill=prefill)


class AscendMLAPrefillBackend(MLAPrefillBackend):
    """vLLM's MLA prefill hook (Platform.get_mla_prefill_backend_cls): FIA in TND over the
    prefill requests' new query tokens and their whole key/value sequences."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]

    @staticmethod
    def get_name() -> str:
        return "ASCEND_FIA"

    def prepare_metadata(self, prefill_metadata: MLAPrefillMetadata) -> None:
        self.metadata = prefill_metadata

    def run_prefill_new_tokens(self, q, k, v, return_softmax_lse: bool):
        if return_softmax_lse:
            raise ValueError("the Ascend MLA prefill attends over whole sequences and returns "
                             "no softmax LSE to merge")
        m = self.metadata
        # FIA in TND with query/key head dim 192 and value 128 takes bfloat16 only
        # (upstream's _forward_prefill casts).
        dtype = q.dtype
        q, k, v = (t.to(torch.bfloat16).contiguous() for t in (q, k, v))
        out, _ = torch_npu.npu_fused_infer_attention_score(
            q, k, v, num_heads=q.shape[1], num_key_value_heads=k.shape[1], input_layout="TND",
            atten_mask=m.atten_mask, sparse_mode=CAUSAL, scale=self.scale,
            actual_seq_lengths=m.query_lens_cu, actual_seq_lengths_kv=m.kv_lens_cu)
        return out.to(dtype)

    def run_prefill_context_chunk(self, chunk_idx, q, k, v):
        raise ValueError("the Ascend MLA prefill has no context chunks: run_prefill_new_tokens "
                         "attends over each request's whole sequence")


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
        self.speculative = get_current_vllm_config().speculative_config is not None
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
            p = m.prefill
            # Each prefill request's whole sequence, context included, from the caches.
            latent = nope_cache.view(-1, self.kv_lora_rank).index_select(0, p.kv_slots)
            k_pe = rope_cache.view(-1, self.qk_rope_head_dim).index_select(0, p.kv_slots)
            kv = self.kv_b_proj(latent)[0].view(-1, self.num_heads,
                                                self.qk_nope_head_dim + self.v_head_dim)
            k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
            k = torch.cat((k_nope, k_pe.unsqueeze(1).expand(-1, self.num_heads, -1)), dim=-1)
            qp = torch.cat((q[nd:na, :, : self.qk_nope_head_dim], q_rope(nd, na)), dim=-1)
            layer.prefill_backend.prepare_metadata(p)
            out = layer.prefill_backend.run_prefill_new_tokens(qp, k, v, False)
            output[nd:na].copy_(out.reshape(na - nd, -1))
        if na < output.shape[0]:
            output[na:].zero_()  # padding tokens of a PIECEWISE step

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
