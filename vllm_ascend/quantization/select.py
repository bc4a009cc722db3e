"""Which quantization a checkpoint runs with on Ascend, settled at start-up."""

from vllm_ascend.logger import get_logger
from vllm_ascend.quantization.modelslim import METHOD, AscendModelSlimConfig, detect

logger = get_logger(__name__)


def select(vllm_config) -> None:
    """A ModelSlim export (quant_model_description.json beside the weights) runs quantized
    without a flag, as upstream detects it; vLLM built no quantization config for it, since
    its config.json names none."""
    model_config = vllm_config.model_config
    if model_config.quantization is None and detect(model_config.model):
        from vllm.config import VllmConfig

        model_config.quantization = METHOD
        vllm_config.quant_config = VllmConfig._get_quantization_config(
            model_config, vllm_config.load_config)
    config = vllm_config.quant_config
    if isinstance(config, AscendModelSlimConfig):
        logger.info("vllm-ascend: ModelSlim checkpoint (quantization='%s'), layer types %s",
                    METHOD, ", ".join(sorted(config.types())))
