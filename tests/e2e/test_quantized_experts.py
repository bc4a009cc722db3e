"""W8A8_DYNAMIC MoE experts (quantization/w8a8_moe.py): ModelSlim exports of the tiny Qwen3-MoE
and DeepSeek-V2-MoE whose linear layers and routed experts are all W8A8_DYNAMIC (DeepSeek's MLA
keeps its latent projections FLOAT) load without a flag, hold int8 experts, and stay close to
the fp32 reference that applies the same quantization (w8a8_reference.py) in NONE,
FULL_DECODE_ONLY and FULL_AND_PIECEWISE (and Qwen3-MoE's float16 export, whose expert scales are
float32, in FULL_DECODE_ONLY), with the graphs each mode calls for replayed. Qwen3-MoE's
graph modes give its eager result exactly (its file fuses each norm into the quantization after
it in eager steps too); DeepSeek-V2's do not, by design: in compiled modes the norm-quant FX pass
fuses its dense layer's post-attention norm into the MLP's quantization
(npu_add_rms_norm_dynamic_quant, which quantizes the float32 norm), which eager steps run apart.
At TP=2 with expert parallelism: test_parallel.py. A malformed expert export fails at load
naming the layer."""

import functools
from unittest import mock

import pytest

from tests.e2e.conftest import (PROMPTS, QUANTIZED, broken_export, check_identical,
                                check_logprobs_close, check_replays, engine, expected_replays,
                                hf_greedy, MAX_TOKENS, model_path, replays, vllm_greedy)

