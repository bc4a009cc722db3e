"""The only package that knows which device runs, and the one import point of torch_npu.

Product code calls torch_npu's own API through ``from vllm_ascend.device import torch_npu``:
on a chip that is the real ``torch_npu`` (``torch_npu.npu`` is ``torch.npu``); elsewhere it is
``vllm_ascend.device.sim``, which implements the same functions on the CPU with the chip's
contracts. ``current`` holds the few device facts the platform and worker need.

The backend is chosen once, at import: ``VLLM_ASCEND_DEVICE=npu|sim`` forces one; otherwise
``npu`` when torch_npu imports and reports a chip, else ``sim``. Detection never crashes a CPU
machine: torch_npu is imported with its autoload entry point disabled and any failure means sim.
"""

import importlib
import os
import types

import torch

ENV_VAR = "VLLM_ASCEND_DEVICE"


class DeviceSelectionError(RuntimeError):
    pass


class Backend:
    """Facts about the device in use (no operators: those are torch_npu's)."""

    name: str  # "npu" or "sim"
    torch_device_type: str  # the torch device string tensors live on
    dist_backend: str
    dispatch_key: str

    def __init__(self, module: types.ModuleType, reason: str):
        self.torch_npu = module
        self.reason = reason  # why this backend was chosen, for the start-up log line

    @property
    def acl(self) -> types.ModuleType:
        """pyACL, CANN's Python runtime API (``acl``): what torch_npu does not wrap (virtual
        memory management, for sleep mode)."""
        return importlib.import_module("acl")

    def device_name(self) -> str:
        return self.torch_npu.npu.get_device_name(self.torch_npu.npu.current_device())

    def device_open(self) -> bool:
        """Whether this process opened its device (a worker after set_device). Asking a device
        anything before that opens a context on device 0 (torch_npu's lazy init)."""
        return self.torch_npu.npu.is_initialized()

    def hold_device(self) -> None:
        """A worker of this process uses its device (until ``release_device``)."""

    def release_device(self) -> None:
        """A worker on this process's device shut down (a context stays until exit)."""

    def torch_device(self, index: int = 0) -> torch.device:
        return torch.device(self.torch_device_type, index)

    op_namespace = "npu"  # the torch.ops namespace torch_npu registers its operators in

    def graph_op(self, api: str):
        """The target an FX node calls to run torch_npu's ``api`` (compilation/passes.py)."""
        return getattr(getattr(torch.ops, self.op_namespace), api)

    def graph_api(self, target) -> str | None:
        """The torch_npu API an FX node's target runs, or None. Dynamo records torch_npu's
        functions as their torch.ops operators, or (torch_npu's generated bindings, if Dynamo
        keeps them) as the functions themselves: both are recognised."""
        if isinstance(target, (torch._ops.OpOverloadPacket, torch._ops.OpOverload)):
            namespace, _, name = target._qualified_op_name.partition("::") if isinstance(
                target, torch._ops.OpOverloadPacket) else target._schema.name.partition("::")
            return name if namespace == self.op_namespace else None
        name = getattr(target, "__name__", None)
        if name and getattr(self.torch_npu, name, None) is target:
            return name
        return None

    def total_memory(self) -> int:
        return self.torch_npu.npu.mem_get_info()[1]

    def device_memory_for_plan(self, index: int = 0) -> int:
        """Device ``index``'s memory, asked from a process that runs no worker (the plan
        command): torch_npu's device properties, which open a context on the device."""
        return self.torch_npu.npu.get_device_properties(index).total_memory

    def memory_in_use(self) -> int:
        """Bytes of device memory this process holds now."""
        return self.torch_npu.npu.memory_allocated()

    def stream_budget(self) -> int:
        """Streams the chip offers to the whole software stack."""
        return 2048

    def streams_in_use(self) -> int | None:
        """Streams held by captured graphs, where the device lets us count them."""
        return None

    def pin_memory_available(self) -> bool:
        """Whether host memory can be page-locked for copies to this device."""
        return True

    def communicator_bytes(self, device_total: int) -> int:
        """Device memory one communicator holds outside torch's allocator: HCCL's send and
        receive buffers, HCCL_BUFFSIZE MB each (CANN's default 200)."""
        return 2 * int(os.environ.get("HCCL_BUFFSIZE", "200")) << 20

    def graph_bytes_per_layer(self) -> int:
        """Device memory a captured graph holds of its own for each decoder layer it covers
        (its task records and their tiling data), beyond the pool's tensors: an estimate for
        the start-up plan. On a chip, from upstream vllm-ascend's measured capture memory
        (Qwen3-0.6B with FULL graphs of 7 sizes at TP=4: 0.2-0.3 GiB, 28 layers a graph;
        DeepSeek-V2-Lite W8A8 in FULL_AND_PIECEWISE: 0.68 GiB; their e2e test_graph_mode.py
        baselines): 1.5 MiB. The engine measures the real figure before sizing the KV cache."""
        return 3 << 19

    def communicator_cls(self) -> str | None:
        """vLLM's device communicator for this device, or None for the platform's default."""
        return None

    def host_compute_threads(self) -> int | None:
        """Torch threads a worker should keep when the host computes the device's work, or None
        when the device computes it (vLLM then keeps one thread for serving)."""
        return None

    def memory_setting(self) -> str | None:
        """The setting that sizes this device's memory, where there is one."""
        return None

    def hccl_comm_name(self, group: torch.distributed.ProcessGroup) -> str:
        """The name MC2's operators take as ``group_ep`` for a device process group: its HCCL
        communicator's (upstream's ``TokenDispatcherWithMC2``)."""
        backend = group._get_backend(torch.device("npu"))
        return backend.get_hccl_comm_name(torch.distributed.get_rank(group))

    def hccl_buffer_bytes(self) -> int:
        """HCCL's window per communicator and direction, what MC2's operators exchange through:
        HCCL_BUFFSIZE MB (CANN's default 200)."""
        return int(os.environ.get("HCCL_BUFFSIZE", "200")) << 20

    def v2_runner_kernels(self) -> dict:
        """Implementations of the Triton kernels vLLM's Model Runner V2 launches, by kernel name
        (for vLLM's kernel dispatcher). None on a chip: triton-ascend runs vLLM's own."""
        return {}

    def fork_unsafe_reason(self) -> str | None:
        """Why a child process of this one must be spawned rather than forked, or None."""
        # As vLLM does for CUDA: a forked child cannot use a device its parent initialised.
        return ("torch_npu is initialised in this process"
                if self.torch_npu.npu.is_initialized() else None)

    def prepare_process(self) -> None:
        """Called in each process that configures an engine or runs a worker (idempotent)."""


