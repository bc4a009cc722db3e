"""NPUPlatform: what vLLM asks of a device platform, answered for Ascend (npu or sim)."""

import os
import sys
import warnings
from typing import TYPE_CHECKING

import torch
from vllm_ascend.logger import get_logger
from vllm.platforms.interface import Platform, PlatformEnum

from vllm_ascend import device, patch
from vllm_ascend.attention import limits
from vllm_ascend.device import torch_npu

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = get_logger(__name__)
MLA_OP = "vllm::ascend_mla_attention"  # the Ascend MLA layer's attention op (ops/mla.py)
COMPILE_BACKEND = "vllm_ascend.compilation.compiler.AscendCompiler"  # FX passes, no codegen

ASCEND_BLOCK_SIZE = 128  # the paged-KV block size FIA is used with
FIA_DTYPES = (torch.bfloat16, torch.float16)  # what FIA computes in; the first is preferred
MULTIPROC_METHOD_ENV = "VLLM_WORKER_MULTIPROC_METHOD"
# The plugin's own settings (README), and the scripts' cache and venv locations.
PLUGIN_ENV_VARS = {"VLLM_ASCEND_DEVICE", "VLLM_ASCEND_SIM_MEMORY_GB", "VLLM_ASCEND_SIM_STREAMS",
                   "VLLM_ASCEND_SIM_DEVICES", "VLLM_ASCEND_SIM_NODE",
                   "VLLM_ASCEND_SIM_CALL_LOG", "VLLM_ASCEND_CACHE", "VLLM_ASCEND_VENV"}


def _scannable(module) -> bool:
    """Whether vLLM's kernel-override scan can read ``module``'s attributes."""
    try:
        return all(hasattr(vars(value), "get")
                   for value in list((getattr(module, "__dict__", None) or {}).values())
                   if hasattr(value, "__dict__"))
    except Exception:
        return False


