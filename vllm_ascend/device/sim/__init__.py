"""``sim``: torch_npu on the CPU. The functions vllm-ascend calls, by torch_npu's own names,
keywords and overloads, with the chip's contracts and graph semantics; README.md beside this file
maps torch_npu's API to the module that implements each part. This module is torch_npu's top
level: its operator functions (the ops themselves are ``ascend_sim`` torch.library ops, defined
in the operator modules), ``torch_npu.npu`` (npu.py) and ``torch_npu._C``. Only what the product
uses is here; anything else is an AttributeError, and a keyword torch_npu has but the simulator
does not model is refused rather than ignored.
"""

import sys

import torch

# Each operator module registers its ascend_sim ops.
from vllm_ascend.device.sim import activation  # noqa: F401  (npu_swiglu)
from vllm_ascend.device.sim import fia  # noqa: F401  (FIA v1)
from vllm_ascend.device.sim import fia_checks as _fia_checks
from vllm_ascend.device.sim import gdn  # noqa: F401  (the Gated DeltaNet operators)
from vllm_ascend.device.sim import graph_pool as _graph_pool
from vllm_ascend.device.sim import kv_cache  # noqa: F401  (npu_scatter_pa_kv_cache)
from vllm_ascend.device.sim import mc2  # noqa: F401  (the MC2 operators)
from vllm_ascend.device.sim import mla as _mla
from vllm_ascend.device.sim import moe as _moe  # noqa: F401  (the MoE operators)
from vllm_ascend.device.sim import norm  # noqa: F401  (the RMS norms)
from vllm_ascend.device.sim import npu  # noqa: F401  (torch_npu.npu, i.e. torch.npu)
from vllm_ascend.device.sim import quant as _quant  # noqa: F401  (the W8A8 operators)
from vllm_ascend.device.sim import rope  # noqa: F401  (npu_rotary_mul, npu_mrope)
from vllm_ascend.device.sim.aclnn import INT32_MAX

class _FusedInferAttention:
    """torch_npu's FIA entry points (v1 and v2): the functional call, and ``.out`` with a
    preallocated ``out=[attention_out, softmax_lse]`` and ``workspace=`` (the graph path). Issued
    between graph_task_update_begin/end, ``.out`` re-parameterises the captured task. Keywords the
    product leaves at their defaults are refused unless at the default; host lists must be
    lists of ints, as the chip's SymInt[] parameters take them."""

    def __init__(self, name: str, op, not_simulated: dict, host_lists: tuple):
        self.name, self.op = name, op
        self.keywords = {a.name for a in op.default._schema.arguments if a.kwarg_only}
        self.not_simulated = not_simulated  # keyword -> its default (None: an optional tensor)
        self.host_lists = host_lists

    def kwargs(self, op: str, kwargs: dict) -> dict:
        kw = {}
        for name, value in kwargs.items():
            if name in self.not_simulated:
                if value is not None and value != self.not_simulated[name]:
                    raise NotImplementedError(f"{op}: {name} is not simulated")
                continue
            if name not in self.keywords:
                raise TypeError(f"{op}() got an unexpected keyword argument '{name}'")
            if name in self.host_lists and value is not None and (
                    not isinstance(value, (list, tuple))
                    or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)):
                # A device tensor is an error on the chip (v2 also takes a host int tensor:
                # the stricter reading).
                raise TypeError(f"{op}(): argument '{name}' must be tuple of ints, not "
                                f"{type(value).__name__}")
            kw[name] = list(value) if isinstance(value, tuple) else value
        return kw

    def __call__(self, query, key, value, **kwargs):
        kw = self.kwargs(self.name, kwargs)
        if npu.open_task_update() is not None:
            raise RuntimeError(f"a task update re-issues the captured op: call {self.name}.out, "
                               "as at capture")
        return self.op.default(query, key, value, **kw)

    def out(self, query, key, value, *, out, workspace=None, **kwargs):
        kw = self.kwargs(f"{self.name}.out", kwargs)
        attention_out, softmax_lse = out
        kw.update(workspace=workspace, attention_out=attention_out, softmax_lse=softmax_lse)
        if npu.open_task_update() is not None:
            npu.issue_task_update(self.op.out, (query, key, value), kw)
            return attention_out, softmax_lse
        return self.op.out(query, key, value, **kw)


