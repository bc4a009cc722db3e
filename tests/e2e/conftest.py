"""Shared e2e machinery: engines on the simulator, HF transformers references, comparisons."""

import collections
import contextlib
import functools
import gc
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from unittest import mock

import pytest
import requests

os.environ.setdefault("VLLM_ASCEND_SIM_MEMORY_GB", "2")  # small simulated device: fast KV alloc
# Each communicator holds 2 x HCCL_BUFFSIZE MB of device memory outside torch (200 by default,
# more than a 2 GiB device's unrequested 8 %), as on a chip: a small device wants small buffers.
os.environ.setdefault("HCCL_BUFFSIZE", "16")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc(callable)

from scripts.models import (agreeing_mtp_dir, eagle3_head_dir, eagle_head_dir,  # noqa: E402
                            quantized_model_dir, smollm2_dir, tiny_model_dir)
from tests.e2e import cells, w8a8_reference  # noqa: E402

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea:",
    "1, 2, 3, 4,",
]
# Low-precision output is compared under the logprob-closeness rule (check_logprobs_close) with
# the top-TOPK logprobs of each side.
TOPK = 5


OUR_CLASSES = {"llama": "AscendLlamaForCausalLM", "smollm2": "AscendLlamaForCausalLM",
               "qwen2": "AscendQwen2ForCausalLM", "qwen3": "AscendQwen3ForCausalLM"}


def class_name(model) -> str:
    return type(model).__name__


def loaded_class(llm) -> str:
    return llm.apply_model(class_name)[0]  # (by reference: workers of other processes too)


# ModelSlim W8A8 exports of the tiny families (scripts/models.py): the base family, the type of
# each decoder layer's linear layers, the dtype they were exported for.
QUANTIZED = {
    "llama-w8a8-dynamic": ("llama", "W8A8_DYNAMIC", "bfloat16"),
    "llama-w8a8": ("llama", "W8A8", "bfloat16"),
    "llama-w8a8-mixed": ("llama", ("W8A8_DYNAMIC", "W8A8"), "bfloat16"),
    "qwen3-w8a8-dynamic": ("qwen3", "W8A8_DYNAMIC", "float16"),
    "qwen3-w8a8": ("qwen3", "W8A8", "float16"),
    # attention and shared expert static in layer 0, dynamic in layer 1; routed experts FLOAT
    "qwen2_moe-w8a8-mixed": ("qwen2_moe", ("W8A8", "W8A8_DYNAMIC"), "float16"),
    # every linear layer and the routed experts W8A8_DYNAMIC, as DeepSeek's and Qwen3-MoE's
    # ModelSlim exports (DeepSeek's MLA projections too, kv_b_proj excepted, as upstream)
    "qwen3_moe-w8a8-dynamic": ("qwen3_moe", "W8A8_DYNAMIC", "bfloat16", 1234, True),
    "deepseek_v2_moe-w8a8-dynamic": ("deepseek_v2_moe", "W8A8_DYNAMIC", "bfloat16", 1234, True),
    # with a query LoRA: q_a_proj and kv_a_proj_with_mqa load into vLLM's fused_qkv_a_proj
    "deepseek_v3-w8a8-dynamic": ("deepseek_v3", "W8A8_DYNAMIC", "bfloat16", 1234, True),
    # upstream's graph-mode end-to-end model, DeepSeek-V2-Lite-W8A8, served (test_serve.py)
    "deepseek_v2_moe-w8a8-dynamic-float16": ("deepseek_v2_moe", "W8A8_DYNAMIC", "float16", 1234,
                                             True),
    # DeepSeek-V3 with its MTP layer (an MoE layer), which the export carries FLOAT and lists
    # as FLOAT, as upstream deploys W8A8 with MTP (test_spec_decode.py, test_serve_mtp.py)
    "deepseek_v3_moe_mtp-w8a8-dynamic": ("deepseek_v3_moe_mtp", "W8A8_DYNAMIC", "bfloat16", 1234,
                                         True),
    # float16: the experts' weight scales in float32, the grouped matmul's other dtype row
    "qwen3_moe-w8a8-dynamic-float16": ("qwen3_moe", "W8A8_DYNAMIC", "float16", 1234, True),
}


