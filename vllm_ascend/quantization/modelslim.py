"""ModelSlim checkpoints (``quantization="ascend"``), as upstream's quantization/modelslim_config.py
reads them: ``quant_model_description.json`` beside the weights names each tensor's quantization
type (``"model.layers.0.self_attn.q_proj.weight": "W8A8_DYNAMIC"``, ``"FLOAT"`` for a layer left
in float). The platform selects this config when the file is there (``detect``); vLLM then asks
it for each layer's method.

Supported here: W8A8_DYNAMIC and W8A8 linear layers, W8A8_DYNAMIC MoE experts
(quantization/w8a8_moe.py), FLOAT anywhere. Other expert types, quantized embeddings and LM
heads, and other types are refused at start-up with the layer's name.
"""

import collections
import functools
import json
import os
import re

import torch
from vllm.model_executor.layers.fused_moe import RoutedExperts
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

from vllm_ascend.quantization.w8a8 import SCHEMES, CheckpointError
from vllm_ascend.quantization.w8a8_moe import AscendW8A8DynamicFusedMoEMethod

METHOD = "ascend"
DESCRIPTION = "quant_model_description.json"
# The tensors each type carries besides the float bias some layers have (ModelSlim lists every
# tensor of the checkpoint in the description, with its layer's type).
CARRIES = {"FLOAT": {"weight"}, **{name: set(cls.tensors) for name, cls in SCHEMES.items()}}
LAYER = re.compile(r"model\.layers\.(\d+)\.")
FIX = ("Re-export the model with ModelSlim (https://gitcode.com/Ascend/msit/tree/master/"
       "msmodelslim), or load the float checkpoint")


def description_path(model: str) -> str | None:
    """The checkpoint's description file: in a local model directory, or in the local Hugging
    Face cache for a repository id (nothing is downloaded here)."""
    if os.path.isdir(model):
        path = os.path.join(model, DESCRIPTION)
        return path if os.path.isfile(path) else None
    try:
        from huggingface_hub import try_to_load_from_cache
        found = try_to_load_from_cache(model, DESCRIPTION)
    except Exception:  # not a repository id
        return None
    return found if isinstance(found, str) else None


