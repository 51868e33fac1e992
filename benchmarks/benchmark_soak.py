"""Soak: misbehaving agent clients against Continuum, then a check that nothing leaked.

Starts `vllm serve --scheduling-policy continuum` with a small KV pool and short pin TTLs
and runs concurrent multi-turn jobs (``job_id``, ``is_last_step``) through the official
``openai`` client. Jobs are dealt round-robin over six kinds of client:

- ``good``: every turn, the last one marked ``is_last_step``;
- ``stop``: like good, every turn ending on a stop string;
- ``disconnect``: streams one turn and closes the stream after 1-3 chunks;
- ``timeout``: one turn with a client timeout of 20-400 ms (it leaves while queued or
  decoding);
- ``abort``: one turn cancelled by the client at a random moment (streaming or not);
- ``no_last_step``: never sends its last turn (its pin must expire by its TTL).

After a misbehaving turn the client gives up (half of them) or retries the turn and
carries on. When the jobs are done and the maximum TTL has passed, /metrics must show no
running, waiting or pinned request, no pinned block and a KV usage of 0; the server's RSS
(its process and children) must be within ``--rss-bound-mib`` of its value after the
warm-up; and the server must still answer a normal request. Any of these failing, a
5xx or connection error, or a job still running at the end is a leak: exit status 1.
``--job-idle-timeout`` sets the server's ``--continuum-job-idle-timeout`` (default: the
server's own).

    .venv/bin/python benchmarks/benchmark_soak.py           # short: 35 s of jobs
    .venv/bin/python benchmarks/benchmark_soak.py --long    # 30 min
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from contextlib import suppress
from dataclasses import dataclass, field

import openai
import psutil
from tqdm import tqdm

from vllm.benchmarks.server import RemoteServer

MODEL = "SmolLM2-135M-Instruct"
KINDS = ("good", "stop", "disconnect", "timeout", "abort", "no_last_step")
IDLE_GAUGES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:num_pinned_requests",
    "vllm:pinned_kv_blocks",
    "vllm:kv_cache_usage_perc",
)
COUNTERS = ("vllm:pins_total", "vllm:pin_hits_total", "vllm:pin_expiries_total")
COUNTERS += ("vllm:pin_forced_releases_total", "vllm:num_preemptions_total")
SYSTEM = "You are a coding agent. Reply with one ```bash``` block holding one command."
WORDS = (
    "main.py utils.py tests/ README.md setup.py error passed failed import def class return "
    "TODO line modified branch commit diff grep cat ls pytest assert None self config"
).split()
STOPS = (["\n"], ["```"], ["Observation:", "\n\n"])  # "```" often ends the turn at once
MiB = 1024 * 1024


@dataclass
class Tally:
    """What the clients did, per job kind."""

    jobs: Counter[str] = field(default_factory=Counter)
    requests: Counter[str] = field(default_factory=Counter)
    completed: Counter[str] = field(default_factory=Counter)
    aborts: Counter[str] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    running: set[int] = field(default_factory=set)


@dataclass
class Report:
    tally: Tally
    duration_s: float
    metrics: dict[str, float]
    rss_warm: int
    rss_end: int
    final: FinalCheck
    leaks: list[str]


def server_rss(pid: int) -> int:
    """Resident set of the server process and all its children, bytes."""
    proc = psutil.Process(pid)
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        with suppress(psutil.NoSuchProcess):
            total += p.memory_info().rss
    return total


def tool_output(rng: random.Random) -> str:
    return "Output:\n" + " ".join(rng.choices(WORDS, k=rng.randint(8, 40)))


async def chat(client, messages, job: str, last: bool, stream: bool, **kw) -> str:
    """One turn; the answer's text. Streams when asked (then reads it to its end)."""
    kw.setdefault("max_tokens", 16)
    extra = {"job_id": job, "is_last_step": last}
    resp = await client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, stream=stream, extra_body=extra, **kw
    )
    if not stream:
        return resp.choices[0].message.content or ""
    parts = []
    async for chunk in resp:
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
    return "".join(parts)