def broken_export(tmp_path, name: str, edit) -> str:
    """A copy of the ``name`` export (QUANTIZED) with ``edit(tensors, description)`` applied to
    its weights and its quant_model_description.json: a malformed export."""
    import safetensors.torch

    dst = tmp_path / "broken"
    shutil.copytree(model_path(name), dst)
    weights = next(dst.glob("*.safetensors"))
    tensors = safetensors.torch.load_file(str(weights))
    description = json.loads((dst / "quant_model_description.json").read_text())
    edit(tensors, description)
    safetensors.torch.save_file(tensors, str(weights), metadata={"format": "pt"})
    (dst / "quant_model_description.json").write_text(json.dumps(description))
    return str(dst)


def model_path(family: str) -> str:
    if family in QUANTIZED:
        return quantized_model_dir(*QUANTIZED[family])
    return str(smollm2_dir()) if family == "smollm2" else tiny_model_dir(family)


MAX_TOKENS = 16  # generated per request in the accuracy checks


AGREEING = "-agreeing"  # a method's drafter built to agree with the target (scripts/models.py)


def speculative_config(family: str, method: str, k: int) -> dict:
    """vLLM's speculative_config for ``method`` with ``k`` tokens a step, on ``family``; "eagle",
    "eagle3" and "mtp" draft with random weights (the target rejects their drafts), with
    "-agreeing" with heads fitted to agree with it (it accepts them on the fitted prompts)."""
    base = method.removesuffix(AGREEING)
    config = {"method": base, "num_speculative_tokens": k}
    if base == "ngram":
        config.update(prompt_lookup_min=2, prompt_lookup_max=4)
    elif base == "mtp":  # the checkpoint's own MTP layers (DeepSeek-V3): spec_target's
        pass
    elif base == "draft_model":  # the model itself: its drafts are the target's own choices
        config["model"] = model_path(family)
    else:  # an EAGLE or EAGLE-3 head, built for the target
        head_dir = eagle3_head_dir if base == "eagle3" else eagle_head_dir
        config["model"] = head_dir(model_path(family), agreeing=method.endswith(AGREEING))
    return config


def spec_target(family: str, method: str) -> str:
    """The target's checkpoint for ``method``: MTP layers live in it, so an agreeing one is a
    checkpoint of its own (the same target weights)."""
    if method != "mtp" + AGREEING:
        return model_path(family)
    if family in QUANTIZED:  # the export of the agreeing checkpoint
        return quantized_model_dir(*QUANTIZED[family],
                                   source=agreeing_mtp_dir(QUANTIZED[family][0]))
    return agreeing_mtp_dir(family)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    cells.new_test()  # before the setup: a module's engines count for the test that made them
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if report.when == "call" and report.passed:
        cells.write_passed(item)


@contextlib.contextmanager
def in_process(multiprocess: bool = False):
    """Engines made inside the block run their engine core in this process
    (VLLM_ENABLE_V1_MULTIPROCESSING=0) unless ``multiprocess``; vLLM's environment cache and the
    heap freeze are undone afterwards."""
    from vllm import envs

    # vLLM's start-up collects garbage a dozen times; in this long-lived process each full
    # collection walks every test's objects (HF references included). Freeze what lives now, as
    # vLLM freezes its own start-up heap, so that those collections walk the new engine only.
    # (No full collection first: it walked the whole heap, 0.5 s and more an engine; garbage
    # frozen now is collected with the engine's, after the unfreeze.)
    gc.freeze()
    try:
        with pytest.MonkeyPatch.context() as env:  # read when the LLM is made; not left behind
            env.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1" if multiprocess else "0")
            # vLLM unfreezes the heap after graph capture (freeze_gc_for_cudagraph_capture), and
            # its four collections after that walked every test's objects again (0.7 s an
            # engine): the heap stays frozen until the engine is gone.
            env.setattr(gc, "unfreeze", lambda: None)
            yield
    finally:
        # An in-process engine core caches vLLM's environment at its start (for serving); undo
        # that, and the heap freeze (vLLM's own freezes the engine too), so that the engine's
        # garbage is collected.
        envs.disable_envs_cache()
        gc.unfreeze()
        gc.collect()


@contextlib.contextmanager
def vllms_own_class(arch: str):
    """Engines made in the block (in this process) load vLLM's own class for ``arch`` instead of
    this plugin's model file: a family with no file, as any other family vLLM serves."""
    from vllm import ModelRegistry
    from vllm.model_executor.model_loader import utils as model_loader_utils
    from vllm.plugins import load_general_plugins

    from vllm_ascend.models import FAMILIES

    load_general_plugins()  # once a process: it registers the files (after this, otherwise)
    module = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
              "Qwen3ForCausalLM": "qwen3"}[arch]
    # vLLM remembers each model config's class (model_loader/utils.py): forget it on both ways.
    with mock.patch.dict(model_loader_utils._MODEL_ARCH_BY_HASH, clear=True):
        ModelRegistry.register_model(arch, f"vllm.model_executor.models.{module}:{arch}")
        try:
            yield
        finally:
            ModelRegistry.register_model(arch, FAMILIES[arch])


