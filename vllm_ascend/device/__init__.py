"""The only package that knows which device runs: ``npu`` (torch_npu, real chips) or ``sim``.

``current`` is chosen once, at import: ``VLLM_ASCEND_DEVICE=npu|sim`` forces a backend; otherwise
``npu`` when torch_npu imports and reports a chip, else ``sim``. Detection never crashes a CPU
machine: torch_npu is imported with its autoload entry point disabled and any failure means sim.
"""

import importlib
import os

from vllm_ascend.device.base import DeviceBackend

ENV_VAR = "VLLM_ASCEND_DEVICE"


class DeviceSelectionError(RuntimeError):
    pass


def _npu_available() -> tuple[bool, str]:
    """(available, reason). Never raises."""
    if importlib.util.find_spec("torch_npu") is None:
        return False, "torch_npu is not installed"
    # torch_npu's autoload entry point breaks `import torch` where CANN is missing.
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    try:
        import torch_npu  # noqa: F401
        import torch

        if not torch.npu.is_available() or torch.npu.device_count() == 0:
            return False, "torch_npu is installed but reports no Ascend chip"
    except Exception as e:  # a broken CANN install must not crash detection
        return False, f"torch_npu failed to initialise ({type(e).__name__}: {e})"
    return True, "torch_npu found an Ascend chip"


def select_backend(requested: str | None = None) -> DeviceBackend:
    """Pick the device backend. ``requested`` defaults to $VLLM_ASCEND_DEVICE."""
    if requested is None:
        requested = os.environ.get(ENV_VAR, "").strip().lower() or None
    if requested not in (None, "npu", "sim"):
        raise DeviceSelectionError(
            f"{ENV_VAR}={requested!r} is not a device backend; use 'npu' or 'sim' "
            "(or leave it unset to detect)."
        )
    if requested == "sim":
        from vllm_ascend.device.sim import SimBackend

        return SimBackend(reason=f"{ENV_VAR}=sim")
    ok, reason = _npu_available()
    if requested == "npu":
        if not ok:
            raise DeviceSelectionError(
                f"{ENV_VAR}=npu was requested but {reason}. Install the extra "
                "`pip install vllm-ascend[npu]` on a machine with CANN and an Ascend chip, "
                f"or set {ENV_VAR}=sim to run on the CPU simulator."
            )
        from vllm_ascend.device.npu import NpuBackend

        return NpuBackend(reason=f"{ENV_VAR}=npu")
    if ok:
        from vllm_ascend.device.npu import NpuBackend

        return NpuBackend(reason=reason)
    from vllm_ascend.device.sim import SimBackend

    return SimBackend(reason=f"no NPU ({reason})")


current: DeviceBackend = select_backend()

