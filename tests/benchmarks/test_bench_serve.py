"""``vllm bench serve`` (vllm/benchmarks/serve.py): its datasets, arrivals and figures on
made-up results, then the command against the real server; with it, on the same server,
the CLI's other clients of a running server, ``vllm chat`` and ``vllm complete``."""

from __future__ import annotations

import json
import math
import re
import statistics
import subprocess
import sys

import pytest

from vllm.benchmarks.serve import (
    RequestResult,
    arrival_gaps,
    compute_metrics,
    custom_requests,
    parse_goodput,
    prefix_repetition_requests,
    ramp_rate,
    random_requests,
    sharegpt_requests,
)
from vllm.entrypoints.cli.main import make_parser

from ..utils import RemoteServer

MODEL = "SmolLM2-135M-Instruct"


def test_random_prompts_have_the_drawn_lengths_and_share_the_prefix(tokenizer):
    reqs = random_requests(tokenizer, 20, 50, 10, 0.2, 16, seed=3)
    assert all(40 <= r.prompt_len - 16 <= 60 and 8 <= r.expected_output_len <= 12 for r in reqs)
    ids = [tokenizer.encode(r.prompt, add_special_tokens=False) for r in reqs]
    assert len({tuple(i[:12]) for i in ids}) == 1  # the shared prefix (cut short of a merge)
    assert len({r.prompt for r in reqs}) == 20
    again = random_requests(tokenizer, 20, 50, 10, 0.2, 16, seed=3)
    assert [r.prompt for r in again] == [r.prompt for r in reqs]  # the seed fixes them
    with pytest.raises(ValueError, match="range-ratio"):
        random_requests(tokenizer, 1, 50, 10, 1.0, 0, seed=0)


def test_prefix_repetition_groups_prompts_behind_shared_prefixes(tokenizer):
    reqs = prefix_repetition_requests(tokenizer, 13, 32, 8, 3, 5, seed=1)
    assert len(reqs) == 12 and all(r.expected_output_len == 5 for r in reqs)  # 13 // 3 each
    heads = [tuple(tokenizer.encode(r.prompt, add_special_tokens=False)[:24]) for r in reqs]
    assert sorted(heads.count(h) for h in set(heads)) == [4, 4, 4]
    assert heads[:4] != [heads[0]] * 4 or heads[4:8] != [heads[4]] * 4  # shuffled
    assert all(36 <= r.prompt_len <= 44 for r in reqs)
    assert [r.prompt for r in prefix_repetition_requests(tokenizer, 13, 32, 8, 3, 5, seed=1)] == [
        r.prompt for r in reqs
    ]  # the seed fixes them
    with pytest.raises(ValueError, match="num-prefixes"):
        prefix_repetition_requests(tokenizer, 2, 32, 8, 3, 5, seed=1)


