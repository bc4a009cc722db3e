"""The simulator's devices and their contexts, the chip it answers as, and its memory queries
(torch.npu's set_device, device_count, current_device, get_device_name, mem_get_info and
memory_stats; ../shared/TORCH_NPU_CONTRACTS.md section 9; docs/chip_first_run.md).

A node has $VLLM_ASCEND_SIM_DEVICES devices (default 8, as a 910 server), of which a process sees
those $ASCEND_RT_VISIBLE_DEVICES lists, in that order (the CANN runtime's rule). A process opens
one device context, with set_device, before anything else touches the device: torch_npu would
otherwise open one on device 0 implicitly, holding memory on a device that belongs to another
worker. The simulator makes that an error, and one context per process, and one live process
per device on the node (a second worker on a device would share its memory and HBM budget and
break HCCL's one-rank-per-device rule): each open device is claimed in a file of the node's
registry, released at the worker's shutdown or when its process is gone. Several simulated
nodes can share one machine (a Ray cluster rehearsed on one host): $VLLM_ASCEND_SIM_NODE names
the node a process runs on, and each name has its own devices and registry.

The chip the simulator answers as: $VLLM_ASCEND_SIM_SOC names an Atlas A2 (Ascend910B*) or A3
(Ascend910_93*) SoC, as torch_npu's get_device_name returns it, and the simulated operators
whose contract differs by chip (MC2, sim/mc2.py) check that chip's limits. Unset, the device
is no chip of those, and the chip-specific operators refuse to run. The memory queries answer
from sim/memory.py.
"""

import contextlib
import os

import torch

from vllm_ascend.device.sim import memory as _memory
from vllm_ascend.device.sim.errors import DeviceContextError

MEMORY_ENV = "VLLM_ASCEND_SIM_MEMORY_GB"
DEVICES_ENV = "VLLM_ASCEND_SIM_DEVICES"
VISIBLE_ENV = "ASCEND_RT_VISIBLE_DEVICES"
NODE_ENV = "VLLM_ASCEND_SIM_NODE"
DEFAULT_DEVICES = 8


_context: "int | None" = None  # the physical device this process opened


def _node_devices() -> int:
    value = os.environ.get(DEVICES_ENV, str(DEFAULT_DEVICES))
    if not value.isdigit() or int(value) <= 0:
        raise ValueError(f"{DEVICES_ENV}={value!r} must be a positive integer")
    return int(value)


def _visible() -> list[int]:
    """The physical devices this process may open, by visible ordinal."""
    count = _node_devices()
    value = os.environ.get(VISIBLE_ENV, "").strip()
    if not value:
        return list(range(count))
    ids = []
    for item in value.split(","):
        item = item.strip()
        if not item.isdigit() or int(item) >= count:
            raise DeviceContextError(
                f"{VISIBLE_ENV}={value!r}: {item!r} is not a device of this node (devices 0 to "
                f"{count - 1}; {DEVICES_ENV}={count})")
        ids.append(int(item))
    return ids


def device_count() -> int:
    return len(_visible())


def _registry() -> str:
    import tempfile

    node = os.environ.get(NODE_ENV, "")
    if node and not node.replace("-", "").replace("_", "").isalnum():
        raise ValueError(f"{NODE_ENV}={node!r}: a node name is letters, digits, '-' and '_'")
    path = os.path.join(tempfile.gettempdir(),
                        f"vllm-ascend-sim-{os.getuid()}" + (f"-{node}" if node else ""))
    os.makedirs(path, exist_ok=True)
    return path


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs. A process that has exited but not been reaped (a zombie: vLLM
    SIGKILLs an engine core that outlives its 5 s of grace and never waits for it) holds no
    device: the driver releases a device when the process's files close, at exit."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]  # the field after "(comm)"
    except (OSError, IndexError):
        return True  # no /proc: a live pid holds its device
    return state not in ("Z", "X")


def devices_in_use() -> dict[int, int]:
    """Physical device -> pid of the live process that holds it, on this node."""
    held = {}
    for name in os.listdir(_registry()):
        if name.startswith("device-"):
            try:
                with open(os.path.join(_registry(), name)) as f:
                    pid = int(f.read().strip() or 0)
            except (OSError, ValueError):
                continue
            if pid and _alive(pid):
                held[int(name.removeprefix("device-"))] = pid
    return held


def _claim(physical: int) -> bool:
    """Take ``physical`` for this process; whether it was not already this process's."""
    path = os.path.join(_registry(), f"device-{physical}")
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            holder = devices_in_use().get(physical)
            if holder == os.getpid():
                return False
            if holder is not None:
                raise DeviceContextError(
                    f"NPU {physical} is already in use by process {holder} (another engine, or "
                    "another worker of this one): two processes on one device share its "
                    "memory, and HCCL takes one rank per device. Stop the other engine, or give "
                    f"each worker its own device ({VISIBLE_ENV}, or fewer ranks per node).")
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # its process is gone
            continue
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        return True


