"""`vllm serve` as users run it at scale, on 127.0.0.1: a tiny DeepSeek-V2 (MLA attention, a
dense layer then an MoE layer with a shared expert) as a ModelSlim W8A8 export, with data
parallelism over tensor parallelism and expert parallelism over both (DP=2 x TP=2, EP=4: four
workers, two experts each), in the default graph mode: upstream's graph-mode end-to-end
configuration. vLLM runs MoE data-parallel engines in lockstep: every step, both agree on one
graph mode and one padded token count, and an engine without requests runs a dummy batch, since
every MoE layer all-gathers all ranks' tokens. The OpenAI endpoints answer as the export's
dequantized HF reference (TP=1) does, under the logprob-closeness rule, with graphs replayed;
the start-up log says what a user needs to know; 16 concurrent requests spread over both DP
engines; a load pinned to one DP rank finishes while the other idles; a long prefill on one rank
beside a short one on the other, and a stream aborted mid-way, leave both serving; `vllm bench
serve` measures the server. Every request has a timeout: a rank hung in a collective fails the
test, not the suite. (Dense models: test_parallel.py; SmolLM2's real weights: the demo in
test_fresh_machine.py, and test_graph_modes.py.)"""

import collections
import concurrent.futures
import re
import time

import pytest
import requests

from tests.e2e.conftest import (TOPK, check_logprobs_close, hf_greedy, model_path,
                                served_completion, served_graph_counts, served_rpc, token_id,
                                vllm_server)

# The full tier only: a served DP=2 x TP=2 engine (an API server, two engine cores, four
# workers).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# Upstream's graph-mode end-to-end configuration: a DeepSeek-V2-Lite-shaped ModelSlim W8A8
# export (every linear layer but kv_b_proj, and the routed experts, W8A8_DYNAMIC) at TP=2, DP=2
# with EP, against its dequantized reference.
FAMILY = "deepseek_v2_moe-w8a8-dynamic-float16"
DTYPE = "float16"
NAME = "tiny-deepseek-v2-moe-w8a8"
LAYERS = 2  # the tiny models'
MOE_LAYERS = 1  # its second layer (first_k_dense_replace 1)
TOKENS = 16
MAX_NUM_SEQS = 16
RANK_0 = {"X-data-parallel-rank": "0"}
DP_SYNC_INTERVAL = 16  # vLLM's default (--dp-sync-interval): how often DP engines sync idleness


@pytest.fixture(scope="module")
def server():
    with vllm_server(model_path(FAMILY), NAME, "--tensor-parallel-size", "2",
                     "--data-parallel-size", "2", "--enable-expert-parallel",
                     "--dtype", DTYPE,  # MoE closeness: see docs/moe.md#tests-and-figures
                     "--max-model-len", "512",
                     "--max-num-seqs", str(MAX_NUM_SEQS), "--api-server-count", "1",
                     "--enable-sleep-mode",  # as RL frameworks serve rollouts
                     # vLLM's KV budget leaves out the graphs' memory, captured after the KV
                     # cache; with the simulator's sleep-mode pool (a 2 MB page per tensor:
                     # docs/sleep_mode.md#limits) 0.9 of a 2 GiB device leaves none for them.
                     "--gpu-memory-utilization", "0.85",
                     start_s=420) as served:
        yield served


def answers_as_hf(base, prompts, headers=None):
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda p: served_completion(base, NAME, p, TOKENS, headers), prompts))
    for prompt, out in zip(prompts, outs):
        check_logprobs_close(hf_greedy(model_path(FAMILY), prompt, TOKENS), out, repr(prompt),
                             dtype=DTYPE)


def finished_per_engine(base) -> dict[str, float]:
    """Requests each DP engine finished so far (vLLM's Prometheus counter, by engine label):
    both engines' counters must be there."""
    metrics = requests.get(f"{base}/metrics", timeout=10).text
    counts: dict[str, float] = {}
    for line in metrics.splitlines():
        if line.startswith("vllm:request_success_total{"):
            engine = re.search(r'engine="(\d+)"', line)
            assert engine, f"vllm:request_success_total without an engine label: {line}"
            counts[engine.group(1)] = counts.get(engine.group(1), 0.0) + \
                float(line.rsplit(" ", 1)[1])
    assert set(counts) == {"0", "1"}, (
        f"vllm:request_success_total should count for DP engines 0 and 1, has "
        f"{sorted(counts)}:\n" + "\n".join(line for line in metrics.splitlines()
                                          if "request_success" in line))
    return counts