def test_custom_and_sharegpt_files(tokenizer, tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"prompt": "Hello there", "output_tokens": 7}\n\n{"prompt": "Bye"}\n')
    reqs = custom_requests(tokenizer, str(path), 3, 5, seed=0)
    assert sorted((r.prompt, r.expected_output_len) for r in reqs[:2]) == [
        ("Bye", 5), ("Hello there", 7)
    ]  # fmt: skip
    assert len(reqs) == 3  # cycled past the file's two
    path.write_text('{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match=":1:"):
        custom_requests(tokenizer, str(path), 1, 5, seed=0)
    share = tmp_path / "s.json"
    share.write_text(json.dumps([
        {"conversations": [{"value": "Tell me a story."}, {"value": "Once upon a time there was"}]},
        {"conversations": [{"value": "Hi"}, {"value": "Yo"}]},  # a reply too short to count
        {"conversations": [{"value": "alone"}]},
    ]))  # fmt: skip
    reqs = sharegpt_requests(tokenizer, str(share), 2, None, seed=0)
    assert {r.prompt for r in reqs} == {"Tell me a story."}
    assert reqs[0].expected_output_len == len(tokenizer.encode("Once upon a time there was"))


def test_arrivals_all_at_once_or_at_the_asked_rate():
    assert arrival_gaps(5, math.inf, 1.0, 0) == [0.0] * 5
    gaps = arrival_gaps(4000, 10.0, 1.0, 0)
    assert abs(statistics.fmean(gaps) - 0.1) < 0.01
    bursty = arrival_gaps(4000, 10.0, 0.25, 0)  # same mean, more spread
    assert abs(statistics.fmean(bursty) - 0.1) < 0.015
    assert statistics.pstdev(bursty) > 1.5 * statistics.pstdev(gaps)
    for rate, burst in ((0.0, 1.0), (-1.0, 1.0), (1.0, 0.0)):
        with pytest.raises(ValueError):
            arrival_gaps(1, rate, burst, 0)


def test_a_ramped_rate_and_the_slo_figures():
    gaps = arrival_gaps(3000, math.inf, 1.0, 0, ramp=("linear", 5.0, 50.0))
    early, late = statistics.fmean(gaps[:300]), statistics.fmean(gaps[-300:])
    assert 0.13 < early < 0.22 and 0.017 < late < 0.026  # ~1/6 s, then ~1/49 s
    assert ramp_rate("exponential", 2.0, 32.0, 2, 5) == pytest.approx(8.0)
    assert parse_goodput(["ttft:500", "tpot:50.5"]) == {"ttft": 500.0, "tpot": 50.5}
    for bad in (["ttft"], ["speed:5"], ["e2el:-1"], ["tpot:x"]):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput(bad)
    fast = RequestResult(True, "x", 10, 5, ttft=0.1, itl=[0.02] * 4, latency=0.18)
    slow = RequestResult(True, "y", 10, 5, ttft=0.9, itl=[0.02] * 4, latency=0.98)
    m = compute_metrics([fast, slow], 2.0, [50], ["ttft"], {"ttft": 500, "tpot": 20})
    assert m["request_goodput"] == 0.5  # fast meets both, slow's TTFT is over
    assert "request_goodput" not in compute_metrics([fast], 1.0, [50], ["ttft"])


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--ramp-up-strategy", "linear"], "--ramp-up-start-rps"),
        (["--ramp-up-strategy", "linear", "--ramp-up-start-rps", "1", "--ramp-up-end-rps", "2",
          "--request-rate", "3"], "--request-rate"),
        (["--ramp-up-strategy", "exponential", "--ramp-up-start-rps", "0",
          "--ramp-up-end-rps", "2"], "> 0"),
        (["--metadata", "nokey"], "KEY=VALUE"),
    ],
)  # fmt: skip
def test_bad_ramps_and_metadata_are_flag_errors(flags, message):
    from vllm.benchmarks.serve import _check

    args = make_parser().parse_args(["bench", "serve", *flags])
    with pytest.raises(ValueError, match=message):
        _check(args)


def test_figures_of_known_results():
    a = RequestResult(True, "x", 10, 5, ttft=0.1, itl=[0.02] * 4, latency=0.18, start_time=0.0)
    b = RequestResult(True, "y", 20, 1, ttft=0.3, itl=[], latency=0.3, start_time=0.05)
    failed = RequestResult(False, error="HTTP 500")
    m = compute_metrics([a, b, failed], 2.0, [50, 99], ["ttft", "tpot", "itl", "e2el"])
    assert (m["completed"], m["failed"]) == (2, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (30, 6)
    assert m["request_throughput"] == 1.0 and m["output_throughput"] == 3.0
    assert m["total_token_throughput"] == 18.0
    assert m["mean_ttft_ms"] == pytest.approx(200.0) and m["p50_ttft_ms"] == pytest.approx(200.0)
    assert m["mean_tpot_ms"] == pytest.approx(20.0)  # b has one token: no TPOT
    assert m["median_itl_ms"] == pytest.approx(20.0) and m["std_itl_ms"] == pytest.approx(0.0)
    assert m["p99_e2el_ms"] == pytest.approx(180 + 0.99 * 120)
    assert m["max_concurrent_requests"] == 2 and m["max_output_tokens_per_s"] == 6


@pytest.fixture(scope="module")
def server():
    with RemoteServer("--num-gpu-blocks-override", "128", "--max-model-len", "512") as srv:
        yield srv


def cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, input=stdin)


