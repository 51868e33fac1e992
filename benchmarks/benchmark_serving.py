"""Online serving benchmark: N concurrent clients against `vllm serve`.

Requests arrive all at once (a closed loop: equal output lengths make them finish and
restart in synchronized bursts, the worst case for per-request overhead) or as a
Poisson process (``--request-rate``).

Phase 1 streams chat completions (EOS ignored, fixed output length) and reports request
and token throughput, TTFT / TPOT / end-to-end percentiles, and the mean server overhead
from /metrics (``vllm:request_server_overhead_seconds``). Phase 2 sends non-streaming
requests and splits each one's latency with the server's timing headers into engine
time, server overhead (HTTP, tokenization, ZMQ, detokenization: server - engine) and
client-side overhead (client - server). Repeats report medians.

    .venv/bin/python benchmarks/benchmark_serving.py                 # starts a server
    .venv/bin/python benchmarks/benchmark_serving.py --base-url http://127.0.0.1:8000/v1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from dataclasses import dataclass

import openai

from vllm.benchmarks.metrics_reader import scrape_metrics
from vllm.benchmarks.server import RemoteServer
from vllm.benchmarks.utils import openai_base_url, percentile

MODEL = "SmolLM2-135M-Instruct"
OVERHEAD = "vllm:request_server_overhead_seconds"
WORDS = (
    "agent tool call shell file cache block token model queue job turn output error test "
    "build deploy server client request latency memory python script config kernel"
).split()


@dataclass
class Result:
    ttft: float = 0.0
    e2e: float = 0.0
    tokens: int = 0
    server: float | None = None  # from the timing headers (non-streaming only)
    engine: float | None = None

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.tokens - 1) if self.tokens > 1 else None


def make_prompts(n: int, words: int, seed: int, tag: str = "") -> list[str]:
    """Distinct prompts; ``tag`` keeps runs against one server from hitting each other's
    prefix cache (only the chat template's system prompt is shared)."""
    rng = random.Random(seed)
    return [
        f"Task {tag}{i}: summarise this log. " + " ".join(rng.choices(WORDS, k=words))
        for i in range(n)
    ]


async def one_stream(client, prompt: str, max_tokens: int) -> Result:
    start = time.perf_counter()
    res = Result()
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content and not res.ttft:
            res.ttft = time.perf_counter() - start
        if chunk.usage:
            res.tokens = chunk.usage.completion_tokens
    res.e2e = time.perf_counter() - start
    return res


async def one_plain(client, prompt: str, max_tokens: int) -> Result:
    start = time.perf_counter()
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        extra_body={"ignore_eos": True},
    )
    resp = raw.parse()
    e2e = time.perf_counter() - start
    return Result(
        e2e=e2e,
        tokens=resp.usage.completion_tokens,
        server=float(raw.headers["x-vllm-server-latency"]),
        engine=float(raw.headers["x-vllm-engine-latency"]),
    )


async def run_phase(base_url, api_key, prompts, max_tokens, concurrency, fn, rate=None, seed=0):
    """All prompts, at most ``concurrency`` in flight; with ``rate`` (requests/s) they
    arrive as a Poisson process, else all at once (a closed loop)."""
    client = openai.AsyncOpenAI(base_url=openai_base_url(base_url), api_key=api_key, max_retries=0)
    sem = asyncio.Semaphore(concurrency)
    rng = random.Random(seed)
    delays, t = [], 0.0
    for _ in prompts:
        delays.append(t)
        t += rng.expovariate(rate) if rate else 0.0

    async def task(prompt: str, delay: float) -> Result:
        await asyncio.sleep(delay)
        async with sem:
            return await fn(client, prompt, max_tokens)

    start = time.perf_counter()
    results = await asyncio.gather(*(task(p, d) for p, d in zip(prompts, delays, strict=True)))
    elapsed = time.perf_counter() - start
    await client.close()
    return results, elapsed


def scrape_overhead(base_url: str) -> tuple[float, float]:
    """(sum, count) of the server-overhead histogram."""
    m = scrape_metrics(base_url)
    return m.get(OVERHEAD + "_sum", 0.0), m.get(OVERHEAD + "_count", 0.0)


