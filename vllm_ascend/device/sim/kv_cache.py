"""torch_npu's ``npu_scatter_pa_kv_cache``: a step's keys and values written into the paged
caches at their slots (slot -1: a padded token, nothing written), with the chip's checks
(../shared/TORCH_NPU_CONTRACTS.md section 2.1; its call site: docs/torch_npu_calls.md,
"Attention")."""

import functools

import torch

from vllm_ascend.device.sim import aclnn
from vllm_ascend.device.sim.aclnn import require_contiguous
from vllm_ascend.device.sim.errors import PARAM_INVALID, TILING_ERROR, AscendOpError
from vllm_ascend.device.sim.trace import kernel

_lib = torch.library.Library("ascend_sim", "FRAGMENT")

_lib.define("npu_scatter_pa_kv_cache(Tensor key, Tensor value, Tensor(a!) key_cache, "
            "Tensor(b!) value_cache, Tensor slot_mapping, *, str? cache_mode='PA_NZ') -> ()")


def _scatter_error(code, message):
    return AscendOpError("npu_scatter_pa_kv_cache", "aclnnScatterPaKvCache", code, message)


def _scatter_impl(key, value, key_cache, value_cache, slot_mapping, *, cache_mode="PA_NZ",
                  _replay=False):
    if not _replay:  # (a replay's tensors and attributes are the ones checked at capture)
        _check_scatter(key, value, key_cache, value_cache, slot_mapping, cache_mode)
    num_blocks, block_size = key_cache.shape[:2]
    # The checks on a host list (fewer ops than on the tensor): the kernel's own read, which a
    # capture's refusal of the product's .tolist() (sim/recorder.py) does not apply to.
    values = torch._C.TensorBase.tolist(slot_mapping)
    if not values:
        return
    slots = slot_mapping.long()
    low, high = min(values), max(values)
    if low < 0:  # -1 marks a padded token: nothing is written for it
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
        values = [v for v in values if v >= 0]
    if high >= num_blocks * block_size:
        raise _scatter_error(TILING_ERROR, f"slot {high} is out of range "
                             f"[0, {num_blocks * block_size - 1}]")
    if len(set(values)) != len(values):
        raise _scatter_error(TILING_ERROR, "slot_mapping values must be unique")
    # Contiguous [blocks, block_size, heads, head_size] caches: a slot is a row of the flat view.
    key_cache.view(-1, *key_cache.shape[2:]).index_copy_(0, slots, key)
    value_cache.view(-1, *value_cache.shape[2:]).index_copy_(0, slots, value)


def _check_scatter(key, value, key_cache, value_cache, slot_mapping, cache_mode):
    if cache_mode != "Norm":
        # 'PA_NZ' (the default) expects NZ-format caches; vLLM's caches are ND.
        raise _scatter_error(PARAM_INVALID, f"cache_mode {cache_mode!r} expects NZ caches, but "
                             "the caches are ND [num_blocks, block_size, heads, head_size]: pass "
                             "cache_mode='Norm'")
    require_contiguous(_scatter_error, key=key, value=value, key_cache=key_cache,
                        value_cache=value_cache, slot_mapping=slot_mapping)
    if not (key.dtype == value.dtype == key_cache.dtype == value_cache.dtype):
        raise _scatter_error(PARAM_INVALID, "key, value and the caches must share one dtype, got "
                             f"{key.dtype}, {value.dtype}, {key_cache.dtype}, {value_cache.dtype}")
    # The doc allows int32 or int64 slots; upstream passes int32, and so must the product.
    if slot_mapping.dtype != torch.int32 or slot_mapping.dim() != 1:
        raise _scatter_error(PARAM_INVALID, f"slot_mapping must be a 1-D int32 tensor, got "
                             f"{slot_mapping.dim()}-D {slot_mapping.dtype}")
    if key.dim() != 3 or value.dim() != 3 or key_cache.dim() != 4 or value_cache.dim() != 4:
        raise _scatter_error(TILING_ERROR, "key/value must be [T, heads, head_size] and the "
                             "caches [num_blocks, block_size, heads, head_size]")
    if key.shape[1:] != key_cache.shape[2:] or value.shape[1:] != value_cache.shape[2:] or \
            key.shape[0] != value.shape[0] or key_cache.shape[:2] != value_cache.shape[:2]:
        raise _scatter_error(TILING_ERROR, f"shapes do not match: key {list(key.shape)}, value "
                             f"{list(value.shape)}, caches {list(key_cache.shape)} and "
                             f"{list(value_cache.shape)}")
    if slot_mapping.shape[0] != key.shape[0]:
        raise _scatter_error(TILING_ERROR, f"slot_mapping has {slot_mapping.shape[0]} slots for "
                             f"{key.shape[0]} tokens")


_lib.impl("npu_scatter_pa_kv_cache", kernel("npu_scatter_pa_kv_cache", _scatter_impl), "CPU")
# A replay checks what changes between replays (the slots' values it reads), not the tensors the
# capture checked (sim/aclnn.py).
aclnn.REPLAY["npu_scatter_pa_kv_cache"] = functools.partial(_scatter_impl, _replay=True)
