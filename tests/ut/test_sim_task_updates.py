"""The simulator's task updates and events: a captured FIA's host lists are frozen at capture,
a task update (with its ExternalEvent) gives a replay this step's lengths, and the order the
chip needs between updates, replays and streams is enforced (sim/npu.py, sim/streams.py,
sim/events.py)."""

import pytest
import torch

from tests.ut.conftest import capture
from vllm_ascend.device import sim as torch_npu
from vllm_ascend.device.sim import npu
from vllm_ascend.device.sim.errors import GraphReplayError

MASK = torch.triu(torch.ones(2048, 2048), diagonal=1).to(torch.int8)
BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def inference():
    with torch.inference_mode():
        yield


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