@contextlib.contextmanager
def call_log(path: pathlib.Path):
    """Yields a set that, at exit, holds the distinct torch_npu call shapes (JSON lines) made
    by engines made and run in the block, compiled pieces' calls included
    (vllm_ascend/device/sim/trace.py)."""
    calls: set = set()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_ASCEND_SIM_CALL_LOG", str(path))  # read when an engine is prepared
        yield calls
    calls.update(path.read_text().splitlines() if path.exists() else ())


@contextlib.contextmanager
def engine(model: str, multiprocess: bool = False, **kwargs):
    """An LLM on the simulator. By default its engine core runs in this process
    (VLLM_ENABLE_V1_MULTIPROCESSING=0): the same scheduler, executor, worker and runner as in
    serving, without spawning a process per engine (about 7 s of interpreter start and imports
    each). ``multiprocess=True`` gives the engine core its own process, as users run it, for
    tests that read the engine's stderr or environment at its start."""
    from vllm import LLM

    # max_num_batched_tokens 512: the start-up profile run of a full batch stays short in bf16
    # on a CPU (tests that need chunking set less).
    # gpu_memory_utilization 0.3: up to three engines live at once in this process (a module's
    # fixtures), sharing its one simulated device as they would share a chip.
    args = dict(dtype="bfloat16", max_model_len=512, max_num_batched_tokens=512, seed=0,
                max_num_seqs=16, gpu_memory_utilization=0.3)
    args.update(kwargs)
    with in_process(multiprocess):
        try:
            llm = LLM(model, **args)
        except BaseException:
            # An engine refused at start-up here leaves vLLM's parallel groups behind (its own
            # process would have exited): drop them, or the next engine of this process reuses
            # groups made for another model (a MoE model then finds no EP group).
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
            cleanup_dist_env_and_memory()
            raise
        try:
            llm.ascend_summary = cells.note_engine(llm.collective_rpc("summary")[0])
            yield llm
        finally:
            # vLLM's shutdown unfreezes the heap and collects it whole, twice (to free CUDA
            # memory); in this long-lived process that walks every test's objects, about a second
            # an engine. in_process() collects once afterwards, which frees the same.
            with mock.patch.object(gc, "collect", lambda *args: 0), \
                    mock.patch.object(gc, "unfreeze", lambda: None):
                llm.llm_engine.engine_core.shutdown()
            del llm


def graph_counts_per_rank(llm) -> list[dict]:
    """Each worker's graphs (NPUWorker.graph_counts): captured and replayed per runtime mode,
    and its device's streams in use."""
    return llm.collective_rpc("graph_counts")


def graph_counts(llm) -> dict:
    """graph_counts_per_rank of the first worker (the only one without parallelism)."""
    return graph_counts_per_rank(llm)[0]


@contextlib.contextmanager
def replays(llm):
    """Yields a dict that, at exit, holds the model's graph replays made inside the block
    ("replayed": runtime mode -> count), a speculative drafter's ("drafter_replayed"), and the
    steps the engine ran meanwhile ("steps": (scheduled tokens, scheduled requests) per step,
    from the runner's record), for the first worker; "ranks" holds the same for every worker
    (tensor and pipeline parallelism)."""
    def mark(worker):
        state = worker.model_runner.graph_state
        worker.recent_steps(clear=True)
        return dict(state.replayed), dict(state.drafter_replayed)

    def read(worker):
        state = worker.model_runner.graph_state
        return (dict(state.replayed), dict(state.drafter_replayed),
                [(s["num_tokens"], s["num_reqs"]) for s in worker.recent_steps()])

    def delta(after, before):
        return collections.Counter(after) - collections.Counter(before)

    result: dict = {}
    before = llm.collective_rpc(mark)
    yield result
    ranks = []
    for (was, drafter_was), (after, drafter_after, steps) in zip(before,
                                                                 llm.collective_rpc(read)):
        drafter = delta(drafter_after, drafter_was)
        ranks.append({"replayed": dict(delta(after, was) - drafter),
                      "drafter_replayed": dict(drafter),
                      "steps": [tuple(step) for step in steps]})  # (the RPC returns lists)
    result.update(ranks[0], ranks=ranks)


