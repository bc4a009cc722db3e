"""Multi-LoRA on the NPU: vLLM's punica interface with static shapes, for graph capture.

Every token carries its adapter's slot (``token_lora_indices``, -1 for the base model) in a
buffer of fixed address that vLLM refills before each step. Each LoRA product runs against all
``max_loras`` slots at once, as one matrix product, and a one-hot mask of the token's slot keeps
its own adapter's rows: ``x @ A[slot]`` is ``(x @ [A_0; ...; A_L]) * mask``, and the expand
multiplies the masked rows by ``[B_0, ..., B_L]``, where only the token's slot is non-zero. The
shapes depend on the batch's token count alone, never on which adapters it mixes, so one
captured graph replays any mix, including adapters loaded into their slots after the capture
(their weights are copied into the same stacked tensors). There is no prefill/decode branch
(a captured graph would keep the branch of its capture) and no host sync: vLLM's prefill
metadata (segments by adapter, found with a sync) is not computed.

Upstream vllm-ascend calls its own AscendC kernels (``torch.ops._C_ascend.bgmv_shrink``,
``bgmv_expand``, ``sgmv_*``: a per-token gather of the adapter's weights) and falls back to
vLLM's torch ops (``vllm.lora.ops.torch_ops``) on 310P and for ranks of 128 and more. Those
kernels are built with upstream's package, not shipped with torch_npu; this wrapper uses aten
products only (torch_npu's matmul, mul and sum), so it runs on any Ascend chip. The cost is a
product over all slots: ``max_loras * rank`` columns instead of ``rank``, small beside the
layer's own product at vLLM's default ``max_loras`` and ranks up to 64.
"""

import torch
from vllm.lora.punica_wrapper.punica_base import PunicaWrapperBase


class PunicaWrapperNPU(PunicaWrapperBase):

    def __init__(self, max_num_batched_tokens: int, max_batches: int,
                 device: "torch.device | str", **kwargs):
        super().__init__(max_num_batched_tokens, max_batches, device)
        # Padding rows of a captured batch read past the step's tokens: the base model there
        # (the embeddings' indices are offsets into a table, 0 for the base model).
        for indices in (self._token_lora_indices, self._sampler_indices,
                        self._sampler_indices_padded):
            indices.fill_(-1)
        self._embeddings_indices.zero_()

    def update_metadata(self, mapping, lora_index_to_id, max_loras, vocab_size, **kwargs):
        # The base class adds prefill segments for sgmv kernels, found with host syncs.
        self._update_base_metadata(mapping, lora_index_to_id, max_loras, vocab_size)
        self.is_prefill = mapping.is_prefill

    # -- the two products, masked by each row's slot --------------------------------------------

    def _mask(self, indices: torch.Tensor, rows: int, slots: int) -> torch.Tensor:
        """[rows, slots] float32: 1 where the row's slot is the column (none for -1)."""
        slot = indices[:rows].unsqueeze(1)
        return (slot == torch.arange(slots, device=slot.device)).to(torch.float32)

    def _shrink(self, x: torch.Tensor, a: torch.Tensor, indices: torch.Tensor,
                scale: float) -> torch.Tensor:
        """[rows, rank] float32: scale * x @ A[slot].T for each row; a: [slots, 1, rank, in]."""
        slots, rank = a.shape[0], a.shape[-2]
        every = x.to(torch.float32) @ a.reshape(slots * rank, -1).to(torch.float32).t()
        mask = self._mask(indices, x.shape[0], slots)
        return (every.view(-1, slots, rank) * mask.unsqueeze(-1)).sum(1) * scale

    def _expand(self, h: torch.Tensor, b: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """[rows, out] float32: h @ B[slot].T for each row; h: [rows, rank], b: [slots, 1, out,
        rank]."""
        slots, out, rank = b.shape[0], b.shape[-2], b.shape[-1]
        mask = self._mask(indices, h.shape[0], slots)
        spread = (h.to(torch.float32).unsqueeze(1) * mask.unsqueeze(-1)).reshape(-1, slots * rank)
        stacked = b.reshape(slots, out, rank).to(torch.float32).transpose(1, 2)
        return spread @ stacked.reshape(slots * rank, out)

    # -- vLLM's interface --------------------------------------------------------------------------

    def add_shrink(self, y, x, lora_a_stacked, scale, **kwargs):
        x = x.view(-1, x.shape[-1])
        for out, a in zip(y, lora_a_stacked):
            out.view(-1, out.shape[-1]).add_(self._shrink(x, a, self._token_lora_indices, scale))

    def add_expand(self, y, x, lora_b_stacked, output_slices, offset_start=0, add_inputs=True,
                   **kwargs):
        y_2d = y.view(-1, y.shape[-1])
        offset = offset_start
        for h, b, size in zip(x, lora_b_stacked, output_slices):
            delta = self._expand(h.view(-1, h.shape[-1]), b, self._token_lora_indices)
            target = y_2d[:, offset:offset + size]
            target.copy_(target.to(torch.float32) + delta if add_inputs else delta)
            offset += size

    def add_lora_embedding(self, y, x, lora_b_stacked, add_inputs=True, **kwargs):
        delta = self._expand(x, lora_b_stacked, self._token_lora_indices)
        y.copy_(y.to(torch.float32) + delta if add_inputs else delta)

    def add_lora_linear(self, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, *,
                        buffer=None, **kwargs):
        assert len(lora_a_stacked) == len(lora_b_stacked) == len(output_slices)
        x = x.view(-1, x.shape[-1])
        shrunk = [self._shrink(x, a, self._token_lora_indices, scale) for a in lora_a_stacked]
        self.add_expand(y, shrunk, lora_b_stacked, output_slices,
                        add_inputs=kwargs.get("add_inputs", True))

    def add_lora_logits(self, y, x, lora_a_stacked, lora_b_stacked, scale, *, buffer=None,
                        **kwargs):
        y_2d, x = y.view(-1, y.shape[-1]), x.view(-1, x.shape[-1])
        h = self._shrink(x, lora_a_stacked, self._sampler_indices, scale)
        y_2d.copy_(y_2d.to(torch.float32) + self._expand(h, lora_b_stacked,
                                                         self._sampler_indices))

    def apply_lora_full_linear(self, y, x, weight_stacked, bias_stacked, module_enabled):
        adapter_y = self._shrink(x, weight_stacked, self._sampler_indices, 1.0)
        y.copy_(self._select_full_linear_output(y, adapter_y, bias_stacked, module_enabled))
