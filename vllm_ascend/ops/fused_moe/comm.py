"""How an MoE layer's tokens reach the experts of other ranks: a pure function of the layer's
setup and the step's tokens a rank, as upstream's ``select_moe_comm_method``
(ascend_forward_context.py) decides it.

Upstream's choices with expert parallelism: on an A3 (910_93) chip, MC2
(``npu_moe_distribute_dispatch_v2``/``combine_v2``) while a rank's tokens fit MC2's capacity
(the largest captured batch, at most the chip's per-rank limit), else all-to-all; on an A2
(910B), MC2 within the capacity once the EP group reaches 16 ranks with at most 24 experts a
rank, else all-gather. The capacity depends on the batch size only, so a graph captured for a
size replays the communication it was captured with, and every EP rank (their batches padded to
one size) makes the same choice. vllm-ascend runs MC2 where upstream does and the operators'
limits allow, all-gather everywhere else (all-to-all's sizes depend on the routing, so it
cannot be captured; all-gather is exact at any size); the reason says which and why.
"""

import dataclasses
import enum
import functools


class MoEComm(enum.Enum):
    ALLGATHER = "all-gather"  # gather tokens and router logits, local experts, reduce-scatter
    MC2 = "MC2"
    ALLTOALL = "all-to-all"


MC2_MIN_EP_A2 = 16  # upstream's _select_a2_moe_comm_method
MC2_MAX_EXPERTS_A2 = 24  # experts a rank, the same
# dispatch_v2/combine_v2's limits per chip (torch_npu's API reference, fullmesh algorithms):
# (EP sizes, hidden sizes, tokens a rank sends). The simulator keeps its own copy
# (device/sim/mc2.py): it enforces the chip's limits whatever the product believes them to be.
MC2_LIMITS = {"A3": (lambda ep: 2 <= ep <= 768, lambda h: 1024 <= h <= 8192, 512),
              "A2": (lambda ep: ep in (2, 3, 4, 5, 6, 7, 8, 16, 32, 64, 128, 256),
                     lambda h: 0 < h <= 7168 and h % 32 == 0, 256)}


@dataclasses.dataclass(frozen=True)
class CommChoice:
    comm: MoEComm
    upstream: MoEComm  # what upstream vllm-ascend runs here
    reason: str


@dataclasses.dataclass(frozen=True)
class MoECommSetup:
    """What the choice depends on besides the step: the chip, the layer, the parallel layout."""
    generation: str  # chip_generation's
    ep_size: int  # ranks sharing the experts (1 without expert parallelism)
    experts: int
    top_k: int
    hidden: int
    partitioned: bool  # each EP rank brings tokens of its own (DP, or DP x TP sequence-parallel)
    largest_batch: int  # tokens a rank runs in the largest captured graph (or decode batch)
    window: int  # HCCL's buffer per communicator and direction, bytes (HCCL_BUFFSIZE)
    mc2_ops: bool = True  # torch_npu has npu_moe_distribute_dispatch_v2 and combine_v2


def chip_generation(device_name: str) -> str:
    """``A2`` (Atlas 800 A2, 910B), ``A3`` (910_93) or ``other``, from torch_npu's device name."""
    if device_name.startswith("Ascend910_93"):
        return "A3"
    if device_name.startswith("Ascend910B"):
        return "A2"
    return "other"


