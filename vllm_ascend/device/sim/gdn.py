"""torch_npu's Gated DeltaNet operators (Qwen3-Next, Qwen3.5): ``npu_chunk_gated_delta_rule``
(a prefill's sequences from their initial states: every step's output and the final states) and
``npu_recurrent_gated_delta_rule`` (decode and speculative verification: 1-8 tokens a sequence,
the states read and written in place in a state pool by per-token index), with the checks
torch_npu's documentation gives for an Atlas A2/A3 (op-plugin
docs/zh/custom_APIs/torch_npu/torch_npu-npu_chunk_gated_delta_rule.md and
torch_npu-npu_recurrent_gated_delta_rule.md; their op-plugin checks:
ChunkGatedDeltaRuleKernelNpuOpApi.cpp, RecurrentGatedDeltaRuleKernelNpuOpApi.cpp). The contracts
and the product's calls: docs/torch_npu_calls.md, "Gated DeltaNet".

The rule, per value head (its key head: head // (Nv / Nk)), state S of [Dv, Dk]:
    S = exp(g_t) * S;   S = S + beta_t * (v_t - S k_t) k_t^T;   o_t = scale * S q_t
(the recurrent op also scales S's columns by exp(gk_t) when given). The simulator computes it
token by token in float32 from the bfloat16 inputs, one sequence at a time (a row's result does
not depend on the batch), and rounds the output and the states once; the chip's chunked kernel
differs from it by rounding only.

Where the documentation states a rule the op-plugin does not check, the simulator checks it
(the stricter reading): q and k L2-normalised ("须归一化"), g <= 0, 0 <= beta <= 1, the state
indices in range and the accepted-token counts within their sequences. Device tensors the
kernels read (the lengths, the state indices, the accepted counts) are read when the kernel
runs: in a graph, at each replay, from the buffers the capture recorded; a capture checks the
shapes only and runs nothing, as a captured task runs at replay.
"""

import torch

from vllm_ascend.device.sim import aclnn
from vllm_ascend.device.sim.aclnn import CAPTURING, require_contiguous, sampling
from vllm_ascend.device.sim.devices import soc_generation
from vllm_ascend.device.sim.errors import PARAM_INVALID, TILING_ERROR, AscendOpError
from vllm_ascend.device.sim.library_caches import first_calls_measured
from vllm_ascend.device.sim.trace import kernel

_lib = torch.library.Library("ascend_sim", "FRAGMENT")
_lib.define("npu_chunk_gated_delta_rule(Tensor query, Tensor key, Tensor value, *, "
            "Tensor? beta=None, Tensor? initial_state=None, Tensor? actual_seq_lengths=None, "
            "float? scale=None, Tensor? g=None) -> (Tensor, Tensor)")
_lib.define("npu_recurrent_gated_delta_rule(Tensor query, Tensor key, Tensor value, "
            "Tensor(a!) state, *, Tensor? beta=None, float? scale=None, "
            "Tensor? actual_seq_lengths=None, Tensor? ssm_state_indices=None, "
            "Tensor? num_accepted_tokens=None, Tensor? g=None, Tensor? gk=None) -> Tensor")

BF16 = torch.bfloat16
MAX_SPEC_TOKENS = 8  # the recurrent op's 1 <= L_i <= 8
_NORM_SLACK = 1.0 + 2 ** -6  # a bfloat16 rounding of a unit vector's norm


def _error(op: str):
    aclnn_name = "aclnn" + "".join(w.capitalize() for w in op.removeprefix("npu_").split("_"))
    return lambda code, message: AscendOpError(op, aclnn_name, code, message)


def _host(t: torch.Tensor) -> list[int]:
    # The kernel's own read of a device tensor (not the product's .tolist(), which a capture
    # refuses: sim/recorder.py).
    return torch._C.TensorBase.tolist(t.reshape(-1))


