"""AscendAttentionBackend: vLLM attention on the fused infer attention operator (FIA).

Metadata carries what FIA takes: cumulative query lengths and per-request KV lengths as *host
lists*, an int32 block table and the int8 causal mask (the KV write takes vLLM's int32 slot
mapping from the forward context). Each layer's KV
cache is one [2, num_blocks, block_size, num_kv_heads, head_size] tensor whose halves are the
separate, contiguous K and V caches FIA reads as [num_blocks, block_size, H] (BnBsH) views.
"""

from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.forward_context import get_forward_context
from vllm.v1.attention.backends.registry import register_backend
from vllm.v1.kv_cache_interface import KVCacheLayout

from vllm_ascend.attention.graph_params import GRAPH_STATE
from vllm_ascend.attention.limits import BLOCK_SIZE_ALIGN, BLOCK_SIZE_BELOW
from vllm_ascend.device import torch_npu

BACKEND_NAME = "ASCEND"
ATTEN_MASK_SIZE = 2048  # FIA's sparse_mode 3 takes a compressed 2048x2048 causal mask
CAUSAL = 3  # FIA sparse_mode: causal, with the compressed mask
BAND = 4  # FIA sparse_mode: a band around the diagonal (a sliding window), the same mask
NO_BAND = 2147483647  # pre_tokens/next_tokens: no band limit (passed explicitly in graphs)


def fia_mask_args(sliding_window: "int | None") -> dict:
    """FIA's sparse mode and band for a layer: causal, or a sliding window of W keys, the
    query's own included (vLLM's meaning), which FIA's band keeps with pre_tokens W - 1 and
    next_tokens 0 (its edges are inclusive: docs/torch_npu_calls.md)."""
    if sliding_window is None:
        return dict(sparse_mode=CAUSAL)
    return dict(sparse_mode=BAND, pre_tokens=sliding_window - 1, next_tokens=0)


@dataclass
class AscendMetadata:
    num_actual_tokens: int  # tokens attention runs on (a FULL step: the graph's size)
    actual_seq_lengths_q: list[int]  # cumulative query lengths (host), FIA's actual_seq_lengths
    seq_lens_list: list[int]  # per-request KV lengths (host), FIA's actual_seq_lengths_kv
    block_table: torch.Tensor  # int32 [len(actual_seq_lengths_q), max_blocks_per_req]
    atten_mask: torch.Tensor  # the int8 2048x2048 causal mask (1 = masked)