def summarize(results: list[Result], elapsed: float) -> dict[str, float]:
    ms = 1000.0
    out = {
        "req_per_s": len(results) / elapsed,
        "out_tok_per_s": sum(r.tokens for r in results) / elapsed,
        "e2e_p50_ms": percentile([r.e2e for r in results], 50) * ms,
        "e2e_p99_ms": percentile([r.e2e for r in results], 99) * ms,
    }
    if results[0].ttft:
        tpots = [r.tpot for r in results if r.tpot is not None]
        for q in (50, 90, 99):
            out[f"ttft_p{q}_ms"] = percentile([r.ttft for r in results], q) * ms
        for q in (50, 90, 99):
            out[f"tpot_p{q}_ms"] = percentile(tpots, q) * ms
    if results[0].server is not None:
        server_oh = [r.server - r.engine for r in results]
        client_oh = [r.e2e - r.server for r in results]
        for q in (50, 90, 99):
            out[f"server_overhead_p{q}_ms"] = percentile(server_oh, q) * ms
        out["client_side_overhead_p50_ms"] = percentile(client_oh, 50) * ms
        out["engine_p50_ms"] = percentile([r.engine for r in results], 50) * ms
    return out


def run_once(args, base: str, repeat: int) -> dict[str, float]:
    tag = f"{os.getpid()}.{repeat}."
    prompts = make_prompts(args.num_prompts, args.prompt_words, args.seed, tag)
    before = scrape_overhead(base)
    results, elapsed = asyncio.run(
        run_phase(
            base,
            args.api_key,
            prompts,
            args.max_tokens,
            args.concurrency,
            one_stream,
            args.request_rate,
            args.seed,
        )
    )
    after = scrape_overhead(base)
    row = summarize(results, elapsed)
    n = after[1] - before[1]
    row["server_overhead_mean_ms(metrics)"] = (after[0] - before[0]) / n * 1000 if n else 0.0
    if args.num_overhead == 0:
        return row
    plain_prompts = make_prompts(args.num_overhead, args.prompt_words, args.seed + 1, tag)
    plain, plain_elapsed = asyncio.run(
        run_phase(
            base,
            args.api_key,
            plain_prompts,
            args.max_tokens,
            args.concurrency,
            one_plain,
            args.request_rate,
            args.seed,
        )
    )
    row.update(
        {
            k: v
            for k, v in summarize(plain, plain_elapsed).items()
            if "overhead" in k or "engine" in k
        }
    )
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--base-url",
        default=None,
        help="A running server, with or without /v1 (default: start one).",
    )
    p.add_argument("--api-key", default="EMPTY")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument(
        "--num-overhead",
        type=int,
        default=16,
        help="Non-streaming requests for the server-overhead figures (0: skip them).",
    )
    p.add_argument("--concurrency", type=int, default=8, help="Maximum requests in flight.")
    p.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="Poisson arrivals at this many requests/s (default: all at once).",
    )
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-words", type=int, default=48)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None)
    p.add_argument(
        "--server-args",
        default="--num-gpu-blocks-override 512 --max-model-len 2048",
        help="Flags of the server this script starts.",
    )
    args = p.parse_args()
    if args.num_overhead < 0:
        p.error(f"--num-overhead must be >= 0, got {args.num_overhead}")
    server = None
    base = args.base_url
    if base is None:
        server = RemoteServer(
            "--disable-log-requests", *args.server_args.split(), timeout_s=300, log_path=os.devnull
        )
        base = server.base
    try:
        # Warm-up: first requests pay for lazy initialisation (chat template, kernels).
        asyncio.run(run_phase(base, args.api_key, make_prompts(2, 8, 1), 4, 2, one_stream))
        rows = [run_once(args, base, i) for i in range(args.repeats)]
    finally:
        if server is not None:
            server.stop()
    summary = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    arrivals = f"Poisson {args.request_rate}/s" if args.request_rate else "all at once"
    print(
        f"\n{args.num_prompts} streaming requests ({arrivals}), at most {args.concurrency} "
        f"in flight, {args.max_tokens} output tokens each (median of {args.repeats}):"
    )
    for key, value in summary.items():
        print(f"  {key:<36} {value:10.2f}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), "summary": summary, "runs": rows}, f, indent=2)


if __name__ == "__main__":
    main()
