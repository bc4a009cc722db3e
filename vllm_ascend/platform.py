"""NPUPlatform: what vLLM asks of a device platform, answered for Ascend (npu or sim)."""

import os
import sys
import warnings
from typing import TYPE_CHECKING

import torch
from vllm_ascend.logger import get_logger
from vllm.platforms.interface import Platform, PlatformEnum

from vllm_ascend import device, patch
from vllm_ascend.attention import hybrid, limits
from vllm_ascend.compilation.settings import COMPILE_BACKEND, SIMPLE_COMPILE_BACKEND
from vllm_ascend.device import torch_npu

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = get_logger(__name__)

ASCEND_BLOCK_SIZE = 128  # the paged-KV block size FIA is used with
FIA_DTYPES = (torch.bfloat16, torch.float16)  # what FIA computes in; the first is preferred
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
    simple_compile_backend: str = SIMPLE_COMPILE_BACKEND  # no usable Inductor on the chip
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
    def _align_hybrid_block_size(cls, vllm_config, backend_cls) -> None:
        # A hybrid model's attention blocks and Gated DeltaNet states share the KV cache in two
        # lanes, not vLLM's pages (attention/hybrid.py): its block size follows from that.
        layout = hybrid.apply_layout(vllm_config,
                                     (limits.BLOCK_SIZE_ALIGN, limits.BLOCK_SIZE_BELOW))
        logger.info("vllm-ascend: attention blocks of %d tokens, so that one block's K is one "
                    "Gated DeltaNet state (%d bytes): the two share the KV cache's slots",
                    layout.block_size, layout.lane_bytes)

    # Whether the config check_and_update_config settled last has Gated DeltaNet layers: vLLM
    # asks support_hybrid_kv_cache right after it, without the config.
    _gdn_model = False

    @classmethod
    def support_hybrid_kv_cache(cls) -> bool:
        # vLLM's hybrid KV cache manager: for Gated DeltaNet models only, whose states share the
        # KV cache with attention (attention/hybrid.py). Sliding-window families keep one group.
        return cls._gdn_model

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
        """Each area settles its part of the config (and refuses what it cannot run, with the
        fix), in the order vLLM needs them."""
        from vllm_ascend.compilation import settings
        from vllm_ascend.lora.config import check_lora_config
        from vllm_ascend.worker import choice, processes, speculative

        # First the process's set-up, so that a config refused below leaves the process able
        # to clean up as vLLM does (its cleanup reaches torch.accelerator). The engine core
        # cleans up the device at shutdown even when its workers are other processes (tensor
        # parallelism): it needs the device's process set-up too.
        patch.apply()
        device.current.prepare_process()
        model_config = vllm_config.model_config
        if model_config is not None and model_config.dtype not in FIA_DTYPES:
            raise ValueError(
                f"dtype {str(model_config.dtype).removeprefix('torch.')} is not supported on "
                "Ascend: the fused infer attention operator computes in bfloat16 or float16 only. "
                "Pass dtype='bfloat16' (--dtype bfloat16), or leave it 'auto', which runs a "
                "float32 checkpoint in bfloat16.")
        if model_config is not None:
            from vllm_ascend.quantization import select

            limits.check(vllm_config)  # the attention operators' shapes, before any worker
            cls._gdn_model = limits.serves_gated_deltanet(model_config)
            if cls._gdn_model and hybrid.without_prefix_caching(vllm_config):
                logger.info("vllm-ascend: prefix caching is off for %s: its Gated DeltaNet "
                            "states are not cached by prefix on Ascend yet",
                            model_config.architecture)
            select.select(vllm_config)
        if model_config is not None and model_config.enable_sleep_mode:
            from vllm_ascend.device_allocator import sleep

            sleep.select_backend(model_config)
        parallel_config = vllm_config.parallel_config
        if parallel_config.worker_cls == "auto":
            parallel_config.worker_cls = "vllm_ascend.worker.worker.NPUWorker"
        cache_config = vllm_config.cache_config
        if cache_config is not None and not cache_config.user_specified_block_size:
            cache_config.block_size = ASCEND_BLOCK_SIZE
        speculative.check_speculative_config(vllm_config.speculative_config, parallel_config)
        check_lora_config(vllm_config)
        speculative.keep_host_lengths_exact(vllm_config)
        settings.apply(vllm_config)  # compile backend, graph mode, capture sizes, CustomOps
        logger.info("vllm-ascend: model runner %s", choice.describe(vllm_config))  # (the mode set)
        os.environ.setdefault("VLLM_DISABLE_SHARED_EXPERTS_STREAM", "1")
        processes.spawn_if_fork_is_unsafe()

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