def check_replays(result: dict, mode: str) -> None:
    """A run's replays are the ones its steps call for; in a graph mode every decode step of
    MAX_TOKENS replays a FULL graph (``result`` as the family tests' ``run`` returns it)."""
    made = result["made"]
    assert made["replayed"] == result["expected"], made
    if mode != "NONE":
        assert made["replayed"].get("FULL", 0) >= MAX_TOKENS - 1, made  # every decode step


def expected_replays(mode: str, steps, num_layers: int, max_size: int,
                     decode_query_len: int = 1) -> dict:
    """The replays ``steps`` must make in ``mode``, by vLLM's dispatch rules (not the runner's
    record of them): a step runs graphs when its tokens fit the largest capture size; it is a
    uniform decode step when it has ``decode_query_len`` tokens per request (1 + the speculative
    tokens); PIECEWISE replays a graph per piece (layers + 1)."""
    counts: collections.Counter = collections.Counter()
    for tokens, reqs in steps:
        if tokens > max_size:
            continue
        uniform = tokens == reqs * decode_query_len
        full = mode == "FULL" or (uniform and mode in ("FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"))
        if full:
            counts["FULL"] += 1
        elif mode in ("PIECEWISE", "FULL_AND_PIECEWISE"):
            counts["PIECEWISE"] += num_layers + 1
    return dict(counts)


def num_layers(llm) -> int:
    return llm.llm_engine.vllm_config.model_config.hf_config.num_hidden_layers


def check_close_with_replays(llm, path: str, dtype: str, mode: str, prompts, label: str,
                             max_size: int) -> dict:
    """Greedy output close to HF's, one step per generated token at least, and exactly the
    replays the steps call for in ``mode`` (graphs up to ``max_size`` tokens); returns the
    replays made (``replays``)."""
    with replays(llm) as made:
        outs = vllm_greedy(llm, prompts, MAX_TOKENS)
    for prompt, out in zip(prompts, outs):
        check_logprobs_close(hf_greedy(path, prompt, MAX_TOKENS), out, f"{label} {prompt!r}",
                             dtype=dtype)
    assert len(made["steps"]) >= MAX_TOKENS, made["steps"]
    assert made["replayed"] == expected_replays(mode, made["steps"], num_layers(llm),
                                                max_size), made
    return made


def chip_cost_per_decode_step(llm, batch: int = 1, tokens: int = 4) -> dict:
    """The simulator's chip-cost ledger (vllm_ascend/device/sim/ledger.py) of one decode step of
    an in-process engine, `batch` requests: counts over 1 + tokens generated minus counts over 1,
    over the engine steps between them (a speculative step makes several tokens)."""
    from vllm import SamplingParams

    from vllm_ascend.device.sim.ledger import ROWS, Ledger

    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    execute_model = runner.execute_model
    prompts = [f"Request {i}: tell me a story about the number {i}." for i in range(batch)]

    def count(n):
        steps = [0]

        def counted(*args, **kwargs):
            steps[0] += 1
            return execute_model(*args, **kwargs)

        runner.execute_model = counted
        try:
            with Ledger() as ledger:
                llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n,
                                                     ignore_eos=True), use_tqdm=False)
        finally:
            del runner.execute_model  # back to the class's
        return ledger.counts, steps[0]

    count(2)  # warm-up
    (short, short_steps), (long, long_steps) = count(1), count(1 + tokens)
    return {row: (long[row] - short[row]) / (long_steps - short_steps) for row in ROWS}


def word_prompt(words: int) -> str:
    """A prompt of ``words`` words, about a token each, repeating nine words in a fixed order
    (the long prompts of the MLA prefill tests)."""
    vocabulary = ["river", "stone", "light", "seven", "garden", "quiet", "north", "paper", "cloud"]
    return " ".join(vocabulary[(i * 7 + 5) % len(vocabulary)] for i in range(words))


def vllm_greedy(llm, prompts, max_tokens, lora_request=None, **kwargs):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=TOPK, ignore_eos=True,
                            **kwargs)
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora_request)
    return [(list(o.outputs[0].token_ids),
             [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs])
            for o in outs]


@functools.lru_cache(maxsize=None)
def _hf_model(path):
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(path)
    if (pathlib.Path(path) / "quant_model_description.json").exists():  # a ModelSlim export
        model = w8a8_reference.load(path)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # like ignore_eos
    return tok, model