def _check_heads(err, query, key, value, beta, g, max_heads, max_dim):
    if query.dim() != 3 or key.shape != query.shape or value.dim() != 3 \
            or value.shape[0] != query.shape[0]:
        raise err(TILING_ERROR, f"query and key must be [T, Nk, Dk] and value [T, Nv, Dv] with "
                  f"one T, got {list(query.shape)}, {list(key.shape)}, {list(value.shape)}")
    t, nk, dk = query.shape
    nv, dv = value.shape[1:]
    if t == 0 or not (0 < nk <= max_heads and 0 < nv <= max_heads and nv % nk == 0):
        raise err(TILING_ERROR, f"T > 0, 0 < Nk, Nv <= {max_heads} and Nv % Nk == 0 are "
                  f"required, got T={t}, Nk={nk}, Nv={nv}")
    if not (0 < dk <= max_dim and 0 < dv <= max_dim):
        raise err(TILING_ERROR, f"0 < Dk, Dv <= {max_dim} are required, got Dk={dk}, Dv={dv}")
    for name, x in (("query", query), ("key", key), ("value", value), ("beta", beta)):
        if x is not None and x.dtype != BF16:
            raise err(PARAM_INVALID, f"{name} must be bfloat16, got {x.dtype}")
    if beta is not None and tuple(beta.shape) != (t, nv):
        raise err(TILING_ERROR, f"beta must be [T, Nv] = {[t, nv]}, got {list(beta.shape)}")
    if g is not None and (g.dtype != torch.float32 or tuple(g.shape) != (t, nv)):
        raise err(PARAM_INVALID, f"g must be float32 [T, Nv] = {[t, nv]}, got {g.dtype} "
                  f"{list(g.shape)}")


def _check_values(err, query, key, beta, g):
    """The documented ranges of the inputs (the caller's guarantee on the chip)."""
    for name, x in (("query", query), ("key", key)):
        norm = _host(x.float().norm(dim=-1).max())[0] if x.numel() else 0.0
        if norm > _NORM_SLACK:
            raise err(TILING_ERROR, f"{name} must be L2-normalised over its head dim (the "
                      f"kernel does not normalise it), got a norm of {norm:.3f}")
    if beta is not None and beta.numel() and not _host(((beta >= 0) & (beta <= 1)).all())[0]:
        raise err(TILING_ERROR, "beta must lie in [0, 1] (a sigmoid)")
    if g is not None and g.numel() and _host((g > 0).any())[0]:
        raise err(TILING_ERROR, "g must be <= 0 (a log decay)")


def _step(s, q, k, v, beta, g, gk, scale, group):
    """One token for all heads: s [Nv, Dv, Dk] float32 in place; returns o [Nv, Dv]."""
    k = k.float().repeat_interleave(group, 0)  # [Nv, Dk]
    q = q.float().repeat_interleave(group, 0)
    if g is not None:
        s.mul_(torch.exp(g.float())[:, None, None])
    if gk is not None:
        s.mul_(torch.exp(gk.float())[:, None, :])
    kv = torch.einsum("hvk,hk->hv", s, k)
    delta = (v.float() - kv) * (beta.float()[:, None] if beta is not None else 1.0)
    s.add_(delta[:, :, None] * k[:, None, :])
    return torch.einsum("hvk,hk->hv", s, q) * scale


