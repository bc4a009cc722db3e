"""How an MoE layer's tokens reach the experts of other ranks: a pure function, as upstream's
``select_moe_comm_method`` (ascend_forward_context.py).

Upstream's choices on an Atlas A2 (910B) chip: without expert parallelism, or with an EP group
of one rank, all-gather; with EP, MC2 (``npu_moe_distribute_dispatch``/``combine``) for batches
within its token capacity once the EP group reaches 16 ranks, else all-gather. A3 (910_93)
prefers MC2 and falls back to all-to-all for large batches; all-to-all's sizes depend on the
routing, so upstream keeps it out of captured graphs. vllm-ascend builds the all-gather path
(correct at every EP size, in every graph mode); where upstream would pick another, the choice
says so and why all-gather runs instead.
"""

import dataclasses
import enum


class MoEComm(enum.Enum):
    ALLGATHER = "all-gather"  # gather tokens and router logits, local experts, reduce-scatter
    MC2 = "MC2"
    ALLTOALL = "all-to-all"


MC2_MIN_EP_A2 = 16  # upstream's _select_a2_moe_comm_method


@dataclasses.dataclass(frozen=True)
class CommChoice:
    comm: MoEComm
    upstream: MoEComm  # what upstream vllm-ascend runs here
    reason: str


def chip_generation(device_name: str) -> str:
    """``A2`` (Atlas 800 A2, 910B), ``A3`` (910_93) or ``other``, from torch_npu's device name."""
    if device_name.startswith("Ascend910_93"):
        return "A3"
    if device_name.startswith("Ascend910B"):
        return "A2"
    return "other"


def select_moe_comm(generation: str, ep_size: int, decode: bool, in_graph: bool) -> CommChoice:
    """The communication of one MoE step: ``ep_size`` ranks share the experts (1 without expert
    parallelism), ``decode`` whether every request of the step is a decode (MC2's capacity holds
    decode batches), ``in_graph`` whether the step replays a captured graph."""
    if ep_size <= 1:
        return CommChoice(MoEComm.ALLGATHER, MoEComm.ALLGATHER, "no expert parallelism")
    if generation == "A3":
        upstream = MoEComm.MC2 if decode or in_graph else MoEComm.ALLTOALL
    elif generation == "A2" and ep_size >= MC2_MIN_EP_A2 and decode:
        upstream = MoEComm.MC2
    else:
        upstream = MoEComm.ALLGATHER
    if upstream == MoEComm.ALLGATHER:
        below = generation == "A2" and ep_size < MC2_MIN_EP_A2
        return CommChoice(MoEComm.ALLGATHER, upstream, f"EP over {ep_size} ranks"
                          + (" below upstream's MC2 threshold" if below else ""))
    return CommChoice(MoEComm.ALLGATHER, upstream,
                      f"upstream runs {upstream.value} here ({generation}, EP over {ep_size} "
                      "ranks); vllm-ascend has only the all-gather path, which is exact at any "
                      "EP size and capturable")
