"""AscendAttentionBackend: vLLM attention on the fused infer attention (FIA) operator.

Metadata carries what FIA takes: cumulative query lengths and per-request KV lengths as *host
lists*, the block table and the slot mapping. KV cache: K and V as
[num_blocks, block_size, num_kv_heads, head_size] views of vLLM's cache tensor.
"""

import enum
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
    MultipleOf,
)
from vllm.v1.attention.backends.registry import register_backend
from vllm.v1.kv_cache_interface import KVCacheLayout

from vllm_ascend import device
from vllm_ascend.attention.graph_params import GRAPH_PARAMS, FIACall, pad_for_graph
from vllm_ascend.device.sim_ops import ATTEN_MASK_SIZE

BACKEND_NAME = "ASCEND"


class AscendAttentionState(enum.Enum):
    """What kind of step this is (for logs and diagnosis). FIA serves all three with the same
    paged call, which is what lets one FULL graph replay any of them."""

    PREFILL_NO_CACHE = 0  # every request starts from an empty KV cache
    CHUNKED_PREFILL = 1  # some request has cached tokens (chunked prefill, prefix hit, mixed)
    DECODE_ONLY = 2  # one new token per request


@dataclass
class AscendMetadata:
    num_actual_tokens: int  # real tokens; the input may be padded beyond this
    num_reqs: int
    attn_state: AscendAttentionState
    actual_seq_lengths_q: list[int]  # cumulative query lengths (host), FIA's actual_seq_lengths
    seq_lens_list: list[int]  # per-request KV lengths (host), FIA's actual_seq_lengths_kv
    block_table: torch.Tensor  # [num_reqs, max_blocks_per_req]
    slot_mapping: torch.Tensor  # [num_tokens], -1 for tokens that write no KV
    atten_mask: torch.Tensor  # the 2048x2048 causal mask FIA's sparse_mode 3 takes
    max_query_len: int
    max_seq_len: int