def mc2_window_bytes(generation: str, local_experts: int, tokens: int, ep: int, hidden: int,
                     top_k: int) -> int:
    """The HCCL buffer MC2 needs for ``tokens`` a rank: the API reference's formula (A3
    fullmesh_v1 with one shared expert slot, upstream's default; A2 fullmesh). (The simulator's
    copy: sim/mc2.py window_bytes.)"""
    def align(x, to):
        return -(-x // to) * to

    if generation == "A3":
        return 2 * (local_experts * tokens * ep * align(align(2 * hidden, 32) + 64, 512)
                    + (top_k + 1) * tokens * align(2 * hidden, 512))
    return 2 * (tokens * ep * min(local_experts, top_k) * hidden * 2 + (2 << 20))


def mc2_capacity(setup: MoECommSetup) -> int:
    """Tokens a rank up to which upstream runs MC2: the largest captured batch, at most the
    chip's per-rank limit (``get_mc2_tokens_capacity``)."""
    limit = MC2_LIMITS[setup.generation][2] if setup.generation in MC2_LIMITS else 512
    return min(setup.largest_batch, limit)


@functools.lru_cache(maxsize=None)  # fixed per layer setup; asked at every eager MoE step
def _mc2_blocker(s: MoECommSetup, capacity: int) -> str | None:
    """Why vllm-ascend cannot run MC2 where upstream does, with the fix; None if it can."""
    ep_ok, hidden_ok, _ = MC2_LIMITS[s.generation]
    local = s.experts // s.ep_size
    if not s.mc2_ops:
        return "this torch_npu has no npu_moe_distribute_dispatch_v2/combine_v2: upgrade it"
    if not s.partitioned:
        return ("every EP rank holds every token (no data parallelism, or DP x TP without "
                "vLLM's sequence-parallel MoE), so MC2 would send each token from every rank")
    if not ep_ok(s.ep_size) or s.experts % s.ep_size or not s.experts <= 1024 or s.top_k > 16 \
            or local * s.ep_size > 2048:
        return (f"MC2's operators do not take {s.experts} experts over {s.ep_size} ranks, "
                f"top-{s.top_k}, on {s.generation}")
    if not hidden_ok(s.hidden):
        return f"MC2's operators do not take a hidden size of {s.hidden} on {s.generation}"
    need = mc2_window_bytes(s.generation, local, capacity, s.ep_size, s.hidden, s.top_k)
    if need > s.window:
        mb = -(-need // (1 << 20))
        return (f"HCCL's buffer ({s.window >> 20} MB) is below the {mb} MB MC2 needs for "
                f"{capacity} tokens a rank: set HCCL_BUFFSIZE={mb} or more")
    return None


def select_moe_comm(setup: MoECommSetup, tokens: int) -> CommChoice:
    """The communication of one MoE step in which each EP rank brings ``tokens`` (the largest
    rank's count, padded alike on every rank)."""
    s = setup
    if s.ep_size <= 1:
        return CommChoice(MoEComm.ALLGATHER, MoEComm.ALLGATHER, "no expert parallelism")
    capacity = mc2_capacity(s)
    fits = tokens <= capacity
    if s.generation == "A3":
        upstream = MoEComm.MC2 if fits else MoEComm.ALLTOALL
    elif s.generation == "A2" and s.ep_size >= MC2_MIN_EP_A2 and fits and \
            s.experts // s.ep_size <= MC2_MAX_EXPERTS_A2:
        upstream = MoEComm.MC2
    else:
        upstream = MoEComm.ALLGATHER
    if upstream == MoEComm.MC2:
        blocker = _mc2_blocker(s, capacity)
        if blocker is None:
            return CommChoice(MoEComm.MC2, upstream, f"MC2 up to {capacity} tokens a rank "
                              f"({s.generation}, EP over {s.ep_size} ranks)")
        return CommChoice(MoEComm.ALLGATHER, upstream, f"all-gather where upstream runs MC2: "
                          f"{blocker}")
    if upstream == MoEComm.ALLTOALL:
        return CommChoice(MoEComm.ALLGATHER, upstream,
                          f"all-gather above {capacity} tokens a rank, where upstream runs "
                          "all-to-all (its sizes depend on the routing; vllm-ascend does not "
                          "build it)")
    below = s.generation == "A2" and s.ep_size < MC2_MIN_EP_A2
    return CommChoice(MoEComm.ALLGATHER, upstream, f"EP over {s.ep_size} ranks"
                      + (" below upstream's MC2 threshold" if below else "")
                      + (f" above {capacity} tokens a rank" if s.generation == "A2"
                         and not below and not fits else ""))
