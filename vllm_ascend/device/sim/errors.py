"""The chip's errors, as torch_npu and the CANN runtime report them, in the lowest module of the
simulator so that every part of it raises the same ones.

* An operator's host-side check (aclnn's tiling or parameter check) fails with
  ``AscendOpError``, worded as torch_npu words it ("<op> call <aclnn> failed, error code is
  <code>", then CANN's EZ9999 inner error), with aclnn's codes: ACLNN_ERR_INNER_TILING_ERROR
  (561002, a shape or value) and ACLNN_ERR_PARAM_INVALID (161002, a dtype or format).
* A capture or replay the chip refuses: ``GraphCaptureError``, ``GraphReplayError``; a captured
  graph past the device's stream budget: ``StreamResourceError``, with ACL's code 207008.
* The device touched outside this process's device context: ``DeviceContextError``.
"""

TILING_ERROR = 561002  # ACLNN_ERR_INNER_TILING_ERROR: a host-side shape or value check
PARAM_INVALID = 161002  # ACLNN_ERR_PARAM_INVALID: dtype or format
STREAM_EXHAUSTED_CODE = 207008  # ACL: the stream resources are insufficient


class AscendOpError(RuntimeError):
    """An operator check failed, worded as torch_npu reports it."""

    def __init__(self, op: str, aclnn: str, code: int, message: str):
        super().__init__(f"{op} call {aclnn} failed, error code is {code}\n"
                         f"[ERROR] EZ9999: Inner Error!\nEZ9999: {message}")
        self.code = code


class GraphCaptureError(RuntimeError):
    pass


class GraphReplayError(RuntimeError):
    pass


class StreamResourceError(RuntimeError):
    """The chip ran out of streams (ACL error 207008)."""


class DeviceContextError(RuntimeError):
    pass
