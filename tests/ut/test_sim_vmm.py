"""The simulator's virtual memory (pyACL's acl.rt, device/sim/acl.py), torch_npu's memory pools
on a custom allocator (device/sim/mempool.py), and sleep mode's allocator on both
(vllm_ascend/device_allocator/vmm.py): addresses stay while memory sleeps, what sleeps cannot
be read by a graph replay, and the device's memory shows what is released."""

import ctypes

import pytest
import torch

from vllm_ascend.device.sim import acl, npu
from vllm_ascend.device_allocator.vmm import NPUMemAllocator
from vllm_ascend.device.sim.errors import GraphReplayError

MB2 = acl.GRANULARITY
PROP = {"handleType": 0, "allocationType": 0, "memAttr": 0, "location": {"id": 0, "type": 1},
        "reserve": 0}


def test_reserve_map_unmap_and_release_with_the_runtimes_codes():
    ptr, ret = acl.rt.reserve_mem_address(MB2, 0, 0, 0)
    assert ret == 0
    handle, ret = acl.rt.malloc_physical(MB2, PROP, 0)
    assert ret == 0 and acl.rt.map_mem(ptr, MB2, 0, handle, 0) == 0
    ctypes.memset(ptr, 7, MB2)  # mapped memory is readable and writable
    assert acl.rt.map_mem(ptr, MB2, 0, handle, 0) == acl.ACL_ERROR_RT_PARAM_INVALID  # twice
    assert acl.rt.free_physical(handle) == acl.ACL_ERROR_RT_PARAM_INVALID  # still mapped
    assert acl.rt.release_mem_address(ptr) == acl.ACL_ERROR_RT_PARAM_INVALID  # still mapped
    assert acl.unmapped_range_holding(ptr, 8) is None
    assert acl.rt.unmap_mem(ptr) == 0 and acl.rt.free_physical(handle) == 0
    assert acl.unmapped_range_holding(ptr + 8, 8) == (ptr, MB2)  # reserved, not mapped
    assert acl.rt.release_mem_address(ptr) == 0
    assert acl.unmapped_range_holding(ptr, 8) is None


@pytest.mark.parametrize("size", [0, MB2 - 1, MB2 + 512])
def test_sizes_off_the_2mb_page_are_refused(size):
    assert acl.rt.reserve_mem_address(size, 0, 0, 0)[1] == acl.ACL_ERROR_RT_PARAM_INVALID
    assert acl.rt.malloc_physical(size, PROP, 0)[1] == acl.ACL_ERROR_RT_PARAM_INVALID


def test_physical_memory_counts_against_the_device_and_fails_beyond_it(monkeypatch):
    allocated = npu.memory_allocated()
    handle, ret = acl.rt.malloc_physical(4 * MB2, PROP, 0)
    assert ret == 0 and npu.memory_allocated() >= allocated + 4 * MB2
    assert acl.rt.free_physical(handle) == 0
    monkeypatch.setenv("VLLM_ASCEND_SIM_MEMORY_GB", "0.5")
    assert acl.rt.malloc_physical(512 * MB2, PROP, 0)[1] == acl.ACL_ERROR_RT_MEMORY_ALLOCATION


def test_memcpy_needs_mapped_device_memory_and_host_memory():
    host, ret = acl.rt.malloc_host(64)
    assert ret == 0
    ptr, _ = acl.rt.reserve_mem_address(MB2, 0, 0, 0)
    assert acl.rt.memcpy(ptr, 64, host, 64, acl.ACL_MEMCPY_HOST_TO_DEVICE) == \
        acl.ACL_ERROR_RT_PARAM_INVALID  # nothing mapped there
    handle, _ = acl.rt.malloc_physical(MB2, PROP, 0)
    acl.rt.map_mem(ptr, MB2, 0, handle, 0)
    ctypes.memset(host, 5, 64)
    assert acl.rt.memcpy(ptr, 64, host, 64, acl.ACL_MEMCPY_HOST_TO_DEVICE) == 0
    assert ctypes.string_at(ptr, 64) == b"\x05" * 64
    assert acl.rt.memcpy(host, 32, ptr, 64, acl.ACL_MEMCPY_DEVICE_TO_HOST) == \
        acl.ACL_ERROR_RT_PARAM_INVALID  # destination smaller than the copy
    for ret in (acl.rt.unmap_mem(ptr), acl.rt.free_physical(handle),
                acl.rt.release_mem_address(ptr), acl.rt.free_host(host)):
        assert ret == 0


def test_pool_tensors_live_in_its_memory_and_give_it_back_when_dead():
    allocator = NPUMemAllocator()
    with torch.inference_mode(), allocator.use_memory_pool("weights"):
        w = torch.randn(256, 256)
        product = w @ w  # every new storage in the pool, views and in-place results not
        view = w.t()
    assert {ptr for ptr in allocator.allocations} == {w.data_ptr(), product.data_ptr()}
    assert view.data_ptr() == w.data_ptr()
    assert allocator.usage_by_tag() == {"weights": (2 * MB2, 0)}
    del product
    assert allocator.usage_by_tag() == {"weights": (MB2, 0)}


def test_sleeping_memory_keeps_its_address_and_a_replay_reading_it_fails_until_woken():
    allocator = NPUMemAllocator()
    with torch.inference_mode():
        with allocator.use_memory_pool("weights"):
            w = torch.randn(64, 64)
        with allocator.use_memory_pool("kv_cache"):
            cache = torch.zeros(64, 64)
        x, address, used = torch.randn(4, 64), w.data_ptr(), npu.memory_allocated()
        stream = npu.Stream()
        g = npu.NPUGraph()
        with npu.stream(stream), npu.graph(g):
            out = x @ w + cache[:4]
        expected = out.clone()

        allocator.sleep(offload_tags=("weights",))
        assert allocator.usage_by_tag() == {"weights": (0, MB2), "kv_cache": (0, MB2)}
        assert used - npu.memory_allocated() >= 2 * MB2 - (1 << 16)  # both back (the heap moves)
        with pytest.raises(GraphReplayError, match="ACL error 507015"):
            g.replay()

        allocator.wake_up(tags=["weights"])  # the KV cache stays asleep
        assert allocator.asleep_tags() == ["kv_cache"]
        with pytest.raises(GraphReplayError, match="unmapped"):
            g.replay()
        allocator.wake_up()
        cache.zero_()  # discarded contents are undefined
        out.zero_()
        g.replay()
        assert w.data_ptr() == address and torch.equal(out, expected)  # the weights came back
