"""Patch of ``VllmConfig._validate_v2_model_runner``: Model Runner V2 without Triton where the
device supplies V2's kernels.

Upstream limitation (vLLM 0.32): the config refuses Model Runner V2 whenever Triton does not
import ("Model Runner V2 requires Triton."), although a platform may override every kernel V2
launches through vLLM's kernel dispatcher. The simulator does (device/sim/v2_kernels.py): there
the check runs with Triton taken as present, so vLLM's other V2 checks still apply. On a chip the
kernels are triton-ascend's and the check stands. Remove when vLLM asks the platform.
"""

from unittest import mock

import vllm.config.vllm as vllm_config_module
from vllm.config import VllmConfig

from vllm_ascend import device

_original = VllmConfig._validate_v2_model_runner


def _validate_v2_model_runner(self) -> None:
    if device.current.v2_runner_kernels():
        with mock.patch.object(vllm_config_module, "HAS_TRITON", True):
            return _original(self)
    return _original(self)


def apply() -> None:
    VllmConfig._validate_v2_model_runner = _validate_v2_model_runner