class Reference(tuple):
    """(tokens, [top-k {token: logprob}]) of HF transformers' greedy generation, which can also
    score another continuation of the same prompt (``rescore``), so that a sequence that parts
    from it at a near tie is still compared at every position."""

    def __new__(cls, tokens, steps, path, prompt_ids):
        self = super().__new__(cls, (tokens, steps))
        self.path, self.prompt_ids = path, prompt_ids
        return self

    def rescore(self, tokens) -> list[dict]:
        return hf_scores(self.path, self.prompt_ids, tuple(tokens))

    def perturbed_gap(self, prefix, token) -> float:
        """The least lead of the reference's choice over ``token`` after ``prefix``, over its
        runs with every decoder layer's input perturbed below bfloat16's rounding
        (hf_perturbed)."""
        runs = hf_perturbed(self.path, self.prompt_ids, tuple(prefix))
        if runs is None:
            return float("inf")
        return (runs.max(-1).values - runs[:, token]).min().item()

    def perturbed_drift(self, prefix, token, logprob) -> float:
        """The least distance of ``logprob`` from the reference's logprob of ``token`` after
        ``prefix``, over the same perturbed runs."""
        runs = hf_perturbed(self.path, self.prompt_ids, tuple(prefix))
        if runs is None:
            return float("inf")
        return (runs[:, token] - logprob).abs().min().item()


def _top(lp, token=None) -> dict:
    top = lp.topk(TOPK)
    step = dict(zip(top.indices.tolist(), top.values.tolist()))
    if token is not None:
        step[token] = lp[token].item()
    return step


@functools.lru_cache(maxsize=None)
def hf_greedy(path: str, prompt: "str | tuple[int, ...]", max_tokens: int) -> Reference:
    """HF transformers' greedy generation (fp32) from a prompt string or its token ids."""
    import torch

    tok, model = _hf_model(path)
    ids = (torch.tensor([prompt]) if isinstance(prompt, tuple)
           else tok(prompt, return_tensors="pt").input_ids)
    with torch.no_grad():
        # Every prompt token is attended to: HF would otherwise mask the ones equal to the pad
        # token (SmolLM2's <|im_end|>, which chat prompts contain).
        out = model.generate(ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             do_sample=False, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=tok.pad_token_id or 0)
    tokens = out.sequences[0, ids.shape[1]:].tolist()
    steps = [_top(torch.log_softmax(logits[0].float(), -1)) for logits in out.logits]
    return Reference(tokens, steps, path, tuple(ids[0].tolist()))


@functools.lru_cache(maxsize=None)
def hf_scores(path: str, prompt_ids: tuple[int, ...], tokens: tuple[int, ...]) -> list[dict]:
    """HF's (fp32) top-k logprobs at each position of ``tokens`` generated after the prompt,
    given the tokens before it, with the given token's own logprob."""
    import torch

    _, model = _hf_model(path)
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + tokens])).logits[0, len(prompt_ids) - 1:-1]
    lps = torch.log_softmax(logits.float(), -1)
    return [_top(lp, t) for lp, t in zip(lps, tokens)]


# A cliff: where the reference's own output jumps under a perturbation of its activations
# smaller than bfloat16's rounding (2^-9 relative, at most), the plain reference's figures
# prove nothing about the engine, which computes in bfloat16. Measured on this session's AVX2
# CPU (docs/testing.md): the W8A8 Qwen3-MoE export's lead of 2.87 over the engine's token (the
# poem's token 10) falls to 0.44-0.83 in 4 of 20 runs perturbed by 1e-3; and where GLM-4.5's
# MoE at TP=2 parts at a near tie, the drift after it (0.438, against 0.4) is within the
# tolerance of a perturbed run.
PERTURBATION, PERTURBED_RUNS = 1e-3, 20


@functools.lru_cache(maxsize=None)
def hf_perturbed(path: str, prompt_ids: tuple[int, ...], prefix: tuple[int, ...]):
    """HF's (fp32) logprobs of the token after ``prefix``, [PERTURBED_RUNS, vocabulary], over
    runs with each decoder layer's input multiplied by 1 + PERTURBATION x N(0, 1) (a fixed
    seed); None for a model without decoder layers to perturb."""
    import torch

    _, model = _hf_model(path)
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        return None
    generator = torch.Generator().manual_seed(0)

    def perturb(module, args):
        x = args[0]
        return (x * (1 + PERTURBATION * torch.randn(x.shape, generator=generator)),) + args[1:]

    handles = [layer.register_forward_pre_hook(perturb) for layer in layers]
    try:
        with torch.no_grad():
            return torch.stack([torch.log_softmax(model(torch.tensor([prompt_ids + prefix]))
                                                  .logits[0, -1].float(), -1)
                                for _ in range(PERTURBED_RUNS)])
    finally:
        for handle in handles:
            handle.remove()


