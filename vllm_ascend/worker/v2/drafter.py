"""The EAGLE drafter of Model Runner V2 on Ascend: vLLM's speculator (spec_decode/
target_dependent_ar, whose code MTP's shares; worker/choice.py runs EAGLE and EAGLE-3 heads),
with what FIA needs of its draft decode steps and the ACL graph managers.

vLLM gives a draft decode step's attention an upper bound of each request's KV length (the
verify step's length plus the step: drafts the verify step rejected are known on the device
only); FIA reads the exact lengths from the host, so they are read back once per draft step, as
V1's drafter does (attention/backend.py). A FULL draft step's batch is padded to its graph's
request count with whole one-token requests, as the runner pads a FULL step (worker/padding.py):
in TND layout FIA needs every padded token to belong to one.
"""

import numpy as np
import torch
from vllm.config import CUDAGraphMode

from vllm_ascend.worker.v2.graphs import NPUDraftGraphManager

_CLASSES: dict = {}


class NPUDrafting:
    """Mixed into vLLM's speculator class (``on_npu``)."""

    graph_state = None  # the runner's GraphState, set before its graph managers are made

    def init_cudagraph_manager(self, cudagraph_mode: CUDAGraphMode) -> None:
        """vLLM's managers, made ACL ones: the draft prefill's replays re-issue the verify
        step's FIA lists (its metadata is the target's), a draft step's its own."""
        super().init_cudagraph_manager(cudagraph_mode)
        target = self.target_attn_groups[0][0].get_metadata_builder()
        own = self.attn_groups[0][0].get_metadata_builder()
        self.prefill_cudagraph_manager = NPUDraftGraphManager.replacing(
            self.prefill_cudagraph_manager, state=self.graph_state,
            step_metadata=lambda: target.latest)
        self.decode_cudagraph_manager = NPUDraftGraphManager.replacing(
            self.decode_cudagraph_manager, state=self.graph_state,
            step_metadata=lambda: own.latest)

    def _build_attn_metadata(self, num_reqs, batch_desc, query_start_loc_np,
                             seq_lens_cpu_upper_bound, step, *args, **kwargs):
        """A draft decode step's metadata with the exact KV lengths on the host (vLLM adds
        ``step`` to what it is given), and a FULL step's padding as one-token requests."""
        exact = self.input_buffers.seq_lens[:num_reqs].cpu() - step  # one device-to-host copy
        padded = batch_desc.num_reqs or num_reqs
        if batch_desc.cg_mode == CUDAGraphMode.FULL and padded > num_reqs:
            if int(query_start_loc_np[num_reqs]) != num_reqs:
                raise NotImplementedError("a FULL draft step of more than one token a request")
            exact = np.concatenate([exact.numpy(), np.full(padded - num_reqs, 1 - step)])
            query_start_loc_np = self.arange_np[:padded + 1]
            exact, num_reqs = torch.from_numpy(exact.astype(np.int32)), padded
        return super()._build_attn_metadata(num_reqs, batch_desc, query_start_loc_np, exact,
                                            step, *args, **kwargs)


def on_npu(speculator, graph_state):
    """``speculator`` (vLLM's, as its runner built it) remade as the NPU drafter of its class."""
    cls = type(speculator)
    npu_cls = _CLASSES.setdefault(cls, type(f"NPU{cls.__name__}", (NPUDrafting, cls), {}))
    drafter = npu_cls(speculator.vllm_config, speculator.device)
    drafter.graph_state = graph_state
    return drafter
