"""The simulator's torch.npu graphs: what a captured ACL graph does and refuses to do, through
torch_npu's own API (NPUGraph, torch.npu.graph, task groups and updates, ExternalEvent)."""

import pytest
import torch

from tests.ut.conftest import on_two_ranks
from vllm_ascend.device import sim as torch_npu
from vllm_ascend.device.sim import npu
from vllm_ascend.device.sim.errors import GraphCaptureError, GraphReplayError, StreamResourceError

MASK = torch.triu(torch.ones(2048, 2048), diagonal=1).to(torch.int8)
BF16 = torch.bfloat16


def capture(fn, *args, pool=None):
    g = npu.NPUGraph()
    with npu.graph(g, pool=pool):
        out = fn(*args)
    return g, out


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


@pytest.mark.parametrize("weights", ["tensors", "parameters"])
@pytest.mark.parametrize("rows", [1, 2, 8, 12])
def test_a_replays_products_write_what_eager_linear_returns(rows, weights):
    """A replay writes aten.linear's products into the graph's outputs without the dispatcher
    (matmul.prepare_linear): the eager op's bits for one row (padded), a few and many (float32),
    with and without a bias, each product counted as one replayed aten::linear. A model's
    weights (parameters) are read packed up to 8 rows (on a CPU whose oneDNN packs bf16), other
    tensors through torch's kernel."""
    from vllm_ascend.device.sim import matmul
    from vllm_ascend.device.sim.ledger import Ledger

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
    assert (matmul._pack_of(w).stamp is not None) == (
        weights == "parameters" and rows <= 8 and matmul.cpu_packs_bf16())
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

class Attention:
    """One FIA call captured the way vllm-ascend captures it (attention/backend.py)."""

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.q = torch.randn(1, 2, 16, generator=g).to(BF16)
        self.k = torch.randn(2, 16, 32, generator=g).to(BF16)  # BnBsH: 2 blocks of 16
        self.v = torch.randn(2, 16, 32, generator=g).to(BF16)
        self.table = torch.tensor([[1]], dtype=torch.int32)
        self.stream = npu.Stream()  # the update stream

    def args(self, kv_len):
        return dict(query=self.q, key=self.k, value=self.v, atten_mask=MASK,
                    block_table=self.table, input_layout="TND", block_size=16,
                    actual_seq_lengths=[1], actual_seq_lengths_kv=[kv_len],
                    num_key_value_heads=2, num_heads=2, scale=0.5, sparse_mode=3)

    def eager(self, kv_len):
        return torch_npu.npu_fused_infer_attention_score(**self.args(kv_len))[0]

    def capture(self, kv_len, with_event=True):
        self.graph = npu.NPUGraph()
        with npu.graph(self.graph):
            self.ws = torch_npu._npu_fused_infer_attention_score_get_max_workspace(
                **self.args(kv_len))
            self.out = torch.empty_like(self.q)
            self.lse = torch.empty(1, dtype=BF16)
            stream = npu.current_stream()
            self.event = npu.ExternalEvent() if with_event else None
            if with_event:
                self.event.wait(stream)
                self.event.reset(stream)
            npu.graph_task_group_begin(stream)
            torch_npu.npu_fused_infer_attention_score.out(**self.args(kv_len), workspace=self.ws,
                                                          out=[self.out, self.lse])
            self.handle = npu.graph_task_group_end(stream)
            doubled = self.out * 2  # work after attention, in the same graph
        self.doubled = doubled

    def update(self, kv_len, record=True):
        with npu.stream(self.stream):
            self.issue_update(kv_len, record)

    def issue_update(self, kv_len, record=True):
        """The update, issued on the update stream (current); it runs when something orders it,
        at the latest when the host leaves the stream's context."""
        npu.graph_task_update_begin(self.stream, self.handle)
        torch_npu.npu_fused_infer_attention_score.out(**self.args(kv_len), workspace=self.ws,
                                                      out=[self.out, self.lse])
        npu.graph_task_update_end(self.stream)
        if record:
            self.event.record(self.stream)


def test_a_capture_records_products_and_attention_unrun_and_the_replay_computes_them():
    """As on the chip, a captured task runs at replay only: a capture's output is garbage until
    a replay writes it; the host-side checks still run at capture."""
    w, x = torch.randn(16, 16, dtype=BF16), torch.randn(32, 16, dtype=BF16)

    def products(a, b):
        return (torch.mm(a, b), torch.addmm(b[0], a, b),
                torch.bmm(a.view(2, 16, 16), b.expand(2, 16, 16)),
                torch.nn.functional.linear(a, torch.nn.Parameter(b, requires_grad=False), b[0]))
    g, out = capture(products, x, w)
    real = products(x, w)
    assert not any(torch.equal(o, r) for o, r in zip(out, real))
    g.replay()
    assert all(torch.equal(o, r) for o, r in zip(out, real))
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        capture(torch.mm, x, torch.randn(8, 16, dtype=BF16))
    a = Attention()
    a.capture(3, with_event=False)
    assert not torch.allclose(a.out, a.eager(3))
    a.graph.replay()
    torch.testing.assert_close(a.out, a.eager(3))
    bad = dict(a.args(3), num_heads=1, num_key_value_heads=1)
    with pytest.raises(RuntimeError, match="numHeads"):
        capture(lambda: torch_npu.npu_fused_infer_attention_score.out(
            **bad, workspace=a.ws, out=[torch.empty_like(a.q), a.lse]))


