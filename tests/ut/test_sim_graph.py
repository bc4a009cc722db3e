"""The simulator's torch.npu graphs: what a captured ACL graph does and refuses to do, through
torch_npu's own API (NPUGraph, torch.npu.graph, task groups and updates, ExternalEvent)."""

import pytest
import torch

from tests.ut.conftest import capture, on_two_ranks
from vllm_ascend.device import sim as torch_npu
from vllm_ascend.device.sim import npu
from vllm_ascend.device.sim.errors import GraphCaptureError, StreamResourceError

MASK = torch.triu(torch.ones(2048, 2048), diagonal=1).to(torch.int8)
BF16 = torch.bfloat16


def mlp(x, w, calls):
    calls.append(1)  # Python side effect: must not happen on replay
    h = torch.nn.functional.silu(x @ w)
    h = h.view(x.shape[0], 4, -1).transpose(0, 1).contiguous().view(x.shape[0], -1)
    return (h * 2 + 1).softmax(-1)


@pytest.fixture(autouse=True)
def inference():
    with torch.inference_mode():
        yield


def test_replay_recomputes_from_new_input_contents_without_running_python():
    w, x, calls = torch.randn(16, 16), torch.randn(4, 16), []
    g, out = capture(mlp, x, w, calls)
    assert len(calls) == 1
    x.copy_(torch.randn(4, 16))
    g.replay()
    assert len(calls) == 1  # only the record ran
    torch.testing.assert_close(out, mlp(x, w, []))


def test_second_replay_overwrites_the_first_replays_output():
    w, x = torch.randn(16, 16), torch.randn(4, 16)
    g, out = capture(mlp, x, w, [])
    g.replay()
    first = out.clone()
    x.copy_(torch.randn(4, 16))
    g.replay()
    assert not torch.equal(out, first)  # same storage, new contents
    torch.testing.assert_close(out, mlp(x, w, []))


def test_capture_needs_a_non_default_stream():
    g = npu.NPUGraph()
    with pytest.raises(RuntimeError, match="non-default stream"):
        g.capture_begin()
    s = npu.Stream()
    with npu.stream(s):
        g.capture_begin()
        assert npu.is_current_stream_capturing()
        y = torch.ones(2) * 3
        g.capture_end()
    assert not npu.is_current_stream_capturing()
    y.zero_()
    g.replay()
    assert y.tolist() == [3.0, 3.0]


def test_item_and_tolist_during_capture_raise_and_release_the_stream():
    x = torch.tensor([1.5, -2.0, 4.0])
    before = npu.streams_in_use()
    with pytest.raises(GraphCaptureError, match=r"host synchronisation \(.item"):
        capture(lambda: (x * 2).sum().item())
    with pytest.raises(GraphCaptureError, match=r"\.tolist\(\)"):
        capture(lambda: (x * 2).tolist())
    assert x.tolist() == [1.5, -2.0, 4.0] and (x * 2).sum().item() == 7.0  # usable again
    assert npu.streams_in_use() == before


@pytest.mark.parametrize("copy", [lambda y: y.cpu(), lambda y: y.numpy(),
                                  lambda y: y.to("cpu"), lambda y: y.to(device="cpu:0"),
                                  lambda y: y.to("cpu", non_blocking=True)],
                         ids=[".cpu()", ".numpy()", '.to("cpu")', '.to(device="cpu:0")',
                              "non_blocking"])
def test_a_device_to_host_copy_during_capture_raises(copy):
    x = torch.tensor([1.5, -2.0, 4.0])
    with pytest.raises(GraphCaptureError, match="device-to-host copy"):
        capture(lambda: copy(x * 2))
    assert copy(x * 2).tolist() == [3.0, -4.0, 8.0]  # outside a capture it is a copy
    # The simulated device is the CPU: a copy to the device object stays in the graph.
    g, y = capture(lambda: (x * 2).to(torch.device("cpu"), torch.float16))
    x.fill_(1.0)
    g.replay()
    assert y.tolist() == [2.0, 2.0, 2.0]


