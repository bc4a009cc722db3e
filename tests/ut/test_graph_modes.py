"""The graph mode in effect, as a table: (requested, backend support, eager, kind) -> mode."""

import pytest
from vllm.config import CUDAGraphMode as M
from vllm.v1.attention.backend import AttentionCGSupport as S

from vllm_ascend.compilation.modes import GraphModeError, ModelKind, resolve_graph_mode

D, P = ModelKind.DECODER, ModelKind.POOLING
TABLE = [
    # requested, support, enforce_eager, kind, expected
    (None, S.ALWAYS, False, D, M.FULL_AND_PIECEWISE),  # the default, as upstream
    (M.FULL_AND_PIECEWISE, S.ALWAYS, True, D, M.NONE),  # enforce_eager wins
    (M.PIECEWISE, S.ALWAYS, False, D, M.PIECEWISE),
    (M.FULL, S.ALWAYS, False, D, M.FULL),
    (M.FULL_DECODE_ONLY, S.ALWAYS, False, D, M.FULL_DECODE_ONLY),
    (M.NONE, S.ALWAYS, False, D, M.NONE),
    (M.FULL, S.UNIFORM_BATCH, False, D, M.FULL_AND_PIECEWISE),  # mixed batches stay piecewise
    (M.FULL_DECODE_ONLY, S.UNIFORM_BATCH, False, D, M.FULL_DECODE_ONLY),
    (M.FULL_AND_PIECEWISE, S.NEVER, False, D, M.PIECEWISE),  # attention can't be in a graph
    (M.FULL, S.NEVER, False, D, M.PIECEWISE),
    (M.FULL_DECODE_ONLY, S.NEVER, False, D, M.NONE),
    (M.FULL_DECODE_ONLY, S.ALWAYS, False, P, M.NONE),  # pooling: no decode steps
    (M.FULL_AND_PIECEWISE, S.ALWAYS, False, P, M.PIECEWISE),
    (M.FULL, S.ALWAYS, False, P, M.FULL),
]


@pytest.mark.parametrize("requested,support,eager,kind,expected", TABLE)
def test_effective_mode(requested, support, eager, kind, expected):
    mode, why = resolve_graph_mode(requested, support, eager, kind)
    assert mode == expected
    assert why  # every decision carries its reason for the log


def test_without_piecewise_compilation():
    assert resolve_graph_mode(M.FULL_AND_PIECEWISE, S.ALWAYS, False,
                              piecewise_compilation=False)[0] == M.FULL_DECODE_ONLY
    with pytest.raises(GraphModeError, match="PIECEWISE needs compilation mode VLLM_COMPILE"):
        resolve_graph_mode(M.PIECEWISE, S.ALWAYS, False, piecewise_compilation=False)


def test_not_a_mode_is_a_clear_error():
    with pytest.raises(GraphModeError, match="not one of"):
        resolve_graph_mode("FAST", S.ALWAYS, False)