@register_quantization_config(METHOD)
class AscendModelSlimConfig(QuantizationConfig):

    def __init__(self, description: dict | None = None):
        super().__init__()
        self.description = description or {}

    def __repr__(self) -> str:
        return f"AscendModelSlimConfig({self.description.get('model_quant_type', 'mixed')})"

    @classmethod
    def get_name(cls) -> str:
        return METHOD

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0  # no CUDA capability on Ascend; vLLM asks only where the platform reports one

    @staticmethod
    def get_config_filenames() -> list[str]:
        # Empty, so vLLM builds the config without a file; maybe_update_config reads it and, if
        # it is missing, says what to do (as upstream).
        return []

    @classmethod
    def from_config(cls, config: dict) -> "AscendModelSlimConfig":
        return cls(config)

    def maybe_update_config(self, model_name: str, hf_config=None, revision=None) -> None:
        if self.description:
            return
        path = description_path(model_name)
        if path is None:
            raise ValueError(
                f"quantization='{METHOD}' reads ModelSlim checkpoints, and {model_name} has no "
                f"{DESCRIPTION}: it is not a ModelSlim export. Drop --quantization {METHOD} to "
                "run a float checkpoint, or quantize the model with ModelSlim first "
                "(docs/quantization.md)")
        with open(path) as f:
            self.description = json.load(f)

    @functools.cached_property
    def _listed(self) -> dict[str, set[str]]:
        """Each layer's tensor names (``weight``, ``weight_scale``, ...) in the description."""
        listed = collections.defaultdict(set)
        for key in self.description:
            module, _, name = key.rpartition(".")
            listed[module].add(name)
        return listed

    def types(self) -> set[str]:
        return {v for k, v in self.description.items() if k.endswith(".weight")}

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        if isinstance(layer, LinearBase):
            quant_type = self._linear_type(prefix)
            if quant_type == "FLOAT":
                return UnquantizedLinearMethod()
            return SCHEMES[quant_type](prefix)
        if isinstance(layer, RoutedExperts):
            return self._experts_method(layer, prefix)
        if isinstance(layer, VocabParallelEmbedding):
            quant_type = self.description.get(prefix + ".weight", "FLOAT")
            if quant_type != "FLOAT":
                raise CheckpointError(
                    f"{prefix}: a {quant_type} embedding or LM head is not supported; export "
                    "it FLOAT (ModelSlim leaves embeddings and the LM head in float by default)")
        return None

    def _experts_method(self, layer, prefix: str):
        """W8A8_DYNAMIC experts, or None (vLLM's unquantized experts, i.e. vllm-ascend's MoE
        layer) when the export leaves them FLOAT; one type for every expert of the layer."""
        found = {v for k, v in self.description.items()
                 if k.startswith(prefix + ".") and k.endswith(".weight")}
        if found <= {"FLOAT"}:
            return None
        if found != {"W8A8_DYNAMIC"}:
            raise CheckpointError(
                f"{prefix}: the experts are {'/'.join(sorted(found))} in this checkpoint; "
                "vllm-ascend runs MoE experts FLOAT or W8A8_DYNAMIC, all of a layer's experts "
                "alike. Export the experts W8A8_DYNAMIC or FLOAT (ModelSlim's disable_names), "
                "or run the float checkpoint")
        return AscendW8A8DynamicFusedMoEMethod(layer.moe_config, prefix)

    def _layer_after_listed(self, prefix: str) -> str | None:
        """The decoder layer of ``prefix`` (``model.layers.N``) if it comes after every layer
        the description lists, else None."""
        layer = LAYER.match(prefix)
        listed = [int(m.group(1)) for m in map(LAYER.match, self.description) if m]
        if layer and listed and int(layer.group(1)) > max(listed):
            return layer.group(0).rstrip(".")
        return None

    def _linear_type(self, prefix: str) -> str:
        """The layer's type, after checking that the description is whole for each projection
        it merges (q/k/v, gate/up) and that they share one type."""
        name = prefix.rsplit(".", 1)[-1]
        shards = [prefix[:-len(name)] + shard
                  for shard in self.packed_modules_mapping.get(name, [name])]
        found = {}
        for shard in shards:
            quant_type = self.description.get(shard + ".weight")
            if quant_type is None and (layer := self._layer_after_listed(shard)):
                raise CheckpointError(
                    f"{DESCRIPTION} lists nothing of {layer}, a layer after the ones it lists: "
                    "DeepSeek's MTP layer, which ModelSlim leaves out of the description and in "
                    "float. Add an entry \"<tensor name>\": \"FLOAT\" for each of its tensors "
                    f"in the checkpoint to {DESCRIPTION} (as upstream vllm-ascend asks), or "
                    "serve without MTP")
            if quant_type is None:
                raise CheckpointError(
                    f"{DESCRIPTION} has no entry for {shard}.weight: the description does not "
                    f"belong to this model. {FIX}")
            if quant_type not in CARRIES:
                raise CheckpointError(
                    f"{shard} is {quant_type}; vllm-ascend runs "
                    f"{', '.join(sorted(CARRIES))} layers. {FIX} with one of those types")
            unexpected = self._listed.get(shard, set()) - CARRIES[quant_type] - {"bias"}
            if unexpected:
                raise CheckpointError(
                    f"{shard} is {quant_type} but the checkpoint also lists "
                    f"{', '.join(sorted(unexpected))}, which a {quant_type} layer does not carry "
                    f"(it carries {', '.join(sorted(CARRIES[quant_type]))}). {FIX}")
            found[shard] = quant_type
        if len(set(found.values())) > 1:
            raise CheckpointError(
                f"{prefix} merges {', '.join(shards)}, which must share one quantization type; "
                f"the checkpoint has {found}. {FIX}")
        return next(iter(found.values()))


def detect(model: str) -> bool:
    """Whether ``model`` is a ModelSlim export (its description file is there)."""
    return description_path(model) is not None