class NpuBackend(Backend):
    name, torch_device_type, dist_backend, dispatch_key = "npu", "npu", "hccl", "PrivateUse1"


class SimBackend(Backend):
    name, torch_device_type, dist_backend, dispatch_key = "sim", "cpu", "gloo", "CPU"
    op_namespace = "ascend_sim"

    @property
    def acl(self) -> types.ModuleType:
        from vllm_ascend.device.sim import acl

        return acl

    def torch_device(self, index: int = 0) -> torch.device:
        return torch.device("cpu")  # vLLM builds "cpu:<rank>"; the host has one device

    def total_memory(self) -> int:
        return self.torch_npu.npu.total_memory()

    def device_memory_for_plan(self, index: int = 0) -> int:
        return self.torch_npu.npu.configured_memory()  # no device to open

    def hold_device(self) -> None:
        self.torch_npu.npu.hold_device()

    def release_device(self) -> None:
        self.torch_npu.npu.release_device()  # after the last worker, another process may open it

    def stream_budget(self) -> int:
        return self.torch_npu.npu.stream_budget()

    def pin_memory_available(self) -> bool:
        # torch's CPU build pins host memory only for an accelerator, and here there is none.
        return False

    def communicator_cls(self) -> str | None:
        # Collectives run on gloo between host processes; each holds HCCL's device buffers.
        return "vllm_ascend.device.sim.comm.SimCommunicator"

    def host_compute_threads(self) -> int | None:
        return len(os.sched_getaffinity(0))  # the CPU *is* the device: every core computes

    def memory_setting(self) -> str | None:
        return "VLLM_ASCEND_SIM_MEMORY_GB"

    def hccl_comm_name(self, group: torch.distributed.ProcessGroup) -> str:
        return self.torch_npu.mc2.comm_name(group)  # the gloo group the simulated ops gather on

    def hccl_buffer_bytes(self) -> int:
        from vllm_ascend.device.sim import memory

        return memory.hccl_buffer_bytes(self.total_memory()) // 2

    def communicator_bytes(self, device_total: int) -> int:
        from vllm_ascend.device.sim import memory

        return memory.hccl_buffer_bytes(device_total)

    def graph_bytes_per_layer(self) -> int:
        # The simulator's record of a graph (its prepared calls and their tensors' metadata,
        # which live on the host heap the simulator counts as the device's): about 600 bytes a
        # node, some 15 nodes a layer (measured on SmolLM2 and the tiny test models).
        return 10 << 10

    def streams_in_use(self) -> int | None:
        return self.torch_npu.npu.streams_in_use()

    def v2_runner_kernels(self) -> dict:
        from vllm_ascend.device.sim import v2_kernels, v2_spec_kernels

        # No Triton here: torch implementations of the same contracts.
        return {**v2_kernels.KERNELS, **v2_spec_kernels.KERNELS}

    def fork_unsafe_reason(self) -> str | None:
        # The simulator computes with torch's OpenMP pool; once any torch op ran in this process
        # (a model conversion, a user's own tensors) a forked child hangs in its first parallel
        # op. Whether one ran cannot be asked of torch, so: always.
        return ("the simulator computes with torch's OpenMP thread pool, which a fork cannot "
                "inherit")

    def prepare_process(self) -> None:
        # torch has no CPU accelerator, yet vLLM empties its host cache at shutdown
        # (vllm_ascend/patch/torch_accelerator.py routes the rest to the simulator).
        if hasattr(torch.accelerator, "empty_host_cache"):
            torch.accelerator.empty_host_cache = lambda *args, **kwargs: None
        self.torch_npu.log_calls_if_requested()


