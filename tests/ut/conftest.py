import pytest

from vllm_ascend.device.sim import npu


@pytest.fixture(autouse=True)
def device_context():
    """Each test opens the device first, as a worker does (the simulator refuses device work in
    a process that has not), and lets it go after, as a worker's shutdown does."""
    npu.set_device(0)
    yield
    npu.release_device()
