"""The device interface every layer above ``device/`` calls. Both backends implement it."""

import contextlib
from abc import ABC, abstractmethod

import torch


def full_width_cos_sin(cos: torch.Tensor, sin: torch.Tensor, is_neox: bool):
    """Half-width cos/sin rows [T, rot/2] -> full width [T, rot] in the rope's layout (neox:
    halves repeated; GPT-J: pairs interleaved), so a rotation is x*cos + rot(x)*sin."""
    if is_neox:
        return torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    return cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)


class DeviceBackend(ABC):
    name: str  # "npu" or "sim"
    torch_device_type: str  # torch device string used for tensors
    dist_backend: str
    dispatch_key: str

    def __init__(self, reason: str):
        self.reason = reason  # why this backend was chosen, for the start-up log line

    # -- device facts ---------------------------------------------------------------------------
    @abstractmethod
    def device_name(self) -> str: ...

    @abstractmethod
    def total_memory(self) -> int: ...

    @abstractmethod
    def memory_in_use(self) -> int:
        """Bytes of device memory this process holds now."""

    @abstractmethod
    def stream_budget(self) -> int:
        """Streams the chip offers to the whole software stack."""

    def torch_device(self, index: int = 0) -> torch.device:
        return torch.device(self.torch_device_type, index) if self.torch_device_type != "cpu" \
            else torch.device("cpu")

    def synchronize(self) -> None:
        pass

    def prepare_process(self) -> None:
        """Called once per worker process before the model runner is built."""

    @abstractmethod
    def fork_unsafe_reason(self) -> str | None:
        """Why a child process of this one must be spawned rather than forked, or None."""

    def runner_init_context(self):
        """Context around GPUModelRunner.__init__, which creates CUDA streams and events."""
        return contextlib.nullcontext()

    # -- graphs -------------------------------------------------------------------------------
    _global_pool = None

    def global_graph_pool(self):
        """The pool every graph of this process shares (capture the largest size first)."""
        if self._global_pool is None:
            self._global_pool = self.graph_pool_handle()
        return self._global_pool

    @abstractmethod
    def graph_pool_handle(self): ...

    @abstractmethod
    def new_graph(self): ...

    @abstractmethod
    def graph_capture(self, graph, pool):
        """Context manager: what runs inside is captured into ``graph``."""

    def graph_finalize(self, graph, outputs) -> None:
        """After capture: ``outputs`` are the tensors the graph writes on every replay."""

    def weak_ref(self, outputs):
        return outputs

    @abstractmethod
    def streams_in_use(self) -> int: ...

    @abstractmethod
    def is_capturing(self) -> bool: ...

    @abstractmethod
    def new_stream(self): ...

    # An op issued between task_group_begin/end during capture is addressable by the returned
    # handle; re-issuing it between task_update_begin(handle)/task_update_end replaces its host
    # arguments for the next replay.
    @abstractmethod
    def task_group_begin(self, stream=None) -> None: ...

    @abstractmethod
    def task_group_end(self, stream=None): ...

    @abstractmethod
    def task_update_begin(self, stream, handle) -> None: ...

    @abstractmethod
    def task_update_end(self, stream=None) -> None: ...

    # -- operators ------------------------------------------------------------------------------
    @abstractmethod
    def fused_infer_attention_score(
        self, query, key, value, *, actual_seq_lengths, actual_seq_lengths_kv, block_table,
        block_size, num_heads, num_key_value_heads, scale, input_layout="TND", sparse_mode=3,
        atten_mask=None, out=None,
    ) -> torch.Tensor: ...

    @abstractmethod
    def reshape_and_cache(self, key, value, key_cache, value_cache, slot_mapping) -> None: ...

    @abstractmethod
    def rms_norm(self, x, weight, eps) -> torch.Tensor: ...

    @abstractmethod
    def add_rms_norm(self, x, residual, weight, eps) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (normed, x + residual)."""

    @abstractmethod
    def swiglu(self, x) -> torch.Tensor:
        """silu(x[..., :d]) * x[..., d:]"""

    @abstractmethod
    def split_qkv_norm_rope(self, qkv, q_size, kv_size, head_size, q_weight, k_weight, eps,
                            cos, sin, is_neox):
        """Fused: split qkv, RMS-normalise q and k per head (when weights are given), rotate
        them by full-width cos/sin [T, rot] (see ops/qkv.StepRope for the layout). Returns
        (q, k, v) flattened per token."""

    @abstractmethod
    def rotary_embedding(self, positions, query, key, cos_sin_cache, head_size, is_neox) -> None:
        """Rotates query and key in place (last dim head_size, rotary dim from the cache)."""
