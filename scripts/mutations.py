"""The suite's mutation score: small breakages a chip owner would dread, applied to the product
one at a time, each followed by the tests that should catch it.

    python scripts/mutations.py            every mutation; prints caught/missed and the time
    python scripts/mutations.py --list     the mutations and their tests
    python scripts/mutations.py NAME ...   only these

Each mutation runs in a copy of the working tree (the product's files as they are now, with that
one change), on the suite's model cache. A mutation is caught when its tests fail (pytest's exit
code 1); any other outcome (a test run that cannot start, a time-out of the whole run) is an
error, reported as such. The full tier (scripts/run_tests.sh) holds every test named here.
"""

import argparse
import dataclasses
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    breaks: str  # what goes wrong on a chip
    path: str  # the product file, from the repository's root
    old: str  # found exactly once
    new: str
    tests: tuple[str, ...]  # pytest arguments: the tests that should catch it
    # What the machine must have for the mutated code to run at all (see NEEDS); elsewhere the
    # mutation is reported as not applicable, not as missed.
    needs: str = ""


# The step's FIA arguments in AscendAttentionImpl.step_args, one a line at this indent.
ARGS_INDENT = " " * 38
# W8A8's folded bias, added on the first rank of a row-parallel split only.
STATIC_BIAS = ("        quant_bias = layer.quant_bias if self.is_first_rank_of_row_split(layer) "
               "else None")

