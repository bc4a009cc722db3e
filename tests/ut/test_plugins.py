"""vLLM's plugin selection (``VLLM_PLUGINS``) with this package's entry points: the platform
plugin ``ascend``, the model-files plugin ``ascend_models`` and the patches ``ascend_patches``.
All load by default; ``VLLM_PLUGINS=ascend`` loads the platform alone, so vLLM keeps upstream's
model classes (how the benchmarks compare them with ours)."""

import pytest
from vllm import envs
from vllm.plugins import (DEFAULT_PLUGINS_GROUP, PLATFORM_PLUGINS_GROUP,
                          load_plugins_by_group)


@pytest.fixture
def plugins(monkeypatch):
    def loaded(setting):
        if setting is None:
            monkeypatch.delenv("VLLM_PLUGINS", raising=False)
        else:
            monkeypatch.setenv("VLLM_PLUGINS", setting)
        envs.disable_envs_cache()
        return {group: sorted(load_plugins_by_group(group))
                for group in (PLATFORM_PLUGINS_GROUP, DEFAULT_PLUGINS_GROUP)}

    return loaded


def test_the_plugins_load_by_default_and_the_platform_is_npu(plugins):
    loaded = plugins(None)
    assert "ascend" in loaded[PLATFORM_PLUGINS_GROUP]
    assert {"ascend_models", "ascend_patches"} <= set(loaded[DEFAULT_PLUGINS_GROUP])
    register = load_plugins_by_group(PLATFORM_PLUGINS_GROUP)["ascend"]
    assert register() == "vllm_ascend.platform.NPUPlatform"


def test_vllm_plugins_ascend_loads_the_platform_without_our_model_files(plugins):
    loaded = plugins("ascend")
    assert loaded == {PLATFORM_PLUGINS_GROUP: ["ascend"], DEFAULT_PLUGINS_GROUP: []}


def test_our_model_files_register_under_upstream_names():
    from vllm import ModelRegistry

    from vllm_ascend.models import FAMILIES, register

    register()
    for arch, path in FAMILIES.items():
        module, name = path.split(":")
        assert ModelRegistry._try_load_model_cls(arch).__name__ == name, arch


# The vLLM modules the CustomOp overrides subclass from, and EAGLE-3's head, whose import is the
# first of vllm.kernels in the process that inspects it (vLLM's registry, before its modelinfo
# cache holds the class): that import calls the platform's import_kernels.
FIRST_IMPORTS = ["vllm.model_executor.layers.layernorm", "vllm.model_executor.layers.activation",
                 "vllm.model_executor.layers.rotary_embedding",
                 "vllm.model_executor.models.llama_eagle3"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("module", FIRST_IMPORTS)
def test_vllm_modules_import_first_in_a_fresh_process(module):
    """No circular import through the platform: a user's first EAGLE-3 head failed to load."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True,
                          text=True, timeout=110)
    assert done.returncode == 0, done.stderr[-2000:]
