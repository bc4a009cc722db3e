"""NPUWorker: upstream's GPU worker with Ascend device set-up, memory budget and warm-up."""

import contextlib
import functools
import gc
import os
import weakref

import torch
from vllm import envs
from vllm.config import CUDAGraphMode
from vllm_ascend.logger import get_logger
from vllm.platforms import current_platform
from vllm.platforms.interface import set_assigned_physical_gpu_ids
from vllm.utils.mem_utils import MemorySnapshot
from vllm.utils.torch_utils import OMP_NUM_THREADS_SET_BY_VLLM, set_random_seed
from vllm.v1.worker.gpu_worker import Worker, init_worker_distributed_environment
from vllm.v1.worker.utils import request_memory
from vllm.v1.worker.worker_base import CompilationTimes

from vllm_ascend import device, patch, plan
from vllm_ascend.device import torch_npu
from vllm_ascend.device_allocator import sleep
from vllm_ascend.device_allocator.vmm import NPUMemAllocator
from vllm_ascend.ops.fused_moe.method import first_moe_layer, step_comm
from vllm_ascend.worker import choice
from vllm_ascend.worker.model_runner import NPUModelRunner
from vllm_ascend.worker.summary import summary as engine_summary
from vllm_ascend.worker.v2.model_runner import NPUModelRunnerV2

logger = get_logger(__name__)
GiB = float(1 << 30)


def request_device_memory(snapshot: MemorySnapshot, cache_config, npu: int) -> int:
    """total x gpu_memory_utilization, which must be free at start-up (upstream's check), said
    of NPU ``npu`` (vLLM names the torch device, "cpu" on the simulator), with what holds the
    rest named."""
    try:
        return request_memory(snapshot, cache_config)
    except ValueError:
        util = cache_config.gpu_memory_utilization
        raise ValueError(
            f"Free memory on NPU {npu} ({snapshot.free_memory / GiB:.2f}/"
            f"{snapshot.total_memory / GiB:.2f} GiB) at start-up is less than "
            f"gpu_memory_utilization {util} asks for ({snapshot.total_memory * util / GiB:.2f} "
            f"GiB). Of the device's memory, {snapshot.non_torch_memory / GiB:.2f} GiB is held "
            "outside torch's allocator: by other processes on this NPU (another engine?), the "
            "runtime, and 2 x HCCL_BUFFSIZE MB per communicator of this worker. Lower "
            "--gpu-memory-utilization, stop what else runs on the NPU, or lower HCCL_BUFFSIZE."
        ) from None