def kv_caches_of(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's [2, blocks, block_size, kv_heads, head] cache -> its K and V caches."""
    return kv_cache[0], kv_cache[1]


class AscendAttentionMetadataBuilder(AttentionMetadataBuilder[AscendMetadata]):
    """FIA's metadata from vLLM's. In a FULL step the runner has already padded the requests
    (worker/padding.py): every request here, fake or dummy included, is one FIA sees."""

    # FIA runs inside FULL graphs for any batch: its host lists are re-issued before each replay
    # (graph_params.GraphParams.update) and the runner pads the metadata to the captured batch.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.ALWAYS

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device_):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device_)
        # Upper triangle 1 = masked, as upstream builds it for sparse_mode 3.
        self.atten_mask = torch.triu(torch.ones(ATTEN_MASK_SIZE, ATTEN_MASK_SIZE),
                                     diagonal=1).to(torch.int8).to(device_)
        self._init_reorder_batch_threshold(1)
        max_blocks = -(-vllm_config.model_config.max_model_len // kv_cache_spec.block_size)
        # Block table rows for a full batch plus the dummy request, which vLLM's table has no
        # row for (persistent: FULL graphs read it at its captured address).
        self.block_table = torch.zeros(vllm_config.scheduler_config.max_num_seqs + 1,
                                       max_blocks, dtype=torch.int32, device=device_)
        # The metadata built last: Model Runner V2 replays a FULL graph outside any forward
        # context, and its task updates re-issue FIA with this (worker/v2/graphs.py).
        self.latest: AscendMetadata | None = None

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> AscendMetadata:
        cam = common_attn_metadata
        n = cam.num_reqs
        # Host lengths: the runner's CPU copies. The KV lengths are exact (an upper bound only
        # under asynchronous speculative decoding, which the platform turns off).
        cu_q = cam.query_start_loc_cpu[1: n + 1].tolist()
        kv_lens = cam.seq_lens_cpu_upper_bound[:n].tolist()
        rows = min(n, cam.block_table_tensor.shape[0])
        block_table = self.block_table[:n]
        block_table[:rows].copy_(cam.block_table_tensor[:rows])
        block_table[rows:].zero_()  # the dummy of a full batch reads the null block
        self.latest = AscendMetadata(
            num_actual_tokens=cam.num_actual_tokens,
            actual_seq_lengths_q=cu_q,
            seq_lens_list=kv_lens,
            block_table=block_table,
            atten_mask=self.atten_mask,
        )
        return self.latest

    def build_for_drafting(self, common_attn_metadata: CommonAttentionMetadata,
                           draft_index: int) -> AscendMetadata:
        # vLLM's drafter moves the KV lengths on the device only (draft slots added, rejected
        # tokens taken off, +1 per draft step), leaving the host copy stale; FIA needs them
        # exact on the host, so read them back: one device-to-host copy per draft step.
        cam = common_attn_metadata
        return self.build(0, cam.replace(seq_lens_cpu_upper_bound=cam.seq_lens.cpu()),
                          fast_build=True)


# FIA v2 (for layers with sinks) names v1's keywords so (upstream attention_v1.py, 1375-1400).
V2_NAMES = {"actual_seq_lengths": "actual_seq_qlen", "actual_seq_lengths_kv": "actual_seq_kvlen",
            "num_heads": "num_query_heads", "scale": "softmax_scale"}
SINK_MAX_HEAD_SIZE = 128  # FIA v2's learnable_sink: a value head dim of at most 128


def check_sinks(sinks: torch.Tensor, head_size: int) -> None:
    """What FIA v2's learnable_sink takes (docs/torch_npu_calls.md), checked as the model is
    built: bfloat16 sinks (vLLM makes them in the model's dtype) and heads of at most 128."""
    if sinks.dtype != torch.bfloat16:
        raise ValueError(
            f"Attention sinks run on FIA v2's learnable_sink, which takes bfloat16; this model "
            f"runs in {sinks.dtype}: serve it with --dtype bfloat16.")
    if head_size > SINK_MAX_HEAD_SIZE:
        raise NotImplementedError(
            f"The Ascend attention backend does not support attention sinks with a head size "
            f"of {head_size}: FIA v2's learnable_sink takes at most {SINK_MAX_HEAD_SIZE}.")


class AscendAttentionImpl(AttentionImpl):
    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
                 kv_cache_dtype, logits_soft_cap=None, attn_type=AttentionType.DECODER,
                 kv_sharing_target_layer_name=None, sinks=None):
        # (ALiBi slopes are a list or a tensor: asked whether given, not whether true)
        unsupported = [name for name, given in (
            ("ALiBi (FIA's pse_shift, which vllm-ascend does not pass)", alibi_slopes is not None),
            ("logits soft-capping (no Ascend attention kernel applies it)", bool(logits_soft_cap)),
            ) if given]
        if unsupported:
            raise NotImplementedError(
                f"The Ascend attention backend does not support {'; '.join(unsupported)}: this "
                "model cannot run on vllm-ascend yet.")
        if sinks is not None:
            check_sinks(sinks, head_size)
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.mask_args = fia_mask_args(sliding_window)
        # Layers with sinks (GPT-OSS) run FIA v2 with learnable_sink, as upstream; others v1.
        self.sinks = sinks
        self.fia, self.fia_workspace = (
            (torch_npu.npu_fused_infer_attention_score,
             torch_npu._npu_fused_infer_attention_score_get_max_workspace) if sinks is None else
            (torch_npu.npu_fused_infer_attention_score_v2,
             torch_npu._npu_fused_infer_attention_score_v2_get_max_workspace))

    def in_fia_names(self, args: dict) -> dict:
        """Keywords written in v1's names, in this layer's FIA's."""
        return args if self.sinks is None else {V2_NAMES.get(k, k): v for k, v in args.items()}

    def fia_args(self, args: dict) -> dict:
        """FIA's keywords, written in v1's names, for this layer's FIA (with its sinks)."""
        sinks = {} if self.sinks is None else {"learnable_sink": self.sinks}
        return self.in_fia_names(args) | sinks

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        if kv_cache is None or kv_cache.numel() == 0:
            return
        key_cache, value_cache = kv_caches_of(kv_cache)
        n = slot_mapping.shape[0]
        # As upstream (device_op.py): the ND caches need cache_mode="Norm"; padded tokens carry
        # slot -1 and write nothing.
        torch_npu.npu_scatter_pa_kv_cache(
            key=key[:n].view(n, self.num_kv_heads, self.head_size).contiguous(),
            value=value[:n].view(n, self.num_kv_heads, self.head_size).contiguous(),
            key_cache=key_cache, value_cache=value_cache, slot_mapping=slot_mapping,
            cache_mode="Norm")

    def forward(self, layer, query, key, value, kv_cache, attn_metadata: AscendMetadata | None,
                output: torch.Tensor, output_scale=None, output_block_scale=None):
        if attn_metadata is None:  # profiling run: no metadata, nothing to attend to
            return output.fill_(0)
        key_cache, value_cache = kv_caches_of(kv_cache)
        num_blocks, block_size = key_cache.shape[:2]
        fia_args = self.fia_args(dict(
            key=key_cache.view(num_blocks, block_size, -1),  # BnBsH, as FIA reads paged KV
            value=value_cache.view(num_blocks, block_size, -1),
            atten_mask=attn_metadata.atten_mask, block_table=attn_metadata.block_table,
            input_layout="TND", block_size=block_size,
            actual_seq_lengths=attn_metadata.actual_seq_lengths_q,
            actual_seq_lengths_kv=attn_metadata.seq_lens_list,
            num_key_value_heads=self.num_kv_heads, num_heads=self.num_heads, scale=self.scale,
            **self.mask_args))
        if torch_npu.npu.is_current_stream_capturing():
            # Inside a FULL graph: the query is not sliced (the runner padded the metadata).
            n = attn_metadata.num_actual_tokens
            self._capture_fia(query.view(n, self.num_heads, self.head_size),
                              output.view(n, self.num_heads, self.head_size), fia_args)
            return output
        # Eager, or between PIECEWISE pieces: the real tokens only.
        n = attn_metadata.num_actual_tokens
        attn_out, _ = self.fia(query=query[:n].view(n, self.num_heads, self.head_size),
                               **fia_args)
        output[:n].view(n, self.num_heads, self.head_size).copy_(attn_out)
        return output

    def step_args(self, metadata: AscendMetadata) -> dict:
        """What a FULL replay re-issues: the step's host lists and block table."""
        return self.in_fia_names(dict(block_table=metadata.block_table,
                                      actual_seq_lengths=metadata.actual_seq_lengths_q,
                                      actual_seq_lengths_kv=metadata.seq_lens_list))

    def _capture_fia(self, query, out, fia_args) -> None:
        """Upstream's FULL-graph protocol (graph_params.GraphParams.capture), with the .out call
        and a workspace that serve any lengths; everything by keyword, as upstream."""
        fia_args = dict({"pre_tokens": NO_BAND, "next_tokens": NO_BAND}, **fia_args,
                        query=query)
        get_forward_context().no_compile_layers[GRAPH_STATE].fia.capture(
            self.fia.out, (), fia_args, out, lambda: self.fia_workspace(**fia_args),
            self.step_args)


class AscendAttentionBackend(AttentionBackend):
    accept_output_buffer: bool = True
    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls():
        return AscendAttentionImpl

    @staticmethod
    def get_builder_cls():
        return AscendAttentionMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None):
        # FIA's paged-KV rule (F6: a multiple of 16, below 512), as sizes: vLLM reads a larger
        # block (a hybrid model's, attention/hybrid.py) as the largest of them that divides it.
        return list(range(BLOCK_SIZE_ALIGN, BLOCK_SIZE_BELOW, BLOCK_SIZE_ALIGN))

    @classmethod
    def get_preferred_block_size(cls, default_block_size: int) -> int:
        return 128

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(range(16, 257, 16))  # FIA in TND: at most 256, 16-element aligned

    @classmethod
    def supported_kv_cache_layouts(cls):
        # Layer-outermost: each layer's pages are one contiguous region, which the runner
        # views as that layer's separate K and V caches.
        return (KVCacheLayout.LBNHC,)

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER


register_backend(BACKEND_NAME, f"{__name__}.AscendAttentionBackend")
