"""Poisson-arrival agentic benchmark against an OpenAI-compatible server.

Jobs arrive as a Poisson process at --jps for --duration seconds; each runs --turns turns
through the official `openai` client with extra_body={"job_id", "is_last_step"}, the
context growing with the model's real answers and simulated tool outputs (see
workload.py). After the last arrival the run waits for every job (at most
--drain-timeout s), then writes one JSON in the research fork's schema plus the prefix
hit rate, pin counters and KV usage scraped from /metrics during the run.

    .venv/bin/python our_experiments/scripts/ab_benchmark.py --policy continuum \\
        --base-url http://127.0.0.1:8000 --jps 0.05 --duration 60 --output out.json

--base-url takes the server's root or its OpenAI base URL (with or without /v1). The
server's scheduling policy is whatever it was started with; --policy only labels the
result. Targets loopback addresses only unless --allow-remote.

Behind a router (one --metrics-url per replica) the result also says where the turns ran:
each response names its server (the x-vllm-instance header, which vllm-router passes
through), so "turns_per_replica", "turn_moves" (turns served by another replica than
their job's previous turn), "jobs_with_turn_moves", and per replica ("replicas") its
turns, prompt tokens, prefix hits, preemptions, pins and pin hits.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import socket
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

# Run as a file, this script sees only its own folder; the repository root makes
# `our_experiments` importable (vllm itself is installed).
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from our_experiments.scripts.workload import (  # noqa: E402
    IDENTITIES,
    TOOL_MIXES,
    JobResult,
    load_corpus,
    load_trace,
    repo_relative,
    run_job,
    summarize,
    synthetic_jobs,
)
from vllm.benchmarks.metrics_reader import scrape_labelled, scrape_metrics  # noqa: E402
from vllm.benchmarks.utils import openai_base_url  # noqa: E402

COUNTERS = {
    "prefix_cache_queries": "vllm:prefix_cache_queries_total",
    "prefix_cache_hits": "vllm:prefix_cache_hits_total",
    # Tokens loaded from the CPU KV tier (--kv-offloading-size): cached, not computed.
    "external_prefix_cache_hits": "vllm:external_prefix_cache_hits_total",
    "prompt_tokens": "vllm:prompt_tokens_total",
    "generation_tokens": "vllm:generation_tokens_total",
    "preemptions": "vllm:num_preemptions_total",
    "pins": "vllm:pins_total",
    "pin_hits": "vllm:pin_hits_total",
    "pin_expiries": "vllm:pin_expiries_total",
    "pin_forced_releases": "vllm:pin_forced_releases_total",
    # The upstream plugin's name for the same counter before it took ours (older runs).
    "pin_pressure_releases": "vllm:pin_pressure_releases_total",
    # Speculative decoding (--speculative-config): drafts proposed, their tokens, accepted.
    "spec_decode_drafts": "vllm:spec_decode_num_drafts_total",
    "spec_decode_draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
    "spec_decode_accepted_tokens": "vllm:spec_decode_num_accepted_tokens_total",
}
# Behind a router, these are also kept per replica (the result's "replicas").
REPLICA_COUNTERS = (
    "prompt_tokens",
    "prefix_cache_hits",
    "preemptions",
    "pins",
    "pin_hits",
    "pin_expiries",
    "pin_forced_releases",
)
# ContextServe's labelled counters (verdicts by class and layer, FAST pin outcomes,
# regret), kept per label set in the result's "context_serve" field.
CONTEXT_SERVE_PREFIX = "vllm:context_serve_"


def labelled_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """after - before per key, the keys that moved only (a series may appear mid-run)."""
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    return {k: v for k, v in sorted(delta.items()) if v}


def check_loopback(base_url: str) -> None:
    host = urlparse(base_url).hostname or ""
    try:
        addrs = {ai[4][0] for ai in socket.getaddrinfo(host, None)}
    except socket.gaierror as e:
        raise SystemExit(f"error: cannot resolve {host!r}: {e}") from None
    if not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs):
        raise SystemExit(
            f"error: {base_url} is not a loopback address; pass --allow-remote to target it"
        )


def scrape_replicas(urls: list[str]) -> list[dict[str, float]]:
    """``scrape_metrics`` of each replica's /metrics (behind a router, the router's own
    /metrics is one replica's)."""
    return [scrape_metrics(url) for url in urls]


def summed(samples: list[dict[str, float]]) -> dict[str, float]:
    """Counters of several replicas, added name by name."""
    out: dict[str, float] = {}
    for sample in samples:
        for name, value in sample.items():
            out[name] = out.get(name, 0.0) + value
    return out