class NPUWorker(Worker):
    graph_memory_estimate = 0  # bytes kept from the KV cache for the graphs (profiled)
    graph_memory = 0  # bytes the capture took
    kv_cache_bytes = 0

    def init_device(self):
        # Upstream raises for any device type but cuda; the device binding and the memory
        # snapshot are its cuda branch's.
        backend = device.current
        backend.prepare_process()
        patch.apply()  # torch.accelerator reaches the device (a spawned worker's first call)
        index = self._visible_device_index()
        self.device = backend.torch_device(index)
        torch_npu.npu.set_device(index)
        backend.hold_device()
        # Released at shutdown, or when a worker whose start failed (never shut down) is collected.
        self._device_hold = weakref.finalize(self, backend.release_device)
        self._check_startup_plan(backend)  # before the communicators: a refusal allocates none
        init_worker_distributed_environment(self.vllm_config, self.rank,
                                            self.distributed_init_method, self.local_rank,
                                            current_platform.dist_backend)
        set_random_seed(self.model_config.seed)
        # The snapshot follows the communicators, whose buffers are device memory outside
        # torch's allocator: the KV-cache budget is profiled from the device's free memory.
        gc.collect()
        torch.accelerator.empty_cache()
        self.init_snapshot = MemorySnapshot(device=self.device)
        self.requested_memory = request_device_memory(
            self.init_snapshot, self.cache_config,
            current_platform.device_id_to_physical_device_id(self.local_rank))
        self._init_workspace_and_model_runner()

    def _check_startup_plan(self, backend) -> None:
        """The rank's plan (vllm_ascend/plan.py) from the config, before any weight loads:
        logged, and refused with the fix when it cannot fit."""
        self.startup_plan = plan.startup_plan(self.vllm_config, backend,
                                              backend.total_memory())
        for line in self.startup_plan.lines():
            logger.info("vllm-ascend: plan of rank %d: %s", self.rank, line)
        problems = self.startup_plan.problems()
        if problems:
            self._device_hold()  # another engine in this process may take the device
            raise plan.StartupPlanError(
                f"vllm-ascend: this engine cannot start on {backend.name} device "
                f"{self.local_rank} (rank {self.rank}): " + "; ".join(problems) + ".")

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
        self._remove_bytecode_hooks()
        super().shutdown()
        if self.model_config.enable_sleep_mode and "sleep_allocator" in self.__dict__:
            # vLLM's cumem allocator is released here too (release_pools).
            released = self.sleep_allocator.release()
            if released:
                logger.info("vllm-ascend: shutdown released %.3f GiB of sleep-mode memory that "
                            "the process still referenced", released / GiB)
        if hasattr(self, "_device_hold"):
            self._device_hold()

    def _remove_bytecode_hooks(self) -> None:
        """vLLM's compiled models register a global Dynamo bytecode hook (a bound method) and
        never remove it, so a shut-down engine's model stays alive in its process, weights and
        all (and with sleep mode, its device memory): an RL loop or a test that makes engines
        one after another would keep every earlier one's."""
        runner = getattr(self, "model_runner", None)
        models = [getattr(runner, "model", None), getattr(getattr(runner, "drafter", None),
                                                          "model", None)]
        for model in models:
            for module in model.modules() if isinstance(model, torch.nn.Module) else ():
                handle = getattr(module, "_bytecode_hook_handle", None)
                if handle is not None:
                    handle.remove()

    def _make_model_runner(self) -> NPUModelRunner | NPUModelRunnerV2:
        # Upstream builds vLLM's runners; the plugin's are theirs on Ascend (worker/choice.py).
        logger.info("vllm-ascend: model runner %s", choice.describe(self.vllm_config))
        if self.use_v2_model_runner:
            return NPUModelRunnerV2(self.vllm_config, self.device)
        return NPUModelRunner(self.vllm_config, self.device)

    def _maybe_get_memory_pool_context(self, tag: str):
        # Upstream's sleep-mode allocator is CUDA's cumem; Ascend's is device_allocator/.
        if not self.model_config.enable_sleep_mode:
            return contextlib.nullcontext()
        sleep.register()  # the backend vLLM's worker builds at the first sleep
        return self.sleep_allocator.use_memory_pool(tag)

    def execute_model(self, scheduler_output, *args, **kwargs):
        # A step on memory that sleeps would read unmapped addresses (on the chip, an AI core
        # exception at the next synchronize): say which wake-up is missing instead.
        asleep = self.sleep_allocator.asleep_tags() if self.model_config.enable_sleep_mode \
            else ()
        if asleep:
            raise RuntimeError(
                f"The engine ran a step while its {', '.join(asleep)} memory is asleep: call "
                "wake_up() (or wake_up(tags=[...]) for each) first.")
        return super().execute_model(scheduler_output, *args, **kwargs)

    @functools.cached_property
    def sleep_allocator(self) -> NPUMemAllocator:
        """This worker's sleep-mode memory."""
        return NPUMemAllocator()

    @property
    def sleep_mode_backend(self):
        # vLLM's factory builds the backend without arguments: give it this worker's memory.
        backend = super().sleep_mode_backend
        backend.allocator = self.sleep_allocator
        return backend

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

    def determine_available_memory(self) -> int:
        available = super().determine_available_memory()
        # What the profile found outside torch's allocator (communication buffers, the
        # runtime's), for the start-up log line.
        self._outside_torch = MemorySnapshot(device=self.device).non_torch_memory
        graphs = 0 if self.cache_config.kv_cache_memory_bytes else self._reserve_graph_memory()
        available -= graphs
        if available <= 0 and not self.cache_config.kv_cache_memory_bytes:
            setting = device.current.memory_setting()
            hint = f", set {setting} higher" if setting else ""
            raise ValueError(
                f"No memory left for the KV cache on the {device.current.name} device: "
                f"{self.requested_memory / GiB:.2f} GiB budget "
                f"({self.init_snapshot.total_memory / GiB:.2f} GiB x gpu_memory_utilization "
                f"{self.cache_config.gpu_memory_utilization}) minus "
                f"{self.total_consumed / GiB:.2f} GiB the engine took from the device's free "
                f"memory by the end of its profile run (weights "
                f"{self.model_runner.model_memory_usage / GiB:.2f} GiB), "
                f"{self.peak_activation_memory / GiB:.2f} GiB of activation peak and "
                f"{graphs / GiB:.2f} GiB kept for the graphs. "
                f"Raise gpu_memory_utilization{hint}, or lower max_num_batched_tokens, or "
                "capture fewer graphs.")
        return available

    def _reserve_graph_memory(self) -> int:
        """The graphs' memory, kept from the KV cache so that capture finds it (vLLM subtracts
        its estimate on CUDA and XPU only; a chip ran out of memory during capture, ACL error
        507015, where it was not). vLLM's switch applies: VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS
        =0 reserves nothing."""
        if self.compilation_config.cudagraph_mode == CUDAGraphMode.NONE:
            return 0
        self.graph_memory_estimate = self.model_runner.profile_cudagraph_memory()
        if not envs.VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS:
            logger.warning("vllm-ascend: graph memory is not kept from the KV cache "
                           "(VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0): capture may run out "
                           "of device memory")
            return 0
        return self.graph_memory_estimate

    def initialize_from_config(self, kv_cache_config) -> None:
        super().initialize_from_config(kv_cache_config)
        # One backing allocation, which every KV cache tensor spans (a hybrid model's groups
        # overlay it: attention/hybrid.py).
        self.kv_cache_bytes = max((t.size for t in kv_cache_config.kv_cache_tensors), default=0)
        logger.info(
            "vllm-ascend: device %s (%s), memory %.2f GiB: weights %.2f GiB, activation peak "
            "%.2f GiB, graphs %.2f GiB, outside torch %.2f GiB, KV cache %d blocks x %d tokens "
            "(%.2f GiB)", device.current.name, device.current.device_name(),
            self.init_snapshot.total_memory / GiB, self.model_runner.model_memory_usage / GiB,
            getattr(self, "peak_activation_memory", 0) / GiB,
            self.graph_memory_estimate / GiB,
            getattr(self, "_outside_torch", self.init_snapshot.non_torch_memory) / GiB,
            kv_cache_config.num_blocks, self.cache_config.block_size, self.kv_cache_bytes / GiB)

    def startup_figures(self) -> dict:
        """The rank's plan and what it measured (bytes), for ``collective_rpc``: weights,
        activations (the profile run's memory beyond the weights), graphs (captured), KV cache,
        and the graphs captured per runtime mode."""
        memory = self.startup_plan.memory
        planned = {"weights": memory.weights, "activations": memory.activations,
                   "graphs": memory.graphs, "kv_cache": memory.kv_cache,
                   "kv_block_bytes": memory.block_bytes, "communicators": memory.communicators,
                   "graph_counts": dict(self.startup_plan.graphs.graphs),
                   "streams": self.startup_plan.graphs.streams}
        weights = self.model_runner.model_memory_usage
        profiled = hasattr(self, "total_consumed")  # (not with kv_cache_memory_bytes)
        measured = {"weights": weights,
                    "activations": (self.total_consumed - weights + self.peak_activation_memory
                                    if profiled else None),
                    "graphs": self.graph_memory, "kv_cache": self.kv_cache_bytes,
                    "communicators": self.init_snapshot.non_torch_memory,
                    "graph_memory_estimate": self.graph_memory_estimate,
                    "graph_counts": dict(self.model_runner.graph_state.captured),
                    "streams": device.current.streams_in_use()}
        return {"planned": planned, "measured": measured}

    def _log_plan_against_measurement(self) -> None:
        if self.cache_config.kv_cache_memory_bytes:
            return  # the KV cache was sized by hand, not profiled
        figures = self.startup_figures()
        parts = []
        for name in ("weights", "activations", "graphs", "kv_cache"):
            planned, measured = figures["planned"][name], figures["measured"][name]
            if planned is None:
                continue
            off = "" if plan.within(name, planned, measured) else " (outside the plan's margin)"
            parts.append(f"{name.replace('_', ' ')} {planned / GiB:.2f}/{measured / GiB:.2f} "
                         f"GiB{off}")
        logger.info("vllm-ascend: plan/measured of rank %d: %s", self.rank, ", ".join(parts))

    def graph_counts(self) -> dict:
        """This worker's ACL graphs, captured and replayed per runtime mode, and the device's
        streams in use: for ``collective_rpc("graph_counts")``, which `vllm serve` exposes in
        its dev mode (VLLM_SERVER_DEV_MODE=1) as POST /collective_rpc."""
        return {**self.model_runner.graph_state.counts(),
                "streams_in_use": device.current.streams_in_use()}

    def summary(self) -> dict:
        """What this engine runs (worker/summary.py), for ``collective_rpc("summary")``."""
        return engine_summary(self.vllm_config)

    def recent_steps(self, clear: bool = False) -> list[dict]:
        """This worker's latest steps (up to 1024) as the runner padded them: runtime mode,
        scheduled tokens and requests, and the tokens the forward ran (with data parallelism,
        the size the DP ranks agreed on). For ``collective_rpc("recent_steps")``; ``clear``
        starts a new record."""
        steps = self.model_runner.graph_state.recent_steps
        moe = first_moe_layer(self.model_runner.get_model())
        record = [{"mode": s.mode.name, "num_tokens": s.num_tokens, "num_reqs": s.num_reqs,
                   "num_tokens_padded": s.num_tokens_padded,
                   "moe_comm": step_comm(moe, s.num_tokens_padded)} for s in steps]
        if clear:
            steps.clear()
        return record

    def device_memory(self) -> dict:
        """This worker's device memory now, for ``collective_rpc("device_memory")``: bytes in
        use on its device, and with sleep mode, its pools' bytes per tag (mapped, asleep) and
        the bytes per tag kept in host memory while asleep."""
        free, total = torch_npu.npu.mem_get_info()
        sleep_mode = self.model_config.enable_sleep_mode
        pools = self.sleep_allocator.usage_by_tag() if sleep_mode else {}
        return {"in_use": total - free, "total": total,
                "sleep_mode": {tag: {"mapped": mapped, "asleep": asleep}
                               for tag, (mapped, asleep) in pools.items()},
                "host_copies": self.sleep_allocator.host_copies() if sleep_mode else {}}

    def device_binding(self) -> dict:
        """The device this worker opened (physical id on its node) and its process, for
        ``collective_rpc("device_binding")``."""
        return {"device": current_platform.device_id_to_physical_device_id(self.local_rank),
                "pid": os.getpid()}

    def compile_or_warm_up_model(self) -> CompilationTimes:
        # Upstream's version warms CUDA kernels (FlashInfer, DeepGEMM) and probes CUDA memory.
        if not self.model_config.enforce_eager:
            try:
                self.graph_memory = self.model_runner.capture_model()
            except BaseException:
                # vLLM never shuts down an engine whose start failed: an engine core in the
                # caller's process would keep the graphs captured so far (and their streams),
                # its model and its device until the traceback is collected.
                self.shutdown()
                raise
        self._log_plan_against_measurement()
        set_random_seed(self.model_config.seed)
        return CompilationTimes(language_model=self.compilation_config.compilation_time,
                                encoder=self.compilation_config.encoder_compilation_time)
