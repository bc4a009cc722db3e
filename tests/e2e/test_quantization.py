"""W8A8 checkpoints in ModelSlim's format (docs/quantization.md): exports of the tiny Llama and
Qwen3 load without a flag and stay close to the fp32 reference that applies the same
quantization (w8a8_reference.py), with the graphs each mode calls for replayed; a malformed
export fails at load with the layer's name and the fix.

Modes: each scheme runs in every graph mode (the CASES below, with test_graph_modes.py's Llama
exports in PIECEWISE and FULL through all its checks); test_parallel.py runs a mixed Qwen2-MoE
export at TP=2; test_torch_npu_calls.py checks every quantized call's shape."""

import pytest

from tests.e2e.conftest import (PROMPTS, QUANTIZED, broken_export, check_logprobs_close, engine,
                                expected_replays, hf_greedy, MAX_TOKENS, model_path, replays,
                                vllm_greedy)

# Both schemes in every mode: Qwen3's static export in all five, Llama's dynamic export in all
# but PIECEWISE (test_graph_modes.py runs it there, and the static one in FULL), Qwen3's dynamic
# export in FULL_DECODE_ONLY.
# The quick tier keeps each scheme eagerly and in one graph mode; the others run in the full tier.
QUICK = {("qwen3-w8a8", "NONE"), ("qwen3-w8a8", "FULL_AND_PIECEWISE"),
         ("qwen3-w8a8-dynamic", "FULL_DECODE_ONLY"), ("llama-w8a8-dynamic", "NONE")}
CASES = [pytest.param(case, marks=() if case in QUICK else pytest.mark.slow) for case in (
    [("qwen3-w8a8", m) for m in ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY",
                                 "FULL_AND_PIECEWISE")]
    + [("qwen3-w8a8-dynamic", "FULL_DECODE_ONLY")]
    + [("llama-w8a8-dynamic", m) for m in ("NONE", "FULL", "FULL_DECODE_ONLY",
                                           "FULL_AND_PIECEWISE")])]
CAPTURE_SIZES = [1, 2, 4]
SHORT = "Hi there"  # a prefill within the largest capture size: PIECEWISE pieces replay for it


@pytest.fixture(scope="module", params=CASES, ids=lambda p: f"{p[0]}-{p[1]}")
def quantized_llm(request):
    name, mode = request.param
    mode_args = {"enforce_eager": True} if mode == "NONE" else {"compilation_config": {
        "cudagraph_mode": mode, "cudagraph_capture_sizes": CAPTURE_SIZES}}
    # No quantization argument: the export's quant_model_description.json selects it.
    with engine(model_path(name), max_num_seqs=4, dtype=QUANTIZED[name][2], **mode_args) as llm:
        yield name, mode, llm


def test_an_export_runs_quantized_and_close_to_its_reference(quantized_llm):
    name, mode, llm = quantized_llm
    assert llm.llm_engine.vllm_config.model_config.quantization == "ascend"
    n, prompts = MAX_TOKENS, PROMPTS + [SHORT]
    with replays(llm) as made:
        outs = vllm_greedy(llm, PROMPTS, n) + vllm_greedy(llm, [SHORT], n)  # SHORT alone
    for prompt, out in zip(prompts, outs):
        check_logprobs_close(hf_greedy(model_path(name), prompt, n), out, f"{name} {mode} "
                             f"{prompt!r}", dtype=QUANTIZED[name][2])
    layers = llm.llm_engine.vllm_config.model_config.hf_config.num_hidden_layers
    expected = expected_replays(mode, made["steps"], layers, max(CAPTURE_SIZES))
    assert made["replayed"] == expected, made
    if mode not in ("NONE", "PIECEWISE"):
        assert expected.get("FULL"), made  # decode steps replayed FULL graphs
    if mode in ("PIECEWISE", "FULL_AND_PIECEWISE"):
        assert expected.get("PIECEWISE"), made  # the short prefill's pieces


