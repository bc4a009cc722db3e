"""The simulator's device communicator: vLLM's CPU communicator (collectives over gloo between
host processes), holding what an HCCL communicator holds on the chip: 2 x HCCL_BUFFSIZE of device
memory outside torch's allocator, from its creation until it is destroyed (sim/memory.py)."""

from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

from vllm_ascend.device.sim import memory


class SimCommunicator(CpuCommunicator):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._holder = f"HCCL buffers of {self.unique_name or 'a communicator'}"
        memory.charge(self._holder, memory.hccl_buffer_bytes())

    def destroy(self):
        memory.release(self._holder)
        super().destroy()