@first_calls_measured(lambda query, key, value, **kw: (query.shape, value.shape))
def _chunk_impl(query, key, value, *, beta=None, initial_state=None, actual_seq_lengths=None,
                scale=None, g=None):
    op = "npu_chunk_gated_delta_rule"
    err = _error(op)
    for name, x in (("beta", beta), ("initial_state", initial_state),
                    ("actual_seq_lengths", actual_seq_lengths)):
        if x is None:  # op-plugin's TORCH_CHECKs (TND requires them)
            raise err(PARAM_INVALID, f"{name} cannot be empty")
    if scale is None:
        raise err(PARAM_INVALID, "scale cannot be empty")
    _check_heads(err, query, key, value, beta, g, max_heads=64, max_dim=128)
    require_contiguous(err, query=query, key=key, value=value, beta=beta, g=g,
                       initial_state=initial_state, actual_seq_lengths=actual_seq_lengths)
    t, nk, dk = query.shape
    nv, dv = value.shape[1:]
    if initial_state.dtype != BF16:
        # float32 states: Ascend 950 only (the documentation's constraints)
        raise err(PARAM_INVALID, f"initial_state must be bfloat16 on {soc_generation() or 'A2'}"
                  f" (float32 states are Ascend 950 only), got {initial_state.dtype}")
    if actual_seq_lengths.dtype != torch.int32 or actual_seq_lengths.dim() != 1:
        raise err(PARAM_INVALID, "actual_seq_lengths must be a 1-D int32 tensor [B]")
    b = actual_seq_lengths.shape[0]
    if b == 0 or tuple(initial_state.shape) != (b, nv, dv, dk):
        raise err(TILING_ERROR, f"initial_state must be [B, Nv, Dv, Dk] = {[b, nv, dv, dk]}, "
                  f"got {list(initial_state.shape)}")
    out = torch.empty((t, nv, dv), dtype=BF16)
    final = torch.empty_like(initial_state)
    if CAPTURING.active:  # checked, not run (sim/aclnn.py)
        return CAPTURING.unwritten(out), CAPTURING.unwritten(final)
    lens = _host(actual_seq_lengths)
    if min(lens) < 0 or sum(lens) != t:
        raise err(TILING_ERROR, f"actual_seq_lengths {lens} must be >= 0 and sum to T = {t}")
    _check_values(err, query, key, beta, g)
    start = 0
    for i, n in enumerate(lens):
        s = initial_state[i].float()
        for j in range(start, start + n):
            out[j] = _step(s, query[j], key[j], value[j], beta[j],
                           None if g is None else g[j], None, scale, nv // nk).to(BF16)
        final[i] = s.to(final.dtype)
        start += n
    return out, final


def _recurrent_checks(query, key, value, state, beta, scale, actual_seq_lengths,
                      ssm_state_indices, num_accepted_tokens, g, gk):
    err = _error("npu_recurrent_gated_delta_rule")
    if scale is None:
        raise err(PARAM_INVALID, "scale cannot be empty")
    _check_heads(err, query, key, value, beta, g, max_heads=256, max_dim=512)
    require_contiguous(err, query=query, key=key, value=value, state=state, beta=beta, g=g,
                       gk=gk, actual_seq_lengths=actual_seq_lengths,
                       ssm_state_indices=ssm_state_indices,
                       num_accepted_tokens=num_accepted_tokens)
    t, nk, dk = query.shape
    nv, dv = value.shape[1:]
    if state.dtype != BF16 or state.dim() != 4 or tuple(state.shape[1:]) != (nv, dv, dk):
        raise err(PARAM_INVALID, f"state must be bfloat16 [BlockNum, Nv, Dv, Dk] with "
                  f"{[nv, dv, dk]}, got {state.dtype} {list(state.shape)}")
    if state.shape[0] < t:
        raise err(TILING_ERROR, f"BlockNum ({state.shape[0]}) must be at least T ({t})")
    if gk is not None and (gk.dtype != torch.float32 or tuple(gk.shape) != (t, nv, dk)):
        raise err(PARAM_INVALID, f"gk must be float32 [T, Nv, Dk], got {gk.dtype} "
                  f"{list(gk.shape)}")
    for name, x in (("actual_seq_lengths", actual_seq_lengths),
                    ("ssm_state_indices", ssm_state_indices),
                    ("num_accepted_tokens", num_accepted_tokens)):
        if x is not None and (x.dtype != torch.int32 or x.dim() != 1):
            raise err(PARAM_INVALID, f"{name} must be a 1-D int32 tensor, got {x.dim()}-D "
                      f"{x.dtype}")
    if ssm_state_indices is not None and ssm_state_indices.shape[0] != t:
        raise err(TILING_ERROR, f"ssm_state_indices must be [T] = [{t}], got "
                  f"{list(ssm_state_indices.shape)}")
    if num_accepted_tokens is not None and (
            actual_seq_lengths is None
            or num_accepted_tokens.shape[0] != actual_seq_lengths.shape[0]):
        raise err(TILING_ERROR, "num_accepted_tokens must be [B], with actual_seq_lengths")
    return err


@first_calls_measured(lambda err, query, key, value, state, *rest: (query.shape, state.shape))
def _recurrent_run(err, query, key, value, state, beta, scale, actual_seq_lengths,
                   ssm_state_indices, num_accepted_tokens, g, gk, out):
    t, nk, _ = query.shape
    nv = value.shape[1]
    lens = _host(actual_seq_lengths) if actual_seq_lengths is not None else [1] * t
    if sum(lens) != t or not all(1 <= n <= MAX_SPEC_TOKENS for n in lens):
        raise err(TILING_ERROR, f"actual_seq_lengths {lens} must each lie in [1, "
                  f"{MAX_SPEC_TOKENS}] and sum to T = {t}")
    slots = _host(ssm_state_indices) if ssm_state_indices is not None else list(range(t))
    if not all(0 <= s < state.shape[0] for s in slots):
        raise err(TILING_ERROR, f"ssm_state_indices {slots} must lie in [0, BlockNum = "
                  f"{state.shape[0]})")
    accepted = (_host(num_accepted_tokens) if num_accepted_tokens is not None
                else [1] * len(lens))
    if not all(1 <= a <= n for a, n in zip(accepted, lens)):
        raise err(TILING_ERROR, f"num_accepted_tokens {accepted} must lie in [1, L_i] for "
                  f"actual_seq_lengths {lens}")
    _check_values(err, query, key, beta, g)
    start = 0
    for n, a in zip(lens, accepted):
        # A sequence starts from the state of its last accepted token, and writes the state
        # after each of its tokens to that token's slot.
        s = state[slots[start + a - 1]].float()
        for j in range(start, start + n):
            out[j] = _step(s, query[j], key[j], value[j],
                           None if beta is None else beta[j], None if g is None else g[j],
                           None if gk is None else gk[j], scale, nv // nk).to(out.dtype)
            state[slots[j]] = s.to(state.dtype)
        start += n


def _recurrent_impl(query, key, value, state, *, beta=None, scale=None,
                    actual_seq_lengths=None, ssm_state_indices=None, num_accepted_tokens=None,
                    g=None, gk=None):
    args = (query, key, value, state, beta, scale, actual_seq_lengths, ssm_state_indices,
            num_accepted_tokens, g, gk)
    err = _recurrent_checks(*args)
    out = torch.empty(value.shape, dtype=BF16)
    if CAPTURING.active:  # checked, not run: the states stay as they are until a replay
        return CAPTURING.unwritten(out)
    _recurrent_run(err, *args, out)
    return out


def _recurrent_into(outs, query, key, value, state, *, beta=None, scale=None,
                    actual_seq_lengths=None, ssm_state_indices=None, num_accepted_tokens=None,
                    g=None, gk=None):
    # A replay: the capture checked the tensors; the values the kernel reads are checked again.
    _recurrent_run(_error("npu_recurrent_gated_delta_rule"), query, key, value, state, beta,
                   scale, actual_seq_lengths, ssm_state_indices, num_accepted_tokens, g, gk,
                   outs[0] if isinstance(outs, (list, tuple)) else outs)


_lib.impl("npu_chunk_gated_delta_rule",
          kernel("npu_chunk_gated_delta_rule", sampling(_chunk_impl)), "CPU")
_lib.impl("npu_recurrent_gated_delta_rule",
          kernel("npu_recurrent_gated_delta_rule", sampling(_recurrent_impl)), "CPU")
aclnn.REPLAY_INTO["npu_recurrent_gated_delta_rule"] = _recurrent_into


@torch.library.register_fake("ascend_sim::npu_chunk_gated_delta_rule")
def _chunk_fake(query, key, value, *, beta=None, initial_state=None, actual_seq_lengths=None,
                scale=None, g=None):
    return value.new_empty(value.shape, dtype=BF16), torch.empty_like(initial_state)


@torch.library.register_fake("ascend_sim::npu_recurrent_gated_delta_rule")
def _recurrent_fake(query, key, value, state, **kwargs):
    return value.new_empty(value.shape, dtype=BF16)