def test_layers_hold_int8_weights_and_norms_quantize_for_them(quantized_llm):
    name, mode, llm = quantized_llm
    scheme = QUANTIZED[name][1]

    def probe(model):
        from vllm.model_executor.layers.linear import LinearBase

        linear = [m for m in model.modules() if isinstance(m, LinearBase)]
        fused = sum(getattr(m, "quantized_for", None) is not None for m in model.modules())
        return (sorted({type(m.quant_method).__name__ for m in linear}),
                sorted({str(m.weight.dtype) for m in linear}), fused)

    linear, weights, fused = llm.apply_model(probe)[0]
    method = {"W8A8_DYNAMIC": "W8A8DynamicMethod", "W8A8": "W8A8StaticMethod"}[scheme]
    assert linear == [method] and weights == ["torch.int8"]
    # Per decoder layer, both norms before a quantized layer (input -> qkv_proj, post-attention
    # -> gate_up_proj) quantize its activation in their kernel.
    layers = llm.llm_engine.vllm_config.model_config.hf_config.num_hidden_layers
    assert fused == 2 * layers
    # ... and each forward runs the fused kernel (replayed: a FULL graph, or every piece of one;
    # eagerly, enforce_eager, where no FX pass runs): it adds, norms and quantizes
    # 2 x layers - 1 times in one op (the first layer's input norm has no residual to add); the
    # one unfused add + norm is the final norm, before the LM head, which is not quantized.
    from vllm_ascend.device.sim.ledger import Ledger

    with replays(llm) as made, Ledger() as ledger:
        vllm_greedy(llm, [SHORT], 4)
    forwards = (made["replayed"].get("FULL", 0)
                + made["replayed"].get("PIECEWISE", 0) // (layers + 1))
    kernel = {"W8A8_DYNAMIC": "npu_add_rms_norm_dynamic_quant",
              "W8A8": "npu_add_rms_norm_quant"}[scheme]
    ran = ledger.replayed_ops
    if mode == "NONE":
        forwards, ran = len(made["steps"]), ledger.launched_ops
    assert forwards and ran[f"ascend_sim::{kernel}"] == (2 * layers - 1) * forwards, (made, ran)
    assert ran["ascend_sim::npu_add_rms_norm"] == forwards, ran


# -- malformed exports ---------------------------------------------------------------------------

def drop_weight_scale(tensors, description):
    del tensors["model.layers.1.mlp.down_proj.weight_scale"]


def float_weight(tensors, description):
    name = "model.layers.0.self_attn.k_proj.weight"
    tensors[name] = tensors[name].half()


def list_a_static_tensor(tensors, description):
    description["model.layers.0.mlp.up_proj.input_scale"] = "W8A8_DYNAMIC"


def asymmetric_weight(tensors, description):
    tensors["model.layers.1.mlp.down_proj.weight_offset"][3] = 2.0


@pytest.mark.parametrize("edit,message", [
    (drop_weight_scale, r"model\.layers\.1\.mlp\.down_proj: the checkpoint has no weight_scale "
                        r"for it \(a W8A8_DYNAMIC layer carries weight, weight_scale, "
                        r"weight_offset\)\. Re-export the model with ModelSlim"),
    (float_weight, r"model\.layers\.0\.self_attn\.qkv_proj\.weight is torch\.float16 in the "
                   r"checkpoint; a W8A8_DYNAMIC layer's weight must be int8\. Re-export"),
    (list_a_static_tensor, r"model\.layers\.0\.mlp\.up_proj is W8A8_DYNAMIC but the checkpoint "
                           r"also lists input_scale, which a W8A8_DYNAMIC layer does not carry"),
    (asymmetric_weight, r"model\.layers\.1\.mlp\.down_proj: weight_offset is not zero; "
                        r"vllm-ascend runs symmetric int8 weights only \(npu_quant_matmul takes "
                        r"no weight offset\)\. Quantize the weights symmetrically with ModelSlim"),
], ids=["missing-weight_scale", "float-weight", "unexpected-tensor", "asymmetric-weight"])
def test_a_malformed_export_fails_at_load_naming_the_layer(tmp_path, edit, message):
    from vllm_ascend.quantization.w8a8 import CheckpointError

    with pytest.raises(CheckpointError, match=message):
        with engine(broken_export(tmp_path, "llama-w8a8-dynamic", edit), enforce_eager=True):
            pass


def test_the_ascend_method_on_a_float_checkpoint_says_what_to_do():
    from vllm.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match=r"quantization='ascend' reads ModelSlim checkpoints, and "
                       r".* has no quant_model_description\.json: it is not a ModelSlim export\. "
                       r"Drop --quantization ascend"):
        EngineArgs(model_path("llama"), quantization="ascend",
                   max_model_len=256).create_engine_config()