@pytest.mark.slow
def test_bench_serve_against_the_server(server, tmp_path):
    from vllm.benchmarks.serve import main

    for backend in ("openai", "openai-chat"):
        args = make_parser().parse_args([
            "bench", "serve", "--base-url", server.base, "--backend", backend,
            "--num-prompts", "6", "--random-input-len", "24", "--random-output-len", "8",
            "--ignore-eos", "--max-concurrency", "3", "--disable-tqdm", "--save-result",
            "--result-dir", str(tmp_path), "--result-filename", f"{backend}.json",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--save-detailed",
        ])  # fmt: skip
        assert main(args) == 0
        result = json.loads((tmp_path / f"{backend}.json").read_text())
        assert result["completed"] == 6 and result["failed"] == 0
        assert result["total_output_tokens"] == 48 and result["output_lens"] == [8] * 6
        assert result["max_concurrent_requests"] <= 3 and result["model_id"] == MODEL
        assert all(t > 0 for t in result["ttfts"]) and result["p99_e2el_ms"] > 0
        assert all(len(itl) >= 1 for itl in result["itls"]) and all(result["generated_texts"])
    cmd = ["bench", "serve", "--base-url", server.base, "--num-prompts", "2",
           "--random-input-len", "8", "--random-output-len", "2", "--disable-tqdm"]  # fmt: skip
    nobody = cli(*cmd, "--model", "nope", "--tokenizer", MODEL)
    assert nobody.returncode == 1 and "model_not_found" in nobody.stderr
    bad = cli(*cmd, "--percentile-metrics", "ttft,foo")
    assert bad.returncode == 2 and "vllm bench serve: error: --percentile-metrics" in bad.stderr
    # vLLM's other flags: SLO goodput, a ramped rate, warm-ups, appended results, metadata.
    path = tmp_path / "runs.jsonl"
    for _ in range(2):
        args = make_parser().parse_args([*cmd, "--goodput", "e2el:600000", "ttft:0",
                                         "--ramp-up-strategy", "linear", "--ramp-up-start-rps",
                                         "20", "--ramp-up-end-rps", "40", "--num-warmups", "2",
                                         "--append-result", "--result-filename", str(path),
                                         "--metadata", "machine=ci", "--request-id-prefix",
                                         "run-"])  # fmt: skip
        assert main(args) == 0
    runs = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(runs) == 2 and all(r["machine"] == "ci" for r in runs)
    assert runs[0]["request_goodput"] == 0.0  # no TTFT is 0 ms
    assert runs[0]["ramp_up_strategy"] == "linear" and "ttfts" not in runs[0]
    shared = cli("bench", "serve", "--base-url", server.base, "--disable-tqdm",
                 "--dataset-name", "prefix_repetition", "--num-prompts", "4",
                 "--prefix-repetition-num-prefixes", "2", "--prefix-repetition-prefix-len",
                 "32", "--prefix-repetition-suffix-len", "4", "--prefix-repetition-output-len",
                 "2")  # fmt: skip
    assert shared.returncode == 0 and re.search(r"Successful requests:\s+4\s", shared.stdout)
    profiled = cli(*cmd, "--profile")  # the server has no --profiler-config
    assert profiled.returncode == 1 and "/start_profile: HTTP 404" in profiled.stderr


@pytest.mark.slow
def test_chat_and_complete_talk_to_the_server(server):
    url = server.url_for_openai
    quick = cli("complete", "--url", url, "--max-tokens", "5", "-q", "The capital of France is")
    assert quick.returncode == 0 and quick.stdout.strip()  # sampled: any text
    # Two turns typed, then end of input: a prompt for each, and one more at the end.
    talk = cli("chat", "--url", url, "--system-prompt", "Be brief.", stdin="Hi\nName a color.\n")
    assert talk.returncode == 0 and talk.stdout.count("> ") == 3 and len(talk.stdout) > 20
    assert cli("chat", "--url", url, "--model-name", "nope", "-q", "hi").returncode == 1
    down = cli("chat", "--url", "http://127.0.0.1:1/v1", "-q", "hi")
    assert down.returncode == 1 and "vllm chat: error:" in down.stderr


@pytest.mark.slow
def test_bench_latency_and_throughput_run_the_engine_in_process(tmp_path):
    from tests.entrypoints.test_generation_config import tiny_model
    from vllm.benchmarks import offline

    model = str(tiny_model(tmp_path / "tiny"))
    engine = ["--model", model, "--max-model-len", "256", "--num-gpu-blocks-override", "64"]
    out = tmp_path / "throughput.json"
    args = make_parser().parse_args([
        "bench", "throughput", *engine, "--num-prompts", "6", "--input-len", "20",
        "--output-len", "5", "--n", "2", "--output-json", str(out),
    ])  # fmt: skip
    result = offline.throughput(args)
    assert result == json.loads(out.read_text())
    assert result["num_requests"] == 6 and result["total_num_output_tokens"] == 6 * 2 * 5
    assert result["total_num_tokens"] - 60 >= 6 * 15  # the prompts, about 20 tokens each
    args = make_parser().parse_args([
        "bench", "latency", *engine, "--batch-size", "3", "--input-len", "8",
        "--output-len", "4", "--num-iters-warmup", "1", "--num-iters", "3",
    ])  # fmt: skip
    result = offline.latency(args)
    assert len(result["latencies"]) == 3 and result["avg_latency"] > 0
    assert result["percentiles"]["10"] <= result["percentiles"]["99"]
    bad = cli("bench", "throughput", "--dataset-name", "custom", *engine)
    assert bad.returncode == 2 and "needs --dataset-path" in bad.stderr