def test_the_ledger_counts_launches_outside_replays_syncs_and_staged_copies():
    from vllm_ascend.device.sim.ledger import H2D, LAUNCHES, REPLAYS, SYNCS, Ledger

    w, x = torch.randn(16, 16), torch.randn(4, 16)
    g, out = capture(mlp, x, w, [])
    staged = torch.empty(4, 16)
    with Ledger() as ledger:
        y = (x * 2)[1:]  # a launch; the view is none
        staged.copy_(x, non_blocking=True)  # a staged host-to-device copy
        g.replay()
        g.replay()  # a launch each, whatever the graph holds
        y.sum().item()  # a launch and a host read
        npu.synchronize()
    assert dict(ledger.counts) == {LAUNCHES: 2, REPLAYS: 2, SYNCS: 2, H2D: 1}
    # ... and which kernels the replays ran: the graph's own, twice, and nothing run eagerly
    assert ledger.replayed_ops["aten::matmul"] == ledger.replayed_ops["aten::silu"] == 2
    assert ledger.replayed_ops["aten::sum"] == 0


def fused_layer(x1, x2, gamma, cos, sin, up):
    """The simulated kernels a decoder layer replays (RoPE in both layouts)."""
    y, rstd, summed = torch_npu.npu_add_rms_norm(x1, x2, gamma, 1e-5)
    normed, rstd2 = torch_npu.npu_rms_norm(summed, gamma, 1e-6)
    heads = y.view(y.shape[0], 4, -1)
    half = torch_npu.npu_rotary_mul(heads, cos, sin)
    interleaved = torch_npu.npu_rotary_mul(heads, cos, sin, rotary_mode="interleave")
    return y, rstd, summed, normed, rstd2, half, interleaved, torch_npu.npu_swiglu(up)


def test_a_replay_of_the_fused_kernels_writes_what_the_eager_ops_return():
    """A replay calls the simulator's kernels without the dispatcher and writes the norms',
    RoPE's and SwiGLU's results into the graph's outputs (ops.REPLAY_INTO): the same bits as
    the ops run eagerly, and each still counted as one replayed op."""
    from vllm_ascend.device.sim.ledger import Ledger

    def inputs():
        return (torch.randn(3, 64).to(BF16) * 3, torch.randn(3, 64).to(BF16),
                torch.randn(64).to(BF16), torch.randn(3, 1, 16).to(BF16),
                torch.randn(3, 1, 16).to(BF16), torch.randn(3, 96).to(BF16))

    args = inputs()
    g, outs = capture(fused_layer, *args)
    for arg, new in zip(args, inputs()):
        arg.copy_(new)
    with Ledger() as ledger:
        g.replay()
        npu.synchronize()
    for got, expected in zip(outs, fused_layer(*args)):
        assert got.dtype == expected.dtype and torch.equal(got, expected)
    ran = ledger.replayed_ops
    assert ran["ascend_sim::npu_add_rms_norm"] == ran["ascend_sim::npu_rms_norm"] == 1
    assert ran["ascend_sim::npu_rotary_mul"] == 2 and ran["ascend_sim::npu_swiglu"] == 1
    assert ran["aten::rsqrt"] == 0  # the kernels' own ops are not counted as the device's


def products(x, w, w2, bias):
    return torch.nn.functional.linear(x, w), torch.nn.functional.linear(x, w2, bias)


