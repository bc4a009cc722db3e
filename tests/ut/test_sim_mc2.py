"""The simulator's MC2 operators (device/sim/mc2.py) over two ranks: dispatch sends each token
to the ranks of its experts and combine brings the weighted sum back, equal to a reference
computed from every rank's tokens; a captured dispatch -> grouped matmul -> combine replays on
new tokens and routes (the ledger counts both operators as replayed); and the chip's limits
refuse a call on both ranks alike (a refusal on one rank would leave the other in its
collective)."""

import os

import pytest
import torch

from tests.ut.conftest import on_two_ranks
from vllm_ascend.device.sim import npu

pytestmark = pytest.mark.timeout(240)

EXPERTS, K, H, BS = 8, 2, 1024, 3


def _tokens(rank: int, seed: int, bs: int = BS):
    g = torch.Generator().manual_seed(seed * 10 + rank)
    x = torch.randn(bs, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:K] for _ in range(bs)])
    weights = torch.rand(bs, K, generator=g)
    return x, ids.to(torch.int32), weights


def _reference(x, ids, weights, w):
    """sum_k weights[b, k] * (x[b] @ w[ids[b, k]]), the grouped matmul's bf16 rounding kept."""
    per = torch.stack([torch.stack([(x[b:b + 1].float() @ w[int(e)].float()).to(torch.bfloat16)[0]
                                    for e in ids[b]]) for b in range(x.shape[0])])
    return (per.float() * weights.unsqueeze(-1)).sum(1).to(torch.bfloat16)


def _moe(torch_npu, x, ids, weights, w, name, rank, **kw):
    common = dict(group_ep=name, ep_world_size=2, ep_rank_id=rank, moe_expert_num=EXPERTS, **kw)
    expand_x, _, assist, counts, ep_counts, tp_counts, scales = \
        torch_npu.npu_moe_distribute_dispatch_v2(x, ids, **common)
    local = w[rank * 4:(rank + 1) * 4]
    y = torch_npu.npu_grouped_matmul(x=[expand_x], weight=[local], split_item=2,
                                     group_list_type=1, group_type=0, group_list=counts)[0]
    out = torch_npu.npu_moe_distribute_combine_v2(
        y, ids, assist, ep_counts, weights, tp_send_counts=tp_counts, expand_scales=scales,
        **common)
    return out, expand_x, counts


def _refusal(torch_npu, name, rank, **change):
    x, ids, weights = _tokens(rank, 7)
    args = dict(x=x, expert_ids=ids, group_ep=name, ep_world_size=2, ep_rank_id=rank,
                moe_expert_num=EXPERTS)
    args.update(change)
    try:
        torch_npu.npu_moe_distribute_dispatch_v2(**args)
    except Exception as e:  # noqa: BLE001  (the message is what the test reads)
        return str(e).splitlines()[-1]
    return "ran"