async def misbehave(kind: str, client, messages, job: str, rng: random.Random) -> bool:
    """One turn of a bad client; True if it really left early (the request was cut)."""
    if kind == "disconnect":
        extra = {"job_id": job, "is_last_step": False}
        stream = await client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=64, stream=True, extra_body=extra
        )
        n, seen = rng.randint(1, 3), 0
        async for _ in stream:
            seen += 1
            if seen >= n:
                break
        await stream.close()
        return seen >= n
    if kind == "timeout":
        hasty = client.with_options(timeout=rng.uniform(0.02, 0.4))
        try:
            await chat(hasty, messages, job, False, rng.random() < 0.5, max_tokens=64)
        except openai.APITimeoutError:
            return True
        return False
    task = asyncio.create_task(chat(client, messages, job, False, rng.random() < 0.5))
    await asyncio.sleep(rng.uniform(0.0, 1.0))
    if task.done():
        task.result()
        return False
    task.cancel()
    with suppress(asyncio.CancelledError):
        await task
    return True


async def run_job(i: int, client, tally: Tally, args: argparse.Namespace) -> None:
    """Job ``i``: 2 to ``--max-turns`` turns with tool gaps, misbehaving as its kind says."""
    kind, rng = KINDS[i % len(KINDS)], random.Random(args.seed * 100_003 + i)
    job, turns = f"soak-{args.seed}-{i}", rng.randint(2, args.max_turns)
    bad_turn, give_up = rng.randrange(turns - 1), rng.random() < 0.5
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Fix it."}]
    stop = rng.choice(STOPS) if kind == "stop" else None
    tally.jobs[kind] += 1
    for t in range(turns):
        last = t == turns - 1
        if kind == "no_last_step" and last:
            return
        if t == bad_turn and kind in ("disconnect", "timeout", "abort"):
            tally.requests[kind] += 1
            if await misbehave(kind, client, messages, job, rng):
                tally.aborts[kind] += 1
                if give_up:
                    return
            else:
                tally.completed[kind] += 1
        tally.requests[kind] += 1
        text = await chat(client, messages, job, last, rng.random() < 0.5, stop=stop)
        tally.completed[kind] += 1
        messages += [
            {"role": "assistant", "content": text},
            {"role": "user", "content": tool_output(rng)},
        ]
        if not last:
            await asyncio.sleep(rng.uniform(0.05, args.max_tool_s))


async def drive(args: argparse.Namespace, base_url: str, tally: Tally, jobs: range) -> None:
    """``--concurrency`` clients take the ``jobs`` in turn until ``--duration`` is over."""
    client = openai.AsyncOpenAI(
        base_url=base_url, api_key="x", max_retries=0, timeout=args.request_timeout
    )
    deadline = time.monotonic() + args.duration
    next_job = iter(jobs)
    bar = tqdm(total=len(jobs), unit="job", disable=not args.long)

    async def worker() -> None:
        for i in next_job:
            if time.monotonic() > deadline:
                return
            tally.running.add(i)
            try:
                await run_job(i, client, tally, args)
            except Exception as e:  # a 5xx, a refused connection, a request past its timeout
                tally.errors.append(f"job {i} ({KINDS[i % len(KINDS)]}): {e!r}"[:300])
            tally.running.discard(i)
            bar.update()

    workers = [asyncio.create_task(worker()) for _ in range(args.concurrency)]
    _, pending = await asyncio.wait(workers, timeout=args.duration + args.drain_timeout)
    for w in pending:  # stuck: left in tally.running, reported as a leak
        w.cancel()
    bar.close()
    await client.close()


