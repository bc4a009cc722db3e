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
