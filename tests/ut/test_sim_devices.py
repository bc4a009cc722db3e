"""The simulator's devices: N per node, one context per process, opened before anything touches
the device, one live process per device; and the worker's binding of DP x TP ranks to them."""

import os
import subprocess
import sys
import time
import types

import pytest

from vllm_ascend.device.sim import devices, npu
from vllm_ascend.device.sim.errors import DeviceContextError


@pytest.fixture
def no_context(monkeypatch):
    """This process as it was before any set_device (restored after)."""
    npu.release_device()
    monkeypatch.setattr(devices, "_context", None)
    yield
    npu.release_device()


@pytest.mark.parametrize("touch", [npu.mem_get_info, npu.get_device_name, npu.memory_allocated,
                                   lambda: npu.NPUGraph().capture_begin()])
def test_touching_the_device_before_set_device_is_refused(no_context, touch):
    with pytest.raises(DeviceContextError, match="has not called torch.npu.set_device: on the "
                                                 "chip this opens a context on device 0"):
        touch()


def test_one_context_per_process():
    with pytest.raises(DeviceContextError, match=r"already opened device 0: one device context "
                                                 r"per process"):
        npu.set_device(1)
    npu.set_device(0)  # the same device again: fine


def test_visible_devices_map_ordinals_to_the_nodes_devices(no_context, monkeypatch):
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "5,6")
    assert npu.device_count() == 2
    with pytest.raises(DeviceContextError, match=r"set_device\(2\): invalid device ordinal, "
                                                 r"this process sees 2 device"):
        npu.set_device(2)
    npu.set_device(1)
    assert npu.devices_in_use()[6] == os.getpid() and npu.current_device() == 1
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "3,8")
    with pytest.raises(DeviceContextError, match="'8' is not a device of this node"):
        npu.device_count()
    monkeypatch.setenv("VLLM_ASCEND_SIM_DEVICES", "16")
    assert npu.device_count() == 2


def test_two_workers_on_one_device_is_an_error(no_context):
    holder = subprocess.Popen(
        [sys.executable, "-c", "from vllm_ascend.device.sim import npu; npu.set_device(3); "
                               "print('ready', flush=True); input()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        with pytest.raises(DeviceContextError, match=f"NPU 3 is already in use by process "
                                                     f"{holder.pid} \\(another engine, or another "
                                                     "worker of this one\\).*Stop the other "
                                                     "engine"):
            npu.set_device(3)
    finally:
        holder.communicate("", timeout=30)
    npu.set_device(3)  # its process is gone: the device is free
    assert npu.devices_in_use()[3] == os.getpid()


def test_a_device_is_free_once_its_process_has_exited_even_unreaped(no_context):
    """vLLM SIGKILLs an engine core that outlives its grace period and does not wait for it; the
    next engine in the same script must find the device free (CI failed on this at stop 54)."""
    holder = subprocess.Popen([sys.executable, "-c", "from vllm_ascend.device.sim import npu; "
                                                     "npu.set_device(3)"])
    try:
        deadline = time.monotonic() + 60
        while _state(holder.pid) != "Z":  # exited, and not reaped: we have not waited
            assert time.monotonic() < deadline, _state(holder.pid)
            time.sleep(0.05)
        assert 3 not in npu.devices_in_use()
        npu.set_device(3)
        assert npu.devices_in_use()[3] == os.getpid()
    finally:
        holder.wait(timeout=30)


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0]


def test_simulated_nodes_on_one_machine_have_their_own_devices(no_context, monkeypatch):
    """Two Ray nodes rehearsed on one host (docs/multi_node.md): each VLLM_ASCEND_SIM_NODE has
    its own devices, so device 3 of node a and device 3 of node b are two devices."""
    env = {**os.environ, "VLLM_ASCEND_SIM_NODE": "a"}
    holder = subprocess.Popen(
        [sys.executable, "-c", "from vllm_ascend.device.sim import npu; npu.set_device(3); "
                               "print('ready', flush=True); input()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout.readline().strip() == "ready"
        monkeypatch.setenv("VLLM_ASCEND_SIM_NODE", "a")
        with pytest.raises(DeviceContextError, match=f"in use by process {holder.pid}"):
            npu.set_device(3)
        monkeypatch.setenv("VLLM_ASCEND_SIM_NODE", "b")
        npu.set_device(3)
        assert npu.devices_in_use() == {3: os.getpid()}
        monkeypatch.setenv("VLLM_ASCEND_SIM_NODE", "a")
        assert npu.devices_in_use() == {3: holder.pid}
        monkeypatch.setenv("VLLM_ASCEND_SIM_NODE", "b")
        npu.release_device()
    finally:
        holder.communicate("", timeout=30)
    with pytest.MonkeyPatch.context() as bad:
        bad.setenv("VLLM_ASCEND_SIM_NODE", "no/slash")
        with pytest.raises(ValueError, match="a node name is letters, digits"):
            npu.devices_in_use()


@pytest.mark.parametrize("dp_local_rank, tp_rank, device", [(0, 0, 0), (0, 1, 1), (1, 0, 2),
                                                            (1, 1, 3)])
def test_dp_engines_on_one_node_take_distinct_devices(monkeypatch, dp_local_rank, tp_rank,
                                                      device):
    """vLLM assigns each DP engine its shard of the node's devices (as for any platform without
    CUDA's set_device_index); the worker opens the shard's tp_rank-th."""
    import vllm.platforms.interface as interface
    from vllm.config import ParallelConfig, VllmConfig
    from vllm.v1.engine.utils import set_assigned_physical_gpu_ids_for_dp_rank

    from vllm_ascend.worker.worker import NPUWorker

    monkeypatch.setattr(interface, "_assigned_physical_gpu_ids", None)  # a fresh worker process
    config = VllmConfig(parallel_config=ParallelConfig(tensor_parallel_size=2,
                                                       data_parallel_size=2))
    set_assigned_physical_gpu_ids_for_dp_rank(config, dp_local_rank, None)  # the DP launcher
    worker = types.SimpleNamespace(parallel_config=config.parallel_config, local_rank=tp_rank)
    assert NPUWorker._visible_device_index(worker) == device


def test_the_engines_parent_process_asks_the_platform_nothing_of_the_device(no_context):
    """vLLM asks the device's memory and name while building the config, in the API server;
    the platform declines (vLLM then takes its defaults) instead of opening a context."""
    from vllm_ascend.platform import NPUPlatform

    for ask in (NPUPlatform.get_device_total_memory, NPUPlatform.get_device_name):
        with pytest.raises(RuntimeError, match="no device is open in this process"):
            ask()
    NPUPlatform.log_warnings()  # the start-up line names the backend without asking the device