class NPUPlatform(Platform):
    _enum = PlatformEnum.OOT
    # On the simulator tensors live on the CPU: vLLM builds torch.device(f"{device_name}:{i}").
    device_name: str = device.current.torch_device_type
    device_type: str = device.current.torch_device_type
    dispatch_key: str = device.current.dispatch_key
    dist_backend: str = device.current.dist_backend
    ray_device_key: str = "NPU"  # the resource Ray's NPU accelerator manager detects and names
    device_control_env_var: str = "ASCEND_RT_VISIBLE_DEVICES"
    # As for CUDA: Ray leaves a worker's visible devices alone, and vLLM gives each worker one of
    # the NPUs Ray reserved for it on its node (assigned_physical_gpu_ids, by local rank).
    ray_noset_device_env_vars: list[str] = ["RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES"]
    simple_compile_backend: str = "eager"  # no usable Inductor backend on the chip
    supported_quantization: list[str] = ["ascend"]  # ModelSlim checkpoints (quantization/)

    @property
    def supported_dtypes(self) -> list[torch.dtype]:
        return list(FIA_DTYPES)  # the fused infer attention operator takes these only

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        cls._check_device_open("get_device_name")
        return device.current.device_name()

    @classmethod
    def get_device_uuid(cls, device_id: int = 0) -> str:
        return f"{device.current.name}-{device_id}"

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        cls._check_device_open("get_device_total_memory")
        return device.current.total_memory()

    @staticmethod
    def _check_device_open(what: str) -> None:
        # vLLM asks these while it builds the engine's config, in the API server or LLM process,
        # and falls back to defaults when they raise (arg_utils.get_batch_defaults). Answering
        # would open a device context there, on device 0, which a worker owns (upstream
        # vllm-ascend does not implement get_device_total_memory for the same reason).
        if not device.current.device_open():
            raise RuntimeError(f"{what}: no device is open in this process (only workers open "
                               "one)")

    @classmethod
    def get_current_memory_usage(cls, dev=None) -> float:
        return float(device.current.memory_in_use())

    @classmethod
    def set_device(cls, dev: torch.device) -> None:
        torch_npu.npu.set_device(dev)

    @classmethod
    def manual_seed_all(cls, seed: int) -> None:
        torch.manual_seed(seed)

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return device.current.pin_memory_available()

    @classmethod
    def get_punica_wrapper(cls) -> str:
        return "vllm_ascend.lora.punica_npu.PunicaWrapperNPU"

    @classmethod
    def import_kernels(cls) -> None:
        # No vllm._C here: every kernel the plugin needs comes from device/. The CustomOp
        # overrides (vllm_ascend.ops) register when the worker's model runner module loads, as
        # upstream registers them in its worker: this method runs inside vLLM's layernorm
        # import (via vllm.kernels) when that is the first to call it, as the registry's
        # inspection of an EAGLE-3 head does, and the overrides import RMSNorm from it.
        return

    @classmethod
    def register_triton_kernel_overrides(cls) -> None:
        from vllm.triton_utils.dispatcher import _registry, register_kernels

        from vllm_ascend.worker import spec_kernels
        from vllm_ascend.worker.kernels import compute_slot_mapping

        overrides = {
            "vllm.v1.worker.block_table.ComputeSlotMappingKernel.kernel": compute_slot_mapping,
            **spec_kernels.kernel_overrides(), **device.current.v2_runner_kernels()}
        # Once per process (vLLM calls this for every engine; the overrides stay).
        if all(name in _registry for name in overrides):
            return
        # vLLM's registration scans every module's attributes and calls vars(value).get(...);
        # llvmlite's ffi.lib (imported with numba, for the n-gram proposer) answers vars() with
        # a function wrapper and the scan fails. Such modules hold no vLLM kernel: hide them
        # from sys.modules while it runs.
        with warnings.catch_warnings():  # the scans touch deprecated torch attributes
            warnings.simplefilter("ignore", FutureWarning)
            hidden = {name: module for name, module in list(sys.modules.items())
                      if not _scannable(module)}
            try:
                for name in hidden:
                    del sys.modules[name]
                register_kernels(overrides)
            finally:
                sys.modules.update(hidden)

    @classmethod
    def check_runner_kv_caches_multi_layer(cls) -> None:
        # A draft model's layers share indices with the target's. Harmless here: layers take
        # their caches by name from the forward context, and the runner's index-ordered list is
        # only cleared at shutdown.
        pass

    @classmethod
    def validate_request(cls, processed_inputs, params) -> None:
        from vllm_ascend.worker import choice

        choice.check_v2_request(params)

    @staticmethod
    def current_stream(device=None):
        # vLLM's current_stream() asks the platform, which resolves unknown names on the torch
        # device module: on the simulator that is torch.cpu, whose streams are not the device's.
        return torch_npu.npu.current_stream(device)

    @classmethod
    def get_compile_backend(cls) -> str:
        return COMPILE_BACKEND

    @classmethod
    def get_pass_manager_cls(cls) -> str:
        return "vllm_ascend.compilation.passes.AscendPassManager"

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None) -> str:
        if getattr(attn_selector_config, "use_mla", False):
            if getattr(attn_selector_config, "use_sparse", False):
                raise ValueError("sparse MLA (DeepSeek-V3.2) is not supported by vllm-ascend yet")
            return "vllm_ascend.attention.mla.AscendMLABackend"
        return "vllm_ascend.attention.backend.AscendAttentionBackend"

    @classmethod
    def get_mla_prefill_backend_cls(cls, mla_selector_config):
        from vllm_ascend.attention.mla import AscendMLAPrefillBackend

        return AscendMLAPrefillBackend

    @classmethod
    def use_custom_op_collectives(cls) -> bool:
        # As upstream vllm-ascend: collectives stay opaque vllm:: ops in the compiled pieces and
        # run through the device communicator (torch.distributed on the device group), which
        # ACL graphs capture. Traced inline, Dynamo would turn them into functional collectives.
        return True

    @classmethod
    def get_device_communicator_cls(cls) -> str:
        return device.current.communicator_cls() or super().get_device_communicator_cls()

    @classmethod
    def inference_mode(cls):
        return torch.inference_mode(mode=True)

    @classmethod
    def support_hybrid_kv_cache(cls) -> bool:
        return False

    def is_sleep_mode_available(self) -> bool:
        return True  # device_allocator/: CANN virtual memory keeps graphs' addresses

    @classmethod
    def pre_register_and_update(cls, parser=None) -> None:
        import vllm_ascend.quantization  # noqa: F401  (registers quantization="ascend")

        if parser is not None and parser.get_default("middleware") == []:  # `vllm serve`'s
            from vllm_ascend import serving

            # A request to a sleeping engine gets an error, not a wait (serving.py); the
            # user's --middleware values are appended to it.
            parser.set_defaults(middleware=[serving.MIDDLEWARE])

    @classmethod
    def check_and_update_config(cls, vllm_config: "VllmConfig") -> None:
        from vllm.config import CompilationMode

        model_config = vllm_config.model_config
        if model_config is not None and model_config.dtype not in FIA_DTYPES:
            raise ValueError(
                f"dtype {str(model_config.dtype).removeprefix('torch.')} is not supported on "
                "Ascend: the fused infer attention operator computes in bfloat16 or float16 only. "
                "Pass dtype='bfloat16' (--dtype bfloat16), or leave it 'auto', which runs a "
                "float32 checkpoint in bfloat16.")
        if model_config is not None:
            limits.check(vllm_config)  # the attention operators' shapes, before any worker
            cls._select_quantization(vllm_config)
        if model_config is not None and model_config.enable_sleep_mode:
            cls._select_sleep_mode_backend(model_config)
        parallel_config = vllm_config.parallel_config
        # The engine core cleans up the device at shutdown even when its workers are other
        # processes (tensor parallelism): it needs the device's process set-up too.
        device.current.prepare_process()
        if parallel_config.worker_cls == "auto":
            parallel_config.worker_cls = "vllm_ascend.worker.worker.NPUWorker"

        cache_config = vllm_config.cache_config
        if cache_config is not None and not cache_config.user_specified_block_size:
            cache_config.block_size = ASCEND_BLOCK_SIZE

        scheduler_config = vllm_config.scheduler_config
        cls._check_speculative_config(vllm_config.speculative_config, parallel_config)
        cls._check_lora_config(vllm_config)
        if vllm_config.speculative_config is not None and scheduler_config.async_scheduling:
            # Under async speculative decoding the host's KV lengths are only an upper bound
            # (vLLM corrects them on the device); FIA takes them as host lists and needs them
            # exact.
            logger.info("vllm-ascend: async scheduling turned off: speculative decoding needs "
                        "exact host KV lengths for the fused infer attention operator")
            scheduler_config.async_scheduling = False

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
            compilation_config.backend = cls.simple_compile_backend
        compilation_config.cudagraph_num_of_warmups = max(
            1, compilation_config.cudagraph_num_of_warmups)
        cls._apply_graph_mode(vllm_config)
        from vllm_ascend.worker import choice

        logger.info("vllm-ascend: model runner %s", choice.describe(vllm_config))  # (the mode set)
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
        os.environ.setdefault("VLLM_DISABLE_SHARED_EXPERTS_STREAM", "1")
        cls._spawn_if_fork_is_unsafe()
        patch.apply()

    @classmethod
    def _select_sleep_mode_backend(cls, model_config) -> None:
        """vLLM's default sleep-mode backend is CUDA's cumem; Ascend's is device_allocator/."""
        from vllm_ascend.device_allocator import sleep

        sleep.register()
        if model_config.sleep_mode_backend == "cumem":
            model_config.sleep_mode_backend = sleep.NAME
        elif model_config.sleep_mode_backend != sleep.NAME:
            raise ValueError(
                f"sleep_mode_backend {model_config.sleep_mode_backend!r} is not available on "
                f"Ascend; leave it unset (Ascend's is {sleep.NAME!r}).")
        logger.info("vllm-ascend: sleep mode on: weights, KV cache and runtime buffers in "
                    "CANN virtual memory, released by sleep() and mapped again at the same "
                    "addresses by wake_up()")

    @classmethod
    def _select_quantization(cls, vllm_config: "VllmConfig") -> None:
        """A ModelSlim export (quant_model_description.json beside the weights) runs quantized
        without a flag, as upstream detects it; vLLM built no quantization config for it, since
        its config.json names none."""
        from vllm_ascend import quantization

        model_config = vllm_config.model_config
        if model_config.quantization is None and quantization.detect(model_config.model):
            from vllm.config import VllmConfig

            model_config.quantization = quantization.METHOD
            vllm_config.quant_config = VllmConfig._get_quantization_config(
                model_config, vllm_config.load_config)
        config = vllm_config.quant_config
        if isinstance(config, quantization.AscendModelSlimConfig):
            logger.info("vllm-ascend: ModelSlim checkpoint (quantization='%s'), layer types %s",
                        quantization.METHOD, ", ".join(sorted(config.types())))

    @classmethod
    def _spawn_if_fork_is_unsafe(cls) -> None:
        """vLLM forks its engine and worker processes by default and forces spawn only for CUDA
        and XPU (``_maybe_force_spawn``); do the same for this device, before any is started."""
        reason = device.current.fork_unsafe_reason()
        current = os.environ.get(MULTIPROC_METHOD_ENV)
        if reason is not None and current != "spawn":
            os.environ[MULTIPROC_METHOD_ENV] = "spawn"
            logger.info("vllm-ascend: engine and worker processes start with 'spawn'%s: %s",
                        f" ({MULTIPROC_METHOD_ENV}={current} overridden)" if current else "",
                        reason)
        if os.environ.get(MULTIPROC_METHOD_ENV) == "spawn":
            cls._spawn_without_a_pseudo_main()

    @staticmethod
    def _spawn_without_a_pseudo_main() -> None:
        """multiprocessing's spawn re-runs the parent's main script, from its ``__file__``, in
        every child. A script read from standard input (``python - <<EOF``) has the pseudo-path
        ``<stdin>``, so the engine core died with FileNotFoundError before it started. Such a
        script cannot be re-run: its children start without it, as under ``python -c`` (whose
        main has no ``__file__``), which the engine core and workers do not need."""
        main = sys.modules.get("__main__")
        path = getattr(main, "__file__", None)
        if (isinstance(path, str) and path.startswith("<") and path.endswith(">")
                and getattr(main, "__spec__", None) is None):
            del main.__file__
            logger.info("vllm-ascend: the main script is %s, which spawned processes cannot "
                        "re-run: they start without it (as under python -c)", path)

    @classmethod
    def opaque_attention_op(cls) -> bool:
        # Attention is one opaque custom op: a splitting point for PIECEWISE graphs, and the
        # place where FIA reads the step's host lists.
        return True

    @classmethod
    def support_static_graph_mode(cls) -> bool:
        return True

    @classmethod
    def get_static_graph_wrapper_cls(cls) -> str:
        return "vllm_ascend.compilation.acl_graph.ACLGraphWrapper"

    def graph_pool_handle(self):
        # Upstream reaches torch.npu through Platform.__getattr__; the simulator's device type
        # is "cpu", so name it.
        return torch_npu.npu.graph_pool_handle()

    @classmethod
    def _check_speculative_config(cls, spec, parallel) -> None:
        if spec is not None and parallel.pipeline_parallel_size > 1:
            # vLLM 0.32 makes the drafter on the last stage only, yet every stage's attention
            # metadata reads it (GPUModelRunner._build_attention_metadata): the first stage
            # fails in its first forward with an AttributeError, on any device.
            raise ValueError(
                f"Speculative decoding ({spec.method}) does not run with "
                f"pipeline_parallel_size={parallel.pipeline_parallel_size} in vLLM 0.32: the "
                "drafter exists on the last pipeline stage only, and the other stages fail in "
                "their first step. Split the model with tensor_parallel_size instead, or turn "
                "speculative decoding off.")

    @classmethod
    def _check_lora_config(cls, vllm_config: "VllmConfig") -> None:
        """LoRA where the NPU punica wrapper (vllm_ascend/lora) has no path: refused."""
        if vllm_config.lora_config is None or vllm_config.model_config is None:
            return
        fix = "Serve without --enable-lora, or merge the adapter into the weights first."
        if vllm_config.model_config.use_mla:
            raise ValueError("LoRA on an MLA model (DeepSeek) is not supported by vllm-ascend "
                             "yet: the Ascend MLA layer absorbs kv_b_proj's weights into its "
                             "attention (W_UK, W_UV), past vLLM's LoRA wrappers. " + fix)
        if vllm_config.model_config.is_moe:
            raise ValueError("LoRA on a mixture-of-experts model is not supported by "
                             "vllm-ascend yet: the NPU punica wrapper has no fused-MoE LoRA. "
                             + fix)
        if vllm_config.speculative_config is not None:
            raise ValueError("LoRA with speculative decoding is not supported by vllm-ascend "
                             "yet: the drafter's graphs with adapters are untested. Turn "
                             "speculative decoding off, or " + fix[0].lower() + fix[1:])

    @classmethod
    def _apply_graph_mode(cls, vllm_config: "VllmConfig") -> None:
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

    @classmethod
    def validate_environ(cls, hard_fail: bool) -> None:
        # Upstream flags every VLLM_* variable it does not know, the plugin's own included.
        from vllm import envs

        for name in os.environ:
            if name.startswith("VLLM_") and name not in envs.environment_variables and \
                    name not in PLUGIN_ENV_VARS:
                if hard_fail:
                    raise ValueError(f"Unknown vLLM environment variable detected: {name}")
                logger.warning("Unknown vLLM environment variable detected: %s", name)

    @classmethod
    def log_warnings(cls) -> None:
        # Not the device's name: asking opens a device context, which only workers do.
        logger.info("vllm-ascend: device backend %s: %s", device.current.name,
                    device.current.reason)
