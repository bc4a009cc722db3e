"""The graph mode in effect, as a table: (requested, backend support, eager, kind) -> mode."""

import os

import pytest
from vllm.config import CUDAGraphMode as M
from vllm.v1.attention.backend import AttentionCGSupport as S

from vllm_ascend.compilation.modes import GraphModeError, ModelKind, resolve_graph_mode

D, P = ModelKind.DECODER, ModelKind.POOLING
CONFIGURED = "as configured"
NO_FULL = "the attention backend cannot run inside a FULL graph"
DECODE_FULL = ("the attention backend runs only uniform decode batches inside FULL graphs, so "
               "mixed batches run PIECEWISE")
POOLING = "a pooling model has no decode steps"
TABLE = [
    # requested, support, enforce_eager, kind, expected, the reason the log gives
    (None, S.ALWAYS, False, D, M.FULL_AND_PIECEWISE, "the default"),  # as upstream
    (M.FULL_AND_PIECEWISE, S.ALWAYS, True, D, M.NONE, "enforce_eager is set"),
    (M.PIECEWISE, S.ALWAYS, False, D, M.PIECEWISE, CONFIGURED),
    (M.FULL, S.ALWAYS, False, D, M.FULL, CONFIGURED),
    (M.FULL_DECODE_ONLY, S.ALWAYS, False, D, M.FULL_DECODE_ONLY, CONFIGURED),
    (M.NONE, S.ALWAYS, False, D, M.NONE, CONFIGURED),
    (M.FULL, S.UNIFORM_BATCH, False, D, M.FULL_AND_PIECEWISE, DECODE_FULL),
    (M.FULL_DECODE_ONLY, S.UNIFORM_BATCH, False, D, M.FULL_DECODE_ONLY, CONFIGURED),
    (M.FULL_AND_PIECEWISE, S.NEVER, False, D, M.PIECEWISE, NO_FULL),
    (M.FULL, S.NEVER, False, D, M.PIECEWISE, NO_FULL),
    (M.FULL_DECODE_ONLY, S.NEVER, False, D, M.NONE, NO_FULL),
    (M.FULL_DECODE_ONLY, S.ALWAYS, False, P, M.NONE, POOLING),
    (M.FULL_AND_PIECEWISE, S.ALWAYS, False, P, M.PIECEWISE, POOLING),
    (M.FULL, S.ALWAYS, False, P, M.FULL, CONFIGURED),
]


@pytest.mark.parametrize("requested,support,eager,kind,expected,reason", TABLE)
def test_effective_mode(requested, support, eager, kind, expected, reason):
    mode, why = resolve_graph_mode(requested, support, eager, kind)
    assert mode == expected
    assert reason in why  # the log line says why this mode is in effect


def test_without_piecewise_compilation():
    assert resolve_graph_mode(M.FULL_AND_PIECEWISE, S.ALWAYS, False,
                              piecewise_compilation=False)[0] == M.FULL_DECODE_ONLY
    mode, why = resolve_graph_mode(M.FULL, S.UNIFORM_BATCH, False, piecewise_compilation=False,
                                   backend="MLA attention")
    assert mode == M.FULL_DECODE_ONLY
    assert "the MLA attention backend runs only uniform decode batches inside FULL graphs, so " \
        "mixed batches run eagerly" in why
    with pytest.raises(GraphModeError, match="PIECEWISE needs compilation mode VLLM_COMPILE"):
        resolve_graph_mode(M.PIECEWISE, S.ALWAYS, False, piecewise_compilation=False)


def test_not_a_mode_is_a_clear_error():
    with pytest.raises(GraphModeError, match="not one of"):
        resolve_graph_mode("FAST", S.ALWAYS, False)


def test_piecewise_compilation_runs_the_ascend_backend_without_aot_compile(monkeypatch):
    # The Ascend backend runs the FX passes and keeps no artifact: vLLM 0.32's AOT compile
    # would save one it cannot load back (and hash the whole config on every forward call).
    from vllm.config import CompilationConfig, CompilationMode, VllmConfig

    from vllm_ascend.compilation.settings import COMPILE_BACKEND
    from vllm_ascend.platform import NPUPlatform

    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "1")
    config = VllmConfig(compilation_config=CompilationConfig(mode=CompilationMode.VLLM_COMPILE,
                                                             backend="inductor"))
    NPUPlatform.check_and_update_config(config)
    assert config.compilation_config.backend == COMPILE_BACKEND
    assert os.environ["VLLM_USE_AOT_COMPILE"] == "0"


def test_a_compile_backend_ascend_cannot_run_is_refused():
    from vllm.config import CompilationConfig, CompilationMode, VllmConfig

    from vllm_ascend.platform import NPUPlatform

    config = VllmConfig(compilation_config=CompilationConfig(mode=CompilationMode.VLLM_COMPILE))
    config.compilation_config.backend = "openxla"
    with pytest.raises(ValueError, match="not available on Ascend"):
        NPUPlatform.check_and_update_config(config)
