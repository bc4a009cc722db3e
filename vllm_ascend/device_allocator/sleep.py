"""vLLM's sleep-mode backend on Ascend (vLLM's hook: ``SleepModeBackendFactory``): the
weights, KV cache and runtime buffers live in NPUMemAllocator's pools (the worker's
``_maybe_get_memory_pool_context``), released at sleep and mapped again at the same addresses
at wake-up, so the captured graphs replay as they are."""

from vllm.device_allocator.sleep_mode_backend import SleepModeBackend, SleepModeBackendFactory

from vllm_ascend.device_allocator.vmm import NPUMemAllocator
from vllm_ascend.logger import get_logger

logger = get_logger(__name__)
NAME = "ascend"
GiB = float(1 << 30)
# Kept across every level, as vLLM's cumem backend keeps them: the state built with the KV
# cache (block tables and the like) and graph memory.
ALWAYS_KEPT = ("runtime", "cudagraph")


def _usage(allocator: NPUMemAllocator, index: int) -> str:
    parts = [f"{tag} {usage[index] / GiB:.3f} GiB"
             for tag, usage in sorted(allocator.usage_by_tag().items()) if usage[index]]
    return ", ".join(parts) or "nothing"


class AscendSleepBackend(SleepModeBackend):
    """The worker hands it its allocator (``allocator``) when vLLM's worker builds it."""

    allocator: NPUMemAllocator

    def suspend(self, level: int = 1) -> None:
        self._state = "SUSPENDED"
        allocator = self.allocator
        kept = ("weights", *ALWAYS_KEPT) if level == 1 else ALWAYS_KEPT
        allocator.sleep(offload_tags=kept)
        logger.info("vllm-ascend: sleep level %d: device memory released (%s), %s copied to host "
                    "memory; addresses stay reserved, so the captured graphs replay after "
                    "wake-up", level, _usage(allocator, 1),
                    " and ".join(t for t in kept if t in allocator.usage_by_tag()) or "nothing")

    def resume(self, tags: list[str] | None = None) -> None:
        self._state = "RESUMING"
        allocator = self.allocator
        allocator.wake_up(tags)
        logger.info("vllm-ascend: woke up %s at the same addresses; still asleep: %s",
                    "everything" if tags is None else ", ".join(tags), _usage(allocator, 1))
        self._state = "RUNNING"

    def discard(self, tags: tuple[str, ...]) -> None:
        self.allocator.discard(tags)
        self._state = "SUSPENDED"

    @classmethod
    def preserves_communicators(cls) -> bool:
        return True  # HCCL's buffers are outside the pools

    @classmethod
    def preserves_graphs_with_communicators(cls) -> bool:
        return True  # graphs are kept and their addresses with them


def register() -> None:
    """Make the backend known to vLLM's factory (in every process that builds a worker)."""
    if NAME not in SleepModeBackendFactory._registry:
        SleepModeBackendFactory.register_backend(NAME, __name__, AscendSleepBackend.__name__)


def select_backend(model_config) -> None:
    """vLLM's default sleep-mode backend is CUDA's cumem; Ascend's is device_allocator/."""
    register()
    if model_config.sleep_mode_backend == "cumem":
        model_config.sleep_mode_backend = NAME
    elif model_config.sleep_mode_backend != NAME:
        raise ValueError(
            f"sleep_mode_backend {model_config.sleep_mode_backend!r} is not available on "
            f"Ascend; leave it unset (Ascend's is {NAME!r}).")
    logger.info("vllm-ascend: sleep mode on: weights, KV cache and runtime buffers in "
                "CANN virtual memory, released by sleep() and mapped again at the same "
                "addresses by wake_up()")
