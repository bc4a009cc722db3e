"""``npu``: real Ascend chips through torch_npu. The only module that imports torch_npu.

Not exercised by this repository's tests (no machine here has a chip); each call maps 1:1 to the
torch_npu operator with the contract that the simulator enforces.
"""

import torch
import torch_npu  # noqa: F401  (registers torch.npu)

from vllm_ascend.device.base import DeviceBackend

DEFAULT_STREAMS = 2048


class NpuBackend(DeviceBackend):
    name = "npu"
    torch_device_type = "npu"
    dist_backend = "hccl"
    dispatch_key = "PrivateUse1"

    def device_name(self) -> str:
        return torch.npu.get_device_name(0)

    def total_memory(self) -> int:
        return torch.npu.get_device_properties(0).total_memory

    def memory_in_use(self) -> int:
        return torch.npu.memory_allocated()

    def stream_budget(self) -> int:
        return DEFAULT_STREAMS

    def fork_unsafe_reason(self) -> str | None:
        # As vLLM does for CUDA: a forked child cannot use a device its parent initialised.
        return "torch_npu is initialised in this process" if torch.npu.is_initialized() else None

    def synchronize(self) -> None:
        torch.npu.synchronize()

    def graph_pool_handle(self):
        return torch.npu.graph_pool_handle()

    def new_graph(self):
        return torch.npu.NPUGraph()

    def graph_capture(self, graph, pool):
        return torch.npu.graph(graph, pool=pool)

    def weak_ref(self, outputs):
        from vllm.utils.torch_utils import weak_ref_tensors

        return weak_ref_tensors(outputs)

    def streams_in_use(self) -> int:
        return -1  # not observable through torch_npu

    def is_capturing(self) -> bool:
        return torch.npu.is_current_stream_capturing()

    def new_stream(self):
        return torch.npu.Stream()

    def task_group_begin(self, stream=None) -> None:
        torch.npu.graph_task_group_begin(stream or torch.npu.current_stream())

    def task_group_end(self, stream=None):
        return torch.npu.graph_task_group_end(stream or torch.npu.current_stream())

    def task_update_begin(self, stream, handle) -> None:
        torch.npu.graph_task_update_begin(stream, handle)

    def task_update_end(self, stream=None) -> None:
        torch.npu.graph_task_update_end(stream)

    def fused_infer_attention_score(
        self, query, key, value, *, actual_seq_lengths, actual_seq_lengths_kv, block_table,
        block_size, num_heads, num_key_value_heads, scale, input_layout="TND", sparse_mode=3,
        atten_mask=None, out=None,
    ):
        if block_table is not None:  # torch_npu takes paged KV as [blocks, block_size, H*D]
            key = key.flatten(-2)
            value = value.flatten(-2)
        result, _ = torch_npu.npu_fused_infer_attention_score(
            query, key, value, atten_mask=atten_mask, block_table=block_table,
            actual_seq_lengths=list(actual_seq_lengths),
            actual_seq_lengths_kv=list(actual_seq_lengths_kv), num_heads=num_heads,
            num_key_value_heads=num_key_value_heads, scale=scale, input_layout=input_layout,
            sparse_mode=sparse_mode, block_size=block_size if block_table is not None else 0,
        )
        if out is None:
            return result
        out.copy_(result)
        return out

    def reshape_and_cache(self, key, value, key_cache, value_cache, slot_mapping):
        torch_npu._npu_reshape_and_cache(key=key, value=value, key_cache=key_cache,
                                         value_cache=value_cache, slot_indices=slot_mapping)

    def rms_norm(self, x, weight, eps):
        return torch_npu.npu_rms_norm(x, weight, eps)[0]

    def add_rms_norm(self, x, residual, weight, eps):
        normed, _, summed = torch_npu.npu_add_rms_norm(x, residual, weight, eps)
        return normed, summed

    def swiglu(self, x):
        return torch_npu.npu_swiglu(x)

    def split_qkv_norm_rope(self, qkv, q_size, kv_size, head_size, q_weight, k_weight, eps,
                            cos, sin, is_neox):
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        t = qkv.shape[0]
        q, k = q.reshape(t, -1, head_size), k.reshape(t, -1, head_size)
        if q_weight is not None:
            q = torch_npu.npu_rms_norm(q, q_weight, eps)[0]
            k = torch_npu.npu_rms_norm(k, k_weight, eps)[0]
        mode = "half" if is_neox else "interleave"
        cos4, sin4 = cos.unsqueeze(1).unsqueeze(0), sin.unsqueeze(1).unsqueeze(0)
        q = torch_npu.npu_rotary_mul(q.unsqueeze(0), cos4, sin4, rotary_mode=mode)[0]
        k = torch_npu.npu_rotary_mul(k.unsqueeze(0), cos4, sin4, rotary_mode=mode)[0]
        return q.reshape(t, q_size), k.reshape(t, kv_size), v

    def rotary_embedding(self, positions, query, key, cos_sin_cache, head_size, is_neox):
        query, key = query.contiguous(), key.contiguous()
        torch_npu._npu_rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)
        return query, key
