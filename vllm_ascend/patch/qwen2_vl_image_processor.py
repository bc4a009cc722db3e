"""Patch of transformers' Qwen2-VL image-processing module, for vLLM's Qwen3-VL and Qwen3.5
classes where torchvision does not import.

Upstream limitation (vLLM 0.32 with transformers 5.x): ``vllm.model_executor.models.qwen3_vl``,
which every Qwen3.5 class imports (the text-only ``Qwen3_5ForCausalLM`` and
``Qwen3_5MoeForCausalLM`` included), imports ``smart_resize`` from
``transformers.models.qwen2_vl.image_processing_qwen2_vl``, and that module imports torchvision
at its top. transformers' own package falls back to its PIL image processor without torchvision,
but this module does not, so a text-only Qwen3.5 failed vLLM's inspection of its class. Where
torchvision is not installed (x86_64 has no CPU torchvision for the project's CPU torch:
docs/gated_deltanet.md), the module's name is given the PIL module's two names vLLM reads:
``smart_resize`` (the same function: transformers marks it "Copied from" this one) and
``Qwen2VLImageProcessor`` (the PIL processor, as transformers' package falls back to). Any other
name is missing, with a message naming torchvision. Remove when vLLM imports ``smart_resize``
from the package or transformers' module stops requiring torchvision.
"""

import importlib
import importlib.util
import sys
import types

TARGET = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
PIL = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"


def _stand_in() -> types.ModuleType:
    pil = importlib.import_module(PIL)
    module = types.ModuleType(TARGET, __doc__)
    module.smart_resize = pil.smart_resize
    module.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil

    def __getattr__(name: str):
        raise AttributeError(f"{TARGET}.{name} needs torchvision, which is not installed "
                             "(vllm-ascend gives this module's smart_resize and its PIL image "
                             "processor only)")

    module.__getattr__ = __getattr__
    return module


def torchvision_installed() -> bool:
    # (One that is installed but does not load breaks transformers' image utilities, which
    # vLLM's config imports, before any plugin loads: nothing to do for it here.)
    return importlib.util.find_spec("torchvision") is not None


def apply() -> None:
    if (TARGET in sys.modules or torchvision_installed()
            or importlib.util.find_spec(PIL) is None):
        return
    sys.modules[TARGET] = _stand_in()
