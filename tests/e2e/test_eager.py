"""The foundation, eagerly: every family equals HF transformers through the real vLLM engine."""

import pytest

from tests.e2e.conftest import (FAMILIES, OUR_CLASSES, check_against_hf, engine, loaded_class,
                                model_path)


@pytest.fixture(scope="module", params=FAMILIES)
def eager_llm(request):
    with engine(model_path(request.param), enforce_eager=True) as llm:
        yield request.param, llm


def test_greedy_tokens_and_logprobs_equal_hf(eager_llm):
    family, llm = eager_llm
    check_against_hf(llm, family, label="eager")


def test_model_runs_on_the_simulator_through_our_attention_backend(eager_llm):
    family, llm = eager_llm

    def probe(worker):
        from vllm_ascend import device

        runner = worker.model_runner
        backends = {g.backend.get_name() for groups in runner.attn_groups for g in groups}
        return device.current.name, type(runner).__name__, sorted(backends)

    assert llm.collective_rpc(probe) == [("sim", "NPUModelRunner", ["ASCEND"])]
    assert loaded_class(llm) == OUR_CLASSES[family]  # the per-family file, with its fusions


def test_float32_is_refused_at_start_up_with_the_fix():
    from vllm import LLM

    with pytest.raises(ValueError, match=r"dtype float32 is not supported on Ascend: the fused "
                                         r"infer attention operator computes in bfloat16 or "
                                         r"float16 only. Pass dtype='bfloat16'"):
        LLM(model_path("llama"), dtype="float32", max_model_len=256)