MUTATIONS = [
    Mutation("fia-update-skipped", "a FULL replay runs attention with the capture's lengths",
             "vllm_ascend/worker/model_runner.py",
             "        self.fia.update(desc, next(m for m in metadata.values()\n"
             "                                   if not isinstance(m, GDNAttentionMetadata)))",
             "        pass", ("tests/e2e/test_full_graphs.py",)),
    Mutation("fia-event-before-update",
             "the replay's attention may run before its task update lands",
             "vllm_ascend/attention/graph_params.py",
             "                torch_npu.npu.graph_task_update_begin(stream, c.handle)",
             "                c.event.record(stream)\n"
             "                torch_npu.npu.graph_task_update_begin(stream, c.handle)",
             ("tests/e2e/test_full_graphs.py",)),
    Mutation("fia-update-not-ordered",
             "the next step's task update rewrites the host lists of a replay still running",
             "vllm_ascend/attention/graph_params.py",
             "        self.stream.wait_stream(torch_npu.npu.current_stream())",
             "        pass", ("tests/e2e/test_full_graphs.py",)),
    Mutation("fia-kv-lengths-not-updated", "a FULL replay attends over the capture's KV lengths",
             "vllm_ascend/attention/backend.py",
             ARGS_INDENT + "actual_seq_lengths=metadata.actual_seq_lengths_q,\n"
             + ARGS_INDENT + "actual_seq_lengths_kv=metadata.seq_lens_list))",
             ARGS_INDENT + "actual_seq_lengths=metadata.actual_seq_lengths_q))",
             ("tests/e2e/test_full_graphs.py",)),
    # (Not re-issuing the block table changes nothing: it lives in the runner's persistent
    # buffer, whose address the captured call reads, on a chip as here.)
    Mutation("fia-query-lengths-not-updated",
             "a mixed FULL replay splits the tokens into the capture's requests",
             "vllm_ascend/attention/backend.py",
             "        return self.in_fia_names(dict(block_table=metadata.block_table,\n"
             + ARGS_INDENT + "actual_seq_lengths=metadata.actual_seq_lengths_q,\n",
             "        return self.in_fia_names(dict(block_table=metadata.block_table,\n",
             ("tests/e2e/test_full_graphs.py",)),
    Mutation("padding-query-starts-off-by-one",
             "the padded requests' cumulative query lengths miss the graph's token count",
             "vllm_ascend/worker/model_runner.py",
             "starts[real + 1: total + 1] = starts[real] + np.cumsum(lens)",
             "starts[real + 1: total + 1] = starts[real] + np.cumsum(lens) - 1",
             ("tests/e2e/test_full_graphs.py",)),
    Mutation("padding-requests-one-short", "a FULL graph's padding requests one too few",
             "vllm_ascend/worker/padding.py",
             "    for _ in range(graph_num_reqs - num_reqs):",
             "    for _ in range(graph_num_reqs - num_reqs - 1):",
             ("tests/ut/test_padding.py", "tests/e2e/test_full_graphs.py")),
    Mutation("rope-stale-positions", "every layer rotates with the previous step's positions",
             "vllm_ascend/worker/model_runner.py",
             "        for rope in ropes:\n            rope.update(kwargs[\"positions\"])",
             "        pass", ("tests/e2e/test_graph_modes.py", "-k", "llama")),
    Mutation("hookless-model-rope-not-filled", "a model whose class runs no hooks (Ernie 4.5: "
             "compiled at its top level) rotates with stale RoPE rows",
             "vllm_ascend/worker/model_runner.py",
             "        for rope in self.ropes_filled_before_call:\n"
             "            rope.update(positions)",
             "        pass", ("tests/e2e/test_families.py", "-k", "ernie4_5")),
    Mutation("mtp-rope-rows-not-filled", "DeepSeek's MTP draft layer (a class that runs no "
             "hooks) rotates with RoPE rows never gathered", "vllm_ascend/models/deepseek_mtp.py",
             '        self._rope_rows.update(kwargs["positions"])', "        pass",
             ("tests/e2e/test_spec_decode.py", "-k", "drafter_rotates and mtp")),
    Mutation("moe-no-renormalisation", "Qwen3-MoE's top-k weights not renormalised",
             "vllm_ascend/ops/fused_moe/router.py",
             "    if layer.renormalize:  # Qwen3-MoE's norm_topk_prob",
             "    if False:", ("tests/e2e/test_moe.py",)),
    Mutation("correction-bias-dropped", "GLM-4.5's and DeepSeek-V3's experts chosen without "
             "the score-correction bias", "vllm_ascend/ops/fused_moe/router.py",
             "            router_logits, k=layer.top_k, bias=bias,",
             "            router_logits, k=layer.top_k, bias=None,",
             ("tests/e2e/test_families.py", "-k",
              "glm4_moe and NONE and close_to_hf and not tp2")),
    Mutation("expert-groups-ignored", "DeepSeek-V3's top-k taken over every expert, not the "
             "best groups'", "vllm_ascend/ops/fused_moe/router.py",
             "            k_group=chosen, group_count=groups,",
             "            k_group=1, group_count=1,",
             ("tests/e2e/test_families.py", "-k",
              "deepseek_v3 and NONE and close_to_hf and not tp2")),
    Mutation("sigmoid-routing-unscaled", "DeepSeek-V3's routed experts without "
             "routed_scaling_factor", "vllm_ascend/ops/fused_moe/router.py",
             "            routed_scaling_factor=scale if sigmoid else 1.0, eps=1e-20)",
             "            routed_scaling_factor=1.0, eps=1e-20)",
             # (vLLM 0.32's DeepSeek and GLM classes scale in their MoE runner instead)
             ("tests/ut/test_moe.py",)),
    Mutation("expert-token-scale-dropped", "W8A8_DYNAMIC experts dequantized without each "
             "token's activation scale", "vllm_ascend/quantization/w8a8_moe.py",
             "per_token_scale=[scale],", "per_token_scale=[torch.ones_like(scale)],",
             ("tests/e2e/test_quantized_experts.py", "-k", "close and qwen3 and FULL_DECODE")),
    Mutation("quantized-experts-without-swiglu", "W8A8_DYNAMIC experts skip their activation",
             "vllm_ascend/quantization/w8a8_moe.py",
             'grouped_matmul(torch_npu.npu_swiglu(grouped_matmul(sorted_x, "w13")), "w2")',
             'grouped_matmul(grouped_matmul(sorted_x, "w13").chunk(2, -1)[1].contiguous(), "w2")',
             ("tests/e2e/test_quantized_experts.py", "-k", "close and qwen3 and FULL_DECODE")),
    Mutation("simulated-gmm-token-scale-ignored", "the simulator's quantized grouped matmul "
             "leaves out the per-token scale", "vllm_ascend/device/sim/moe.py",
             "s[e].float() * t[start:start + n].unsqueeze(1)", "s[e].float().expand(n, -1)",
             ("tests/ut/test_sim_moe.py",)),
    Mutation("simulated-gating-weights-biased", "the simulator's grouped gating weighs the "
             "experts by their biased scores", "vllm_ascend/device/sim/moe.py",
             "    y = scores.gather(1, expert_idx)", "    y = choice.gather(1, expert_idx)",
             ("tests/ut/test_sim_moe.py",)),
    Mutation("moe-ep-range-off-by-one", "an EP rank drops its first expert's tokens",
             "vllm_ascend/ops/fused_moe/method.py",
             "((topk_ids >= first) & (topk_ids < last))",
             "((topk_ids > first) & (topk_ids < last))",
             ("tests/e2e/test_parallel.py", "-k", "layout and EP")),
    Mutation("mla-value-up-projection-transposed", "MLA's W_UV applied per the wrong head",
             "vllm_ascend/attention/mla.py",
             "        out = torch_npu.npu_transpose_batchmatmul(latent.contiguous(), layer.W_UV,",
             "        out = torch_npu.npu_transpose_batchmatmul(latent.contiguous(),\n"
             "                                                  layer.W_UV.flip(0),",
             ("tests/e2e/test_mla.py",)),
    Mutation("mla-key-absorption-dropped-head", "MLA's W_UK_T absorbed with the heads shifted",
             "vllm_ascend/attention/mla.py",
             "                                layer.W_UK_T).transpose(0, 1)",
             "                                layer.W_UK_T.roll(1, 0)).transpose(0, 1)",
             ("tests/e2e/test_mla.py",)),
    Mutation("w8a8-no-quant-bias", "static W8A8 without its folded bias and offset",
             "vllm_ascend/quantization/w8a8.py",
             STATIC_BIAS,
             "        quant_bias = None", ("tests/e2e/test_quantization.py",)),
    Mutation("w8a8-bias-on-every-rank", "a row-parallel W8A8 layer adds its bias once per rank",
             "vllm_ascend/quantization/w8a8.py",
             STATIC_BIAS,
             "        quant_bias = layer.quant_bias",
             ("tests/e2e/test_parallel.py", "-k", "tp1_with_exactly")),
    Mutation("w8a8-dynamic-scale-dropped", "dynamic W8A8 without its per-token scale",
             "vllm_ascend/quantization/w8a8.py",
             "                                          pertoken_scale=scale, bias=bias,",
             "                                          pertoken_scale=scale.mean().expand_as("
             "scale), bias=bias,", ("tests/e2e/test_quantization.py",)),
    Mutation("w8a8-norm-quant-unfused", "the norm before a static W8A8 layer leaves the "
             "activation's quantization to a kernel of its own (one launch more per norm)",
             "vllm_ascend/quantization/w8a8.py",
             "        y, _, added = torch_npu.npu_add_rms_norm_quant(\n"
             "            x, residual, gamma, layer.aclnn_input_scale, layer.aclnn_input_offset, "
             "epsilon=eps)",
             "        y, _, added = torch_npu.npu_add_rms_norm(x, residual, gamma, eps)",
             ("tests/e2e/test_quantization.py", "-k", "norms_quantize")),
    Mutation("add-rms-norm-residual-lost", "the residual stream skips the fused add",
             "vllm_ascend/ops/layernorm.py",
             "        x, _, residual = torch_npu.npu_add_rms_norm(x, residual, self.weight,\n"
             "                                                    self.variance_epsilon)\n"
             "        return x, residual",
             "        y, _, added = torch_npu.npu_add_rms_norm(x, residual, self.weight,\n"
             "                                                 self.variance_epsilon)\n"
             "        return y, x", ("tests/e2e/test_graph_modes.py", "-k", "llama")),
    Mutation("sleep-level-2-keeps-weights", "sleep level 2 keeps a host copy of the weights",
             "vllm_ascend/device_allocator/sleep.py",
             '        kept = ("weights", *ALWAYS_KEPT) if level == 1 else ALWAYS_KEPT',
             '        kept = ("weights", *ALWAYS_KEPT)', ("tests/e2e/test_sleep_mode.py",)),
    Mutation("wake-up-without-contents", "wake-up maps the memory but does not copy it back",
             "vllm_ascend/device_allocator/vmm.py",
             "            if allocation.backup is not None:\n"
             "                _check(self.acl.rt.memcpy(",
             "            if False:\n                _check(self.acl.rt.memcpy(",
             ("tests/e2e/test_sleep_mode.py",)),
    Mutation("w8a8-reload-reallocates",
             "a reload gives the activation scale new memory; the graphs read the old",
             "vllm_ascend/quantization/w8a8.py",
             "            if hasattr(layer, name):  # a reload (sleep mode): captured graphs read "
             "the old one",
             "            if False:",
             ("tests/e2e/test_sleep_mode.py", "-k", "w8a8")),
    Mutation("streams-per-graph-undercounted", "the stream budget forgets the TP group's stream",
             "vllm_ascend/compilation/capture_sizes.py",
             "    return 1 + (tensor_parallel > 1) + (data_parallel > 1)",
             "    return 1 + (data_parallel > 1)",
             ("tests/ut/test_capture_sizes.py", "tests/e2e/test_parallel.py")),
    Mutation("kv-write-slot-off-by-one", "each token's K and V written one slot further on",
             "vllm_ascend/attention/backend.py",
             "key_cache=key_cache, value_cache=value_cache, slot_mapping=slot_mapping,",
             "key_cache=key_cache, value_cache=value_cache,\n"
             "            slot_mapping=slot_mapping + (slot_mapping >= 0),",
             ("tests/e2e/test_graph_modes.py", "-k", "llama")),
    Mutation("fia-scale-dropped", "attention without its 1/sqrt(head size)",
             "vllm_ascend/attention/backend.py",
             "num_heads=self.num_heads, scale=self.scale,",
             "num_heads=self.num_heads, scale=1.0,", ("tests/e2e/test_graph_modes.py", "-k",
                                                      "llama")),
    Mutation("sliding-window-one-key-wider",
             "a sliding-window model attends one key more than its window (FIA's band edges are "
             "inclusive)", "vllm_ascend/attention/backend.py",
             "pre_tokens=sliding_window - 1, next_tokens=0)",
             "pre_tokens=sliding_window, next_tokens=0)", ("tests/e2e/test_families.py",)),
    Mutation("sliding-window-lost-in-full-graphs",
             "a FULL graph replays attention over every key, past the window",
             "vllm_ascend/attention/backend.py",
             "        fia_args = dict({\"pre_tokens\": NO_BAND, \"next_tokens\": NO_BAND}, "
             "**fia_args,\n                        query=query)",
             "        fia_args = dict(fia_args, query=query, sparse_mode=CAUSAL, "
             "pre_tokens=NO_BAND,\n                        next_tokens=NO_BAND)",
             ("tests/e2e/test_families.py", "-m", "not slow")),
    Mutation("norm-quant-pass-off",
             "a W8A8 family with no model file quantizes apart from its norms",
             "vllm_ascend/compilation/passes.py",
             "        self.passes = [NormQuantFusion(), QKRopeMerge()]",
             "        self.passes = [QKRopeMerge()]",
             ("tests/e2e/test_fusion_passes.py",)),
    Mutation("norm-quant-pass-reciprocal-scale",
             "the fused W8A8 norm divides by the reciprocal of the calibrated scale",
             "vllm_ascend/compilation/passes.py",
             "        _, scale, _, offset = quant.args", "        _, _, scale, offset = quant.args",
             ("tests/e2e/test_fusion_passes.py",)),
    Mutation("step-rope-not-shared",
             "a family with no model file gathers cos/sin in every layer (npu_mrope)",
             "vllm_ascend/worker/model_runner.py",
             "        if self.speculative_config is None:\n            share_step_ropes(",
             "        if False:\n            share_step_ropes(",
             ("tests/e2e/test_families.py", "-k", "twins_calls")),
    Mutation("qk-rope-merge-k-heads-shifted",
             "the merged q|k rotation hands k's heads out shifted by one",
             "vllm_ascend/compilation/passes.py",
             "                rotated, (slice(None), slice(None), "
             "slice(q_size // head, None)))),))",
             "                rotated, (slice(None), slice(None), "
             "slice(q_size // head - 1, -1)))),))",
             ("tests/e2e/test_fusion_passes.py",)),
    Mutation("attention-sinks-dropped", "GPT-OSS attends without its sinks (FIA v2 without "
             "learnable_sink)", "vllm_ascend/attention/backend.py",
             '{"learnable_sink": self.sinks}', '{"learnable_sink": None}',
             ("tests/e2e/test_families.py", "-k", "gpt_oss and close")),
    Mutation("sinks-replayed-with-v1-names",
             "a FULL replay re-issues a layer with sinks under FIA v1's keyword names",
             "vllm_ascend/attention/backend.py",
             "        return self.in_fia_names(dict(block_table=metadata.block_table,",
             "        return (dict(block_table=metadata.block_table,",
             ("tests/e2e/test_families.py", "-k", "gpt_oss and close")),
    Mutation("expert-biases-dropped", "GPT-OSS's experts without their biases",
             "vllm_ascend/ops/fused_moe/method.py",
             "        biased = self.moe.has_bias", "        biased = False",
             ("tests/ut/test_moe.py",)),
    Mutation("swiglu-oai-gate-up-halves",
             "GPT-OSS's clamped SwiGLU reads gate and up as halves, not interleaved columns",
             "vllm_ascend/ops/fused_moe/method.py",
             "lambda x: SwigluOAIAndMul.forward_native(_OAI, x)}",
             "lambda x: SwigluOAIAndMul.forward_native(\n    _OAI, x.view(x.shape[0], 2, -1)"
             ".transpose(1, 2).reshape(x.shape))}",
             ("tests/ut/test_moe.py",)),
    Mutation("simulated-sinks-ignored-in-decode",
             "the simulator's FIA v2 drops the sinks of one-token queries (decode)",
             "vllm_ascend/device/sim/fia.py", "    if sink is None:\n        probs = "
             "scores.softmax(-1)", "    if True:\n        probs = scores.softmax(-1)",
             ("tests/ut/test_sim_fia.py",)),
    Mutation("mla-later-context-chunks-dropped",
             "a long prompt's MLA prefill attends to its first context chunk only",
             "vllm_ascend/attention/mla.py", "        for chunk in chunks:",
             "        for chunk in chunks[:1]:", ("tests/e2e/test_mla_long_context.py",)),
    Mutation("mla-prefill-not-reserved",
             "the profile run does not reserve MLA's prefill: a long prompt may run out of "
             "memory the KV cache took", "vllm_ascend/ops/mla.py",
             "        if is_profiling_prefill():", "        if False:",
             ("tests/e2e/test_mla_long_context.py",)),
    Mutation("simulated-attention-update-unweighted",
             "the simulator merges partial attention results without their LSE weights",
             "vllm_ascend/device/sim/mla.py",
             "    out = sum(w * o.float() for w, o in zip(weights, local_out))",
             "    out = sum(o.float() for w, o in zip(weights, local_out)) / len(local_out)",
             ("tests/ut/test_sim_mla.py",)),
    Mutation("asymmetric-weights-accepted",
             "an export with non-zero weight offsets loads, and its layers run as if the "
             "offsets were zero (the quantized matmuls take none): silently wrong answers",
             "vllm_ascend/quantization/w8a8.py",
             "    if any(bool(offset.ne(0).any()) for offset in offsets):",
             "    if False:",
             ("tests/e2e/test_quantization.py::"
              "test_a_malformed_export_fails_at_load_naming_the_layer",
              "tests/e2e/test_quantized_experts.py::"
              "test_a_malformed_expert_export_fails_at_load_naming_the_layer")),
    Mutation("simulated-zombie-holds-its-device",
             "the simulator keeps a device held by a process that exited unreaped: the next "
             "engine of a script that makes them one after the other cannot start",
             "vllm_ascend/device/sim/devices.py", '    return state not in ("Z", "X")',
             "    return True",
             ("tests/ut/test_sim_devices.py::"
              "test_a_device_is_free_once_its_process_has_exited_even_unreaped",)),
    Mutation("simulated-matmul-one-call",
             "the simulator's float32 product runs all rows in one call: on AVX-512, MKL sums a "
             "row differently by row count, so a padded graph step is not the eager step",
             "vllm_ascend/device/sim/matmul.py", "        rows = min(start, LAST_BLOCK)",
             "        rows = n", ("tests/ut/test_sim_matmul.py",)),
    Mutation("simulated-matmul-one-row-unpadded",
             "the simulator's one-row bf16 product runs torch's one-row kernel: on AVX-512-BF16 "
             "its bits differ from the same row among others, so a padded graph step is not the "
             "eager step",
             "vllm_ascend/device/sim/matmul.py", "            and a.shape[0] == 1)",
             "            and a.shape[0] == 0)", ("tests/ut/test_sim_matmul.py",),
             needs="one-row-kernel"),
    Mutation("replayed-rope-reads-cos-for-sin",
             "a FULL or PIECEWISE replay's RoPE (the form that writes into the graph's output) "
             "multiplies the rotated half by cos: graphs rotate otherwise than eager steps",
             "vllm_ascend/device/sim/rope.py",
             "    turned = x.roll(half, -1).mul_(r2)",
             "    turned = x.roll(half, -1).mul_(r1)",
             ("tests/ut/test_sim_graph.py::"
              "test_a_replay_of_the_fused_kernels_writes_what_the_eager_ops_return",)),
    Mutation("replayed-norm-ignores-gamma",
             "a replay's RMS norms (the form that writes into the graph's outputs) leave out "
             "the weight: graphs normalise otherwise than eager steps",
             "vllm_ascend/device/sim/norm.py",
             "    torch.mul(xf.mul_(rstd), gamma, out=y)",
             "    torch.mul(xf.mul_(rstd), 1.0, out=y)",
             ("tests/ut/test_sim_graph.py::"
              "test_a_replay_of_the_fused_kernels_writes_what_the_eager_ops_return",)),
    Mutation("replayed-product-drops-its-bias",
             "a replay's aten.linear with a bias takes the direct product path, which has no "
             "bias: a graph's biased projections (Qwen2's q/k/v) lose it",
             "vllm_ascend/device/sim/matmul.py",
             "    if bias is not None:  # linear's addmm",
             "    if False:  # linear's addmm",
             ("tests/ut/test_sim_graph.py::"
              "test_a_replays_products_write_what_eager_linear_returns",)),
    Mutation("packed-product-drops-its-bias",
             "a model's weight read packed loses the product's bias: every biased projection "
             "(Qwen2's q/k/v) of 1 to 8 rows, eager and replayed alike",
             "vllm_ascend/device/sim/matmul.py",
             '    return _LINEAR(rows, packed, bias, "none", [], "")',
             '    return _LINEAR(rows, packed, None, "none", [], "")',
             ("tests/ut/test_sim_matmul.py::"
              "test_a_parameters_products_read_it_packed_with_the_plain_tensors_bits",),
             needs="packs"),
    Mutation("packed-product-one-row-unpadded",
             "a one-row product read packed is not padded to two rows: on an AVX-512-BF16 CPU "
             "oneDNN's one-row kernel gives other bits, and a batch-1 step parts from the same "
             "request in a batch",
             "vllm_ascend/device/sim/matmul.py",
             "    rows = _padded_rows(a)",
             "    rows = a",
             ("tests/ut/test_sim_matmul.py::"
              "test_a_parameters_products_read_it_packed_with_the_plain_tensors_bits",),
             needs="packs"),
    Mutation("copied-weight-misses-in-place-writes",
             "a weight's copy (packed, float32) is not made again after an in-place write to "
             "the weight: products read the weights as they were",
             "vllm_ascend/device/sim/matmul.py",
             "        stamp = (weight._version, _DATA_TAKEN[0], _acl.raw_writes(), "
             "weight.data_ptr())",
             "        stamp = (0, _DATA_TAKEN[0], _acl.raw_writes(), weight.data_ptr())",
             ("tests/ut/test_sim_matmul.py::test_a_copied_weight_is_read_as_last_written",)),
    Mutation("copied-weight-misses-data-writes",
             "a write through .data (vLLM's weight loaders: a reload after sleep mode, new "
             "weights from a trainer) leaves products reading the old weights",
             "vllm_ascend/device/sim/matmul.py",
             "    _DATA_TAKEN[0] += 1",
             "    _DATA_TAKEN[0] += 0",
             ("tests/ut/test_sim_matmul.py::test_a_copied_weight_is_read_as_last_written",)),
    Mutation("copied-weight-misses-device-memory-writes",
             "memory ACL discarded and mapped again (sleep mode) is read as it was before",
             "vllm_ascend/device/sim/matmul.py",
             "        stamp = (weight._version, _DATA_TAKEN[0], _acl.raw_writes(), "
             "weight.data_ptr())",
             "        stamp = (weight._version, _DATA_TAKEN[0], 0, weight.data_ptr())",
             ("tests/ut/test_sim_matmul.py::test_a_copied_weight_is_read_as_last_written",)),
    Mutation("copies-outlive-their-weights",
             "a weight's copies (packed, float32) stay after the weight is freed: host memory "
             "grows with every engine a process starts",
             "vllm_ascend/device/sim/matmul.py",
             "        weakref.finalize(storage, _COPIES.pop, key, None)",
             "        pass",
             ("tests/ut/test_sim_matmul.py::"
              "test_a_copy_lives_as_long_as_its_weights_memory_and_the_device",)),
    Mutation("packs-counted-as-device-memory",
             "the simulator counts a model's packed weights as device memory: its KV cache and "
             "start-up figures differ from the chip's by a second copy of the weights",
             "vllm_ascend/device/sim/matmul.py",
             "    _memory.simulator_holds(nbytes)",
             "    pass",
             ("tests/ut/test_sim_matmul.py::"
              "test_a_copy_is_the_simulators_memory_not_the_devices",),
             needs="packs"),
    Mutation("copies-outlive-their-engines",
             "the weights' copies (packed, float32) stay when the device's last worker shuts "
             "down: vLLM keeps a model's parameters alive, so each engine a process starts adds "
             "its copies",
             "vllm_ascend/device/sim/matmul.py",
             "        copies.stamp = copies.packed = copies.wide = None",
             "        pass",
             ("tests/ut/test_sim_matmul.py::"
              "test_a_copy_lives_as_long_as_its_weights_memory_and_the_device",)),
    Mutation("float32-copy-made-at-every-call",
             "a model's weight is converted to float32 at every product of 9 rows or more (as "
             "09e93d8 did): served SmolLM2 is a third slower",
             "vllm_ascend/device/sim/matmul.py",
             "        if self.wide is None:",
             "        if True:",
             ("tests/ut/test_sim_matmul.py::"
              "test_a_weight_is_converted_once_for_its_products_of_9_rows_or_more",)),
    Mutation("bf16-pack-in-one-call",
             "on a CPU with bf16 instructions a weight's product of more than 16 rows reads its "
             "pack in one call, not in the fixed row blocks: a row's bits may depend on how "
             "many rows follow it, and a padded graph step part from the eager one",
             "vllm_ascend/device/sim/matmul.py",
             "    if n == FIRST_BLOCK:  # a decode step of 16",
             "    if n >= FIRST_BLOCK:  # a decode step of 16",
             ("tests/ut/test_sim_matmul.py::"
              "test_a_bf16_cpu_reads_the_pack_in_fixed_row_blocks",), needs="packs"),
    Mutation("bf16-cpu-keeps-float32",
             "a CPU with bf16 instructions converts weights to float32 for products of 9 rows "
             "or more: served SmolLM2 at 0.7x of 3c788d9 on an AMX Xeon",
             "vllm_ascend/device/sim/matmul.py",
             "    _CPU_BF16[0] = _CPU_PACKS[0] and cpu_has_bf16()",
             "    _CPU_BF16[0] = False",
             ("tests/ut/test_sim_matmul.py::"
              "test_the_cpus_flags_choose_the_path_of_9_rows_or_more",), needs="bf16"),
    Mutation("bf16-flags-misread",
             "the CPU's bf16 instructions are looked for in another line of /proc/cpuinfo: every "
             "CPU takes the float32 path",
             "vllm_ascend/device/sim/matmul.py",
             '                          if line.startswith("flags")), [])',
             '                          if line.startswith("bugs")), [])',
             ("tests/ut/test_sim_matmul.py::"
              "test_the_cpus_flags_choose_the_path_of_9_rows_or_more",)),
    Mutation("library-buffers-counted-as-device",
             "what MKL keeps after the simulator's float32 products (FIA, MLA, MoE, GDN) is "
             "counted as the device's memory: on an AMX Xeon vLLM's default FULL engine's graph "
             "estimate grew from 50 to 504 MB",
             "vllm_ascend/device/sim/library_caches.py",
             "            if key in _MEASURED:\n                return kernel(*args, **kwargs)",
             "            if True:\n                return kernel(*args, **kwargs)",
             ("tests/ut/test_sim_fia.py::"
              "test_what_the_products_cpu_library_keeps_is_host_memory",)),
    Mutation("fia-heap-read-at-every-step",
             "FIA's first calls are keyed by the KV lengths, not the batch: a decode step reads "
             "the heap twice a layer (1.4 ms each in an engine's process: 80 ms a SmolLM2 step)",
             "vllm_ascend/device/sim/fia.py",
             "len(q_lens), max(q_lens) > 1))",
             "len(q_lens), max(q_lens) > 1, tuple(rest[0])))",
             ("tests/ut/test_sim_fia.py::"
              "test_what_the_products_cpu_library_keeps_is_host_memory",)),
    Mutation("exponential-noise-negative",
             "the simulator's exponential numbers are log(u), not -log(u): vLLM's random "
             "sampling divides by negative noise and picks the least likely token",
             "vllm_ascend/device/sim/rng.py",
             "    self.uniform_(generator=generator).clamp_min_(torch.finfo(self.dtype).tiny)"
             ".log_().neg_()",
             "    self.uniform_(generator=generator).clamp_min_(torch.finfo(self.dtype).tiny)"
             ".log_()",
             ("tests/ut/test_sim_rng.py",)),
    Mutation("exponential-noise-ignores-the-seed",
             "the simulator's exponential numbers ignore the request's generator: a seeded "
             "request samples differently every time",
             "vllm_ascend/device/sim/rng.py",
             "    self.uniform_(generator=generator)",
             "    self.uniform_()",
             ("tests/ut/test_sim_rng.py",)),
    Mutation("float32-copies-counted-as-device-memory",
             "the simulator counts a model's float32 copies as device memory: a second copy of "
             "the weights, twice their size, comes out of the KV cache",
             "vllm_ascend/device/sim/matmul.py",
             "    _memory.simulator_holds(size)",
             "    pass",
             ("tests/ut/test_sim_matmul.py::"
              "test_a_copy_is_the_simulators_memory_not_the_devices",)),
    Mutation("replay-costs-host-work",
             "every graph replay costs the host about 10 ms of work (host work that graphs "
             "should remove, put back): the default graph mode serves slower than eager",
             "vllm_ascend/device/sim/npu.py",
             "        blocked_at = self._graph.run(0)",
             "        blocked_at = sum(range(600_000)) and self._graph.run(0)",
             ("tests/e2e/test_serve_throughput.py::"
              "test_the_default_graph_mode_serves_no_slower_than_eager",)),
    Mutation("kernel-caches-counted-as-device-memory",
             "what the CPU's libraries keep for a product's shape (oneDNN's primitives) counts "
             "as device memory: on a CPU whose kernels cache, a capture outgrows the graphs' "
             "estimate and runs out of memory where another CPU's fits",
             "vllm_ascend/device/sim/library_caches.py",
             "        _memory.simulator_holds(left)",
             "        pass",
             ("tests/ut/test_sim_matmul.py::"
              "test_what_a_kernel_keeps_for_a_shape_is_the_simulators_memory",)),
    Mutation("cpu-that-cannot-pack-reads-packed",
             "a CPU whose oneDNN refuses to pack bf16 weights (AVX2) is taken for one that "
             "packs: every engine fails at its first product of 1 to 8 rows",
             "vllm_ascend/device/sim/matmul.py",
             "    except RuntimeError:\n        return False",
             "    except RuntimeError:\n        return True",
             ("tests/ut/test_sim_matmul.py::test_the_cpu_is_asked_once_whether_it_packs",)),
    Mutation("fia-one-request-reads-its-block-end",
             "FIA's one-request path (a batch-1 prefill within one block) reads the block's last "
             "tokens instead of its first: attention over slots the request has not written",
             "vllm_ascend/device/sim/fia.py",
             "        return (x[block, :max_kv].view(1, max_kv, nkv, d) for x in (key, value))",
             "        return (x[block, -max_kv:].view(1, max_kv, nkv, d) for x in (key, value))",
             ("tests/ut/test_sim_fia.py::"
              "test_one_request_within_one_block_reads_its_first_block_in_place[prefill]",)),
    Mutation("fia-one-token-reads-the-next-block",
             "FIA's one-token path (a batch-1 decode within one block) reads the block after the "
             "table's: attention over another request's keys",
             "vllm_ascend/device/sim/fia.py",
             "                           x.storage_offset() + block * x.stride(0))",
             "                           x.storage_offset() + (block + 1) * x.stride(0))",
             ("tests/ut/test_sim_fia.py::"
              "test_one_request_within_one_block_reads_its_first_block_in_place[decode]",)),
    Mutation("task-update-skips-its-tensor-check",
             "a task update compares no tensor with the captured one (the shortcut for the "
             "same objects taken for all): an update may point a replay at other memory",
             "vllm_ascend/device/sim/graph.py",
             "            if value is was:  # the same object",
             "            if True:  # the same object",
             ("tests/ut/test_sim_task_updates.py::test_task_update_rules",)),
    Mutation("replayed-scatter-skips-its-slot-checks",
             "a replay's KV scatter, which skips the checks the capture made, skips the check of "
             "the slots it reads too: an out-of-range slot writes past the cache unreported",
             "vllm_ascend/device/sim/kv_cache.py",
             "    if high >= num_blocks * block_size:",
             "    if not _replay and high >= num_blocks * block_size:",
             ("tests/ut/test_sim_task_updates.py::"
              "test_a_replayed_scatter_writes_each_replays_slots_and_checks_them",)),
    Mutation("replayed-kernels-not-in-the-ledger",
             "a replay's simulated kernels, called without the dispatcher, are not counted as "
             "replayed ops: the ledger's proof that a graph ran a fused kernel goes blind",
             "vllm_ascend/device/sim/graph.py",
             "                        if counting and op_called(fn) is not None:",
             "                        if False:",
             ("tests/ut/test_sim_graph.py::"
              "test_a_replay_of_the_fused_kernels_writes_what_the_eager_ops_return",)),
    Mutation("custom-ops-registered-in-import-kernels",
             "the CustomOp overrides register from Platform.import_kernels, which vLLM's "
             "layernorm import calls half-done: an EAGLE-3 head fails to load (circular import)",
             "vllm_ascend/platform.py",
             "the overrides import RMSNorm from it.\n        return",
             "the overrides import RMSNorm from it.\n        import vllm_ascend.ops  # noqa: F401",
             ("tests/ut/test_plugins.py", "-k", "fresh")),
    Mutation("lora-slot-mask-ignored",
             "every token gets the sum of all loaded adapters, not its own",
             "vllm_ascend/lora/punica_npu.py",
             "        return (slot == torch.arange(slots, device=slot.device)).to(torch.float32)",
             "        return torch.ones(rows, slots)",
             ("tests/e2e/test_lora.py", "-k", "mixing and FULL_DECODE_ONLY")),
    Mutation("lora-graph-cases-uncounted",
             "the stream budget counts each capture size once with LoRA on, where vLLM "
             "captures it twice (no adapter; any adapter): start-up can run out of streams",
             "vllm_ascend/compilation/capture_sizes.py",
             "    if not vllm_config.compilation_config.cudagraph_specialize_lora:\n"
             "        return 1",
             "    if True:\n        return 1",
             ("tests/e2e/test_lora.py", "-k", "plan and FULL_DECODE_ONLY")),
    Mutation("mc2-combine-unweighted",
             "MC2's combine sums each token's experts without their routing weights",
             "vllm_ascend/ops/fused_moe/method.py",
             "            expand_x=down, expert_scales=topk_weights.to(torch.float32),",
             "            expand_x=down, expert_scales=torch.ones_like(topk_weights, "
             "dtype=torch.float32),",
             ("tests/e2e/test_data_parallel.py", "-k", "mc2 and FULL_DECODE_ONLY")),
    Mutation("mc2-never-dispatched",
             "the log and the step record say MC2 while the layers all-gather",
             "vllm_ascend/ops/fused_moe/method.py",
             "        if select_moe_comm(self.comm_setup, most).comm == MoEComm.MC2:",
             "        if False:",
             ("tests/e2e/test_data_parallel.py", "-k", "mc2 and FULL_DECODE_ONLY")),
    Mutation("mc2-capacity-ignored",
             "MC2 runs above the largest graph batch and the chip's per-rank limit, where the "
             "HCCL buffer sized for the capacity overflows",
             "vllm_ascend/ops/fused_moe/comm.py",
             "    fits = tokens <= capacity",
             "    fits = True",
             ("tests/ut/test_moe.py",)),
    Mutation("v2-fia-update-skipped", "under Model Runner V2 a FULL replay runs attention "
             "with the capture's lengths", "vllm_ascend/worker/v2/graphs.py",
             "        self.state.fia.update(graph, self.step_metadata())", "        pass",
             ("tests/e2e/test_model_runner_v2.py", "-k", "llama and FULL_AND_PIECEWISE")),
    Mutation("v2-update-not-ordered",
             "under Model Runner V2, the next step's task update rewrites a running replay's lists",
             "vllm_ascend/worker/v2/graphs.py",
             "        self.state.fia.before_replay()\n",
             "", ("tests/e2e/test_model_runner_v2.py",)),
    Mutation("v2-mixed-capture-without-dummy", "under Model Runner V2 a mixed FULL graph is "
             "captured without the dummy request its replays' FIA sees",
             "vllm_ascend/worker/v2/graphs.py",
             "                return rows.padded(batch, num_reqs + 1, scheduled=True)",
             "                return batch",
             ("tests/e2e/test_model_runner_v2.py", "-k", "llama-FULL]")),
    Mutation("v2-draft-kv-upper-bound", "under Model Runner V2 a draft step attends over the "
             "KV of drafts the verify step rejected (vLLM's host upper bound)",
             "vllm_ascend/worker/v2/drafter.py",
             "        exact = self.input_buffers.seq_lens[:num_reqs].cpu() - step",
             "        exact = seq_lens_cpu_upper_bound[:num_reqs]",
             ("tests/e2e/test_model_runner_v2_spec.py", "-k", "exact_where")),
    Mutation("v2-draft-step-not-padded", "under Model Runner V2 a FULL draft step's padding "
             "tokens belong to no request (FIA's TND check)", "vllm_ascend/worker/v2/drafter.py",
             "        if batch_desc.cg_mode == CUDAGraphMode.FULL and padded > num_reqs:",
             "        if False:", ("tests/e2e/test_model_runner_v2_spec.py", "-k",
                                    "FULL_DECODE_ONLY")),
    Mutation("v2-draft-replays-prefill-lists", "under Model Runner V2 a draft decode step's FULL "
             "graph re-issues the verify step's FIA lists", "vllm_ascend/worker/v2/drafter.py",
             "            step_metadata=lambda: own.latest)",
             "            step_metadata=lambda: target.latest)",
             ("tests/e2e/test_model_runner_v2_spec.py", "-k", "FULL_DECODE_ONLY")),
    Mutation("v2-plan-without-drafter-graphs", "under V2 the start-up plan and stream budget "
             "leave out the drafter's FULL graphs", "vllm_ascend/plan.py",
             "        drafter += len(descs.get(\"FULL\", [])) + (len(decode.get(\"FULL\", [])) "
             "if k > 1 else 0)", "        pass",
             ("tests/e2e/test_model_runner_v2_spec.py", "-k", "npu_one")),
    Mutation("sim-fp64-noise-overflows", "fp64 Gumbel noise is NaN for half the hashes "
             "(sampling with use_fp64_gumbel draws garbage)",
             "vllm_ascend/device/sim/v2_sampling.py", "        random53 = (hi << 21) | (lo >> 11)",
             "        random53 = ((hi << 32) | lo) >> 11",
             ("tests/ut/test_sim_v2_spec_kernels.py",)),
    Mutation("sim-greedy-rejection-accepts-all", "a greedy request accepts every draft",
             "vllm_ascend/device/sim/v2_spec_kernels.py",
             "                  else argmax == drafts) & valid",
             "                  else argmax >= 0) & valid",
             ("tests/ut/test_sim_v2_spec_kernels.py",)),
    Mutation("sim-resample-keeps-rejected-draft", "a sampled request may resample the draft it "
             "rejected", "vllm_ascend/device/sim/v2_spec_kernels.py",
             "            residual[rejected] = float(\"-inf\")", "            pass",
             ("tests/ut/test_sim_v2_spec_kernels.py",)),
    Mutation("sim-draft-step-always-advances", "the last draft step advances positions and "
             "inputs past the drafts", "vllm_ascend/device/sim/v2_spec_kernels.py",
             "    more = step < num_speculative_steps - 1  # [1]: not the last step",
             "    more = step >= 0", ("tests/ut/test_sim_v2_spec_kernels.py",)),
    Mutation("v2-full-step-not-padded", "under Model Runner V2 a FULL step's padding tokens "
             "belong to no request (FIA's TND check)", "vllm_ascend/worker/v2/model_runner.py",
             "        if not padding.pads_attention:", "        if True:",
             ("tests/e2e/test_model_runner_v2.py", "-k", "llama and FULL_AND_PIECEWISE")),
    Mutation("v2-step-rope-not-filled", "under Model Runner V2 every layer rotates with stale "
             "positions", "vllm_ascend/worker/v2/model_runner.py",
             "        if fill_step_ropes_before_forward(model):",
             "        if fill_step_ropes_before_forward(None):",
             ("tests/e2e/test_model_runner_v2.py", "-k", "llama and FULL_AND_PIECEWISE")),
    Mutation("v2-profile-graphs-kept", "Model Runner V2's memory-profile captures keep their "
             "streams", "vllm_ascend/worker/v2/model_runner.py",
             "            self.graph_state.clear()", "            pass",
             ("tests/e2e/test_model_runner_v2.py", "-k", "llama and FULL_AND_PIECEWISE")),
    Mutation("v2-sampling-without-noise", "the simulator's V2 sampling takes the argmax at any "
             "temperature", "vllm_ascend/device/sim/v2_sampling.py",
             "    if bool(sampling.any()):", "    if False:",
             ("tests/ut/test_sim_v2_kernels.py",)),
    Mutation("v2-dummy-requests-write-kv", "the simulator's V2 slot mapping gives a dummy "
             "request's tokens cache slots", "vllm_ascend/device/sim/v2_kernels.py",
             "torch.where(real & enabled, slots, PAD_ID)", "torch.where(enabled, slots, PAD_ID)",
             ("tests/ut/test_sim_v2_kernels.py",)),
    Mutation("v2-repetition-penalty-ignored", "the simulator's V2 sampling leaves out the "
             "repetition penalty", "vllm_ascend/device/sim/v2_sampling.py",
             "        if rep != 1.0:\n", "        if False:\n",
             ("tests/ut/test_sim_v2_kernels.py",)),
    Mutation("gdn-speculative-start-ignored", "the simulator's recurrent delta rule starts "
             "every sequence from its first token's state slot, whatever the verification "
             "accepted", "vllm_ascend/device/sim/gdn.py",
             "        s = state[slots[start + a - 1]].float()",
             "        s = state[slots[start]].float()", ("tests/ut/test_sim_gdn.py",)),
    Mutation("gdn-capture-writes-states", "a captured recurrent delta rule updates the states "
             "at capture, as no chip does", "vllm_ascend/device/sim/gdn.py",
             "    if CAPTURING.active:  # checked, not run: the states stay as they are until a "
             "replay\n        return CAPTURING.unwritten(out)\n",
             "", ("tests/ut/test_sim_gdn.py",)),
    Mutation("gdn-gate-sign", "the simulator's delta rule grows the state by exp(-g) instead "
             "of decaying it", "vllm_ascend/device/sim/gdn.py",
             "        s.mul_(torch.exp(g.float())[:, None, None])",
             "        s.mul_(torch.exp(-g.float())[:, None, None])", ("tests/ut/test_sim_gdn.py",)),
    Mutation("gdn-state-slots-shifted", "each request's Gated DeltaNet states are read and "
             "written in another request's slot", "vllm_ascend/ops/gdn.py",
             "        index = slots.long()\n",
             "        index = slots.long().roll(1)\n",
             ("tests/e2e/test_families.py", "-k", "qwen3_next and NONE and not tp2")),
    Mutation("gdn-state-indices-frozen-at-capture", "a FULL replay reads the Gated DeltaNet "
             "state indices of the step it was captured in", "vllm_ascend/ops/gdn.py",
             "            out = self._decode(md.non_spec_state_indices_tensor[:n], *args)",
             "            out = self._decode(self.__dict__.setdefault('_frozen', {}).setdefault("
             "n, md.non_spec_state_indices_tensor[:n].clone()), *args)",
             ("tests/e2e/test_families.py", "-k",
              "qwen3_next and FULL_DECODE_ONLY and close and not tp2")),
    Mutation("gdn-conv-state-not-carried", "a prompt's conv state starts from zero in each "
             "chunk of its prefill", "vllm_ascend/ops/gdn.py",
             "            state = conv[slots[i]] if has_state[i] else torch.zeros_like(conv[slots[i]])",
             "            state = torch.zeros_like(conv[slots[i]])",
             ("tests/e2e/test_gated_deltanet.py", "-k", "longer")),
    Mutation("gdn-beta-sign", "the delta rule's write strength is sigmoid(-b)",
             "vllm_ascend/ops/gdn.py",
             "        return g.contiguous(), torch.sigmoid(b.float()).to(torch.bfloat16)",
             "        return g.contiguous(), torch.sigmoid(-b.float()).to(torch.bfloat16)",
             ("tests/e2e/test_families.py", "-k", "qwen3_next and NONE and not tp2")),
    Mutation("gdn-kv-lanes-overlap", "a hybrid model's recurrent states take the V lane, where "
             "another block's V lies", "vllm_ascend/attention/hybrid.py",
             "    ssm = raw[start:start + num_blocks * lane].view(ssm_dtype)",
             "    ssm = raw[start + lane:start + lane + num_blocks * lane].view(ssm_dtype)",
             ("tests/e2e/test_families.py", "-k", "qwen3_next and NONE and not tp2")),
    Mutation("hybrid-model-not-refused", "a Mamba-2 model starts and dies in its profile run "
             "on vLLM's Triton kernels", "vllm_ascend/attention/limits.py",
             "        found += state_space_layers(vllm_config, config)\n", "",
             ("tests/e2e/test_start_up_errors.py", "-k", "mamba2")),
    Mutation("gdn-recomputed-request-reads-old-states", "a request prefilled from its first "
             "token (new, or preempted and recomputed) starts its delta rule from the recurrent "
             "state left in its slot", "vllm_ascend/ops/gdn.py",
             "        initial[fresh] = 0\n", "",
             ("tests/e2e/test_gated_deltanet.py", "-k", "preempted")),
    Mutation("plan-hybrid-blocks-as-attention", "the start-up plan sizes a hybrid model's KV "
             "cache blocks as if every layer were attention", "vllm_ascend/plan.py",
             "    if states is not None:\n        return states.group_size * 2 * states.recurrent\n",
             "", ("tests/e2e/test_gated_deltanet.py", "-k", "plan")),
    Mutation("kv-views-at-the-managers-block-size", "a hybrid model's 512-token blocks are "
             "viewed whole, not as the kernel blocks FIA reads",
             "vllm_ascend/worker/model_runner.py",
             "        kv_caches = npu_kv_cache_views(raw, kv_cache_config, kernel_block_sizes)\n",
             "        kv_caches = npu_kv_cache_views(raw, kv_cache_config)\n",
             ("tests/e2e/test_gated_deltanet.py", "-k", "kernel_blocks")),
    Mutation("qwen3_5-needs-torchvision", "the stand-in for transformers' torchvision image "
             "processor module is not installed: a text-only Qwen3.5 fails vLLM's inspection",
             "vllm_ascend/patch/qwen2_vl_image_processor.py",
             "    sys.modules[TARGET] = _stand_in()", "    return",
             ("tests/ut/test_patch_qwen2_vl.py",)),
    Mutation("qwen3_5-images-not-refused", "Qwen3.5's vision-language class starts with image "
             "inputs that no Ascend vision encoder serves", "vllm_ascend/attention/limits.py",
             "    if model.is_multimodal_model and model.supports_multimodal_inputs:",
             "    if False:", ("tests/e2e/test_gated_deltanet.py", "-k", "images")),
    Mutation("modelslim-mtp-layer-unnamed",
             "an export whose description leaves out DeepSeek's MTP layer fails saying the "
             "description is another model's, not how to list the layer",
             "vllm_ascend/quantization/modelslim.py",
             "        if layer and listed and int(layer.group(1)) > max(listed):",
             "        if False:",
             ("tests/e2e/test_spec_decode.py::"
              "test_an_export_whose_description_omits_the_mtp_layer_runs_without_mtp_and_"
              "refuses_it",)),
]