def model_kind(path: str) -> str:
    """Which tolerance a model's comparison uses: SmolLM2's real weights, a W8A8 export, or a
    tiny random-weight model."""
    if (pathlib.Path(path) / "quant_model_description.json").exists():
        return "w8a8"
    if "tiny-gpt_oss" in str(path):
        return "tiny-gpt-oss"
    return "smollm2" if "SmolLM2" in str(path) else "tiny"


# The most a chosen token's logprob may differ from HF transformers' fp32 reference, per kind of
# model and dtype: about twice the worst measured over the whole suite (every position of every
# comparison, VLLM_ASCEND_DRIFT_LOG; docs/testing.md). A sequence may part from the reference
# only at a near tie: where the reference's top two are closer than the same figure (the widest
# parting measured is beside each figure).
LOGPROB_TOLERANCE = {
    ("tiny", "bfloat16"): 0.4,  # worst 0.207 of 1573 positions; partings at gaps up to 0.33
    ("tiny", "float16"): 0.15,  # worst 0.067 of 688; partings at gaps up to 0.018
    # GPT-OSS's tiny model amplifies bfloat16 rounding into its logits more than the others: its
    # attention and MoE outputs are as close to fp32 as HF's own bfloat16 run's (measured per
    # layer), yet HF's bfloat16 logprobs depart from fp32 by up to 0.64 along the same tokens.
    ("tiny-gpt-oss", "bfloat16"): 1.9,  # worst 0.951 of 256; partings at gaps up to 0.39
    ("smollm2", "bfloat16"): 0.3,  # worst 0.158 (32 tokens, 7 prompts); no parting
    ("smollm2", "float16"): 0.05,  # worst 0.016 (the same prompts)
    # W8A8 exports against their fp32 reference (the same quantization, w8a8_reference.py): an
    # activation that rounds to the next int8 level in one and not the other moves the output
    # by a quantization step, and the tiny models' peaked LM head (scripts/models.py) multiplies
    # that in the logits: the loosest figures here.
    ("w8a8", "bfloat16"): 2.5,  # worst 1.214 of 544; partings at gaps up to 1.62
    ("w8a8", "float16"): 1.5,  # worst 0.730 of 256; partings at gaps up to 0.66
}
EXACT = 1e-6  # the same kernels in eager and graph mode: the same bits, up to printing


def _record_drift(kind, dtype, label, drift, gap):
    """With VLLM_ASCEND_DRIFT_LOG set, each compared position is appended to that file (one JSON
    object a line): what the tolerances are sized from."""
    path = os.environ.get("VLLM_ASCEND_DRIFT_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"kind": kind, "dtype": dtype, "label": label, "drift": drift,
                                "parted_at_gap": gap}) + "\n")


@functools.lru_cache(maxsize=None)
def hf_prompt_logprobs(path: str, ids: tuple[int, ...]) -> list[float]:
    """HF transformers' (fp32) logprob of each prompt token after the first, given the ones
    before it."""
    import torch

    _, model = _hf_model(path)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


