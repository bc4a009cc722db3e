"""How vLLM's engine and worker processes start on this device: with ``spawn`` where a fork is
unsafe (the device says why), and without re-running a main script that cannot be re-run."""

import os
import sys

from vllm_ascend import device
from vllm_ascend.logger import get_logger

logger = get_logger(__name__)
MULTIPROC_METHOD_ENV = "VLLM_WORKER_MULTIPROC_METHOD"


def spawn_if_fork_is_unsafe() -> None:
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
        _spawn_without_a_pseudo_main()

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