@pytest.mark.parametrize("bf16", [False, True], ids=["float32-from-9", "bf16-from-9"])
@pytest.mark.parametrize("weights", ["tensors", "parameters"])
@pytest.mark.parametrize("rows", [1, 2, 8, 12])
def test_a_replays_products_write_what_eager_linear_returns(rows, weights, bf16, monkeypatch):
    """A replay writes aten.linear's products into the graph's outputs without the dispatcher
    (matmul.prepare_linear): the eager op's bits for one row (padded), a few and many (float32),
    with and without a bias, each product counted as one replayed aten::linear. A model's
    weights (parameters) are read packed up to 8 rows (on a CPU whose oneDNN packs bf16), and
    from 9 through their float32 copy, or packed on a CPU with bf16 instructions; other
    tensors through torch's kernel or converted."""
    from vllm_ascend.device.sim import matmul
    from vllm_ascend.device.sim.ledger import Ledger

    packs = matmul.cpu_packs_bf16()
    if bf16 and not packs:
        pytest.skip("this CPU's oneDNN does not pack bf16 weights: no bf16 path from 9 rows")
    monkeypatch.setattr(matmul, "_CPU_BF16", [bf16])

    with torch.inference_mode(False):  # a model's weights are made outside inference mode
        w, w2 = torch.randn(96, 64).to(BF16), torch.randn(32, 64).to(BF16)
        if weights == "parameters":
            w, w2 = (torch.nn.Parameter(t, requires_grad=False) for t in (w, w2))
    args = (torch.randn(rows, 64).to(BF16), w, w2, torch.randn(32).to(BF16))
    g, outs = capture(products, *args)
    args[0].copy_(torch.randn(rows, 64).to(BF16))
    with Ledger() as ledger:
        g.replay()
        npu.synchronize()
    copies = matmul._copies_of(w)
    assert (copies.packed is not None) == (
        weights == "parameters" and (rows <= 8 or bf16) and packs)
    assert (copies.wide is not None) == (weights == "parameters" and rows >= 9 and not bf16)
    for got, expected in zip(outs, products(*args)):
        assert torch.equal(got, expected)
    assert dict(ledger.replayed_ops) == {"aten::linear": 2}


def test_a_weak_reference_reads_poison_once_its_owner_is_released():
    owner = torch.arange(6, dtype=torch.float32)
    weak = torch_npu._C._weak_ref_tensor(owner)
    assert weak.data_ptr() == owner.data_ptr() and weak.tolist() == [0, 1, 2, 3, 4, 5]
    view = owner[2:]  # another owner of the same memory
    del owner
    assert weak.tolist() == [0, 1, 2, 3, 4, 5]  # still owned
    del view, weak
    weak = torch_npu._C._weak_ref_tensor(torch.arange(6, dtype=torch.float32))
    assert weak.isnan().all()  # its only owner went at once: on the chip, someone else's memory
    ids = torch_npu._C._weak_ref_tensor(torch.arange(4, dtype=torch.int32))
    assert ids.tolist() == [-1, -1, -1, -1]


def test_stream_budget_exhaustion_raises_207008_and_reset_frees_a_stream(monkeypatch):
    w, x = torch.randn(8, 8), torch.randn(2, 8)
    base = npu.streams_in_use()
    monkeypatch.setenv("VLLM_ASCEND_SIM_STREAMS", str(base + 2))
    g1, _ = capture(lambda: x @ w)
    g2, _ = capture(lambda: x @ w)
    assert npu.streams_in_use() == base + 2
    with pytest.raises(StreamResourceError, match="207008.*stream resources are insufficient"):
        capture(lambda: x @ w)
    assert npu.streams_in_use() == base + 2  # the failed capture held none
    g1.reset()
    g3, _ = capture(lambda: x @ w)
    del g2, g3  # a freed graph gives its stream back
    assert npu.streams_in_use() == base


def test_graphs_share_one_pool_sized_by_the_largest_and_keep_their_outputs():
    pool = npu.graph_pool_handle()
    w = torch.randn(64, 64)
    xs = {n: torch.randn(n, 64) for n in (32, 8, 1)}
    graphs, sizes = {}, {}
    for n in (32, 8, 1):  # largest first; each output kept by the caller
        graphs[n] = capture(mlp, xs[n], w, [], pool=pool)
        sizes[n] = pool.pool.nbytes
    assert sizes[32] > 0 and sizes[1] == sizes[8]  # the later graphs fit in what 32 freed
    for n, (g, out) in graphs.items():  # still correct after sharing
        xs[n].copy_(torch.randn(n, 64))
        g.replay()
        torch.testing.assert_close(out, mlp(xs[n], w, []))


