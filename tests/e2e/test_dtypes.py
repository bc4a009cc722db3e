"""The dtypes a model runs in: FIA computes in bfloat16 or float16, so `dtype="auto"` runs a
float32 checkpoint in bfloat16 and a bfloat16 or float16 checkpoint in its own dtype, and float32
is refused at start-up with the fix. (Engines in float16: test_graph_modes.py, Qwen3; on a
bfloat16 checkpoint with dtype auto: test_request_classes.py.)"""

import pytest
import torch
from vllm.engine.arg_utils import EngineArgs

from scripts.models import tiny_model_dir
from tests.e2e.conftest import model_path


@pytest.mark.parametrize("checkpoint,runs_in", [("float32", torch.bfloat16),
                                                ("bfloat16", torch.bfloat16)])
def test_dtype_auto_runs_a_checkpoint_in_a_dtype_fia_computes_in(checkpoint, runs_in):
    config = EngineArgs(tiny_model_dir("llama", checkpoint), dtype="auto",
                        max_model_len=256).create_engine_config()
    assert config.model_config.hf_config.dtype == getattr(torch, checkpoint)
    assert config.model_config.dtype == runs_in


def test_float16_is_kept():
    config = EngineArgs(model_path("llama"), dtype="float16",
                        max_model_len=256).create_engine_config()
    assert config.model_config.dtype == torch.float16


def test_float32_is_refused_at_start_up_with_the_fix():
    from vllm import LLM

    with pytest.raises(ValueError, match=r"dtype float32 is not supported on Ascend: the fused "
                                         r"infer attention operator computes in bfloat16 or "
                                         r"float16 only. Pass dtype='bfloat16'"):
        LLM(model_path("llama"), dtype="float32", max_model_len=256)
