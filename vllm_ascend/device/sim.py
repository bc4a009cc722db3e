"""``sim``: the CPU simulator of the Ascend device contracts (see sim_ops.py for the kernels)."""

import contextlib
import os

import psutil
import torch

from vllm_ascend.device import sim_graph, sim_ops
from vllm_ascend.device.base import DeviceBackend, full_width_cos_sin

MEMORY_ENV = "VLLM_ASCEND_SIM_MEMORY_GB"
STREAMS_ENV = "VLLM_ASCEND_SIM_STREAMS"
DEFAULT_STREAMS = 2048  # a 910-class chip's stream budget for the whole software stack


class SimBackend(DeviceBackend):
    name = "sim"
    torch_device_type = "cpu"
    dist_backend = "gloo"
    dispatch_key = "CPU"

    def device_name(self) -> str:
        return "Ascend simulator (CPU)"

    def total_memory(self) -> int:
        """The simulated device memory: $VLLM_ASCEND_SIM_MEMORY_GB, default a quarter of RAM."""
        value = os.environ.get(MEMORY_ENV)
        if value:
            try:
                gb = float(value)
            except ValueError:
                gb = -1
            if gb <= 0:
                raise ValueError(f"{MEMORY_ENV}={value!r} must be a positive number of GiB")
            return int(gb * (1 << 30))
        return psutil.virtual_memory().total // 4

    def memory_in_use(self) -> int:
        return psutil.Process().memory_info().rss  # the host is the device

    def stream_budget(self) -> int:
        value = os.environ.get(STREAMS_ENV, str(DEFAULT_STREAMS))
        if not value.isdigit() or int(value) <= 0:
            raise ValueError(f"{STREAMS_ENV}={value!r} must be a positive integer")
        return int(value)

    def __init__(self, reason: str):
        super().__init__(reason)
        self.streams = sim_graph.StreamPool(self.stream_budget)
        self._updating = None  # the task-group handle an update is being issued for

    # -- graphs ------------------------------------------------------------------------------
    def graph_pool_handle(self):
        return sim_graph.GraphPool()

    def new_graph(self):
        return sim_graph.SimGraph(self.streams)

    def graph_capture(self, graph, pool):
        return graph.capture(pool)

    def graph_finalize(self, graph, outputs) -> None:
        graph.finalize(outputs)

    def weak_ref(self, outputs):
        # The graph owns its output storage (it writes it on every replay), so a plain reference
        # keeps nothing alive that the graph would not.
        return outputs

    def streams_in_use(self) -> int:
        return self.streams.in_use

    def is_capturing(self) -> bool:
        return sim_graph.SimGraph.capturing is not None

    def new_stream(self):
        return object()  # the host runs every stream in order; streams only name the update's

    def task_group_begin(self, stream=None) -> None:
        sim_graph.SimGraph.capturing.task_group_begin()

    def task_group_end(self, stream=None):
        return sim_graph.SimGraph.capturing.task_group_end()

    def task_update_begin(self, stream, handle) -> None:
        if self._updating is not None:
            raise sim_graph.TaskUpdateError("task updates do not nest")
        self._updating = handle

    def task_update_end(self, stream=None) -> None:
        if self._updating is None:
            raise sim_graph.TaskUpdateError("task_update_end without task_update_begin")
        self._updating = None

    def fork_unsafe_reason(self) -> str | None:
        # The simulator computes with torch's OpenMP pool; once any torch op ran in this process
        # (a model conversion, a user's own tensors) a forked child hangs in its first parallel
        # op. Whether it ran cannot be asked of torch, so always.
        return "the simulator computes with torch's OpenMP thread pool, which a fork cannot inherit"

    def prepare_process(self) -> None:
        # torch has no CPU accelerator, yet vLLM's runner calls torch.accelerator.synchronize /
        # empty_cache unconditionally (shutdown, profiling clean-up): on the simulator the device
        # is the host, so there is nothing to wait for or release.
        def noop(*args, **kwargs):
            return None

        def empty_cache_noop(*args, **kwargs):  # distinct object: Dynamo keys on identity
            return None

        torch.accelerator.synchronize = noop
        torch.accelerator.empty_cache = empty_cache_noop
        if hasattr(torch.accelerator, "empty_host_cache"):
            torch.accelerator.empty_host_cache = noop

    @contextlib.contextmanager
    def runner_init_context(self):
        """GPUModelRunner.__init__ creates CUDA events/streams for host<->device overlap; the
        simulator's host and device are one, so they become host no-ops for its duration."""

        class HostEvent:
            def __init__(self, *args, **kwargs):
                pass

            def record(self, *args, **kwargs):
                pass

            def synchronize(self):
                pass

            def query(self):
                return True

        class HostStream:
            def __init__(self, *args, **kwargs):
                self.device = torch.device("cpu")

            def wait_stream(self, *args, **kwargs):
                pass

        saved = torch.Event, torch.cuda.Stream, torch.cuda.Event
        torch.Event, torch.cuda.Stream, torch.cuda.Event = HostEvent, HostStream, HostEvent
        try:
            yield
        finally:
            torch.Event, torch.cuda.Stream, torch.cuda.Event = saved

    # -- operators ------------------------------------------------------------------------------
    def fused_infer_attention_score(
        self, query, key, value, *, actual_seq_lengths, actual_seq_lengths_kv, block_table,
        block_size, num_heads, num_key_value_heads, scale, input_layout="TND", sparse_mode=3,
        atten_mask=None, out=None,
    ):
        for name, lst in (("actual_seq_lengths", actual_seq_lengths),
                          ("actual_seq_lengths_kv", actual_seq_lengths_kv)):
            if not isinstance(lst, (list, tuple)) or not all(isinstance(v, int) for v in lst):
                raise sim_ops.AscendOpError(
                    f"When layout is TND, {name} must be a host list of ints "
                    f"(got {type(lst).__name__}); pass e.g. tensor.tolist() built before the call")
        args = (query, key, value, block_table, atten_mask, list(actual_seq_lengths),
                list(actual_seq_lengths_kv), num_heads, num_key_value_heads, float(scale),
                input_layout, sparse_mode, block_size)
        if self._updating is not None:
            # Re-issued between task_update_begin/end: not launched, it re-parameterises the
            # captured node of the handle's task group for the next replay.
            graph, group = self._updating
            graph.stage_update(group, sim_ops.fia_op, args)
            return out
        result = sim_ops.fia_op(*args)
        if out is None:
            return result
        out.copy_(result)
        return out

    def reshape_and_cache(self, key, value, key_cache, value_cache, slot_mapping):
        sim_ops.reshape_and_cache_op(key, value, key_cache, value_cache, slot_mapping)

    def rms_norm(self, x, weight, eps):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return (y * weight.float()).to(x.dtype)

    def add_rms_norm(self, x, residual, weight, eps):
        summed = x + residual
        return self.rms_norm(summed, weight, eps), summed

    def swiglu(self, x):
        d = x.shape[-1] // 2
        return torch.nn.functional.silu(x[..., :d]) * x[..., d:]

    def rotary_embedding(self, positions, query, key, cos_sin_cache, head_size, is_neox):
        cos, sin = full_width_cos_sin(
            *cos_sin_cache.index_select(0, positions.flatten()).chunk(2, dim=-1), is_neox)

        def rotate(x):
            return _rotate(x.unflatten(-1, (-1, head_size)), cos, sin, is_neox).flatten(-2)

        return rotate(query), (rotate(key) if key is not None else None)

    def split_qkv_norm_rope(self, qkv, q_size, kv_size, head_size, q_weight, k_weight, eps,
                            cos, sin, is_neox):
        t = qkv.shape[0]
        if q_weight is None:
            # q and k are adjacent in qkv: rotate both heads' worth in one pass.
            qk = _rotate(qkv[:, : q_size + kv_size].unflatten(-1, (-1, head_size)), cos, sin,
                         is_neox)
            q, k = qk[:, : q_size // head_size], qk[:, q_size // head_size:]
        else:
            q = self.rms_norm(qkv[:, :q_size].unflatten(-1, (-1, head_size)), q_weight, eps)
            k = self.rms_norm(qkv[:, q_size: q_size + kv_size].unflatten(-1, (-1, head_size)),
                              k_weight, eps)
            q, k = _rotate(q, cos, sin, is_neox), _rotate(k, cos, sin, is_neox)
        return q.reshape(t, q_size), k.reshape(t, kv_size), qkv[:, q_size + kv_size:]


def _rotate(x, cos, sin, is_neox):
    """x [T, heads, head_size] rotated by full-width cos/sin [T, rot]: x*cos + rot(x)*sin on
    the first rot dims; the rest passes through."""
    rot = cos.shape[-1]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x_rot = x[..., :rot] if rot < x.shape[-1] else x
    if is_neox:
        x1, x2 = x_rot.chunk(2, dim=-1)
        turned = torch.cat((-x2, x1), dim=-1)
    else:
        turned = torch.stack((-x_rot[..., 1::2], x_rot[..., ::2]), dim=-1).flatten(-2)
    out = x_rot * cos + turned * sin
    if rot < x.shape[-1]:
        out = torch.cat((out, x[..., rot:]), dim=-1)
    return out
