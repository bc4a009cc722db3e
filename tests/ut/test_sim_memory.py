"""The simulated device's memory: torch's allocations, the memory outside torch's allocator that
HCCL's communicators hold, out-of-memory when they exceed the device, and the worker's start-up
budget that counts both (vllm_ascend/device/sim/memory.py, vllm_ascend/worker/worker.py)."""

import pytest
import torch
import torch.distributed as dist
from vllm.config import CacheConfig
from vllm.utils.mem_utils import MemorySnapshot

from vllm_ascend.device.sim import memory, npu
from vllm_ascend.device.sim.comm import SimCommunicator
from vllm_ascend.patch import torch_accelerator
from vllm_ascend.worker.worker import request_device_memory

MiB = 1 << 20


@pytest.fixture(autouse=True, scope="module")
def accelerator_routed():
    torch_accelerator.apply()  # as a worker does: vLLM's MemorySnapshot asks torch.accelerator


@pytest.fixture
def one_rank_group(tmp_path):
    if dist.is_initialized():  # an in-process engine of an earlier test left its world group
        yield dist.new_group([dist.get_rank()], backend="gloo")
        return
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.fixture
def communicator(one_rank_group, monkeypatch):
    monkeypatch.setenv("HCCL_BUFFSIZE", "100")
    comm = SimCommunicator(cpu_group=one_rank_group, unique_name="tp:0")
    yield comm
    comm.destroy()


def test_torch_tensors_count_against_the_device_until_freed_and_their_peak_stays():
    free0, total = npu.mem_get_info()
    npu.reset_peak_memory_stats()
    x = torch.ones(64 * MiB, dtype=torch.uint8)
    assert npu.memory_allocated() >= 64 * MiB
    assert npu.mem_get_info()[0] <= free0 - 64 * MiB
    del x
    assert npu.memory_allocated() < 32 * MiB
    assert npu.max_memory_allocated() >= 64 * MiB
    assert npu.memory_stats()["allocated_bytes.all.peak"] == npu.max_memory_allocated()


def test_a_peak_is_measured_at_each_simulated_op_until_read_after_a_sync():
    # A temporary that lives across an op the simulator implements (an MLP's gate/up output
    # across its SwiGLU), and is gone before anything asks: the peak has it, as a chip's
    # allocator counts every allocation.
    import vllm_ascend.device.sim as torch_npu

    npu.reset_peak_memory_stats()
    base = npu.max_memory_allocated()
    gate_up = torch.ones(1024, 48 * 1024, dtype=torch.bfloat16)  # 96 MiB
    torch_npu.npu_swiglu(gate_up[:1, :64])
    del gate_up
    npu.synchronize()
    assert npu.max_memory_allocated() - base >= 96 * MiB
    # Read after the sync: the measurement is over, and serving does not pay for looking.
    temporary = torch.ones(2048, 48 * 1024, dtype=torch.bfloat16)  # 192 MiB
    torch_npu.npu_swiglu(temporary[:1, :64])
    del temporary
    assert npu.max_memory_allocated() - base < 160 * MiB


def test_a_communicator_holds_twice_hccl_buffsize_outside_torchs_allocator(communicator):
    free, total = npu.mem_get_info()
    assert total - free >= 200 * MiB  # send and receive buffers of 100 MB each
    assert npu.memory_allocated() < 200 * MiB  # torch's allocator does not see them
    snapshot = MemorySnapshot(device=torch.device("cpu"))
    assert snapshot.non_torch_memory == 200 * MiB
    communicator.destroy()
    assert npu.mem_get_info()[0] >= free + 200 * MiB


@pytest.mark.parametrize("device_gib,mb", [(64, 200), (5.89, 18), (2, 6), (0.1, 1)])
def test_unset_hccl_buffsize_is_canns_default_scaled_to_the_simulated_device(
        monkeypatch, device_gib, mb):
    from vllm_ascend.device.sim import memory

    monkeypatch.delenv("HCCL_BUFFSIZE", raising=False)
    assert memory.hccl_buffer_bytes(int(device_gib * (1 << 30))) == 2 * mb * MiB
    monkeypatch.setenv("HCCL_BUFFSIZE", "100")  # set: as given, whatever the device
    assert memory.hccl_buffer_bytes(int(device_gib * (1 << 30))) == 200 * MiB


def test_torch_accelerator_reaches_the_device(monkeypatch):
    """(The count is the heap gained since the device opened, at least 0: in a long test
    process, host memory freed since then, the earlier tests' garbage, can hold it at 0 or
    lower it, so the device is counted from now, as if opened here, and the test reads what the
    tensor adds, with 1 MiB of the interpreter's own arenas as slack. What the simulator holds
    for itself, the CPU libraries' caches the earlier tests' products left, stays apart, as
    when a device opens.)"""
    import gc

    from vllm_ascend.device.sim import memory

    assert torch.accelerator.get_memory_info() == npu.mem_get_info()
    gc.collect()
    monkeypatch.setattr(memory._ACCOUNT, "base", memory._heap() - memory._ACCOUNT.simulator)
    before = torch.accelerator.memory_allocated()
    x = torch.ones(32 * MiB, dtype=torch.uint8)
    assert torch.accelerator.memory_allocated() - before >= 31 * MiB
    del x


def test_more_than_the_device_holds_is_out_of_memory_when_memory_is_next_asked_about(
        communicator, monkeypatch):
    # A budget from torch's allocator alone gives torch the whole device and ignores HCCL's
    # buffers: the chip fails the allocation, the simulator the next memory query (vLLM's
    # profiling, the capture's log line).
    monkeypatch.setenv("VLLM_ASCEND_SIM_MEMORY_GB", "0.25")
    held = torch.ones(112 * MiB, dtype=torch.uint8)  # 112 MiB torch + 200 MiB HCCL > 256 MiB
    with pytest.raises(torch.OutOfMemoryError, match=r"NPU out of memory.*0\.25 GiB total "
                       r"capacity.*0\.20 GiB outside PyTorch's allocator \(HCCL buffers of tp:0"):
        npu.memory_allocated()
    del held
    npu.reset_peak_memory_stats()
    npu.mem_get_info()  # the device fits again


def test_a_worker_whose_communicators_leave_too_little_free_memory_fails_at_start_up(
        communicator, monkeypatch):
    # 1 GiB x 0.9 must be free when the worker starts; HCCL's 200 MiB leave 0.80 GiB.
    monkeypatch.setenv("VLLM_ASCEND_SIM_MEMORY_GB", "1")
    snapshot = MemorySnapshot(device=torch.device("cpu"))
    with pytest.raises(ValueError, match=r"Free memory on NPU 0 \(0\.80/1\.00 GiB\) at start-up "
                       r"is less than gpu_memory_utilization 0\.9 asks for \(0\.90 GiB\).* 0\.20 "
                       r"GiB is held outside torch's allocator.* other processes on this NPU "
                       r"\(another engine\?\).* lower HCCL_BUFFSIZE"):
        request_device_memory(snapshot, CacheConfig(gpu_memory_utilization=0.9), 0)
    assert request_device_memory(snapshot, CacheConfig(gpu_memory_utilization=0.75), 0) == \
        pytest.approx(0.75 * (1 << 30), abs=1)