def test_an_output_python_dropped_returns_to_the_pool_and_one_it_holds_is_not_overwritten():
    pool = npu.graph_pool_handle()
    w = torch.randn(64, 64)
    x = torch.randn(32, 64)
    first, out = capture(mlp, x, w, [], pool=pool)
    # The next piece reads the first one's output while it is captured: its scratch goes around
    # the output's block, which Python still holds.
    second, out2 = capture(mlp, out, w, [], pool=pool)
    held = pool.pool.nbytes
    x.copy_(torch.randn(32, 64))
    first.replay()
    second.replay()
    torch.testing.assert_close(out2, mlp(mlp(x, w, []), w, []))
    # Once dropped, both outputs' memory is the next capture's: it adds no segment.
    weak = torch_npu._C._weak_ref_tensor(out)
    del out, out2
    assert weak.isnan().all()  # its block went back to the pool, poisoned (someone else's now)
    third, out3 = capture(mlp, torch.randn(32, 64), w, [], pool=pool)
    assert pool.pool.nbytes == held
    first.replay()  # the graph still writes its output where it was captured
    torch.testing.assert_close(weak, mlp(x, w, []))
    assert not out3.isnan().any()


def test_a_graph_that_passes_an_earlier_output_through_does_not_keep_it_allocated():
    pool = npu.graph_pool_handle()
    w = torch.randn(64, 64)
    first, out = capture(mlp, torch.randn(8, 64), w, [], pool=pool)
    # A piece returning a view of its input (vLLM's pieces pass the residual on this way).
    second, (passed, new) = capture(lambda t: (t[:4], t @ w), out, pool=pool)
    weak = torch_npu._C._weak_ref_tensor(passed)
    del out, passed, new
    assert weak.isnan().all()  # the block was freed: no graph holds it


def test_graph_wrapper_refuses_inputs_at_other_addresses_counts_and_releases():
    from vllm.compilation.monitor import set_cudagraph_capturing_enabled
    from vllm.config import CUDAGraphMode, VllmConfig
    from vllm.forward_context import BatchDescriptor, set_forward_context

    from vllm_ascend import device
    from vllm_ascend.compilation.acl_graph import GRAPH_STATE, ACLGraphWrapper, GraphState

    config = VllmConfig()
    state = GraphState()  # the runner's, registered where the engine's wrappers find it
    config.compilation_config.static_forward_context[GRAPH_STATE] = state
    streams = device.current.streams_in_use()
    w = torch.randn(8, 8)
    wrapper = ACLGraphWrapper(lambda x: x @ w, config, CUDAGraphMode.PIECEWISE)
    x = torch.randn(2, 8)
    with set_forward_context(None, config, cudagraph_runtime_mode=CUDAGraphMode.PIECEWISE,
                             batch_descriptor=BatchDescriptor(num_tokens=2)):
        set_cudagraph_capturing_enabled(True)
        out = wrapper(x)
        x.copy_(torch.randn(2, 8))
        torch.testing.assert_close(wrapper(x), x @ w)
        replayed = wrapper(x)  # a non-owning reference to the captured output's memory
        assert replayed is not out and replayed.data_ptr() == out.data_ptr()
        with pytest.raises(RuntimeError, match="inputs at other addresses"):
            wrapper(x.clone())
    assert state.counts() == {"captured": {"PIECEWISE": 1}, "replayed": {"PIECEWISE": 2}}
    assert device.current.streams_in_use() == streams + 1
    del out
    state.release()  # the engine's shutdown: its graphs and their streams go
    assert device.current.streams_in_use() == streams and not wrapper.entries
    assert replayed.isnan().all()  # the memory went with the graph


def test_a_capture_the_streams_cannot_hold_fails_with_advice(monkeypatch):
    """Where the plan's stream count is wrong (on a chip, other processes hold streams the
    worker cannot count), capture's 207008 says how to capture fewer graphs."""
    from vllm.compilation.monitor import set_cudagraph_capturing_enabled
    from vllm.config import CUDAGraphMode, VllmConfig
    from vllm.forward_context import BatchDescriptor, set_forward_context

    from vllm_ascend import device
    from vllm_ascend.compilation.acl_graph import (GRAPH_STATE, ACLGraphWrapper,
                                                   GraphCaptureFailed, GraphState)

    config = VllmConfig()
    config.compilation_config.static_forward_context[GRAPH_STATE] = GraphState()
    monkeypatch.setenv("VLLM_ASCEND_SIM_STREAMS", str(device.current.streams_in_use() + 1))
    wrapper = ACLGraphWrapper(lambda x: x * 2, config, CUDAGraphMode.FULL)
    set_cudagraph_capturing_enabled(True)
    for tokens in (2, 4):  # the second graph finds no stream
        with set_forward_context(None, config, cudagraph_runtime_mode=CUDAGraphMode.FULL,
                                 batch_descriptor=BatchDescriptor(num_tokens=tokens)):
            if tokens == 2:
                wrapper(torch.randn(tokens, 8))
                continue
            with pytest.raises(GraphCaptureFailed, match="(?s)207008.*Capture fewer graphs: "
                                                         "lower the capture sizes"):
                wrapper(torch.randn(tokens, 8))
    wrapper.clear_graphs()