EXPORTS = ["qwen3_moe-w8a8-dynamic", "deepseek_v2_moe-w8a8-dynamic", "deepseek_v3-w8a8-dynamic"]
ROUTING = {"deepseek_v3-w8a8-dynamic": "sigmoid scores plus a correction bias"}  # else softmax
MODES = ["NONE", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"]
CAPTURE_SIZES = [1, 2, 4]
QUICK = {("qwen3_moe-w8a8-dynamic", "FULL_DECODE_ONLY")}


def probe(model):
    """Each MoE layer's method and its experts' weight dtypes."""
    from vllm.model_executor.layers.fused_moe import RoutedExperts

    return sorted({(type(m.quant_method).__name__, str(m.w13_weight.dtype), str(m.w2_weight.dtype))
                   for m in model.modules() if isinstance(m, RoutedExperts)})


@functools.lru_cache(maxsize=None)
def run(name: str, mode: str) -> dict:
    """The export's greedy outputs in ``mode``, its MoE layers and the replays they made."""
    mode_args = {"enforce_eager": True} if mode == "NONE" else {"compilation_config": {
        "cudagraph_mode": mode, "cudagraph_capture_sizes": CAPTURE_SIZES}}
    from vllm_ascend.ops.fused_moe import method

    lines = []  # the MoE layer's start-up lines (the worker runs in this process)
    with mock.patch.object(method.logger, "info", lambda msg, *a, **k: lines.append(msg % a)), \
            engine(model_path(name), max_num_seqs=4, dtype=QUANTIZED[name][2],
                   **mode_args) as llm:
        assert llm.llm_engine.vllm_config.model_config.quantization == "ascend"
        with replays(llm) as made:
            outs = vllm_greedy(llm, PROMPTS, MAX_TOKENS)
        layers = llm.llm_engine.vllm_config.model_config.hf_config.num_hidden_layers
        return dict(outs=outs, made=made, experts=llm.apply_model(probe)[0],
                    routing=[line for line in lines if "MoE routing" in line],
                    expected=expected_replays(mode, made["steps"], layers, max(CAPTURE_SIZES)))


@pytest.mark.parametrize("name,mode", [
    pytest.param(n, m, marks=() if (n, m) in QUICK else pytest.mark.slow)
    for n, m in [(n, m) for n in EXPORTS for m in MODES]
    + [("qwen3_moe-w8a8-dynamic-float16", "FULL_DECODE_ONLY")]])
def test_quantized_experts_are_close_to_their_reference(name, mode):
    result = run(name, mode)
    assert result["experts"] == [("AscendW8A8DynamicFusedMoEMethod", "torch.int8", "torch.int8")]
    assert len(result["routing"]) == 1 and result["routing"][0].endswith(
        "; experts W8A8_DYNAMIC (int8 per channel, activations quantized per token)"), result
    assert result["routing"][0].startswith("vllm-ascend: MoE routing: " + ROUTING.get(
        name, "softmax top-2")), result
    for prompt, out in zip(PROMPTS, result["outs"]):
        check_logprobs_close(hf_greedy(model_path(name), prompt, MAX_TOKENS), out,
                             f"{name} {mode} {prompt!r}", dtype=QUANTIZED[name][2])
    check_replays(result, mode)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"])
@pytest.mark.parametrize("name", ["qwen3_moe-w8a8-dynamic"])
def test_a_graph_mode_gives_the_eager_result_exactly(name, mode):
    for prompt, eager, graph in zip(PROMPTS, run(name, "NONE")["outs"], run(name, mode)["outs"]):
        check_identical(eager, graph, f"{name} {mode} {prompt[:24]!r}")


# -- malformed expert exports ---------------------------------------------------------------------

EXPERT = "model.layers.1.mlp.experts.3"


def drop_an_experts_scale(tensors, description):
    del tensors[f"{EXPERT}.up_proj.weight_scale"]


def float_expert_weight(tensors, description):
    tensors[f"{EXPERT}.down_proj.weight"] = tensors[f"{EXPERT}.down_proj.weight"].bfloat16()


def asymmetric_expert(tensors, description):
    tensors[f"{EXPERT}.gate_proj.weight_offset"][5] = 1.0


def one_expert_float(tensors, description):
    for name in list(description):
        if name.startswith(f"{EXPERT}."):
            description[name] = "FLOAT"


@pytest.mark.parametrize("edit,message", [
    (drop_an_experts_scale, r"model\.layers\.1\.mlp\.experts: the checkpoint has 15 of the 16 "
                            r"weight_scale tensors of this rank's gate/up projections"),
    (float_expert_weight, r"model\.layers\.1\.mlp\.experts: expert 3's down_proj\.weight is "
                          r"torch\.bfloat16 in the checkpoint; a W8A8_DYNAMIC expert's weight "
                          r"must be int8"),
    (one_expert_float, r"model\.layers\.1\.mlp\.experts: the experts are FLOAT/W8A8_DYNAMIC in "
                       r"this checkpoint; vllm-ascend runs MoE experts FLOAT or W8A8_DYNAMIC, all "
                       r"of a layer's experts alike"),
    (asymmetric_expert, r"model\.layers\.1\.mlp\.experts: weight_offset is not zero; "
                        r"vllm-ascend runs symmetric int8 experts only \(npu_grouped_matmul "
                        r"takes no weight offset\)\. Quantize"),
], ids=["missing-scale", "float-weight", "mixed-types", "asymmetric-weight"])
def test_a_malformed_expert_export_fails_at_load_naming_the_layer(tmp_path, edit, message):
    from vllm_ascend.quantization.w8a8 import CheckpointError

    with pytest.raises(CheckpointError, match=message):
        with engine(broken_export(tmp_path, "qwen3_moe-w8a8-dynamic", edit),
                    enforce_eager=True):
            pass


def test_a_quantized_kv_b_proj_is_refused_at_load_naming_it(tmp_path):
    """DeepSeek's kv_b_proj stays FLOAT in Ascend's exports: upstream's MLA splits W_UK and
    W_UV from its float weight. An export that quantizes it is refused before weights load."""
    def quantized_kv_b_proj(tensors, description):
        description["model.layers.0.self_attn.kv_b_proj.weight"] = "W8A8_DYNAMIC"

    with pytest.raises(NotImplementedError, match=r"model\.layers\.0\.self_attn\.kv_b_proj is "
                       r"W8A8DynamicMethod in this checkpoint: .* export it FLOAT"):
        with engine(broken_export(tmp_path, "deepseek_v2_moe-w8a8-dynamic",
                                  quantized_kv_b_proj), enforce_eager=True):
            pass