_FIA = torch.ops.ascend_sim.npu_fused_infer_attention_score
# Keywords of torch_npu's FIA that vllm-ascend's decoder path leaves at their defaults.
npu_fused_infer_attention_score = _FusedInferAttention(
    "npu_fused_infer_attention_score", _FIA, not_simulated={
        **dict.fromkeys((
            "pse_shift", "dequant_scale1", "quant_scale1", "dequant_scale2", "quant_scale2",
            "quant_offset2", "antiquant_scale", "antiquant_offset", "key_antiquant_scale",
            "key_antiquant_offset", "value_antiquant_scale", "value_antiquant_offset",
            "query_padding_size", "kv_padding_size", "key_shared_prefix", "value_shared_prefix",
            "actual_shared_prefix_len", "query_rope", "key_rope", "key_rope_antiquant_scale")),
        **dict.fromkeys(("antiquant_mode", "key_antiquant_mode", "value_antiquant_mode"), 0)},
    host_lists=("actual_seq_lengths", "actual_seq_lengths_kv"))


def _npu_fused_infer_attention_score_get_max_workspace(query, key, value, **kwargs):
    """A workspace for ``.out`` that serves any sequence lengths: a 1-D tensor of the query's
    dtype. The host-side checks run as in the op."""
    kw = npu_fused_infer_attention_score.kwargs(
        "_npu_fused_infer_attention_score_get_max_workspace", kwargs)
    _fia_checks.check_fia(query, key, value, kw.get("atten_mask"), kw.get("actual_seq_lengths"),
                   kw.get("actual_seq_lengths_kv"), kw.get("block_table"),
                   kw.get("num_heads", 1), kw.get("num_key_value_heads", 0),
                   kw.get("input_layout", "BSH"), kw.get("sparse_mode", 0),
                   kw.get("block_size", 0), kw.get("pre_tokens", INT32_MAX),
                   kw.get("next_tokens", INT32_MAX))
    size = _fia_checks.fia_workspace_elements(query, kw.get("block_table"), kw.get("num_heads", 1))
    return torch.empty(size, dtype=query.dtype, device=query.device)


def npu_scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping, *,
                            compress_lens=None, compress_seq_offsets=None, seq_lens=None,
                            cache_mode="PA_NZ"):
    if compress_lens is not None or compress_seq_offsets is not None or seq_lens is not None:
        raise NotImplementedError("npu_scatter_pa_kv_cache: compression is not simulated")
    torch.ops.ascend_sim.npu_scatter_pa_kv_cache(key, value, key_cache, value_cache,
                                                 slot_mapping, cache_mode=cache_mode)


# FIA v2: the MLA decode path and the dense one with sinks (device/sim/mla.py); the keywords
# both leave at defaults.
npu_fused_infer_attention_score_v2 = _FusedInferAttention(
    "npu_fused_infer_attention_score_v2", torch.ops.ascend_sim.npu_fused_infer_attention_score_v2,
    not_simulated={
        **dict.fromkeys((
            "pse_shift", "dequant_scale_query", "dequant_scale_key", "dequant_scale_value",
            "quant_scale_out", "quant_offset_out", "key_shared_prefix",
            "value_shared_prefix", "actual_shared_prefix_len", "query_padding_size",
            "kv_padding_size")),
        **dict.fromkeys(("inner_precise", "query_quant_mode", "key_quant_mode",
                         "value_quant_mode"), 0)},
    host_lists=("actual_seq_qlen", "actual_seq_kvlen"))


