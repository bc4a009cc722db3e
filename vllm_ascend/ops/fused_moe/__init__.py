"""Mixture-of-experts on torch_npu's fused-MoE operators: the expert computation (method.py) and
the choice of how tokens reach other ranks' experts (comm.py)."""

from vllm_ascend.ops.fused_moe import method  # noqa: F401  (registers the CustomOp override)