def check_logprobs_close(reference: Reference, actual, label="", dtype="bfloat16") -> int:
    """The rule for output against HF transformers' fp32 reference, by value at every position:
    the chosen token's logprob within LOGPROB_TOLERANCE of the reference's logprob of the same
    token given the same prefix. The sequences may part only at a near tie: the reference's
    top-two gap there below the tolerance. At a cliff, where the reference itself moves when its
    activations are perturbed below bfloat16's rounding (hf_perturbed), a lead or a logprob
    within the tolerance of one of those runs counts too; it is measured only where the plain
    reference fails. From a parting on the reference is HF's scoring of the actual sequence, so
    every position is still compared. Returns the positions compared."""
    (ref_tokens, ref_steps), (tokens, steps) = reference, actual
    kind = model_kind(reference.path)
    tolerance = LOGPROB_TOLERANCE[kind, dtype]
    assert len(tokens) == len(ref_tokens), \
        f"{label}: {len(tokens)} tokens, expected {len(ref_tokens)}"
    parted = next((i for i, (r, t) in enumerate(zip(ref_tokens, tokens)) if r != t), None)
    along = list(ref_steps)
    where = f"\ngot       {tokens}\nreference {ref_tokens}"
    for i, (t, got) in enumerate(zip(tokens, steps)):
        if parted is not None and i == parted + 1:  # past the parting: HF along this sequence
            along[i:] = reference.rescore(tokens)[i:]
        ref = along[i]
        best = max(ref, key=ref.get)
        gap = ref[best] - ref.get(t, float("-inf"))
        perturbed = None  # measured only where the unperturbed lead is no near tie
        if t != best and gap >= tolerance:
            perturbed = reference.perturbed_gap(tokens[:i], t)
        assert t == best or gap < tolerance or perturbed < tolerance, (
            f"{label}: token {i} is {t}, the reference's choice {best} leads it by {gap:.4f}: "
            f"not a near tie (under {tolerance}; by {perturbed:.4f} at least with its "
            f"activations perturbed below bfloat16's rounding){where}\nhere      {got}\n"
            f"reference {ref}")
        drift = abs(got[t] - ref[t])
        _record_drift(kind, dtype, label, drift, None if t == best else gap)
        nearest = drift if drift <= tolerance else reference.perturbed_drift(tokens[:i], t,
                                                                             got[t])
        assert nearest <= tolerance, (
            f"{label}: token {i} ({t}) has logprob {got[t]:.4f}, reference {ref[t]:.4f}: "
            f"{drift:.4f} apart, more than the {tolerance} {kind} {dtype} allows (and "
            f"{nearest:.4f} from the nearest of its runs perturbed below bfloat16's "
            f"rounding){where}")
    return len(tokens)


def check_identical(expected, actual, label="") -> None:
    """The rule for the same engine settings in eager and in a graph mode (the same kernels):
    the same tokens, and the same top-k logprobs at every position, within EXACT."""
    (tokens_a, steps_a), (tokens_b, steps_b) = expected, actual
    assert tokens_a == tokens_b, \
        f"{label}: tokens differ\ngot      {tokens_b}\nexpected {tokens_a}"
    for i, (a, b) in enumerate(zip(steps_a, steps_b)):
        assert a.keys() == b.keys() and all(a[t] == b[t] or abs(a[t] - b[t]) <= EXACT
                                            for t in a), (
            f"{label}: position {i}'s logprobs differ\ngot      {b}\nexpected {a}")


@contextlib.contextmanager
def platform_log():
    """Yields a list that collects the lines NPUPlatform and the areas it hands the config to
    log inside the block (its start-up decisions; vLLM's log handlers write to a stream fixed
    when vLLM configured logging, which pytest's capture may no longer hold)."""
    from vllm_ascend import platform
    from vllm_ascend.compilation import settings
    from vllm_ascend.device_allocator import sleep
    from vllm_ascend.quantization import select
    from vllm_ascend.worker import processes, speculative

    lines: list[str] = []
    with contextlib.ExitStack() as stack:
        for module in (platform, settings, sleep, select, processes, speculative):
            def record(msg, *args, _info=module.logger.info, **kwargs):
                lines.append(msg % args if args else msg)
                _info(msg, *args, **kwargs)

            stack.enter_context(mock.patch.object(module.logger, "info", record))
        yield lines


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The settings the suite's engines share; a test of vLLM's and the simulator's defaults removes
# them (vllm_server(..., defaults=True), default_env()).
SUITE_SETTINGS = ("VLLM_ASCEND_SIM_MEMORY_GB", "HCCL_BUFFSIZE")


def default_env() -> dict:
    """This process's environment without the suite's settings: the simulator's default device
    (a quarter of the host's memory) and HCCL buffers, as a user's shell has them."""
    return {k: v for k, v in os.environ.items() if k not in SUITE_SETTINGS}


