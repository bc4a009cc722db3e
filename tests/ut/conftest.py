import socket

import pytest

from vllm_ascend.device.sim import npu


@pytest.fixture(autouse=True)
def device_context():
    """Each test opens the device first, as a worker does (the simulator refuses device work in
    a process that has not), and lets it go after, as a worker's shutdown does."""
    npu.set_device(0)
    yield
    npu.release_device()


def on_two_ranks(rank_fn) -> list:
    """What ``rank_fn(rank, port, results)`` leaves in ``results[rank]``, run by two processes
    (workers on devices 0 and 1, which this process lets go) that rendezvous on ``port``."""
    import torch.multiprocessing as mp

    npu.release_device()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(rank_fn, args=(port, results), nprocs=2)
    return [results[rank] for rank in (0, 1)]


def capture(fn, *args, pool=None):
    """A graph of ``fn(*args)`` captured through torch.npu.graph, and its output."""
    g = npu.NPUGraph()
    with npu.graph(g, pool=pool):
        out = fn(*args)
    return g, out