def test_host_lists_are_frozen_at_capture_and_a_replay_reads_stale_values():
    a = Attention()
    a.capture(3, with_event=False)
    a.graph.replay()
    torch.testing.assert_close(a.out, a.eager(3))
    # The next step has 9 tokens of KV: Python would pass [9]; the graph still holds [3].
    a.graph.replay()
    torch.testing.assert_close(a.out, a.eager(3))
    assert not torch.allclose(a.out, a.eager(9))


@pytest.mark.parametrize("order", ["update, then replay", "replay, then update"])
def test_task_update_with_event_gives_the_replay_this_steps_lengths_in_either_order(order):
    a = Attention()
    a.capture(3)
    for kv_len in (9, 5, 12):
        a.stream.wait_stream(npu.current_stream())  # the updates come after the last replay
        if order == "update, then replay":  # torch_npu's reference test
            a.update(kv_len)
            a.graph.replay()
        else:  # upstream vllm-ascend: launch the replay, then update and record
            a.graph.replay()  # held at the event wait
            a.update(kv_len)  # the record resumes it
        torch.testing.assert_close(a.out, a.eager(kv_len))
        torch.testing.assert_close(a.doubled, a.eager(kv_len) * 2)


def test_a_replay_that_does_not_wait_for_its_update_reads_stale_lengths():
    """The update stream runs beside the replay: without a captured wait on the update's event
    the chip may run attention before the update lands. The simulator runs the update as late
    as the events allow, so the broken variant reads the previous step's lengths."""
    a = Attention()
    a.capture(3, with_event=False)
    for previous, kv_len in ((3, 9), (9, 5), (5, 12)):
        a.graph.replay()
        a.stream.wait_stream(npu.current_stream())  # the update runs after this replay
        a.update(kv_len, record=False)  # nothing in the graph waits for it
        torch.testing.assert_close(a.out, a.eager(previous))
        assert not torch.allclose(a.out, a.eager(kv_len))


@pytest.mark.parametrize("ordering", ["none", "wait_stream", "event", "synchronize"])
def test_an_update_must_be_ordered_after_the_graphs_previous_replay(ordering):
    """The host does not wait for a replay (async scheduling prepares the next step meanwhile):
    the next step's update, on its own stream, could rewrite an attention node that replay has
    yet to run. vllm-ascend orders it on the device: the update stream waits for the stream the
    previous replay ran on. Without an order the update fails."""
    a = Attention()
    a.capture(3)
    a.graph.replay()
    a.update(9)
    torch.testing.assert_close(a.out, a.eager(9))
    if ordering == "wait_stream":
        a.stream.wait_stream(npu.current_stream())
    elif ordering == "event":
        done = npu.Event()
        done.record(npu.current_stream())
        a.stream.wait_event(done)
    elif ordering == "synchronize":
        npu.current_stream().synchronize()
    a.graph.replay()
    if ordering == "none":
        with pytest.raises(GraphReplayError, match="previous replay may still run"):
            a.update(5)
        with pytest.raises(GraphReplayError, match="1 replay"):
            npu.synchronize()  # the replay that waits for the refused update waits forever
        return
    a.update(5)
    torch.testing.assert_close(a.out, a.eager(5))


def test_an_update_stream_waiting_for_the_replay_it_serves_is_a_deadlock():
    a = Attention()
    a.capture(3)
    a.graph.replay()  # held at the event wait
    a.stream.wait_stream(npu.current_stream())  # after the launch: waits for the held replay
    with pytest.raises(GraphReplayError, match="both streams hang"):
        a.update(9)
    with pytest.raises(GraphReplayError, match="1 replay"):
        npu.synchronize()


def test_side_stream_work_runs_when_an_event_orders_it():
    a = Attention()
    a.capture(3)
    with npu.stream(a.stream):
        a.issue_update(9)  # queued on the update stream, with its record
        done = npu.Event()
        done.record(a.stream)
        assert not done.query() and not a.event._recorded
        done.wait(npu.default_stream())  # the default stream's next work comes after it
        assert done.query() and a.event._recorded
    a.graph.replay()
    torch.testing.assert_close(a.out, a.eager(9))