@contextlib.contextmanager
def vllm_server(model: str, name: "str | None", *args: str, start_s: int = 300,
                defaults: bool = False):
    """``vllm serve model --served-model-name name *args`` on 127.0.0.1, as a user starts it;
    yields (base URL, start-up log) once /health answers. ``defaults``: nothing but the model,
    the address and ``args`` (served under the model's path), on the default simulated device."""
    port = free_port()
    log = open(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"vllm-serve-{port}.log"), "w+")
    cmd = [os.path.join(os.path.dirname(sys.executable), "vllm"), "serve", model,
           "--host", "127.0.0.1", "--port", str(port),
           *(() if defaults else ("--served-model-name", name, "--seed", "0")), *args]
    env = default_env() if defaults else {**os.environ, "VLLM_ASCEND_SIM_MEMORY_GB": "2"}
    # Dev mode: POST /collective_rpc, through which the tests read the workers' graph counts.
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**env, "VLLM_SERVER_DEV_MODE": "1"})
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + start_s
    try:
        while time.time() < deadline:
            if proc.poll() is not None:
                log.seek(0)
                pytest.fail(f"vllm serve exited with {proc.returncode}:\n{log.read()[-4000:]}")
            try:
                if requests.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            time.sleep(1)
        else:
            pytest.fail(f"vllm serve did not become healthy in {start_s} s")
        log.seek(0)
        cells.note_engine(served_rpc(base, "summary")[0])
        yield base, log.read()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        # The server's engine cores and workers (its session) exit after it: wait for them, so
        # that the next test finds their devices free.
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        else:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def served_rpc(base: str, method: str, **kwargs) -> list:
    """What each worker of a dev-mode server's first DP engine answers to ``method``."""
    r = requests.post(f"{base}/collective_rpc", json={"method": method, "kwargs": kwargs},
                      timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["results"]


def check_plan(figures: dict, label: str = "", exact_streams: bool = True) -> None:
    """A rank's start-up plan against what it measured (NPUWorker.startup_figures): the graphs
    it captured per runtime mode exactly; the streams exactly, or (``exact_streams`` False: MoE
    models, whose pieces without an MoE layer hold one stream less) at most the plan's bound;
    weights, activations, graph memory and KV cache within the plan's stated margins."""
    from vllm_ascend import plan

    planned, measured = figures["planned"], figures["measured"]
    assert planned["graph_counts"] == measured["graph_counts"], (label, figures)
    if measured["streams"] is not None:
        assert (planned["streams"] == measured["streams"] if exact_streams else
                measured["streams"] <= planned["streams"]), (label, figures)
    for name in ("weights", "activations", "graphs", "kv_cache"):
        assert plan.within(name, planned[name], measured[name]), (label, name, figures)


def plan_command(model: str, *args: str, env: dict) -> str:
    """`vllm-ascend plan model *args`, as a user runs it, in ``env``; its output."""
    run = subprocess.run([os.path.join(os.path.dirname(sys.executable), "vllm-ascend"), "plan",
                          model, *args], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    return run.stdout


def printed_plan(output: str) -> dict:
    """The figures `vllm-ascend plan` printed: graphs per runtime mode, streams, GiB."""
    graphs = re.search(r"graphs: (\w+), (\d+) graphs \(([^)]*)\), (\d+) of (\d+) streams", output)
    kv = re.search(r"KV cache ([\d.]+) GiB \((\d+) blocks\)", output)
    assert graphs and kv, output
    counts = {mode: int(n) for n, mode in re.findall(r"(\d+) (PIECEWISE|FULL)", graphs.group(3))}
    gib = {name: float(v) for name, v in re.findall(
        r"(weights|activations|graphs|communicators) ([\d.]+) GiB", output)}
    return {"mode": graphs.group(1), "graph_counts": counts, "streams": int(graphs.group(4)),
            "kv_cache": float(kv.group(1)), **gib}


def check_printed_plan(output: str, figures: dict) -> None:
    """What the command printed is what the engine planned for itself (to the printed GiB)."""
    printed, planned = printed_plan(output), figures["planned"]
    assert printed["graph_counts"] == planned["graph_counts"]
    assert printed["streams"] == planned["streams"]
    for name in ("weights", "activations", "graphs", "kv_cache", "communicators"):
        assert abs(printed[name] - planned[name] / (1 << 30)) <= 0.006, (name, printed, planned)


def served_graph_counts(base: str) -> list[dict]:
    """Each worker's graph counts (NPUWorker.graph_counts) from a dev-mode server."""
    return served_rpc(base, "graph_counts")


def served_completion(base: str, name: str, prompt: str | list[str], max_tokens: int,
                      headers=None):
    """(tokens, [top-k {token: logprob}]) of a greedy /v1/completions answer; a list of each
    prompt's, in order, for a list of prompts (sent as one request: the server adds them to the
    engine together)."""
    r = requests.post(f"{base}/v1/completions", timeout=120, headers=headers, json={
        "model": name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "logprobs": TOPK, "return_tokens_as_token_ids": True})
    assert r.status_code == 200, r.text
    answers = [([token_id(t) for t in lp["tokens"]],
                [{token_id(t): v for t, v in top.items()} for top in lp["top_logprobs"]])
               for lp in (c["logprobs"] for c in sorted(r.json()["choices"],
                                                        key=lambda c: c["index"]))]
    return answers if isinstance(prompt, list) else answers[0]


def token_id(token: str) -> int:
    return int(token.removeprefix("token_id:"))