def set_device(device) -> None:
    """Open this process's device context on visible ordinal ``device`` (an int, or a
    torch.device; the simulator's CPU device without an index means the process's own device)."""
    global _context
    index = device if isinstance(device, int) else torch.device(device).index
    visible = _visible()
    if index is None:
        index = visible.index(_context) if _context in visible else 0
    if not 0 <= index < len(visible):
        raise DeviceContextError(f"set_device({index}): invalid device ordinal, this process "
                                 f"sees {len(visible)} device(s) ({VISIBLE_ENV}, "
                                 f"{DEVICES_ENV})")
    physical = visible[index]
    if _context is not None and _context != physical:
        raise DeviceContextError(
            f"set_device({index}) opens device {physical}, but this process already opened "
            f"device {_context}: one device context per process (one worker per device).")
    if _claim(physical):
        _memory.open_device()  # a worker's device: what the process holds now is host memory
    _context = physical


_workers = 0  # the workers of this process that hold its device (engines run in-process)


def hold_device() -> None:
    """A worker of this process uses its device until it calls ``release_device``."""
    global _workers
    _workers += 1


def release_device() -> bool:
    """A worker using this process's device shut down: when it was the last (returns True),
    another process may open the device, and a worker that opens it next starts from an empty
    device."""
    global _workers
    _workers = max(_workers - 1, 0)
    if _workers:
        return False
    if _context is not None and devices_in_use().get(_context) == os.getpid():
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(_registry(), f"device-{_context}"))
    return True


def is_initialized() -> bool:
    return _context is not None


def current_device() -> int:
    return _visible().index(opened("current_device"))


def opened(what: str) -> int:
    """The device this process opened; touching the device before that is an error."""
    if _context is None:
        raise DeviceContextError(
            f"torch.npu.{what}() in a process that has not called torch.npu.set_device: on the "
            "chip this opens a context on device 0, holding its memory, from a process that "
            "does not own it (an API server, an engine core whose workers are other "
            "processes). Ask the device only in the worker, after set_device.")
    return _context


# The chip the simulator answers as: $VLLM_ASCEND_SIM_SOC names an Atlas A2 (Ascend910B*) or A3
# (Ascend910_93*) SoC, as torch_npu's get_device_name returns it, and the simulated operators
# whose contract differs by chip (MC2, sim/mc2.py) check that chip's limits. Unset, the device
# is no chip of those, and the chip-specific operators refuse to run.
SOC_ENV = "VLLM_ASCEND_SIM_SOC"
DEFAULT_SOC = "Ascend simulator (CPU)"
SOC_PREFIXES = {"Ascend910B": "A2", "Ascend910_93": "A3"}


def soc_name() -> str:
    value = os.environ.get(SOC_ENV, "").strip()
    if value and not any(value.startswith(p) for p in SOC_PREFIXES):
        raise ValueError(f"{SOC_ENV}={value!r} is not a simulated SoC: name an Atlas A2 "
                         "(Ascend910B1 ... Ascend910B4) or A3 (Ascend910_9382, ...) chip, or "
                         "leave it unset")
    return value or DEFAULT_SOC


def soc_generation() -> str | None:
    """``A2``, ``A3``, or None for the default simulator."""
    name = soc_name()
    return next((g for p, g in SOC_PREFIXES.items() if name.startswith(p)), None)


def get_device_name(device=None) -> str:
    opened("get_device_name")
    return soc_name()


def total_memory() -> int:
    """The simulated device memory: $VLLM_ASCEND_SIM_MEMORY_GB, default a quarter of RAM."""
    opened("mem_get_info")
    return configured_memory()


def configured_memory() -> int:
    """What ``total_memory`` gives a process that opens a device (without opening one)."""
    import psutil

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


def _check_memory(what: str) -> tuple[int, int]:
    """(torch's allocation now, its peak), after the out-of-memory check: the simulator cannot
    see allocations, so an excess is found when memory is next asked about."""
    return _memory.check_capacity(total_memory(), opened(what))


# torch's allocator (sim/memory.py: the heap this process gained since it opened its device) and
# the whole device (that, plus what is held outside torch's allocator).
def memory_allocated(device=None) -> int:
    return _check_memory("memory_allocated")[0]


def memory_reserved(device=None) -> int:
    return _check_memory("memory_reserved")[0]  # no cache: the heap returns what torch frees


def max_memory_allocated(device=None) -> int:
    return _check_memory("max_memory_allocated")[1]


def reset_peak_memory_stats(device=None) -> None:
    opened("reset_peak_memory_stats")
    _memory.reset_peak()


def memory_stats(device=None) -> dict:
    current, peak = _check_memory("memory_stats")
    return {"allocated_bytes.all.current": current, "allocated_bytes.all.peak": peak,
            "reserved_bytes.all.current": current, "reserved_bytes.all.peak": peak}


def empty_cache() -> None:
    """Nothing is cached: the heap takes back what torch frees at once."""


def mem_get_info(device=None) -> tuple[int, int]:
    current, _ = _check_memory("mem_get_info")
    total = total_memory()
    return max(total - current - _memory.outside_torch(), 0), total
