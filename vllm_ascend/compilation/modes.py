"""The graph mode in effect: a pure function of what was asked and what can run."""

import enum

from vllm.config import CUDAGraphMode
from vllm.v1.attention.backend import AttentionCGSupport


class ModelKind(enum.Enum):
    DECODER = "decoder"  # generates tokens: has decode steps
    POOLING = "pooling"  # one forward per request: no decode steps


class GraphModeError(ValueError):
    pass


def resolve_graph_mode(requested: CUDAGraphMode | None, support: AttentionCGSupport,
                       enforce_eager: bool, kind: ModelKind = ModelKind.DECODER,
                       piecewise_compilation: bool = True,
                       backend: str = "attention") -> tuple[CUDAGraphMode, str]:
    """(effective mode, why). ``requested`` None means the default, FULL_AND_PIECEWISE as
    upstream; ``support`` is the attention builder's; ``piecewise_compilation`` is False when the
    user turned compilation off (then PIECEWISE pieces do not exist); ``backend`` names the
    attention backend in the reasons."""
    if enforce_eager:
        return CUDAGraphMode.NONE, "enforce_eager is set"
    if requested is None:
        requested, why = CUDAGraphMode.FULL_AND_PIECEWISE, "the default"
    else:
        why = "as configured (vLLM's default unless set)"
    if not isinstance(requested, CUDAGraphMode):
        raise GraphModeError(f"cudagraph_mode {requested!r} is not one of "
                             f"{[m.name for m in CUDAGraphMode]}")
    if requested == CUDAGraphMode.NONE:
        return requested, why
    mode = requested
    if not piecewise_compilation and mode.requires_piecewise_compilation():
        if mode == CUDAGraphMode.PIECEWISE:
            raise GraphModeError(
                "cudagraph_mode PIECEWISE needs compilation mode VLLM_COMPILE (3), but "
                "compilation is off; remove the compilation 'mode' setting or choose "
                "cudagraph_mode FULL_DECODE_ONLY.")
        mode = CUDAGraphMode.FULL_DECODE_ONLY if mode.has_full_cudagraphs() else \
            CUDAGraphMode.NONE
        why += "; no piecewise compilation"
    if kind == ModelKind.POOLING and mode.decode_mode() == CUDAGraphMode.FULL and \
            mode.mixed_mode() != CUDAGraphMode.FULL:
        # The decode-only FULL graphs would never be used.
        mode = CUDAGraphMode.PIECEWISE if mode.has_piecewise_cudagraphs() else CUDAGraphMode.NONE
        why += "; a pooling model has no decode steps"
    if mode.has_full_cudagraphs() and support == AttentionCGSupport.NEVER:
        mode = CUDAGraphMode.PIECEWISE if (mode.has_piecewise_cudagraphs()
                                           or mode == CUDAGraphMode.FULL) and \
            piecewise_compilation else CUDAGraphMode.NONE
        why += f"; the {backend} backend cannot run inside a FULL graph"
    elif mode.mixed_mode() == CUDAGraphMode.FULL and support != AttentionCGSupport.ALWAYS:
        # Mixed prefill/decode batches need ALWAYS; decode batches keep their FULL graphs.
        mode = CUDAGraphMode.FULL_AND_PIECEWISE if piecewise_compilation else \
            CUDAGraphMode.FULL_DECODE_ONLY
        why += (f"; the {backend} backend runs only uniform decode batches inside FULL graphs, "
                f"so mixed batches run {'PIECEWISE' if piecewise_compilation else 'eagerly'}")
    return mode, why
