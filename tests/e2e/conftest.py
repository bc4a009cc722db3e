"""Shared e2e machinery: engines on the simulator, HF transformers references, comparisons."""

import collections
import contextlib
import functools
import gc
import os
import socket
import subprocess
import sys
import time

import pytest
import requests

os.environ.setdefault("VLLM_ASCEND_SIM_MEMORY_GB", "2")  # small simulated device: fast KV alloc
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc(callable)

from scripts.models import eagle_head_dir, smollm2_dir, tiny_model_dir  # noqa: E402

FAMILIES = ["llama", "qwen2", "qwen3", "smollm2"]
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


def loaded_class(llm) -> str:
    return llm.apply_model(lambda model: type(model).__name__)[0]


def model_path(family: str) -> str:
    return str(smollm2_dir()) if family == "smollm2" else tiny_model_dir(family)


def max_tokens_for(family: str) -> int:
    return 32 if family == "smollm2" else 16


def speculative_config(family: str, method: str, k: int) -> dict:
    """vLLM's speculative_config for ``method`` with ``k`` tokens a step, on ``family``."""
    config = {"method": method, "num_speculative_tokens": k}
    if method == "ngram":
        config.update(prompt_lookup_min=2, prompt_lookup_max=4)
    elif method == "draft_model":  # the model itself: its drafts are the target's own choices
        config["model"] = model_path(family)
    else:  # a random-weight EAGLE head: drafts are rarely accepted, output must not change
        config["model"] = eagle_head_dir(model_path(family))
    return config


@contextlib.contextmanager
def engine(model: str, multiprocess: bool = False, **kwargs):
    """An LLM on the simulator. By default its engine core runs in this process
    (VLLM_ENABLE_V1_MULTIPROCESSING=0): the same scheduler, executor, worker and runner as in
    serving, without spawning a process per engine (about 7 s of interpreter start and imports
    each). ``multiprocess=True`` gives the engine core its own process, as users run it, for
    tests that read the engine's stderr or environment at its start."""
    from vllm import LLM, envs

    # max_num_batched_tokens 512: the start-up profile run of a full batch stays short in bf16
    # on a CPU (tests that need chunking set less).
    args = dict(dtype="bfloat16", max_model_len=512, max_num_batched_tokens=512, seed=0,
                max_num_seqs=16)
    args.update(kwargs)
    # vLLM's start-up collects garbage a dozen times; in this long-lived process each full
    # collection walks every test's objects (HF references included). Freeze what lives now, as
    # vLLM freezes its own start-up heap, so that those collections walk the new engine only.
    gc.collect()
    gc.freeze()
    with pytest.MonkeyPatch.context() as env:  # read when the LLM is made; not left behind
        env.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1" if multiprocess else "0")
        llm = LLM(model, **args)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        # An in-process engine core caches vLLM's environment at its start (for serving); undo
        # that, and the heap freezes, so that the engine's garbage is collected.
        envs.disable_envs_cache()
        gc.unfreeze()
        gc.collect()


def graph_counts_per_rank(llm) -> list[dict]:
    """Each worker's graphs (its runner's GraphState): captured and replayed per runtime mode,
    and its device's streams in use."""
    def probe(worker):
        from vllm_ascend import device

        counts = worker.model_runner.graph_state.counts()
        return {**counts, "streams_in_use": device.current.streams_in_use()}

    return llm.collective_rpc(probe)


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
        state.recent_steps.clear()
        return dict(state.replayed), dict(state.drafter_replayed)

    def read(worker):
        state = worker.model_runner.graph_state
        return (dict(state.replayed), dict(state.drafter_replayed),
                [(s.num_tokens, s.num_reqs) for s in state.recent_steps])

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


def vllm_greedy(llm, prompts, max_tokens, **kwargs):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=TOPK, ignore_eos=True,
                            **kwargs)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids),
             [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs])
            for o in outs]


@functools.lru_cache(maxsize=None)
def _hf_model(path):
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # like ignore_eos
    return tok, model


@functools.lru_cache(maxsize=None)
def hf_greedy(path: str, prompt: "str | tuple[int, ...]", max_tokens: int):
    """(tokens, [top-k {token: logprob}]) of HF transformers' greedy generation (fp32) from a
    prompt string or its token ids."""
    import torch

    tok, model = _hf_model(path)
    ids = (torch.tensor([prompt]) if isinstance(prompt, tuple)
           else tok(prompt, return_tensors="pt").input_ids)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             do_sample=False, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=tok.pad_token_id or 0)
    tokens = out.sequences[0, ids.shape[1]:].tolist()
    steps = []
    for logits in out.logits:
        lp = torch.log_softmax(logits[0].float(), -1)
        top = lp.topk(TOPK)
        steps.append(dict(zip(top.indices.tolist(), top.values.tolist())))
    return tokens, steps


def check_logprobs_close(reference, actual, label=""):
    """The rule for low-precision output (vLLM's ``check_logprobs_close``): the greedy sequences
    may part only at a position where each side's token is among the other's top-k logprobs, and
    the comparison stops there (what follows depends on a different prefix)."""
    (ref_tokens, ref_lps), (tokens, lps) = reference, actual
    assert len(tokens) == len(ref_tokens), f"{label}: {len(tokens)} tokens, expected {len(ref_tokens)}"
    for i, (rt, t) in enumerate(zip(ref_tokens, tokens)):
        if rt == t:
            continue
        assert rt in lps[i] and t in ref_lps[i], (
            f"{label}: token {i} is {t}, reference {rt}, and they are not in each other's top "
            f"{TOPK}\ngot       {tokens}\nreference {ref_tokens}\n"
            f"top-k here {lps[i]}\nreference {ref_lps[i]}")
        break


def check_against_hf(llm, family, prompts=PROMPTS, label=""):
    path = model_path(family)
    n = max_tokens_for(family)
    outs = vllm_greedy(llm, prompts, n)
    for prompt, out in zip(prompts, outs):
        check_logprobs_close(hf_greedy(path, prompt, n), out, f"{label} {family} {prompt!r}")
    return outs


@pytest.fixture(scope="session")
def paths():
    return {f: model_path(f) for f in FAMILIES}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def vllm_server(model: str, name: str, *args: str, start_s: int = 300):
    """``vllm serve model --served-model-name name *args`` on 127.0.0.1, as a user starts it;
    yields (base URL, start-up log) once /health answers."""
    port = free_port()
    log = open(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"vllm-serve-{port}.log"), "w+")
    cmd = [os.path.join(os.path.dirname(sys.executable), "vllm"), "serve", model,
           "--host", "127.0.0.1", "--port", str(port), "--served-model-name", name,
           "--seed", "0", *args]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "VLLM_ASCEND_SIM_MEMORY_GB": "2"})
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
        yield base, log.read()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def served_completion(base: str, name: str, prompt: str, max_tokens: int, headers=None):
    """(tokens, [top-k {token: logprob}]) of a greedy /v1/completions answer."""
    r = requests.post(f"{base}/v1/completions", timeout=120, headers=headers, json={
        "model": name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "logprobs": TOPK, "return_tokens_as_token_ids": True})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    return ([token_id(t) for t in lp["tokens"]],
            [{token_id(t): v for t, v in top.items()} for top in lp["top_logprobs"]])


def token_id(token: str) -> int:
    return int(token.removeprefix("token_id:"))
