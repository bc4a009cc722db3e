"""Capture sizes under the chip's stream budget: a pure function.

Every captured ACL graph holds a stream (and one more per communication group it captures), and a
910-class chip has about 2048 for the whole software stack. PIECEWISE needs a graph per piece
(layers + 1) per capture size, so upstream's ~50 default sizes on a deep model would exhaust the
streams halfway through start-up. This keeps as many sizes as fit, evenly spread, always keeping
the smallest and the largest.
"""

import dataclasses

from vllm.config import CUDAGraphMode

DEFAULT_STREAM_TOTAL = 2048  # 910-class chip
DEFAULT_STREAM_RESERVE = 248  # streams left to torch, CANN and HCCL outside the graphs


@dataclasses.dataclass(frozen=True)
class CapturePlan:
    mode: CUDAGraphMode  # may be narrower than asked when no size fits
    kept: list[int]
    dropped: list[int]
    streams_per_size: int
    usable_streams: int
    reason: str  # why these sizes
    narrowed: str = ""  # why the mode is narrower than asked ("" when it is not)

    @property
    def streams_needed(self) -> int:
        return self.streams_per_size * len(self.kept)


def graphs_per_size(mode: CUDAGraphMode, num_layers: int, draft_layers: int = 0,
                    lora_cases: int = 1) -> int:
    """ACL graphs one capture size costs in ``mode``. A speculative drafter's model (a draft
    model or an EAGLE head, of ``draft_layers``) adds its own pieces where there are pieces:
    vLLM captures drafters in PIECEWISE only, never FULL. With LoRA, vLLM captures the model's
    graphs once per ``lora_cases`` (lora_graph_cases)."""
    pieces = (num_layers + 1) * lora_cases + (draft_layers + 1 if draft_layers else 0)
    return ((pieces if mode.has_piecewise_cudagraphs() else 0)
            + (lora_cases if mode.has_full_cudagraphs() else 0))


def lora_graph_cases(vllm_config) -> int:
    """How many times vLLM's CudagraphDispatcher captures each size: once without LoRA, or,
    with LoRA, once per count of active adapters it specializes on (by default: none and any,
    two) or once for any (``cudagraph_specialize_lora`` off)."""
    lora = vllm_config.lora_config
    if lora is None:
        return 1
    if not vllm_config.compilation_config.cudagraph_specialize_lora:
        return 1
    from vllm.lora.utils import get_captured_lora_counts

    return 1 + len(get_captured_lora_counts(lora.max_loras, lora.specialize_active_lora))


def streams_per_graph(tensor_parallel: int, data_parallel: int) -> int:
    """One stream for the graph, one more per communication group captured in it."""
    return 1 + (tensor_parallel > 1) + (data_parallel > 1)


def evenly_spread(sizes: list[int], n: int) -> list[int]:
    """``n`` of the sorted ``sizes``, evenly spread, first and last included."""
    if n >= len(sizes):
        return list(sizes)
    if n == 1:
        return [sizes[0]]
    picks = {round(i * (len(sizes) - 1) / (n - 1)) for i in range(n)}
    return [sizes[i] for i in sorted(picks)]


def plan_capture_sizes(requested: list[int], mode: CUDAGraphMode, num_layers: int, *,
                       tensor_parallel: int = 1, data_parallel: int = 1, draft_layers: int = 0,
                       lora_cases: int = 1, multiple_of: int = 1,
                       stream_total: int = DEFAULT_STREAM_TOTAL,
                       stream_reserve: int = DEFAULT_STREAM_RESERVE) -> CapturePlan:
    sizes = sorted(set(requested))
    aligned = [s for s in sizes if s % multiple_of == 0]
    usable = max(stream_total - stream_reserve, 0)
    narrowed = []
    while True:
        per_size = graphs_per_size(mode, num_layers, draft_layers, lora_cases) * \
            streams_per_graph(tensor_parallel, data_parallel)
        if mode == CUDAGraphMode.NONE or not aligned:
            return CapturePlan(CUDAGraphMode.NONE if not aligned else mode, [], sizes, per_size,
                               usable, "no capture size" if not aligned else "graph mode NONE",
                               "; ".join(narrowed))
        fit = usable // per_size
        if fit >= 1:
            kept = evenly_spread(aligned, fit)
            reason = ("all sizes fit" if len(kept) == len(sizes) else
                      f"{fit} sizes of {per_size} streams fit in {usable} streams")
            if len(aligned) < len(sizes):
                reason += f"; sizes must be multiples of {multiple_of}"
            return CapturePlan(mode, kept, [s for s in sizes if s not in kept], per_size,
                               usable, reason, "; ".join(narrowed))
        narrower = (CUDAGraphMode.FULL if mode == CUDAGraphMode.FULL_AND_PIECEWISE
                    else CUDAGraphMode.NONE)
        narrowed.append(f"not one {mode.name} capture size fits the stream budget ({per_size} "
                        f"streams per size, {usable} usable): {narrower.name} instead")
        if narrower == CUDAGraphMode.NONE:
            return CapturePlan(CUDAGraphMode.NONE, [], sizes, per_size, usable,
                               "not one size fits", "; ".join(narrowed))
        mode = narrower
