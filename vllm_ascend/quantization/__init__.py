"""Quantized checkpoints: ModelSlim's format (modelslim.py) and its W8A8 linear layers (w8a8.py).
Importing this package registers ``quantization="ascend"`` with vLLM."""

from vllm_ascend.quantization.modelslim import METHOD, AscendModelSlimConfig, detect  # noqa: F401