def _rank(rank, port, results):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      VLLM_ASCEND_SIM_SOC="Ascend910_9382")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    npu.set_device(rank)
    from vllm_ascend.device import sim as torch_npu
    from vllm_ascend.device.sim.ledger import Ledger

    name = torch_npu.mc2.comm_name(dist.group.WORLD)
    w = (torch.randn(EXPERTS, H, H, generator=torch.Generator().manual_seed(5)) / 32).to(
        torch.bfloat16)
    found = {}
    with torch.inference_mode():
        # eager: what this rank receives, and its tokens' weighted sum back
        x, ids, weights = _tokens(rank, 1)
        out, expand_x, counts = _moe(torch_npu, x, ids, weights, w, name, rank)
        found["eager"] = (out, _reference(x, ids, weights, w))
        every = [_tokens(r, 1) for r in (0, 1)]
        mine = [(r, b) for e in range(rank * 4, rank * 4 + 4) for r in (0, 1)
                for b in range(BS) if e in every[r][1][b].tolist()]
        received = counts.sum().item()
        found["received"] = (received, len(mine), torch.equal(
            expand_x[:received], torch.stack([every[r][0][b] for r, b in mine])),
            bool(expand_x[received:].isnan().all()))
        # a padded rank: the mask's false rows are not sent and come back NaN
        mask = torch.tensor([True, True, False])
        out, _, counts = _moe(torch_npu, x, ids, weights, w, name, rank, x_active_mask=mask)
        found["masked"] = (out[:2], _reference(x[:2], ids[:2], weights[:2], w),
                           bool(out[2].isnan().all()))
        # captured, then replayed on new tokens and routes
        g = npu.NPUGraph()
        with npu.graph(g):
            graph_out, _, _ = _moe(torch_npu, x, ids, weights, w, name, rank)
        x2, ids2, weights2 = _tokens(rank, 2)
        x.copy_(x2), ids.copy_(ids2), weights.copy_(weights2)
        with Ledger() as ledger:
            g.replay()
            npu.synchronize()
        found["replayed"] = (graph_out.clone(), _reference(x2, ids2, weights2, w))
        found["ledger"] = dict(ledger.replayed_ops)
        g.reset()
        found["refused"] = {
            "H": _refusal(torch_npu, name, rank, x=torch.zeros(BS, 512, dtype=torch.bfloat16)),
            "BS": _refusal(torch_npu, name, rank, x=torch.zeros(513, H, dtype=torch.bfloat16),
                           expert_ids=torch.zeros(513, K, dtype=torch.int32)),
            "unequal BS": _refusal(torch_npu, name, rank, x=_tokens(rank, 3, 2 + rank)[0],
                                   expert_ids=_tokens(rank, 3, 2 + rank)[1]),
            "repeat": _refusal(torch_npu, name, rank,
                               expert_ids=torch.zeros(BS, K, dtype=torch.int32)),
            "mask": _refusal(torch_npu, name, rank,
                             x_active_mask=torch.tensor([False, True, True])),
            "experts": _refusal(torch_npu, name, rank, moe_expert_num=7),
        }
        os.environ["HCCL_BUFFSIZE"] = "1"
        found["refused"]["buffer"] = _refusal(torch_npu, name, rank,
                                              x=torch.zeros(256, H, dtype=torch.bfloat16),
                                              expert_ids=_tokens(rank, 4, 256)[1])
        os.environ["VLLM_ASCEND_SIM_SOC"] = ""
        found["refused"]["chip"] = _refusal(torch_npu, name, rank)
    results[rank] = found
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks():
    return on_two_ranks(_rank)


def test_dispatch_sends_each_token_to_its_experts_ranks(ranks):
    for found in ranks:
        received, expected, equal, rest_undefined = found["received"]
        assert received == expected and received > 0 and equal and rest_undefined


@pytest.mark.parametrize("case", ["eager", "replayed"])
def test_combine_returns_each_tokens_weighted_expert_sum(ranks, case):
    for found in ranks:
        out, reference = found[case]
        assert torch.allclose(out.float(), reference.float(), rtol=0.02, atol=0.02)


def test_masked_tokens_are_not_sent_and_come_back_undefined(ranks):
    for found in ranks:
        out, reference, undefined = found["masked"]
        assert torch.allclose(out.float(), reference.float(), rtol=0.02, atol=0.02) and undefined


def test_a_captured_dispatch_and_combine_replay(ranks):
    for found in ranks:
        assert found["ledger"].get("ascend_sim::npu_moe_distribute_dispatch_v2") == 1
        assert found["ledger"].get("ascend_sim::npu_moe_distribute_combine_v2") == 1


@pytest.mark.parametrize("case,message", [
    ("H", "H 512 is outside A3's range"), ("BS", "BS 513 must be in (0, 512]"),
    ("unequal BS", "global_bs 0 with the ranks' BS [2, 3]"), ("repeat", "repeats an expert"),
    ("mask", "true values must all precede"), ("experts", "moe_expert_num 7"),
    ("buffer", "HCCL buffer (1 MB, HCCL_BUFFSIZE) is smaller than the 13 MB"),
    ("chip", "runs on Atlas A2 and A3 chips")])
def test_the_chips_limits_refuse_on_every_rank(ranks, case, message):
    for found in ranks:
        assert message in found["refused"][case], found["refused"][case]
