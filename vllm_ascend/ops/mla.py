"""The MLA layer on Ascend: vLLM's MultiHeadLatentAttentionWrapper with the fused MLA operators.

vLLM's wrapper normalises the latent and ropes the key before its attention op, then writes the
cache; upstream vllm-ascend fuses norm, RoPE and the cache write into one operator
(``npu_kv_rmsnorm_rope_cache``) that takes the latent before the norm. So the projections stay
in the compiled graph, and one opaque op, ``vllm::ascend_mla_attention`` (a PIECEWISE splitting
point, like vLLM's attention ops), takes the query and the un-normed latent and returns the
attention output for ``o_proj``: attention/mla.py's AscendMLAImpl.forward.
"""

import torch
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import MLAAttention
from vllm.model_executor.layers.linear import UnquantizedLinearMethod
from vllm.model_executor.layers.mla import MultiHeadLatentAttentionWrapper
from vllm.model_executor.utils import replace_parameter
from vllm.utils.torch_utils import direct_register_custom_op

from vllm_ascend.attention.mla import is_profiling_prefill
from vllm_ascend.ops.qkv import StepRope


class AscendMLAAttention(MLAAttention):
    def process_weights_after_loading(self, act_dtype: torch.dtype):
        # vLLM keeps W_UK_T and W_UV as transposed views; the NPU matmuls take them contiguous
        # (upstream makes them so). On a reload vLLM copies into them in place, so graphs keep
        # their addresses and they stay contiguous.
        super().process_weights_after_loading(act_dtype)
        for name in ("W_UK_T", "W_UV"):
            if not getattr(self, name).is_contiguous():
                replace_parameter(self, name, getattr(self, name).contiguous())


@MultiHeadLatentAttentionWrapper.register_oot
class AscendMultiHeadLatentAttention(MultiHeadLatentAttentionWrapper):

    def __init__(self, hidden_size, num_heads, scale, qk_nope_head_dim, qk_rope_head_dim,
                 v_head_dim, q_lora_rank, kv_lora_rank, mla_modules, cache_config=None,
                 quant_config=None, prefix="", **kwargs):
        if mla_modules.is_sparse or mla_modules.indexer is not None:
            raise NotImplementedError("sparse MLA (DeepSeek-V3.2's indexer) is not supported by "
                                      "vllm-ascend yet")
        if mla_modules.rotary_emb is None:
            raise NotImplementedError("MLA without a rotary embedding is not supported by "
                                      "vllm-ascend: its fused operators rope the key's rope part")
        super().__init__(hidden_size, num_heads, scale, qk_nope_head_dim, qk_rope_head_dim,
                         v_head_dim, q_lora_rank, kv_lora_rank, mla_modules, cache_config,
                         quant_config, prefix, **kwargs)
        if not isinstance(self.kv_b_proj.quant_method, UnquantizedLinearMethod):
            raise NotImplementedError(
                f"{prefix}.kv_b_proj is {type(self.kv_b_proj.quant_method).__name__} in this "
                "checkpoint: vllm-ascend takes DeepSeek's kv_b_proj unquantized, as upstream "
                "does (its W_UK and W_UV are split from it); export it FLOAT")
        self.mla_attn.__class__ = AscendMLAAttention  # adds no state: see above
        config = self.mla_attn._vllm_config
        # The step's cos/sin rows, in the half layout the interleave-rope operators take; the
        # runner fills them before each forward. A family file shares one among all its layers
        # (models/common.py attach_step_rope).
        self.step_rope = StepRope()
        self.step_rope.attach(self.rotary_emb, config.scheduler_config.max_num_batched_tokens,
                              config.model_config.dtype, half_layout=True)
        self.layer_name = f"{prefix}.mla"
        context = config.compilation_config.static_forward_context
        if self.layer_name in context:
            raise ValueError(f"Duplicate layer name: {self.layer_name}")
        context[self.layer_name] = self

    def forward(self, positions, hidden_states, llama_4_scaling=None):
        # The projections of vLLM's wrapper, then the fused op in place of its norm, RoPE and
        # attention op.
        if llama_4_scaling is not None:
            raise NotImplementedError("llama_4_scaling is not supported by the Ascend MLA layer")
        if self.q_lora_rank is not None:
            q_c, kv_no_split = self.fused_qkv_a_proj(hidden_states)[0].split(
                [self.q_lora_rank, self.kv_lora_rank + self.qk_rope_head_dim], dim=-1)
            q = self.q_b_proj(self.q_a_layernorm(q_c))[0]
        else:
            kv_no_split = self.kv_a_proj_with_mqa(hidden_states)[0]
            q = self.q_proj(hidden_states)[0]
        output = torch.empty(hidden_states.shape[0], self.num_heads * self.v_head_dim,
                             dtype=hidden_states.dtype, device=hidden_states.device)
        torch.ops.vllm.ascend_mla_attention(q.view(-1, self.num_heads, self.qk_head_dim),
                                            kv_no_split.contiguous(), output, self.layer_name)
        return self.o_proj(output)[0]


def ascend_mla_attention(q: torch.Tensor, kv_no_split: torch.Tensor, output: torch.Tensor,
                         layer_name: str) -> None:
    ctx = get_forward_context()
    mla = ctx.no_compile_layers[layer_name]
    attn = mla.mla_attn
    metadata = ctx.attn_metadata
    if isinstance(metadata, list):  # micro-batches are not used on Ascend
        raise NotImplementedError("micro-batched MLA is not supported")
    metadata = metadata.get(attn.layer_name) if metadata else None
    if metadata is None:  # a dummy run: nothing to attend to
        if is_profiling_prefill():
            attn.impl.reserve_prefill(q)
        output.fill_(0)
        return
    t = q.shape[0]
    cos, sin = (x.view(t, 1, 1, -1) for x in mla.step_rope.get(t))
    attn.impl.forward(attn, q, kv_no_split, mla.kv_a_layernorm, cos, sin,
                      ctx.slot_mapping[attn.layer_name], metadata, output)


def _ascend_mla_attention_fake(q, kv_no_split, output, layer_name) -> None:
    return


direct_register_custom_op(op_name="ascend_mla_attention", op_func=ascend_mla_attention,
                          mutates_args=["output"], fake_impl=_ascend_mla_attention_fake)
