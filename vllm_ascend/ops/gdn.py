"""Gated DeltaNet on Ascend (Qwen3-Next's linear-attention layers): vLLM's layer, its core on
torch_npu's delta-rule operators.

vLLM's ``QwenGatedDeltaNetAttention`` keeps its projections, its gated RMSNorm and its custom op
``vllm::qwen_gdn_attention_core`` (a splitting op of PIECEWISE graphs); only the core is Ascend's:

* the causal conv1d with its rolling state: aten ops (torch_npu's ``npu_fused_causal_conv1d``
  is Ascend 950 only, with a kernel width of 3; upstream calls its own AscendC build,
  ``torch.ops._C_ascend.npu_causal_conv1d_custom``, which torch_npu does not ship);
* the gating (``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)``) and the q/k
  L2 norms: aten ops (upstream: triton-ascend kernels);
* prefill: ``torch_npu.npu_chunk_gated_delta_rule``; decode: ``npu_recurrent_gated_delta_rule``
  on the state pool in place (upstream: its own AscendC build of the same operator).

A decode step reads only device tensors (the state indices vLLM's builder keeps in persistent
buffers, updated before each step), so a FULL graph replays it with the step's requests; a step
with prefills runs eagerly (vLLM's builder gives FULL graphs uniform decode batches only) and
reads the sequences' lengths on the host. The states live in the KV cache's lanes
(attention/hybrid.py).
"""

import torch
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention
from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

from vllm_ascend.device import torch_npu

L2_EPS = 1e-6  # vLLM's FLA l2norm_fwd


def l2_normalised(x: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + L2_EPS)).to(torch.bfloat16)


def conv_taps(window: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    """The causal conv1d's outputs from ``window`` [..., dim, width + n - 1] (the state, then
    the tokens), SiLU-activated, in float32: tap by tap in one order, so that a token gets the
    same bits in a decode step and in a prefill."""
    width = weight.shape[-1]
    n = window.shape[-1] - width + 1
    w = weight.float()
    acc = window[..., 0:n].float() * w[:, 0:1]
    for j in range(1, width):
        acc = acc + window[..., j:j + n].float() * w[:, j:j + 1]
    if bias is not None:
        acc = acc + bias.float()[:, None]
    return torch.nn.functional.silu(acc)


@QwenGatedDeltaNetAttention.register_oot(name="QwenGatedDeltaNetAttention")
class AscendQwenGatedDeltaNetAttention(QwenGatedDeltaNetAttention):

    def bind_kv_cache(self, kv_cache) -> None:
        # The (conv, recurrent) state views of the KV cache's lanes (attention/hybrid.py), not
        # a page to unpack.
        self.kv_cache = tuple(kv_cache)

    def _warmup_prefill_kernels(self, *args, **kwargs) -> None:
        return  # (Triton's autotuning in upstream's)

    def _forward_core(self, mixed_qkv, b, a, core_attn_out):
        metadata = get_forward_context().attn_metadata
        md = metadata.get(self.prefix) if isinstance(metadata, dict) else None
        if md is None:
            return  # the profile run
        if md.spec_sequence_masks is not None:
            raise NotImplementedError("speculative decoding on Gated DeltaNet layers")
        conv, ssm = self.kv_cache
        if not is_conv_state_dim_first():
            conv = conv.transpose(-1, -2)  # [blocks, dim, width - 1]
        n = md.num_actual_tokens
        weight = self.conv1d.weight.view(self.conv1d.weight.size(0), -1)
        args = (mixed_qkv[:n], b[:n], a[:n], conv, ssm, weight)
        if md.num_prefills == 0:
            out = self._decode(md.non_spec_state_indices_tensor[:n], *args)
        else:
            out = self._prefill(md, *args)
        core_attn_out[:n] = out

    def _gating(self, b, a):
        g = -self.A_log.float().exp() * torch.nn.functional.softplus(
            a.float() + self.dt_bias.float())
        return g.contiguous(), torch.sigmoid(b.float()).to(torch.bfloat16)

    def _split(self, y):
        """q, k (L2-normalised) and v, bfloat16 [T, heads, head_dim], from the conv's output."""
        keys = self.key_dim // self.tp_size
        q, k, v = torch.split(y, [keys, keys, self.value_dim // self.tp_size], dim=-1)
        t = y.shape[0]
        return (l2_normalised(q.reshape(t, -1, self.head_k_dim)),
                l2_normalised(k.reshape(t, -1, self.head_k_dim)),
                v.reshape(t, -1, self.head_v_dim).to(torch.bfloat16).contiguous())

    def _decode(self, slots, x, b, a, conv, ssm, weight):
        """One token per sequence, device tensors only (a FULL graph's step)."""
        index = slots.long()
        window = torch.cat([conv.index_select(0, index), x.unsqueeze(-1).to(conv.dtype)], -1)
        conv.index_copy_(0, index, window[..., 1:])
        y = conv_taps(window, weight, self.conv1d.bias)[..., 0]
        q, k, v = self._split(y)
        g, beta = self._gating(b, a)
        lengths = torch.ones(x.shape[0], dtype=torch.int32, device=x.device)
        return torch_npu.npu_recurrent_gated_delta_rule(
            q, k, v, ssm, beta=beta, scale=self.head_k_dim ** -0.5,
            actual_seq_lengths=lengths, ssm_state_indices=slots.to(torch.int32), g=g)

    def _prefill(self, md, x, b, a, conv, ssm, weight):
        """A step with prefills (eager): each sequence's conv from its state (zero for a new
        one), then every sequence through the chunked rule from its recurrent state."""
        starts = md.non_spec_query_start_loc.tolist()
        slots = md.non_spec_state_indices_tensor.tolist()
        has_state = (md.has_initial_state.tolist() if md.has_initial_state is not None
                     else [True] * len(slots))
        ys, keep, lens = [], [], []
        for i in range(len(starts) - 1):
            s, e = starts[i], starts[i + 1]
            if e == s:
                continue  # a padding request
            state = conv[slots[i]] if has_state[i] else torch.zeros_like(conv[slots[i]])
            window = torch.cat([state, x[s:e].t().to(conv.dtype)], -1)
            conv[slots[i]] = window[..., -state.shape[-1]:]
            ys.append(conv_taps(window, weight, self.conv1d.bias).t())
            keep.append(i)
            lens.append(e - s)
        y = torch.cat(ys)
        tokens = y.shape[0]
        q, k, v = self._split(y)
        g, beta = self._gating(b[:tokens], a[:tokens])
        index = torch.tensor([slots[i] for i in keep], dtype=torch.long, device=x.device)
        initial = ssm.index_select(0, index)
        fresh = torch.tensor([not has_state[i] for i in keep], device=x.device)
        initial[fresh] = 0
        out, final = torch_npu.npu_chunk_gated_delta_rule(
            q, k, v, beta=beta, initial_state=initial.contiguous(),
            actual_seq_lengths=torch.tensor(lens, dtype=torch.int32, device=x.device),
            scale=self.head_k_dim ** -0.5, g=g)
        ssm.index_copy_(0, index, final.to(ssm.dtype))
        return out