def _npu_fused_infer_attention_score_v2_get_max_workspace(query, key, value, **kwargs):
    kw = npu_fused_infer_attention_score_v2.kwargs(
        "_npu_fused_infer_attention_score_v2_get_max_workspace", kwargs)
    _mla.check_fia_v2(query, key, value, kw.get("query_rope"), kw.get("key_rope"),
                      kw.get("atten_mask"), kw.get("actual_seq_qlen"),
                      kw.get("actual_seq_kvlen"), kw.get("block_table"),
                      kw.get("num_query_heads", 1), kw.get("num_key_value_heads", 0),
                      kw.get("input_layout", "BSH"), kw.get("sparse_mode", 0),
                      kw.get("block_size", 0), kw.get("learnable_sink"),
                      kw.get("pre_tokens", INT32_MAX), kw.get("next_tokens", INT32_MAX))
    size = _mla.fia_v2_workspace_elements(query, kw["block_table"], kw.get("num_query_heads", 1))
    return torch.empty(size, dtype=query.dtype, device=query.device)


npu_interleave_rope = torch.ops.ascend_sim.npu_interleave_rope


def npu_attention_update(lse, local_out, update_type):
    # torch_npu takes any sequence of tensors (upstream passes tuples).
    return torch.ops.ascend_sim.npu_attention_update(list(lse), list(local_out), update_type)


def npu_kv_rmsnorm_rope_cache(kv, gamma, cos, sin, index, k_cache, ckv_cache, *,
                              k_rope_scale=None, c_kv_scale=None, k_rope_offset=None,
                              c_kv_offset=None, epsilon=1e-5, cache_mode="Norm",
                              is_output_kv=False):
    """Returns (k_cache, ckv_cache, k_rope, c_kv): the updated caches, then, with is_output_kv,
    the token's roped key part and normed latent ([B, 1, S, 64] and [B, 1, S, 512])."""
    if any(v is not None for v in (k_rope_scale, c_kv_scale, k_rope_offset, c_kv_offset)):
        raise NotImplementedError("npu_kv_rmsnorm_rope_cache: quantized caches are not "
                                  "simulated")
    k_rope, c_kv = torch.ops.ascend_sim.npu_kv_rmsnorm_rope_cache(
        kv, gamma, cos, sin, index, k_cache, ckv_cache, epsilon=epsilon, cache_mode=cache_mode,
        is_output_kv=is_output_kv)
    return k_cache, ckv_cache, k_rope, c_kv


def npu_transpose_batchmatmul(input, weight, *, bias=None, scale=None, perm_x1=None,
                              perm_x2=None, perm_y=None, batch_split_factor=1):
    if bias is not None or scale is not None or perm_x2 not in (None, [0, 1, 2], (0, 1, 2)) \
            or batch_split_factor != 1:
        raise NotImplementedError("npu_transpose_batchmatmul: bias, scale, perm_x2 and "
                                  "batch_split_factor are not simulated")
    return torch.ops.ascend_sim.npu_transpose_batchmatmul(
        input, weight, perm_x1=list(perm_x1) if perm_x1 is not None else None,
        perm_y=list(perm_y) if perm_y is not None else None)


npu_moe_gating_top_k_softmax = torch.ops.ascend_sim.npu_moe_gating_top_k_softmax
npu_moe_gating_top_k = torch.ops.ascend_sim.npu_moe_gating_top_k
npu_moe_init_routing_v2 = torch.ops.ascend_sim.npu_moe_init_routing_v2
npu_moe_token_unpermute = torch.ops.ascend_sim.npu_moe_token_unpermute
npu_moe_distribute_dispatch_v2 = torch.ops.ascend_sim.npu_moe_distribute_dispatch_v2
npu_moe_distribute_combine_v2 = torch.ops.ascend_sim.npu_moe_distribute_combine_v2
_GMM_QUANT = ("offset", "antiquant_scale", "antiquant_offset", "activation_input",
              "activation_quant_scale", "activation_quant_offset")