def engine_metric(base, name: str, engine: str) -> float:
    """One DP engine's value of a Prometheus metric (summed over its other labels)."""
    metrics = requests.get(f"{base}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith(name + "{") and f'engine="{engine}"' in line)


def test_server_runs_on_the_ascend_plugin(server):
    _, log = server
    assert "vllm-ascend: device backend sim" in log


def test_four_workers_hold_four_devices_and_no_other_process_opens_one(server):
    """DP=2 x TP=2 on one node: DP engine d's rank r on device 2d + r, each its own. The API
    server and the two engine cores open none (the simulator refuses device use before
    set_device, so a parent that asked would have failed the start)."""
    from vllm_ascend.device.sim import npu

    base, _ = server
    held = npu.devices_in_use()  # the node's devices -> the live process that opened each
    assert sorted(held) == [0, 1, 2, 3] and len(set(held.values())) == 4, held
    engine_0 = served_rpc(base, "device_binding")
    assert {b["device"]: b["pid"] for b in engine_0} == {0: held[0], 1: held[1]}, engine_0


def test_start_up_log_says_graph_mode_kept_sizes_graphs_streams_and_memory(server):
    """One line each, with figures that agree with each other and with the workers' counts; the
    memory is VLLM_ASCEND_SIM_MEMORY_GB (2, set by the fixture); the dtype is the one served; each
    worker says where its experts are and how tokens reach them."""
    base, log = server
    assert re.search(r"vllm-ascend: graph mode FULL_AND_PIECEWISE \(configured "
                     r"FULL_AND_PIECEWISE\): ", log), log[-3000:]
    kept = re.search(r"vllm-ascend: capture sizes \[([\d, ]+)\] kept, none dropped \(all sizes "
                     r"fit; (\d+) streams per size, (\d+) of 1800 usable streams\)", log)
    assert kept, log[-3000:]
    sizes = [int(x) for x in kept.group(1).split(",")]
    # (pieces + 1 FULL graph) x (the graph's own stream + its TP group's + one for the MoE
    # layers' all-gather and reduce-scatter): the plan's bound
    assert int(kept.group(2)) == (LAYERS + 1 + 1) * 3
    assert int(kept.group(3)) == int(kept.group(2)) * len(sizes)
    summaries = re.findall(r"vllm-ascend: graph mode FULL_AND_PIECEWISE on TP rank (\d) of 2: "
                           r"captured (\d+) graphs \(PIECEWISE sizes \[([\d, ]+)\]; FULL sizes "
                           r"\[([\d, ]+)\]\) in [\d.]+ s, [\d.]+ GiB; streams used (\d+) of 2048",
                           log)
    assert len(summaries) == 4, log[-4000:]  # 2 DP engines x 2 TP ranks
    assert sorted(rank for rank, *_ in summaries) == ["0", "0", "1", "1"]
    for _, graphs, piecewise, full, streams in summaries:
        full_sizes = [int(x) for x in full.split(",")]
        assert [int(x) for x in piecewise.split(",")] == sizes
        assert full_sizes == [s for s in sizes if s <= MAX_NUM_SEQS]  # decode: <= max_num_seqs
        assert int(graphs) == (LAYERS + 1) * len(sizes) + len(full_sizes)
        # A piece holds 2 streams (its own and its TP group's) when no MoE layer is in it: the
        # first (the embedding's all-reduce) and the dense layer's; 3 with the MoE layer (the EP
        # group too), as does each FULL graph.
        pieces = 2 * (1 + LAYERS - MOE_LAYERS) + 3 * MOE_LAYERS
        assert int(streams) == pieces * len(sizes) + 3 * len(full_sizes)
    for counts in served_graph_counts(base):  # DP engine 0's two workers
        assert sum(counts["captured"].values()) == int(summaries[0][1])
    # Outside torch: each worker's TP, DP and EP communicators, 2 x HCCL_BUFFSIZE (16 MB) each;
    # all of it, the weights, the activation peak, the graphs and the KV cache fit the device.
    # (The weights: 0.12 GiB, as the simulator's sleep-mode pool gives each of the export's
    # tensors, its scales and offsets included, a 2 MB page: docs/sleep_mode.md#limits.)
    memory = re.findall(r"vllm-ascend: device sim \(.*\), memory 2\.00 GiB: weights (0\.\d\d) GiB, "
                        r"activation peak ([\d.]+) GiB, graphs ([\d.]+) GiB, outside torch 0\.09 "
                        r"GiB, KV cache \d+ blocks x 128 tokens \(([\d.]+) GiB\)", log)
    assert len(memory) == 4, log[-3000:]
    for weights, peak, graphs, kv_cache in memory:
        assert 1.5 < float(kv_cache) and float(weights) + float(peak) + float(graphs) + \
            3 * 0.03125 + float(kv_cache) <= 2.0, memory
    # Each worker: its 2 of the 8 experts (EP over DP x TP), and vLLM's sequence-parallel MoE
    # (DP x TP with EP): each TP rank brings half of its DP rank's tokens to an EP all-gather.
    moe = re.findall(r"vllm-ascend: MoE layers: top-2 of experts (\d-\d) of 8 on EP rank (\d) of "
                     r"4; tokens reach them by all-gather and reduce-scatter over the EP group "
                     r"\(4 ranks, each TP rank bringing 1/2 of its DP rank's tokens\), in every "
                     r"phase and graph mode \(EP over 4 ranks\)", log)
    assert sorted(moe) == [("0-1", "0"), ("2-3", "1"), ("4-5", "2"), ("6-7", "3")], moe
    assert f"dtype=torch.{DTYPE}" in log


def replays_once_idle(base) -> list[collections.Counter]:
    """DP engine 0's workers' replays once its lockstep wave has ended: the engines agree that
    all are idle every DP_SYNC_INTERVAL steps, and until then run dummy batches (FULL graphs)
    after their last request, while the answer is already back."""
    counts = None
    for _ in range(60):
        now = [collections.Counter(c["replayed"]) for c in served_graph_counts(base)]
        if now == counts:
            return now
        counts = now
        time.sleep(0.5)
    raise AssertionError(f"DP engine 0 still replays graphs 30 s after its answer: {counts}")


def test_completions_answer_as_hf_with_a_piecewise_prefill_and_a_full_graph_per_decode(server):
    base, _ = server
    before = replays_once_idle(base)
    prompt = "The capital of France is"  # 6 tokens: a PIECEWISE prefill (padded to 8)
    check_logprobs_close(hf_greedy(model_path(FAMILY), prompt, TOKENS),
                         served_completion(base, NAME, prompt, TOKENS, RANK_0), "completions",
                         dtype=DTYPE)
    after = replays_once_idle(base)
    for rank, (was, now) in enumerate(zip(before, after)):  # both TP ranks of DP engine 0
        # A FULL graph per decode step, then a dummy batch (a FULL graph) per step until the
        # engines' next DP sync finds both idle: at most DP_SYNC_INTERVAL more, as the scheduler
        # may report the request finished a step late (measured: 15 + 16 here).
        made = now - was
        assert made["PIECEWISE"] == LAYERS + 1 and \
            TOKENS - 1 <= made["FULL"] <= TOKENS - 1 + DP_SYNC_INTERVAL, (rank, made)


def test_chat_completions_answer_as_hf(server):
    import transformers

    base, _ = server
    messages = [{"role": "user", "content": "What is the capital of Japan?"}]
    r = requests.post(f"{base}/v1/chat/completions", timeout=120, json={
        "model": NAME, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True,
        "messages": messages, "logprobs": True, "top_logprobs": TOPK,
        "return_tokens_as_token_ids": True})
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    answer = ([token_id(c["token"]) for c in content],
              [{token_id(t["token"]): t["logprob"] for t in c["top_logprobs"]} for c in content])
    tok = transformers.AutoTokenizer.from_pretrained(model_path(FAMILY))
    prompt_ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt_ids = getattr(prompt_ids, "input_ids", prompt_ids)
    check_logprobs_close(hf_greedy(model_path(FAMILY), tuple(prompt_ids), TOKENS), answer, "chat",
                         dtype=DTYPE)


def test_bad_request_gets_an_error_and_the_server_keeps_serving(server):
    base, _ = server
    r = requests.post(f"{base}/v1/completions", timeout=60, json={
        "model": NAME, "prompt": "word " * 2000, "max_tokens": 4})
    assert r.status_code == 400
    assert "maximum" in r.text.lower() or "context length" in r.text.lower()
    answers_as_hf(base, ["After a bad request, the answer is"])


def test_16_concurrent_requests_answer_as_tp1_on_both_engines(server):
    base, _ = server
    before = finished_per_engine(base)
    answers_as_hf(base, [f"Request {i} of sixteen: the answer is" for i in range(16)])
    after = finished_per_engine(base)
    served = {e: after[e] - before[e] for e in after}
    assert sum(served.values()) == 16 and all(served.values()), served


def test_a_load_pinned_to_one_rank_finishes_and_the_idle_rank_still_answers(server):
    base, _ = server
    before = finished_per_engine(base)
    answers_as_hf(base, [f"Pinned {i}: one, two," for i in range(8)], headers=RANK_0)
    middle = finished_per_engine(base)
    assert middle["0"] - before["0"] == 8 and middle["1"] == before["1"], (before, middle)
    answers_as_hf(base, ["After idling, rank one says"], headers={"X-data-parallel-rank": "1"})
    assert finished_per_engine(base)["1"] == middle["1"] + 1


def test_the_idle_rank_runs_the_busy_ranks_padded_size_in_lockstep(server):
    """Three requests pinned to rank 1 while rank 0 has none: rank 0 runs a dummy batch (one
    token) every step, through the graph of rank 1's step: when rank 1 decodes all three, the
    FULL graph of size 4 they are padded to, and when it prefills, a PIECEWISE graph of the size
    its prompt tokens are padded to. An idle rank that ran its own size (1) would leave rank 1's
    MoE all-gather waiting for tokens it never sends."""
    base, _ = server
    replays_once_idle(base)
    served_rpc(base, "recent_steps", clear=True)
    prompts = [f"Rank one alone, request {i}:" for i in range(3)]
    answers_as_hf(base, prompts, headers={"X-data-parallel-rank": "1"})
    for rank, steps in enumerate(served_rpc(base, "recent_steps")):  # DP engine 0's workers
        assert steps and all((s["num_tokens"], s["num_reqs"]) == (1, 1) for s in steps), steps
        ran = collections.Counter((s["mode"], s["num_tokens_padded"]) for s in steps)
        assert ran[("FULL", 4)] >= 1, (rank, ran)  # rank 1's three decodes
        assert any(mode == "PIECEWISE" and size >= 8 for mode, size in ran), (rank, ran)


def test_vllm_bench_serve_measures_the_server(server):
    """`vllm bench serve`, in this process: its subcommand's arguments, and the function its
    command runs (vllm.benchmarks.serve.main), which returns the figures it prints."""
    from vllm.benchmarks.serve import main
    from vllm.entrypoints.cli.benchmark.serve import BenchmarkServingSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    base, _ = server
    parser = FlexibleArgumentParser()
    BenchmarkServingSubcommand.add_cli_args(parser)
    args = parser.parse_args([
        "--backend", "vllm", "--base-url", base, "--model", NAME, "--tokenizer",
        model_path(FAMILY), "--dataset-name", "random", "--random-input-len", "16",
        "--random-output-len", "8", "--num-prompts", "8", "--seed", "0", "--ignore-eos",
        "--disable-tqdm"])
    result = main(args)
    assert (result["completed"], result["failed"], result["total_output_tokens"]) == (8, 0, 64)
    assert result["output_throughput"] > 0


def test_a_long_prefill_beside_a_short_one_on_the_other_rank_answers_as_hf(server):
    """Rank 0 prefills about 400 tokens (eager: above the largest capture size) while rank 1
    prefills two and decodes: in lockstep, every step runs the smaller graph mode of the two
    and both ranks' MoE layers gather the other's tokens, padded to the larger count."""
    base, _ = server
    long_prompt = "Once upon a time, " + "the river ran past the mill and " * 50 + "then"
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        long = pool.submit(served_completion, base, NAME, long_prompt, TOKENS, RANK_0)
        short = pool.submit(served_completion, base, NAME, "Hi there", TOKENS,
                            {"X-data-parallel-rank": "1"})
        answers = [(long_prompt, long.result(timeout=180)), ("Hi there", short.result(timeout=180))]
    for prompt, out in answers:
        check_logprobs_close(hf_greedy(model_path(FAMILY), prompt, TOKENS), out, prompt[:20],
                             dtype=DTYPE)


def test_a_stream_aborted_mid_way_leaves_both_ranks_serving(server):
    """A client drops a streamed request on rank 1 after a few tokens: vLLM aborts it (it
    leaves rank 1 having made far fewer than its 400 tokens), and both engines (one of them now
    idle, running dummy batches) keep answering."""
    base, _ = server
    generated = engine_metric(base, "vllm:generation_tokens_total", "1")
    with requests.post(f"{base}/v1/completions", stream=True, timeout=60,
                       headers={"X-data-parallel-rank": "1"}, json={
                           "model": NAME, "prompt": "Count to a thousand: 1, 2,",
                           "max_tokens": 400, "temperature": 0, "ignore_eos": True,
                           "stream": True}) as r:
        assert r.status_code == 200, r.text
        chunks = 0
        for line in r.iter_lines():
            chunks += line.startswith(b"data: ")
            if chunks == 4:
                break  # the connection closes with the block: vLLM aborts the request
    # vLLM 0.32 counts no client abort among finished requests: the request left rank 1's
    # running set long before its 400 tokens (vLLM's generated-token counter for that engine).
    deadline = time.time() + 60
    while engine_metric(base, "vllm:num_requests_running", "1") and time.time() < deadline:
        time.sleep(0.2)
    assert engine_metric(base, "vllm:num_requests_running", "1") == 0
    made = engine_metric(base, "vllm:generation_tokens_total", "1") - generated
    assert 4 <= made < 200, made
    before = finished_per_engine(base)
    answers_as_hf(base, ["After an abort, rank zero says"], headers=RANK_0)
    answers_as_hf(base, ["After an abort, rank one says"], headers={"X-data-parallel-rank": "1"})
    after = finished_per_engine(base)
    assert (after["0"] - before["0"], after["1"] - before["1"]) == (1, 1), (before, after)


def test_sleep_frees_the_device_refuses_requests_meanwhile_and_wake_up_replays_the_graphs(
        server):
    """POST /sleep puts both DP engines' four workers to sleep (level 1: weights to host
    memory, KV cache discarded); meanwhile a completion gets a 503 that says what to do, not a
    wait; after POST /wake_up the same graphs replay and the answers are HF's again."""
    base, _ = server
    awake = served_rpc(base, "device_memory")  # DP engine 0's two workers
    captured = [c["captured"] for c in served_graph_counts(base)]
    r = requests.post(f"{base}/sleep", params={"level": 1}, timeout=120)
    assert r.status_code == 200, r.text
    assert requests.get(f"{base}/is_sleeping", timeout=30).json() == {"is_sleeping": True}
    for was, now in zip(awake, served_rpc(base, "device_memory")):
        for tag in ("weights", "kv_cache"):
            assert now["sleep_mode"][tag] == {"mapped": 0,
                                              "asleep": was["sleep_mode"][tag]["mapped"]}, now
        assert now["in_use"] <= was["in_use"] - was["sleep_mode"]["weights"]["mapped"] - \
            was["sleep_mode"]["kv_cache"]["mapped"], (was, now)
    r = requests.post(f"{base}/v1/completions", timeout=30, json={
        "model": NAME, "prompt": "Asleep?", "max_tokens": 4})
    assert r.status_code == 503 and "POST /wake_up" in r.json()["error"]["message"], r.text
    r = requests.post(f"{base}/wake_up", timeout=120)
    assert r.status_code == 200 and r.json()["status"] == "awake", r.text
    assert requests.get(f"{base}/is_sleeping", timeout=30).json() == {"is_sleeping": False}
    before = replays_once_idle(base)
    answers_as_hf(base, ["Awake again, the answer is"], headers=RANK_0)
    after = replays_once_idle(base)
    assert all((now - was)["FULL"] >= TOKENS - 1 for was, now in zip(before, after))
    assert [c["captured"] for c in served_graph_counts(base)] == captured  # none again
