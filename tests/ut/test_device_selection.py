import subprocess
import sys

import pytest

from vllm_ascend.device import DeviceSelectionError, select_backend



def test_detection_without_override_picks_sim_here(monkeypatch):
    monkeypatch.delenv("VLLM_ASCEND_DEVICE", raising=False)
    backend = select_backend()
    assert backend.name == "sim" and "no NPU" in backend.reason


def test_forcing_npu_without_torch_npu_is_a_clear_error():
    with pytest.raises(DeviceSelectionError, match=r"VLLM_ASCEND_DEVICE=npu was requested but "
                                                   r"torch_npu is not installed.*=sim"):
        select_backend("npu")


def test_unknown_backend_name_is_rejected():
    with pytest.raises(DeviceSelectionError, match="use 'npu' or 'sim'"):
        select_backend("gpu")


def test_plugin_import_with_forced_npu_fails_with_the_message_not_a_trace():
    proc = subprocess.run(
        [sys.executable, "-c", "import vllm_ascend.device"],
        env={**__import__("os").environ, "VLLM_ASCEND_DEVICE": "npu"},
        capture_output=True, text=True)
    assert proc.returncode != 0
    assert "VLLM_ASCEND_DEVICE=npu was requested" in proc.stderr


def test_entry_point_registers_the_platform():
    from importlib.metadata import entry_points

    eps = [ep for ep in entry_points(group="vllm.platform_plugins") if ep.name == "ascend"]
    assert eps and eps[0].load()() == "vllm_ascend.platform.NPUPlatform"


def test_the_platform_and_worker_read_device_facts_not_the_backend_name():
    """What differs between the chip and the simulator is a fact of the device backend; the
    platform and the worker ask for the fact."""
    import os
    import types

    from vllm_ascend.device import NpuBackend, SimBackend, sim
    from vllm_ascend.platform import NPUPlatform

    chip = NpuBackend(types.SimpleNamespace(), "test")
    assert (chip.pin_memory_available(), chip.communicator_cls(), chip.host_compute_threads(),
            chip.memory_setting()) == (True, None, None, None)
    simulated = SimBackend(sim, "test")
    assert simulated.pin_memory_available() is False
    assert simulated.communicator_cls().endswith("sim.comm.SimCommunicator")
    assert simulated.host_compute_threads() == len(os.sched_getaffinity(0))
    assert simulated.memory_setting() == "VLLM_ASCEND_SIM_MEMORY_GB"
    # This process runs the simulator: the platform answers with its facts.
    assert NPUPlatform.is_pin_memory_available() is False
    assert NPUPlatform.get_device_communicator_cls() == simulated.communicator_cls()
