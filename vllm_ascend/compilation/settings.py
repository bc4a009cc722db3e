"""The compilation and graph settings vLLM reads from the config, settled for Ascend before its
dispatcher, compile sizes and the runner read them (NPUPlatform.check_and_update_config hands
them here): the compile backend (compiler.py: FX passes, no Inductor code generation), the
pieces PIECEWISE graphs split at, the CUDA-only fusion passes off, the CustomOps on; then the
graph mode in effect (modes.py) and the capture sizes the stream budget keeps
(capture_sizes.py), each said in one log line."""

import os

from vllm_ascend import device
from vllm_ascend.logger import get_logger

logger = get_logger(__name__)
MLA_OP = "vllm::ascend_mla_attention"  # the Ascend MLA layer's attention op (ops/mla.py)
COMPILE_BACKEND = "vllm_ascend.compilation.compiler.AscendCompiler"  # FX passes, no codegen
SIMPLE_COMPILE_BACKEND = "eager"  # what the other modes hand torch.compile: no usable Inductor


def apply(vllm_config) -> None:
    """Everything above, in the order vLLM needs it: the compile backend and warm-ups, the graph
    mode and capture sizes, then the splitting ops (vLLM fills them only after the platform's
    hook, from the mode), the fusion passes and the CustomOps."""
    from vllm.config import CompilationMode

    parallel_config = vllm_config.parallel_config
    compilation_config = vllm_config.compilation_config
    if compilation_config.mode == CompilationMode.VLLM_COMPILE:
        # No usable Inductor on Ascend: Dynamo splits the model into pieces and each piece
        # runs as traced, after the Ascend FX passes (compilation/compiler.py; the
        # simulator's graphs record dispatcher ops, which Inductor's generated kernels would
        # bypass).
        if compilation_config.backend not in ("", "eager", "inductor", COMPILE_BACKEND):
            raise ValueError(
                f"compile backend {compilation_config.backend!r} is not available on "
                "Ascend; leave compilation_config.backend unset (the Ascend backend runs "
                "the FX fusion passes, with no code generation).")
        if compilation_config.backend == "inductor":
            logger.info("vllm-ascend: compile backend 'inductor' replaced by the Ascend "
                        "one (FX fusion passes, no Inductor code generation on Ascend)")
        compilation_config.backend = COMPILE_BACKEND
        # With VLLM_USE_AOT_COMPILE on (its default on torch >= 2.10) vLLM 0.32 hashes the
        # whole config on every forward call (decorators.py, ~5 ms a step); the Ascend
        # backend keeps no compiled artifact, so the switch is off.
        if os.environ.get("VLLM_USE_AOT_COMPILE", "0") != "0":
            logger.info("vllm-ascend: VLLM_USE_AOT_COMPILE=%s ignored: the Ascend compile "
                        "backend has no ahead-of-time artifact",
                        os.environ["VLLM_USE_AOT_COMPILE"])
        os.environ["VLLM_USE_AOT_COMPILE"] = "0"
    elif compilation_config.backend == COMPILE_BACKEND:
        # vLLM's default for every mode; the other modes hand it to torch.compile itself.
        compilation_config.backend = SIMPLE_COMPILE_BACKEND
    compilation_config.cudagraph_num_of_warmups = max(
        1, compilation_config.cudagraph_num_of_warmups)
    apply_graph_mode(vllm_config)
    if compilation_config.mode == CompilationMode.VLLM_COMPILE:
        # The Ascend MLA layer's attention op splits PIECEWISE graphs like vLLM's attention
        # ops. vLLM fills splitting_ops only after this hook: fill them now, as upstream
        # vllm-ascend does, and add it.
        compilation_config.set_splitting_ops_for_v1(
            all2all_backend=parallel_config.all2all_backend,
            data_parallel_size=parallel_config.data_parallel_size)
        ops = compilation_config.splitting_ops
        if ops and MLA_OP not in ops:
            ops.append(MLA_OP)
    # The CUDA-only fusion passes must stay off on this platform.
    pass_config = compilation_config.pass_config
    for name, value in list(vars(pass_config).items()):
        if (name.startswith("fuse_") or name == "enable_qk_norm_rope_fusion") and \
                isinstance(value, (bool, type(None))):
            setattr(pass_config, name, False)
    # The Ascend kernels are CustomOps (forward_oot): keep them on unless the user said no.
    custom_ops = compilation_config.custom_ops
    if "none" not in custom_ops and "all" not in custom_ops:
        compilation_config.custom_ops.append("all")


