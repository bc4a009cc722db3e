"""The simulator's graph semantics: what a captured ACL graph does and refuses to do."""

import pytest
import torch

from vllm_ascend.device.sim import SimBackend
from vllm_ascend.device.sim_graph import (GraphCaptureError, GraphPool, SimGraph,
                                          StreamPool, StreamResourceError)
from vllm_ascend.device.sim_ops import ATTEN_MASK_SIZE

sim = SimBackend(reason="test")


def capture(fn, *args, streams=None, pool=None):
    g = SimGraph(streams or StreamPool(lambda: 16))
    with g.capture(pool):
        out = fn(*args)
    g.finalize(out)
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


def fia(q, k, v, table, kv_lens):
    mask = torch.ones(ATTEN_MASK_SIZE, ATTEN_MASK_SIZE, dtype=torch.bool).triu(1)
    return sim.fused_infer_attention_score(
        q, k, v, actual_seq_lengths=[1], actual_seq_lengths_kv=kv_lens, block_table=table,
        block_size=16, num_heads=2, num_key_value_heads=2, scale=0.5, atten_mask=mask)


def test_host_lists_are_frozen_at_capture_and_replay_stale_values():
    q = torch.randn(1, 2, 8)
    k, v = torch.randn(2, 16, 2, 8), torch.randn(2, 16, 2, 8)
    table = torch.tensor([[1]], dtype=torch.int32)
    g, out = capture(fia, q, k, v, table, [3])
    g.replay()
    with_3 = out.clone()
    # The next step has 9 tokens of KV: Python would pass [9], the graph still holds [3].
    fresh = fia(q, k, v, table, [9])
    g.replay()
    torch.testing.assert_close(out, with_3)
    assert not torch.allclose(out, fresh)


def test_item_and_tolist_during_capture_raise():
    x = torch.randn(3)
    g = SimGraph(StreamPool(lambda: 4))
    with pytest.raises(GraphCaptureError, match=r"host synchronisation \(.item"):
        with g.capture():
            (x * 2).sum().item()
    g = SimGraph(StreamPool(lambda: 4))
    with pytest.raises(GraphCaptureError, match=r"\.tolist\(\)"):
        with g.capture():
            (x * 2).tolist()
    assert x.tolist()  # restored after capture


def test_stream_budget_exhaustion_raises_207008_and_reset_frees_a_stream():
    streams = StreamPool(lambda: 2)
    w, x = torch.randn(8, 8), torch.randn(2, 8)
    g1, _ = capture(lambda: x @ w, streams=streams)
    g2, _ = capture(lambda: x @ w, streams=streams)
    assert streams.in_use == 2
    with pytest.raises(StreamResourceError, match="207008.*stream resources are insufficient"):
        capture(lambda: x @ w, streams=streams)
    assert streams.in_use == 2  # the failed capture gave its stream back
    g1.reset()
    g3, _ = capture(lambda: x @ w, streams=streams)
    assert streams.in_use == 2
    del g2, g3  # a freed graph gives its stream back
    assert streams.in_use == 0


def test_graphs_share_one_pool_sized_by_the_largest():
    pool = GraphPool()
    w = torch.randn(64, 64)
    xs = {n: torch.randn(n, 64) for n in (32, 8, 1)}
    graphs = {n: capture(mlp, xs[n], w, [], pool=pool) for n in (32, 8, 1)}
    assert pool.nbytes == graphs[32][0].scratch_bytes
    assert graphs[32][0].scratch_bytes > graphs[8][0].scratch_bytes > 0
    for n, (g, out) in graphs.items():  # still correct after sharing
        xs[n].copy_(torch.randn(n, 64))
        g.replay()
        torch.testing.assert_close(out, mlp(xs[n], w, []))


def test_graph_wrapper_refuses_inputs_at_other_addresses():
    from vllm.config import CUDAGraphMode, VllmConfig
    from vllm.forward_context import BatchDescriptor, set_forward_context

    from vllm_ascend.compilation.acl_graph import ACLGraphWrapper

    config = VllmConfig()
    w = torch.randn(8, 8)
    wrapper = ACLGraphWrapper(lambda x: x @ w, config, CUDAGraphMode.FULL)
    x = torch.randn(2, 8)
    from vllm.compilation.monitor import set_cudagraph_capturing_enabled

    with set_forward_context(None, config, cudagraph_runtime_mode=CUDAGraphMode.FULL,
                             batch_descriptor=BatchDescriptor(num_tokens=2)):
        set_cudagraph_capturing_enabled(True)
        out = wrapper(x)
        x.copy_(torch.randn(2, 8))
        torch.testing.assert_close(wrapper(x), x @ w)
        assert wrapper(x) is out
        with pytest.raises(RuntimeError, match="inputs at other addresses"):
            wrapper(x.clone())
    wrapper.clear_graphs()


def test_task_update_replaces_host_lists_for_the_next_replay_only_once_per_replay():
    from vllm_ascend.device.sim_graph import TaskUpdateError

    q = torch.randn(1, 2, 8)
    k, v = torch.randn(2, 16, 2, 8), torch.randn(2, 16, 2, 8)
    table = torch.tensor([[1]], dtype=torch.int32)
    mask = torch.ones(ATTEN_MASK_SIZE, ATTEN_MASK_SIZE, dtype=torch.bool).triu(1)
    out = torch.empty(1, 2, 8)
    args = dict(actual_seq_lengths=[1], block_table=table, block_size=16, num_heads=2,
                num_key_value_heads=2, scale=0.5, atten_mask=mask)
    g = SimGraph(sim.streams)
    with g.capture():
        sim.task_group_begin()
        sim.fused_infer_attention_score(q, k, v, actual_seq_lengths_kv=[3], out=out, **args)
        handle = sim.task_group_end()
    g.finalize(out)
    expected = sim.fused_infer_attention_score(q, k, v, actual_seq_lengths_kv=[9], **args)
    sim.task_update_begin(None, handle)
    sim.fused_infer_attention_score(q, k, v, actual_seq_lengths_kv=[9], out=out, **args)
    sim.task_update_end(None)
    with pytest.raises(TaskUpdateError, match="before a replay consumed the first"):
        sim.task_update_begin(None, handle)
        try:
            sim.fused_infer_attention_score(q, k, v, actual_seq_lengths_kv=[5], out=out, **args)
        finally:
            sim.task_update_end(None)
    g.replay()
    torch.testing.assert_close(out, expected)  # the update landed before attention ran
    g.replay()
    torch.testing.assert_close(out, expected)  # and stays until the next update
    g.reset()
