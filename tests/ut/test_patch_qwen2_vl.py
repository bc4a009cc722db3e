"""A text-only Qwen3.5 class imports where torchvision is not installed (this project's venv on
x86_64: vllm_ascend/patch/qwen2_vl_image_processor.py), in a fresh interpreter as vLLM inspects
a model's class; where torchvision is installed, transformers' own module is left alone."""

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

from vllm_ascend.patch import qwen2_vl_image_processor as patch

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = f"""
import sys
import vllm_ascend.patch
vllm_ascend.patch.apply()
module = sys.modules["{patch.TARGET}"]
from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil
assert module.smart_resize is pil.smart_resize
assert module.Qwen2VLImageProcessor is pil.Qwen2VLImageProcessorPil
try:
    module.TorchvisionBackend
except AttributeError as e:
    assert "needs torchvision, which is not installed" in str(e), e
else:
    raise AssertionError("a name the stand-in does not give")
from vllm.model_executor.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM
print("IMPORTED", Qwen3_5ForCausalLM.__name__, Qwen3_5MoeForCausalLM.__name__)
"""


@pytest.mark.slow  # a fresh interpreter importing vLLM: the full tier
@pytest.mark.timeout(180)
@pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None,
                    reason="torchvision is installed here: transformers' module imports")
def test_qwen3_5_classes_import_without_torchvision():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, text=True,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
                          timeout=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "IMPORTED Qwen3_5ForCausalLM Qwen3_5MoeForCausalLM" in proc.stdout


def test_an_installed_torchvision_keeps_transformers_module(monkeypatch):
    monkeypatch.setattr(patch, "torchvision_installed", lambda: True)
    monkeypatch.delitem(sys.modules, patch.TARGET, raising=False)
    patch.apply()
    assert patch.TARGET not in sys.modules