def test_a_sync_in_another_host_thread_leaves_this_threads_replay_to_it():
    """vLLM's async output thread synchronises its copy event while the model thread's FULL
    replay waits for its update: the device's work must not run in two host threads at once."""
    import threading

    a = Attention()
    a.capture(3)
    a.graph.replay()  # held at the event wait
    errors = []

    def output_thread():
        try:
            npu.Event().synchronize()
            npu.synchronize()
        except Exception as e:  # pragma: no cover - the failure this test is about
            errors.append(e)

    with npu.stream(a.stream):
        a.issue_update(9)  # queued on this thread's update stream
        t = threading.Thread(target=output_thread)
        t.start()
        t.join()
        assert not errors and not a.event._recorded and npu.waiting_replays() == [a.graph.sim_graph]
    # Leaving the update stream's context ran the update and released the replay.
    assert a.event._recorded is False and not npu.waiting_replays()
    torch.testing.assert_close(a.out, a.eager(9))


def test_a_replay_whose_event_nobody_records_fails_loudly():
    a = Attention()
    a.capture(3)
    a.graph.replay()  # waits for an update that never comes
    with pytest.raises(GraphReplayError, match="waits on an ExternalEvent that no task update "
                                               "recorded"):
        _ = a.doubled + 1  # anything that depends on the graph's work
    a.graph.replay()
    a.update(9, record=False)  # the update without its record: still waiting
    with pytest.raises(GraphReplayError, match="no task update recorded"):
        npu.current_stream().synchronize()


def test_after_a_replay_gave_up_waiting_the_next_engine_compiles():
    """The failing op raised inside the waiting guard's dispatch, where the guard cannot leave
    the mode stack; the next engine's set_device must clear it, or Dynamo refuses to compile
    ("non-infra torch dispatch mode present")."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    a = Attention()
    a.capture(3)
    a.graph.replay()
    with pytest.raises(GraphReplayError):
        _ = a.doubled + 1
    npu.set_device(torch.device("cpu"))
    assert _get_current_dispatch_mode() is None
    compiled = torch.compile(lambda x: x * 2 + 1, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(torch.ones(3)), torch.full((3,), 3.0))


def test_an_event_is_recorded_once_per_replay():
    a = Attention()
    a.capture(3)
    a.update(9)
    with pytest.raises(RuntimeError, match="recorded twice without a reset"):
        a.update(5)


def test_task_update_rules():
    a = Attention()
    a.capture(3)
    with pytest.raises(RuntimeError, match="stream that is not capturing"):
        s = npu.Stream()
        with npu.stream(s):
            g = npu.NPUGraph()
            g.capture_begin()
            try:
                npu.graph_task_update_begin(s, a.handle)
            finally:
                g.capture_end()
    with pytest.raises(RuntimeError, match="no task was issued on the update stream"):
        npu.graph_task_update_begin(a.stream, a.handle)  # the op then goes to another stream
        npu.graph_task_update_end(a.stream)
    with pytest.raises(RuntimeError, match="is not the captured tensor"):
        with npu.stream(a.stream):
            npu.graph_task_update_begin(a.stream, a.handle)
            try:
                torch_npu.npu_fused_infer_attention_score.out(
                    **a.args(9), workspace=a.ws, out=[a.out.clone(), a.lse])
            finally:
                a.stream.update_handle = None
    with pytest.raises(RuntimeError, match="re-issues the captured op"):
        with npu.stream(a.stream):
            npu.graph_task_update_begin(a.stream, a.handle)
            try:
                torch_npu.npu_fused_infer_attention_score(**a.args(9))
            finally:
                a.stream.update_handle = None
    with pytest.raises(RuntimeError, match="needs a stream that is capturing"):
        npu.graph_task_group_begin(npu.current_stream())


def test_updated_host_values_are_checked_at_replay():
    a = Attention()
    a.capture(3)
    a.update(40)  # more KV than the block table's one block holds
    with pytest.raises(Exception, match=r"block table shape should be \[1, >=3\]"):
        a.graph.replay()


def test_a_replayed_scatter_writes_each_replays_slots_and_checks_them():
    """A replay skips the checks of the scatter's tensors, which the capture made, and keeps the
    checks of the slots it reads when it runs: out of range, or twice, raises at the replay."""
    key, value = torch.randn(2, 2, 16).to(BF16), torch.randn(2, 2, 16).to(BF16)
    caches = [torch.zeros(4, 16, 2, 16).to(BF16) for _ in range(2)]
    slots = torch.tensor([3, 17], dtype=torch.int32)

    def write():
        torch_npu.npu_scatter_pa_kv_cache(key, value, *caches, slots, cache_mode="Norm")

    g, _ = capture(write)
    slots.copy_(torch.tensor([40, 5], dtype=torch.int32))
    g.replay()
    npu.synchronize()
    flat_k = caches[0].view(-1, 2, 16)
    assert torch.equal(flat_k[40], key[0]) and torch.equal(flat_k[5], key[1])
    for bad, message in (([64, 1], "out of range"), ([9, 9], "must be unique")):
        slots.copy_(torch.tensor(bad, dtype=torch.int32))
        with pytest.raises(Exception, match=message):
            g.replay()
            npu.synchronize()


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
