"""What an engine runs, in the terms of docs/supported_models.md: the model's architecture, its
quantization, its parallel layout and speculative method, the graph mode in effect and vLLM's
model runner (``collective_rpc("summary")``, NPUWorker.summary)."""


def quantization(vllm_config) -> str:
    """"none", or the method with the ModelSlim types its layers use (FLOAT layers left out)."""
    method = vllm_config.model_config.quantization
    if not method:
        return "none"
    description = getattr(vllm_config.quant_config, "description", None)
    if not description:
        return method
    types = sorted({kind for name, kind in description.items()
                    if name.endswith(".weight") and kind != "FLOAT"})
    return "ModelSlim " + "+".join(types)


def layout(parallel) -> str:
    """"TP=1", or the sizes above 1 (and EP where the experts are spread over the ranks)."""
    parts = [f"{name}={size}" for name, size in (
        ("TP", parallel.tensor_parallel_size), ("PP", parallel.pipeline_parallel_size),
        ("DP", parallel.data_parallel_size)) if size > 1]
    if parallel.enable_expert_parallel:
        parts.append("EP")
    return " ".join(parts) or "TP=1"


def summary(vllm_config) -> dict:
    spec = vllm_config.speculative_config
    hf_config = vllm_config.model_config.hf_config
    return {"architecture": (hf_config.architectures or [hf_config.model_type])[0],
            "quantization": quantization(vllm_config),
            "layout": layout(vllm_config.parallel_config),
            "speculative": spec.method if spec else None,
            "graph_mode": vllm_config.compilation_config.cudagraph_mode.name,
            "model_runner": "V2" if vllm_config.use_v2_model_runner else "V1"}