def _npu_available() -> tuple[bool, str]:
    """(available, reason). Never raises."""
    if importlib.util.find_spec("torch_npu") is None:
        return False, "torch_npu is not installed"
    # torch_npu's autoload entry point breaks `import torch` where CANN is missing.
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    try:
        import torch_npu  # noqa: F401

        if not torch.npu.is_available() or torch.npu.device_count() == 0:
            return False, "torch_npu is installed but reports no Ascend chip"
    except Exception as e:  # a broken CANN install must not crash detection
        return False, f"torch_npu failed to initialise ({type(e).__name__}: {e})"
    return True, "torch_npu found an Ascend chip"


def _npu(reason: str) -> Backend:
    import torch_npu as real

    return NpuBackend(real, reason)


def _sim(reason: str) -> Backend:
    from vllm_ascend.device import sim

    return SimBackend(sim, reason)


def select_backend(requested: str | None = None) -> Backend:
    """Pick the device backend. ``requested`` defaults to $VLLM_ASCEND_DEVICE."""
    if requested is None:
        requested = os.environ.get(ENV_VAR, "").strip().lower() or None
    if requested not in (None, "npu", "sim"):
        raise DeviceSelectionError(
            f"{ENV_VAR}={requested!r} is not a device backend; use 'npu' or 'sim' "
            "(or leave it unset to detect)."
        )
    if requested == "sim":
        return _sim(f"{ENV_VAR}=sim")
    ok, reason = _npu_available()
    if requested == "npu":
        if not ok:
            raise DeviceSelectionError(
                f"{ENV_VAR}=npu was requested but {reason}. Install the extra "
                "`pip install vllm-ascend[npu]` on a machine with CANN and an Ascend chip, "
                f"or set {ENV_VAR}=sim to run on the CPU simulator."
            )
        return _npu(f"{ENV_VAR}=npu")
    return _npu(reason) if ok else _sim(f"no NPU ({reason})")


current: Backend = select_backend()
torch_npu = current.torch_npu