def per_replica(
    urls: list[str],
    before_each: list[dict[str, float]],
    after_each: list[dict[str, float]],
    turns_per_replica: dict[str, int],
) -> list[dict[str, float | int | str]]:
    """One row per replica: the turns it served (its ``x-vllm-instance``, host:port, is the
    netloc of its URL) and how its ``REPLICA_COUNTERS`` moved during the run."""
    rows = []
    for i, (url, before, after) in enumerate(zip(urls, before_each, after_each, strict=True)):
        instance = urlparse(url).netloc
        row: dict[str, float | int | str] = {
            "replica": i,
            "instance": instance,
            "turns": turns_per_replica.get(instance, 0),
        }
        for key in REPLICA_COUNTERS:
            name = COUNTERS[key]
            row[key] = after.get(name, 0.0) - before.get(name, 0.0)
        rows.append(row)
    return rows


class UsageSampler:
    """Samples KV usage and queue length from /metrics while the run goes on; over
    several replicas (pools of one size) the usage is their mean, the queue their sum."""

    def __init__(self, urls: list[str], period_s: float) -> None:
        self.urls, self.period_s = urls, period_s
        self.usage: list[float] = []
        self.waiting: list[float] = []

    async def run(self) -> None:
        while True:
            try:
                ms = await asyncio.to_thread(scrape_replicas, self.urls)
                usage = [m.get("vllm:kv_cache_usage_perc", 0.0) for m in ms]
                self.usage.append(sum(usage) / len(usage))
                self.waiting.append(sum(m.get("vllm:num_requests_waiting", 0.0) for m in ms))
            except Exception:  # a missed sample is not worth failing the run
                pass
            await asyncio.sleep(self.period_s)

    def summary(self) -> dict[str, float | None]:
        u = self.usage
        return {
            "kv_usage_mean": round(sum(u) / len(u), 4) if u else None,
            "kv_usage_max": round(max(u), 4) if u else None,
            "kv_usage_frac_above_90": round(sum(x > 0.9 for x in u) / len(u), 4) if u else None,
            "max_waiting_requests": max(self.waiting) if self.waiting else None,
        }


async def run_benchmark(args, jobs) -> tuple[list[JobResult], UsageSampler, float]:
    import openai
    from tqdm import tqdm

    client = openai.AsyncOpenAI(
        base_url=openai_base_url(args.base_url),
        api_key=args.api_key,
        max_retries=0,
        timeout=args.request_timeout,
    )
    model = args.model or (await client.models.list()).data[0].id
    sampler = UsageSampler(metrics_urls(args), args.sample_period)
    sampler_task = asyncio.create_task(sampler.run())
    bar = tqdm(total=len(jobs), desc=f"{args.policy} jps={args.jps}", unit="job", disable=None)
    start = time.monotonic()

    async def play(job):
        await asyncio.sleep(max(0.0, job.arrival_s - (time.monotonic() - start)))
        result = await run_job(client, model, job, args.request_timeout, args.identity)
        bar.update(1)
        return result

    tasks = [asyncio.create_task(play(j)) for j in jobs]
    last_arrival = max((j.arrival_s for j in jobs), default=0.0)
    done, pending = await asyncio.wait(tasks, timeout=last_arrival + args.drain_timeout)
    for t in pending:
        t.cancel()
    elapsed = time.monotonic() - start
    results = []
    for job, task in zip(jobs, tasks, strict=True):
        if task in done and not task.cancelled():
            results.append(task.result())
        else:  # its time so far: a lower bound of its job time
            results.append(
                JobResult(
                    job.job_id,
                    duration_s=max(elapsed - job.arrival_s, 0.0),
                    error="timeout: not finished in the drain time",
                )
            )
    sampler_task.cancel()
    bar.close()
    await client.close()
    return results, sampler, elapsed