def apply_graph_mode(vllm_config) -> None:
    """Settle the graph mode and the capture sizes before vLLM's dispatcher, compile sizes
    and the runner read them, and say what was decided."""
    from vllm.config import CompilationMode, CUDAGraphMode

    from vllm_ascend.attention.backend import AscendAttentionMetadataBuilder
    from vllm_ascend.attention.mla import AscendMLAMetadataBuilder
    from vllm_ascend.compilation.capture_sizes import (DEFAULT_STREAM_RESERVE,
                                                       lora_graph_cases, plan_capture_sizes)
    from vllm_ascend.compilation.modes import ModelKind, resolve_graph_mode

    cc, model_config = vllm_config.compilation_config, vllm_config.model_config
    if model_config is None:
        return
    requested = cc.cudagraph_mode
    kind = ModelKind.POOLING if model_config.runner_type == "pooling" else ModelKind.DECODER
    builder, backend = ((AscendMLAMetadataBuilder, "MLA attention") if model_config.use_mla
                        else (AscendAttentionMetadataBuilder, "attention"))
    mode, why = resolve_graph_mode(
        requested, builder._cudagraph_support, model_config.enforce_eager, kind,
        cc.mode == CompilationMode.VLLM_COMPILE, backend)
    cc.cudagraph_mode = mode
    if mode == CUDAGraphMode.NONE:
        cc.cudagraph_capture_sizes, cc.max_cudagraph_capture_size = [], 0
        logger.info("vllm-ascend: graph mode NONE (eager): %s", why)
        return
    parallel = vllm_config.parallel_config
    extra = vllm_config.additional_config or {}
    spec = vllm_config.speculative_config
    draft = getattr(spec, "draft_model_config", None) if spec is not None else None
    # Speculative decoding's verify step has 1 + K tokens per request.
    multiple = 1 + ((spec.num_speculative_tokens or 0) if spec is not None else 0)
    plan = plan_capture_sizes(
        list(cc.cudagraph_capture_sizes or []), mode,
        model_config.get_num_layers(parallel),
        tensor_parallel=parallel.tensor_parallel_size,
        # vLLM runs the data-parallel ranks of a dense model as independent engines: their
        # graphs capture no DP group (only MoE layers communicate across DP ranks).
        data_parallel=parallel.data_parallel_size if model_config.is_moe else 1,
        draft_layers=draft.get_num_layers(parallel) if draft is not None else 0,
        lora_cases=lora_graph_cases(vllm_config), multiple_of=multiple,
        stream_total=int(extra.get("graph_stream_total", device.current.stream_budget())),
        stream_reserve=int(extra.get("graph_stream_reserve", DEFAULT_STREAM_RESERVE)))
    if cc.cudagraph_capture_sizes and all(s % multiple for s in cc.cudagraph_capture_sizes):
        raise ValueError(
            f"None of the capture sizes {sorted(cc.cudagraph_capture_sizes)} is a multiple "
            f"of 1 + num_speculative_tokens = {multiple}: the verify step's batches have "
            f"{multiple} tokens per request, so no graph would ever replay. Use multiples of "
            f"{multiple} (e.g. --compilation-config '{{\"cudagraph_capture_sizes\": "
            f"{[multiple * n for n in (1, 2, 4, 8)]}}}'), or leave cudagraph_capture_sizes "
            "unset and vLLM picks them.")
    if plan.narrowed:
        why += f"; {plan.narrowed}"
    cc.cudagraph_mode = plan.mode
    cc.cudagraph_capture_sizes = plan.kept
    cc.max_cudagraph_capture_size = max(plan.kept, default=0)
    logger.info("vllm-ascend: graph mode %s (configured %s): %s", plan.mode.name,
                requested.name if requested is not None else "default", why)
    logger.info(
        "vllm-ascend: capture sizes %s kept, %s dropped (%s; %d streams per size, "
        "%d of %d usable streams)", plan.kept, plan.dropped or "none", plan.reason,
        plan.streams_per_size, plan.streams_needed, plan.usable_streams)
