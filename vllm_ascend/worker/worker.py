"""NPUWorker: upstream's GPU worker with Ascend device set-up, memory budget and warm-up."""

import contextlib
import os

import torch
from vllm_ascend.logger import get_logger
from vllm.platforms import current_platform
from vllm.platforms.interface import set_assigned_physical_gpu_ids
from vllm.utils.torch_utils import OMP_NUM_THREADS_SET_BY_VLLM, set_random_seed
from vllm.v1.worker.gpu_worker import Worker, init_worker_distributed_environment
from vllm.v1.worker.worker_base import CompilationTimes

from vllm_ascend import device
from vllm_ascend.device import torch_npu
from vllm_ascend.worker.model_runner import NPUModelRunner

logger = get_logger(__name__)
GiB = float(1 << 30)


def _model_bytes(model: torch.nn.Module) -> int:
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


class NPUWorker(Worker):
    def init_device(self):
        # Upstream raises for any device type but cuda; the device binding is its cuda branch's.
        backend = device.current
        backend.prepare_process()
        index = self._visible_device_index()
        self.device = backend.torch_device(index)
        torch_npu.npu.set_device(index)
        init_worker_distributed_environment(self.vllm_config, self.rank,
                                            self.distributed_init_method, self.local_rank,
                                            current_platform.dist_backend)
        set_random_seed(self.model_config.seed)
        self._init_workspace_and_model_runner()

    def _visible_device_index(self) -> int:
        """This worker's device, as vLLM binds it on a platform without CUDA's
        set_device_index: each data-parallel engine is assigned its shard of the node's devices
        (``assigned_physical_gpu_ids``: DP engine d of a TP x PP world w gets d*w .. d*w+w-1),
        and local rank r takes the r-th of them, through the visible list."""
        assigned = self.parallel_config.assigned_physical_gpu_ids
        if assigned is not None:
            set_assigned_physical_gpu_ids(assigned)
        return current_platform.logical_device_id_to_visible_device_id(self.local_rank)

    def shutdown(self) -> None:
        super().shutdown()
        device.current.release_device()

    def _make_model_runner(self) -> NPUModelRunner:
        return NPUModelRunner(self.vllm_config, self.device)

    def _maybe_get_memory_pool_context(self, tag: str):
        # Upstream's sleep-mode allocator is CUDA's cumem; there is none here.
        return contextlib.nullcontext()

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        super().load_model(load_dummy_weights=load_dummy_weights)
        # Upstream then drops torch to 1 thread for serving; where the host computes the
        # device's work (the simulator), it keeps every core unless the user set
        # OMP_NUM_THREADS themselves.
        user_set = ("OMP_NUM_THREADS" in os.environ
                    and os.environ.get(OMP_NUM_THREADS_SET_BY_VLLM) != "1")
        threads = device.current.host_compute_threads()
        if threads is not None and not user_set:
            torch.set_num_threads(threads)
            logger.info("vllm-ascend: the host computes the device's work: %d torch threads "
                        "(set OMP_NUM_THREADS to choose another number)", torch.get_num_threads())

    @torch.inference_mode()
    def determine_available_memory(self) -> int:
        # Upstream reads CUDA memory snapshots taken in its init_device. Here the device memory
        # is an account, like a chip's HBM: budget = total * gpu_memory_utilization, minus the
        # weights and the activation peak of a full batch (the profile run).
        backend = device.current
        total = backend.total_memory()
        weights = _model_bytes(self.model_runner.get_model())
        activations = backend.peak_memory_of(self.model_runner.profile_run)
        self._memory_account = (total, weights, activations)
        if self.cache_config.kv_cache_memory_bytes:
            return self.cache_config.kv_cache_memory_bytes
        budget = int(total * self.cache_config.gpu_memory_utilization)
        available = budget - weights - activations
        if available <= 0:
            setting = backend.memory_setting()
            hint = f", set {setting} higher" if setting else ""
            raise ValueError(
                f"No memory left for the KV cache on the {backend.name} device: "
                f"{budget / GiB:.2f} GiB budget ({total / GiB:.2f} GiB x "
                f"gpu_memory_utilization {self.cache_config.gpu_memory_utilization}) minus "
                f"weights {weights / GiB:.2f} GiB and activations {activations / GiB:.2f} GiB. "
                f"Raise gpu_memory_utilization{hint}, or lower max_num_batched_tokens.")
        return available

    def initialize_from_config(self, kv_cache_config) -> None:
        super().initialize_from_config(kv_cache_config)
        total, weights, activations = getattr(self, "_memory_account", (
            device.current.total_memory(), _model_bytes(self.model_runner.get_model()), 0))
        logger.info(
            "vllm-ascend: device %s (%s), memory %.2f GiB: weights %.2f GiB, activations "
            "%.2f GiB, KV cache %d blocks x %d tokens (%.2f GiB)", device.current.name,
            device.current.device_name(), total / GiB, weights / GiB, activations / GiB,
            kv_cache_config.num_blocks, self.cache_config.block_size,
            sum(t.size for t in kv_cache_config.kv_cache_tensors) / GiB)

    def graph_counts(self) -> dict:
        """This worker's ACL graphs, captured and replayed per runtime mode, and the device's
        streams in use: for ``collective_rpc("graph_counts")``, which `vllm serve` exposes in
        its dev mode (VLLM_SERVER_DEV_MODE=1) as POST /collective_rpc."""
        return {**self.model_runner.graph_state.counts(),
                "streams_in_use": device.current.streams_in_use()}

    def device_binding(self) -> dict:
        """The device this worker opened (physical id on its node) and its process, for
        ``collective_rpc("device_binding")``."""
        return {"device": current_platform.device_id_to_physical_device_id(self.local_rank),
                "pid": os.getpid()}

    def compile_or_warm_up_model(self) -> CompilationTimes:
        # Upstream's version warms CUDA kernels (FlashInfer, DeepGEMM) and probes CUDA memory.
        if not self.model_config.enforce_eager:
            self.model_runner.capture_model()
        set_random_seed(self.model_config.seed)
        return CompilationTimes(language_model=self.compilation_config.compilation_time,
                                encoder=self.compilation_config.encoder_compilation_time)