def metrics_urls(args) -> list[str]:
    return args.metrics_url or [args.base_url]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--base-url", default="http://127.0.0.1:8000", help="with or without /v1")
    ap.add_argument("--api-key", default="EMPTY")
    ap.add_argument("--model", default=None, help="default: the server's first model")
    ap.add_argument("--policy", default="unknown", help="label for the result")
    ap.add_argument("--jps", type=float, default=0.05, help="job arrivals per second")
    ap.add_argument("--duration", type=float, default=60.0, help="arrival window, seconds")
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48, help="per turn")
    ap.add_argument("--trace", type=Path, default=None, help="JSONL trace to replay")
    ap.add_argument(
        "--tool-mix",
        choices=TOOL_MIXES,
        default="fork",
        help="fork: the research fork's per-turn tool table; slow: 30%% of tools are builds, "
        "installs or whole test suites (10-60 s) and each turn's command is hinted and "
        "called through guided decoding; guided: the fork table's tools called that way "
        "(for random-weight models)",
    )
    ap.add_argument("--corpus", type=Path, default=None, help="tool-output corpus JSON")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-jobs", type=int, default=500, help="bound on jobs started")
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument(
        "--identity",
        choices=IDENTITIES,
        default="job_id",
        help="how a turn names its job: extra_body job_id, OpenAI's prompt_cache_key, the "
        "X-Session-ID header, or program_id: vllm-router's Program identity "
        "(vllm_xargs.agentic_context) plus that header",
    )
    ap.add_argument("--drain-timeout", type=float, default=600.0, help="after the last arrival")
    ap.add_argument("--sample-period", type=float, default=0.5, help="/metrics polling, s")
    ap.add_argument(
        "--metrics-url",
        action="append",
        default=[],
        help="a replica's root URL whose /metrics count (repeat; default: --base-url); "
        "behind a router, every replica's",
    )
    ap.add_argument("--output", type=Path, default=None, help="result JSON path")
    ap.add_argument("--allow-remote", action="store_true")
    args = ap.parse_args(argv)
    if not args.allow_remote:
        for url in [args.base_url, *args.metrics_url]:
            check_loopback(url)

    corpus = load_corpus(args.corpus) if args.corpus else load_corpus()
    if args.trace:
        jobs = load_trace(args.trace, args.jps, corpus, args.seed, args.max_tokens, args.max_jobs)
    else:
        jobs = synthetic_jobs(
            args.jps,
            args.duration,
            args.turns,
            args.max_tokens,
            corpus,
            args.seed,
            args.max_jobs,
            args.tool_mix,
        )
    if not jobs:
        raise SystemExit(
            f"error: no job arrives in {args.duration:g} s at {args.jps:g} jobs/s "
            "(seeded); raise --duration or --jps, or change --seed"
        )
    urls = metrics_urls(args)
    before_each = scrape_replicas(urls)
    cs_before = summed([scrape_labelled(url, CONTEXT_SERVE_PREFIX) for url in urls])
    results, sampler, elapsed = asyncio.run(run_benchmark(args, jobs))
    after_each = scrape_replicas(urls)
    cs_after = summed([scrape_labelled(url, CONTEXT_SERVE_PREFIX) for url in urls])
    before, after = summed(before_each), summed(after_each)

    out = summarize(args.policy, args.jps, results, window_s=elapsed)
    delta = {k: after.get(m, 0.0) - before.get(m, 0.0) for k, m in COUNTERS.items()}
    delta["pin_forced_releases"] += delta.pop("pin_pressure_releases")
    q = delta["prefix_cache_queries"]
    out.update(
        prompt_tokens_computed=delta["prompt_tokens"]
        - delta["prefix_cache_hits"]
        - delta["external_prefix_cache_hits"],
        duration_s=args.duration,
        turns=args.turns if not args.trace else None,
        trace=repo_relative(args.trace) if args.trace else None,
        seed=args.seed,
        identity=args.identity,
        tool_mix=args.tool_mix if not args.trace else None,
        wall_time_s=round(elapsed, 1),
        prefix_hit_rate=round(delta["prefix_cache_hits"] / q, 4) if q else None,
        metrics=delta,
        context_serve=labelled_delta(cs_before, cs_after),
        **sampler.summary(),
    )
    if len(urls) > 1:  # how the router spread the work
        out["replica_prompt_tokens"] = [
            a.get(COUNTERS["prompt_tokens"], 0.0) - b.get(COUNTERS["prompt_tokens"], 0.0)
            for a, b in zip(after_each, before_each, strict=True)
        ]
        turns = out.get("turns_per_replica", {})
        out["replicas"] = per_replica(urls, before_each, after_each, turns)
    text = json.dumps(out, indent=1)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text + "\n")
    print(
        f"{args.policy} jps={args.jps}: {out['num_completed']}/{out['num_jobs']} jobs "
        f"({out['goodput_jobs_per_min']} per min; all jobs avg >= {out['avg_duration_all_s']} "
        f"s, p95 >= {out['p95_duration_all_s']} s), "
        f"{out['prompt_tokens_computed']:.0f} prompt tokens computed, "
        f"{delta['preemptions']:.0f} preemptions, finished jobs: "
        f"avg {out['avg_duration_s']} s, p90 {out['p90_duration_s']} s, "
        f"p95 {out['p95_duration_s']} s, hit rate {out['prefix_hit_rate']}, "
        f"pins {delta['pins']:.0f} / pin hits {delta['pin_hits']:.0f}, "
        f"KV usage max {out['kv_usage_max']}"
    )
    if "turn_moves" in out:
        print(
            f"turns per replica {out['turns_per_replica']}, {out['turn_moves']} turns moved "
            f"replica ({out['jobs_with_turn_moves']} jobs)"
        )
    return out


if __name__ == "__main__":
    main()