def wait_idle(server: RemoteServer, timeout_s: float) -> dict[str, float]:
    """Poll /metrics until every idle gauge is 0; the last sample."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = server.metrics()
        if all(m.get(g) == 0 for g in IDLE_GAUGES) or time.monotonic() > deadline:
            return m
        time.sleep(0.25)


@dataclass
class FinalCheck:
    """The normal request sent after the soak."""

    latency_s: float | None = None  # None: not served within the timeout
    error: str = ""
    pending_gauges: dict[str, float] = field(default_factory=dict)  # sampled after 3 s


def final_request(server: RemoteServer, timeout_s: float) -> FinalCheck:
    """A new, well-behaved job's single turn: the server still serves. If it has not
    been answered after 3 s the idle gauges are sampled while it waits."""
    check, start = FinalCheck(), time.monotonic()

    def send() -> None:
        try:
            resp = server.client(timeout=timeout_s).chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Say hello."}],
                max_tokens=8,
                extra_body={"job_id": f"soak-final-{os.getpid()}", "is_last_step": True},
            )
            if resp.choices[0].message.content:
                check.latency_s = time.monotonic() - start
            else:
                check.error = "empty answer"
        except openai.OpenAIError as e:
            check.error = repr(e)[:200]

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    thread.join(3.0)
    if thread.is_alive():
        m = server.metrics()
        check.pending_gauges = {g: m.get(g, float("nan")) for g in IDLE_GAUGES}
    thread.join()
    return check


def rss_bound_mib(args: argparse.Namespace) -> float:
    """The RSS growth allowed: ``--rss-bound-mib`` plus the KV tier, which fills up to its
    size as contexts are saved (a cache, not a leak)."""
    return args.rss_bound_mib + args.tier_gib * 1024


def find_leaks(report: Report, bound_mib: float) -> list[str]:
    leaks = [f"{g} = {report.metrics.get(g)}" for g in IDLE_GAUGES if report.metrics.get(g) != 0]
    growth = (report.rss_end - report.rss_warm) / MiB
    if growth > bound_mib:
        leaks.append(f"server RSS grew {growth:.0f} MiB (bound {bound_mib:g})")
    final = report.final
    if final.latency_s is None:
        waiting = ", ".join(f"{g} {v:g}" for g, v in final.pending_gauges.items())
        leaks.append(
            f"a new job's request was not served: {final.error}; while it waited: {waiting}"
        )
    leaks += [f"job {i} still running at the end" for i in sorted(report.tally.running)]
    leaks += [f"client error: {e}" for e in report.tally.errors]
    return leaks


def server_args(args: argparse.Namespace) -> list[str]:
    idle = [] if args.job_idle_timeout is None else [str(args.job_idle_timeout)]
    return [
        "--scheduling-policy", "continuum",
        # Job admission (opt-in) holds requests back: the soak checks it strands nothing.
        "--continuum-job-admission",
        "--num-gpu-blocks-override", str(args.num_gpu_blocks),
        "--max-model-len", "768",
        "--max-num-seqs", str(args.max_num_seqs),
        "--continuum-default-ttl", str(args.default_ttl),
        "--continuum-max-ttl", str(args.max_ttl),
        # An explicit tier (continuum's default one is sized from the host): it fills as
        # contexts are saved, a bounded cache the RSS bound allows for.
        "--kv-offloading-size", f"{args.tier_gib:g}",
        *(["--continuum-job-idle-timeout", *idle] if idle else []),
        "--disable-log-requests",
        *args.server_args.split(),
    ]  # fmt: skip


def warm_up(args: argparse.Namespace, server: RemoteServer) -> None:
    """Two good jobs of two turns: lazy initialisation before the RSS is taken."""
    warm_args = argparse.Namespace(**{**vars(args), "seed": args.seed + 10_000, "max_turns": 2})
    good = range(0, len(KINDS) * min(args.concurrency, 2), len(KINDS))
    asyncio.run(drive(warm_args, server.url_for_openai, Tally(), good))
    wait_idle(server, args.max_ttl + 10)


def run_soak(args: argparse.Namespace) -> Report:
    """Start the server, warm it up, soak it, wait out the TTLs, check; stop it."""
    log = args.server_log or os.path.join(tempfile.gettempdir(), f"soak_server_{os.getpid()}.log")
    print(f"server log: {log}", flush=True)
    server = RemoteServer(*server_args(args), timeout_s=300, log_path=log)
    try:
        warm_up(args, server)
        rss_warm, before = server_rss(server.proc.pid), server.metrics()
        tally, start = Tally(), time.monotonic()
        asyncio.run(drive(args, server.url_for_openai, tally, range(args.jobs)))
        duration = time.monotonic() - start
        time.sleep(args.max_ttl + 1.0)  # every pin placed by now has passed its deadline
        metrics = wait_idle(server, 10.0)
        rss_end = server_rss(server.proc.pid)
        final = final_request(server, args.final_timeout)
    finally:
        server.stop()
    for name in COUNTERS:  # the soak's own, without the warm-up
        metrics[name] = metrics.get(name, 0.0) - before.get(name, 0.0)
    report = Report(tally, duration, metrics, rss_warm, rss_end, final, [])
    report.leaks = find_leaks(report, rss_bound_mib(args))
    return report


def print_report(report: Report, args: argparse.Namespace) -> None:
    t = report.tally
    print(f"\n{'kind':<14}{'jobs':>6}{'requests':>10}{'completed':>11}{'aborted':>9}")
    for kind in KINDS:
        print(
            f"{kind:<14}{t.jobs[kind]:>6}{t.requests[kind]:>10}"
            f"{t.completed[kind]:>11}{t.aborts[kind]:>9}"
        )
    total = sum(t.jobs.values()), sum(t.requests.values()), sum(t.completed.values())
    print(f"{'total':<14}{total[0]:>6}{total[1]:>10}{total[2]:>11}{sum(t.aborts.values()):>9}")
    m = report.metrics
    ttl_wait = args.max_ttl + 1
    print(f"\nsoak {report.duration_s:.1f} s with {args.concurrency} clients, {ttl_wait:g} s more")
    print("for the TTLs; gauges at the end, counters over the soak:")
    for name in IDLE_GAUGES + COUNTERS:
        print(f"  {name:<36}{m.get(name, float('nan')):>10g}")
    warm, end = report.rss_warm / MiB, report.rss_end / MiB
    print(f"  {'server RSS after warm-up / end':<36}{warm:>7.0f} / {end:.0f} MiB", end="")
    print(f" ({end - warm:+.0f} MiB, bound {rss_bound_mib(args):g} with the tier)")
    lat = report.final.latency_s
    served = f"{lat:.1f} s" if lat is not None else "NOT SERVED"
    print(f"  {'final normal request (new job)':<36}{served:>10}")
    print(f"\nleaks found: {len(report.leaks)}")
    for leak in report.leaks:
        print(f"  - {leak}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--duration", type=float, default=35.0, help="Seconds of new jobs.")
    p.add_argument("--jobs", type=int, default=200, help="At most this many jobs.")
    p.add_argument("--concurrency", type=int, default=6, help="Jobs in flight.")
    p.add_argument("--long", action="store_true", help="30 min, 100,000 jobs at most.")
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--max-tool-s", type=float, default=1.5, help="Longest tool gap.")
    p.add_argument("--num-gpu-blocks", type=int, default=64, help="KV pool, null included.")
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--default-ttl", type=float, default=1.0)
    p.add_argument("--max-ttl", type=float, default=3.0)
    p.add_argument("--request-timeout", type=float, default=60.0, help="Of good requests.")
    p.add_argument("--drain-timeout", type=float, default=60.0, help="After --duration.")
    p.add_argument(
        "--rss-bound-mib", type=float, default=64.0, help="Allowed RSS growth, besides the tier."
    )
    p.add_argument("--tier-gib", type=float, default=0.25, help="The server's KV tier (0: none).")
    p.add_argument("--final-timeout", type=float, default=30.0, help="Of the final request.")
    p.add_argument(
        "--job-idle-timeout",
        type=float,
        default=-1.0,
        help="Server's --continuum-job-idle-timeout (negative: the server's default).",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-args", default="", help="More flags for the server.")
    p.add_argument("--server-log", default=None, help="Default: a file in the temp dir.")
    args = p.parse_args(argv)
    if args.job_idle_timeout < 0:
        args.job_idle_timeout = None
    if args.long:
        args.duration, args.jobs = max(args.duration, 1800.0), max(args.jobs, 100_000)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run_soak(args)
    print_report(report, args)
    return 1 if report.leaks else 0


if __name__ == "__main__":
    sys.exit(main())
