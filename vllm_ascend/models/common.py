"""What the families share: their attention with the fused QKV op."""

import torch

from vllm_ascend.ops.qkv import StepRope, split_qkv_norm_rope


def attach_step_rope(model: torch.nn.Module, vllm_config, of_type: type = torch.nn.Module,
                     half_layout: bool = False) -> StepRope:
    """Give the model one set of step cos/sin buffers, made from its rotary table, which all its
    attention layers (the modules ``of_type`` with a ``rotary_emb``) share (``module.step_rope``;
    the runner fills it before each forward; returned). ``half_layout``: see StepRope.attach."""
    max_tokens = vllm_config.scheduler_config.max_num_batched_tokens
    step_rope = StepRope()
    for module in model.modules():
        rope = getattr(module, "rotary_emb", None)
        if isinstance(module, of_type) and rope is not None and hasattr(rope, "cos_sin_cache"):
            step_rope.attach(rope, max_tokens, vllm_config.model_config.dtype, half_layout)
            module.step_rope = step_rope
    return step_rope


def fused_attention_forward(attn, positions: torch.Tensor, hidden_states: torch.Tensor,
                            q_norm=None, k_norm=None) -> torch.Tensor:
    """qkv_proj -> fused split(+q/k norm)+RoPE -> attention -> o_proj."""
    qkv, _ = attn.qkv_proj(hidden_states)
    q, k, v = split_qkv_norm_rope(qkv, attn.q_size, attn.kv_size, attn.head_dim,
                                  attn.step_rope, q_norm, k_norm)
    output, _ = attn.o_proj(attn.attn(q, k, v))
    return output


def fuse_norms_into_quantization(model: torch.nn.Module, pairs=(
        ("input_layernorm", "self_attn.qkv_proj"), ("post_attention_layernorm",
                                                    "mlp.gate_up_proj"))) -> None:
    """For each decoder layer, the norms whose output only the given linear layer reads quantize
    that layer's activation in the norm's kernel, when the layer is W8A8 (ops/layernorm.py)."""
    for module in list(model.modules()):
        for norm_name, linear_name in pairs:
            try:
                norm, linear = module.get_submodule(norm_name), module.get_submodule(linear_name)
            except AttributeError:  # not a decoder layer, or its MLP is a mixture of experts
                continue
            if hasattr(getattr(linear, "quant_method", None), "add_norm_quant"):
                # Kept out of the module tree: the layer is the decoder's, not the norm's.
                object.__setattr__(norm, "quantized_for", linear)


def use_attention_class(model: torch.nn.Module, upstream: type, fused: type) -> None:
    """Re-class upstream attention modules as ``fused`` (a subclass that only overrides
    forward, adding no state). Upstream's Qwen2/Qwen3ForCausalLM build their decoder layers
    with no hook for another attention class."""
    assert issubclass(fused, upstream)
    for module in model.modules():
        if type(module) is upstream:
            module.__class__ = fused