# What a mutation may need of the machine: a command that prints True where it has it.
ONE_ROW_KERNEL = """
import torch
torch.manual_seed(0)
differ = False
for k, n in [(64, 192), (576, 3072), (1536, 576), (576, 49152), (2048, 1024)]:
    x, w = torch.randn(2, k).to(torch.bfloat16), torch.randn(k, n).to(torch.bfloat16)
    differ |= not torch.equal((x[:1] @ w)[0], (x @ w)[0])
print(differ)
"""
NEEDS = {"packs": ("oneDNN packs bf16 weights on this CPU (AVX-512 BW/VL/DQ or AVX-NE-CONVERT); "
                   "elsewhere the packed products do not run",
                   "from vllm_ascend.device.sim import matmul; print(matmul.cpu_packs_bf16())"),
         # torch's bf16 kernel gives one row other bits than the same row among two (AVX-512:
         # a vector kernel for one row); on an AVX2 CPU it does not, and padding changes nothing.
         "one-row-kernel": ("torch's bf16 kernel gives a row of one other bits than the same row "
                            "among two on this CPU (AVX-512-BF16); elsewhere padding changes "
                            "nothing", ONE_ROW_KERNEL),
         "bf16": ("this CPU has bf16 instructions (AVX512_BF16, AMX-BF16) and packs: its "
                  "products of 9 rows or more read the pack",
                  "from vllm_ascend.device.sim import matmul; "
                  "print(matmul.cpu_packs_bf16() and matmul.cpu_has_bf16())")}


