"""The simulator's device communicator: vLLM's CPU communicator (collectives over gloo between
host processes), holding what an HCCL communicator holds on the chip: 2 x HCCL_BUFFSIZE of device
memory outside torch's allocator, from its creation until it is destroyed (sim/memory.py)."""

import torch
from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

from vllm_ascend.device.sim import devices, memory


class SimCommunicator(CpuCommunicator):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._holder = f"HCCL buffers of {self.unique_name or 'a communicator'}"
        memory.charge(self._holder, memory.hccl_buffer_bytes(devices.total_memory()))

    def reduce_scatter(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """HCCL's reduce-scatter, as an in-place all-reduce and this rank's chunk. Gloo has no
        reduce-scatter of its own: its emulation copies the result out of a scratch tensor when
        the caller waits, and a graph capturing that copy would replay the capture's scratch."""
        dim = dim % input_.dim()
        if input_.shape[dim] % self.world_size:
            raise ValueError(f"reduce_scatter: dimension {dim} of {tuple(input_.shape)} does "
                             f"not split into {self.world_size} equal chunks")
        reduced = input_.contiguous().clone()
        torch.distributed.all_reduce(reduced, group=self.device_group)
        return reduced.chunk(self.world_size, dim)[self.rank_in_group].contiguous()

    def destroy(self):
        memory.release(self._holder)
        super().destroy()