def split_kv_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's per-layer cache [blocks, kv_heads, block_size, 2*head] -> K, V views in FIA's
    [blocks, block_size, kv_heads, head] order (the physical order is LBNHC, so no copy)."""
    kv = kv_cache.permute(0, 2, 1, 3)
    head_size = kv.shape[-1] // 2
    return kv[..., :head_size], kv[..., head_size:]


class AscendAttentionMetadataBuilder(AttentionMetadataBuilder[AscendMetadata]):
    # FIA runs inside FULL graphs for any batch: its host lists are re-issued before each replay
    # (graph_params.GraphParams.update) and the metadata is padded to the captured batch.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.ALWAYS

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device_):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device_)
        self.atten_mask = torch.ones(ATTEN_MASK_SIZE, ATTEN_MASK_SIZE, dtype=torch.bool,
                                     device=device_).triu_(1)
        self._init_reorder_batch_threshold(1)
        sched = vllm_config.scheduler_config
        self.block_size = kv_cache_spec.block_size
        self.max_blocks = -(-vllm_config.model_config.max_model_len // self.block_size)
        # Block table rows for a full batch plus the dummy request (persistent: FULL graphs
        # read it at its captured address).
        self.block_table = torch.zeros(sched.max_num_seqs + 1, self.max_blocks,
                                       dtype=torch.int32, device=device_)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> AscendMetadata:
        cam = common_attn_metadata
        num_reqs = cam.num_reqs  # padded to the graph's batch in FULL mode
        qsl = cam.query_start_loc_cpu[: num_reqs + 1].tolist()
        q_lens = [b - a for a, b in zip(qsl, qsl[1:])]
        seq_lens = cam.seq_lens_cpu_upper_bound
        seq_lens = (seq_lens if seq_lens is not None else cam.seq_lens)[:num_reqs].tolist()
        # Scheduled requests have tokens; the runner's graph padding appends empty ones.
        num_real = next((i for i, q in enumerate(q_lens) if q == 0), num_reqs)
        real_q, real_kv = q_lens[:num_real], seq_lens[:num_real]
        if all(q == s for q, s in zip(real_q, real_kv)):
            state = AscendAttentionState.PREFILL_NO_CACHE
        elif max(real_q, default=0) <= 1:
            state = AscendAttentionState.DECODE_ONLY
        else:
            state = AscendAttentionState.CHUNKED_PREFILL
        cu_q, kv_lens = pad_for_graph(q_lens, seq_lens, num_real, cam.num_actual_tokens,
                                      self.max_blocks * self.block_size)
        block_table = self.block_table[: num_reqs + 1]
        block_table[:num_reqs].copy_(cam.block_table_tensor[:num_reqs])
        block_table[num_reqs:].zero_()  # the dummy reads the null block
        block_table[num_real:num_reqs].zero_()
        return AscendMetadata(
            num_actual_tokens=cam.num_actual_tokens,
            num_reqs=num_reqs,
            attn_state=state,
            actual_seq_lengths_q=cu_q,
            seq_lens_list=kv_lens,
            block_table=block_table,
            slot_mapping=cam.slot_mapping,
            atten_mask=self.atten_mask,
            max_query_len=cam.max_query_len,
            max_seq_len=cam.max_seq_len,
        )


class AscendAttentionImpl(AttentionImpl):
    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
                 kv_cache_dtype, logits_soft_cap=None, attn_type=AttentionType.DECODER,
                 kv_sharing_target_layer_name=None, sinks=None):
        unsupported = [name for name, v in (("ALiBi", alibi_slopes),
                                            ("sliding-window attention", sliding_window),
                                            ("logits soft-capping", logits_soft_cap),
                                            ("attention sinks", sinks)) if v]
        if unsupported:
            raise NotImplementedError(
                f"The Ascend attention backend does not support {', '.join(unsupported)}; "
                "this model needs an attention kernel vllm-ascend does not provide.")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        if kv_cache is None or kv_cache.numel() == 0:
            return
        key_cache, value_cache = split_kv_cache(kv_cache)
        device.current.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata: AscendMetadata | None,
                output: torch.Tensor, output_scale=None, output_block_scale=None):
        if attn_metadata is None:  # profiling run: no metadata, nothing to attend to
            return output.fill_(0)
        # PIECEWISE/eager pass real tokens only; FULL graphs pass the padded count, which the
        # metadata covers with fake requests (FIA's TND check: tokens == last cumulative length).
        n = attn_metadata.num_actual_tokens
        query = query[:n].view(n, self.num_heads, self.head_size)
        out = output[:n].view(n, self.num_heads, self.head_size)
        key_cache, value_cache = split_kv_cache(kv_cache)
        # Always paged: the KV update has already written this step's keys, and a FULL graph
        # needs the same operator whatever the batch it replays.
        args = dict(actual_seq_lengths=attn_metadata.actual_seq_lengths_q,
                    actual_seq_lengths_kv=attn_metadata.seq_lens_list,
                    block_table=attn_metadata.block_table, block_size=key_cache.shape[1],
                    num_heads=self.num_heads, num_key_value_heads=self.num_kv_heads,
                    scale=self.scale, input_layout="TND", sparse_mode=3,
                    atten_mask=attn_metadata.atten_mask)
        backend = device.current
        if GRAPH_PARAMS.capturing and backend.is_capturing():
            backend.task_group_begin()
            backend.fused_infer_attention_score(query, key_cache, value_cache, out=out, **args)
            GRAPH_PARAMS.record(FIACall(
                handle=backend.task_group_end(), query=query, key_cache=key_cache,
                value_cache=value_cache, block_table=attn_metadata.block_table,
                atten_mask=attn_metadata.atten_mask, out=out, num_heads=self.num_heads,
                num_kv_heads=self.num_kv_heads, scale=self.scale))
        else:
            backend.fused_infer_attention_score(query, key_cache, value_cache, out=out, **args)
        return output


class AscendAttentionBackend(AttentionBackend):
    accept_output_buffer: bool = True
    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16,
                                                     torch.float32]
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
        return [MultipleOf(16)]  # FIA's paged-KV rule; see device/sim_ops.check_block_size

    @classmethod
    def get_preferred_block_size(cls, default_block_size: int) -> int:
        return 128

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [16, 32, 64, 80, 96, 128, 192, 256]

    @classmethod
    def supported_kv_cache_layouts(cls):
        # Block, position, head, content: FIA's [blocks, block_size, kv_heads, head] order.
        return (KVCacheLayout.LBNHC,)

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER


register_backend(BACKEND_NAME, f"{__name__}.AscendAttentionBackend")