def machine_has(need: str) -> bool:
    code = NEEDS[need][1]
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return out.stdout.strip().endswith("True")


def run(mutation: Mutation, copy: pathlib.Path, timeout: int) -> tuple[str, float, str]:
    target = copy / mutation.path
    original = target.read_text()
    if original.count(mutation.old) != 1:
        return "error", 0.0, f"the text to change is not found once in {mutation.path}"
    target.write_text(original.replace(mutation.old, mutation.new))
    env = {**os.environ, "PYTHONPATH": str(copy)}
    start = time.monotonic()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
             *mutation.tests], cwd=copy, env=env, capture_output=True, text=True,
            timeout=timeout)
        outcome = {0: "MISSED", 1: "caught"}.get(proc.returncode, "error")
        # pytest's short summary: the first test that failed (or could not run), and why.
        lines = [line for line in proc.stdout.splitlines()
                 if line.startswith(("FAILED tests/", "ERROR tests/"))]
        detail = (lines or proc.stdout.strip().splitlines()[-1:] or [""])[0][:160]
    except subprocess.TimeoutExpired:
        outcome, detail = "error", f"no result in {timeout} s"
    finally:
        target.write_text(original)
    return outcome, time.monotonic() - start, detail


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="mutations to run (all by default)")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per mutation")
    args = parser.parse_args()
    chosen = [m for m in MUTATIONS if not args.names or m.name in args.names]
    unknown = set(args.names) - {m.name for m in MUTATIONS}
    if unknown:
        parser.error(f"no such mutation: {', '.join(sorted(unknown))}")
    if args.list:
        for m in chosen:
            print(f"{m.name:38s} {m.path}: {m.breaks}\n{'':38s} tests: {' '.join(m.tests)}")
        return 0
    results = []
    with tempfile.TemporaryDirectory(prefix="vllm-ascend-mutations-") as tmp:
        copy = pathlib.Path(tmp) / "tree"
        shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(".git", "__pycache__"))
        has = {need: machine_has(need) for need in {m.needs for m in chosen if m.needs}}
        for m in chosen:
            if m.needs and not has[m.needs]:
                outcome, took, detail = "n/a", 0.0, "needs: " + NEEDS[m.needs][0]
            else:
                outcome, took, detail = run(m, copy, args.timeout)
            results.append(outcome)
            print(f"{outcome:7s} {took:6.0f} s  {m.name:38s} {detail}", flush=True)
    caught, applicable = results.count("caught"), len(results) - results.count("n/a")
    print(f"\n{caught} of {applicable} caught, {results.count('MISSED')} missed, "
          f"{results.count('error')} errors; {results.count('n/a')} not applicable on this "
          "machine")
    return 0 if caught == applicable else 1


if __name__ == "__main__":
    sys.exit(main())