def npu_grouped_matmul(x, weight, *, bias=None, scale=None, per_token_scale=None,
                       group_list=None, split_item=0, group_type=None, group_list_type=0,
                       act_type=0, output_dtype=None, tuning_config=None, **quant):
    given = [name for name, value in quant.items() if value is not None]
    unknown = [name for name in quant if name not in _GMM_QUANT]
    if unknown:
        raise TypeError(f"npu_grouped_matmul() got an unexpected keyword argument '{unknown[0]}'")
    if given or act_type:
        raise NotImplementedError(f"npu_grouped_matmul: {given or ['act_type']} not simulated "
                                  "(unquantized, or int8 with per-token scales, only)")
    return torch.ops.ascend_sim.npu_grouped_matmul(
        x, weight, bias=bias, scale=scale, per_token_scale=per_token_scale,
        group_list=group_list, split_item=split_item, group_type=group_type,
        group_list_type=group_list_type, output_dtype=output_dtype)


npu_rms_norm = torch.ops.ascend_sim.npu_rms_norm
npu_add_rms_norm = torch.ops.ascend_sim.npu_add_rms_norm
npu_swiglu = torch.ops.ascend_sim.npu_swiglu
npu_mrope = torch.ops.ascend_sim.npu_mrope
npu_dynamic_quant = torch.ops.ascend_sim.npu_dynamic_quant
npu_quantize = torch.ops.ascend_sim.npu_quantize
npu_quant_matmul = torch.ops.ascend_sim.npu_quant_matmul
npu_add_rms_norm_quant = torch.ops.ascend_sim.npu_add_rms_norm_quant
npu_add_rms_norm_dynamic_quant = torch.ops.ascend_sim.npu_add_rms_norm_dynamic_quant


def npu_chunk_gated_delta_rule(query, key, value, *, beta=None, initial_state=None,
                               actual_seq_lengths=None, scale=None, g=None):
    return torch.ops.ascend_sim.npu_chunk_gated_delta_rule(
        query, key, value, beta=beta, initial_state=initial_state,
        actual_seq_lengths=actual_seq_lengths, scale=scale, g=g)


def npu_recurrent_gated_delta_rule(query, key, value, state, *, beta=None, scale=None,
                                   actual_seq_lengths=None, ssm_state_indices=None,
                                   num_accepted_tokens=None, g=None, gk=None):
    return torch.ops.ascend_sim.npu_recurrent_gated_delta_rule(
        query, key, value, state, beta=beta, scale=scale,
        actual_seq_lengths=actual_seq_lengths, ssm_state_indices=ssm_state_indices,
        num_accepted_tokens=num_accepted_tokens, g=g, gk=gk)


def npu_rotary_mul(input, r1, r2, rotary_mode="half", rotate=None):
    if rotate is not None:
        raise NotImplementedError("npu_rotary_mul: rotate is not simulated")
    return torch.ops.ascend_sim.npu_rotary_mul(input, r1, r2, rotary_mode)


class _C:
    """torch_npu._C, as far as vllm-ascend reaches into it."""

    @staticmethod
    def _npu_customAllocator(malloc_ptr: int, free_ptr: int):  # noqa: N802 (torch_npu's name)
        return npu.memory.CustomAllocator(malloc_ptr, free_ptr)

    @staticmethod
    def _weak_ref_tensor(tensor):
        # A non-owning alias: its memory is poisoned once its owner is released (graph_pool.py).
        return _graph_pool.weak_ref_tensor(tensor)


def log_calls_if_requested() -> None:
    """The simulator's call log (trace.py), if VLLM_ASCEND_SIM_CALL_LOG is set."""
    from vllm_ascend.device.sim import trace

    trace.install_if_requested(sys.modules[__name__], npu)


log_calls_if_requested()