def test_a_wrapper_without_the_runners_graph_state_is_a_clear_error():
    from vllm.config import CUDAGraphMode, VllmConfig

    from vllm_ascend.compilation.acl_graph import ACLGraphWrapper

    with pytest.raises(RuntimeError, match="need vllm-ascend's NPUModelRunner"):
        ACLGraphWrapper(lambda x: x, VllmConfig(), CUDAGraphMode.PIECEWISE)


# -- FIA in a graph: frozen host lists, task updates, ExternalEvents ------------------------------

def test_boolean_operators_replay_on_new_inputs():
    # torch's `__and__`/`__or__` bindings accept out= yet write nothing (NotImplemented): the
    # replay must not take them for out= kernels (vLLM's vocabulary-parallel embedding masks
    # its token ids with & and |).
    x = torch.zeros(4, dtype=torch.int64)

    def mask(ids):
        inside = (ids >= 100) & (ids < 200)
        return inside | (ids == 7), ~inside

    g, (either, outside) = capture(mask, x)
    x.copy_(torch.tensor([5, 150, 7, 250]))
    g.replay()
    assert either.tolist() == [False, True, True, False]
    assert outside.tolist() == [True, False, True, True]


def _collective_rank(rank, port, results):
    import os

    import torch.distributed as dist
    from torch.distributed import _functional_collectives as funcol

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    npu.set_device(rank)  # a worker per device
    x = torch.full((4,), float(rank + 1))
    streams_before = npu.streams_in_use()

    def reduce(t):
        y = t * 10
        dist.all_reduce(y)
        return y + 1

    g, out = capture(reduce, x)
    streams = npu.streams_in_use() - streams_before
    x.fill_(rank + 2)  # the replay must reduce the new values of both ranks
    g.replay()
    npu.synchronize()
    g.reset()
    try:
        capture(lambda t: funcol.all_reduce(t, "sum", dist.group.WORLD), x)
        functional = "captured"
    except GraphCaptureError as e:
        functional = str(e)
    after_reset = npu.streams_in_use() - streams_before
    # An MoE layer's data-parallel round trip: all-gather, then the communicator's
    # reduce-scatter (gloo's own would copy its capture-time scratch back at every replay).
    from types import SimpleNamespace

    from vllm_ascend.device.sim.comm import SimCommunicator

    comm = SimpleNamespace(world_size=2, rank_in_group=rank, device_group=dist.group.WORLD)
    tokens = torch.full((2, 3), float(rank + 1))

    def gather_scatter(t):
        gathered = torch.empty(4, 3)
        dist.all_gather_into_tensor(gathered, t * 1)
        return SimCommunicator.reduce_scatter(comm, gathered * 10, 0)

    g2, mine = capture(gather_scatter, tokens)
    tokens.fill_(rank + 5)
    g2.replay()
    npu.synchronize()
    results[rank] = (out.tolist(), streams, after_reset, functional, mine.tolist())
    g2.reset()
    dist.destroy_process_group()


def test_a_captured_all_reduce_is_replayed_and_its_group_costs_a_stream():
    for rank, found in enumerate(on_two_ranks(_collective_rank)):
        out, streams, after_reset, functional, mine = found
        assert out == [10.0 * (2 + 3) + 1] * 4  # reduced at replay, not the capture's values
        # both ranks' replayed tokens (5 and 6) gathered, x 10, summed over the two ranks
        assert mine == [[2 * 10.0 * (5 + rank)] * 3] * 2
        assert streams == 2 and after_reset == 0  # the graph's stream, and its group's
        assert "functional collectives" in functional and "torch.distributed" in functional
