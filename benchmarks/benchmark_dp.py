"""What job affinity buys data-parallel engines (`vllm serve -dp 2`), measured in one run.

One server with two engines and Continuum serves J agent jobs of T turns each, the jobs
side by side: each turn sends the whole history (a long system prompt, the turns so far)
and waits a short "tool" time before the next. Two routings, the same jobs:

- **affinity**: the server's own (a job's turns go to the engine that holds its KV);
- **alternating**: each turn names the other engine (``X-data-parallel-rank``), as a
  balancer that looks at load only may do, so the history is never where the turn runs.

Prints, per routing, the share of prompt tokens served from the prefix cache, the mean
time to the first token and the mean turn time, and the ratios.

    .venv/bin/python benchmarks/benchmark_dp.py [--jobs 4] [--turns 4]

``--placement``: where new jobs go. Jobs arrive one after another (``--arrival-s``
apart) and spend most of their time in tools, so when a job arrives the others are
mostly between turns: pinned by Continuum, with no request in either engine. Two
servers, the same jobs: vLLM's balance (running + 4 x waiting requests:
``VLLM_DP_PINNED_WEIGHT=0``) and this engine's, which also counts the jobs each engine
pins. Prints the jobs each engine got (from its KV events), the mean and P90 turn time
and TTFT, and the ratios.

    .venv/bin/python benchmarks/benchmark_dp.py --placement [--jobs 8] [--tool-s 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark_gpu import cpu_model, vector_extensions  # noqa: E402

from vllm.benchmarks.server import RemoteServer  # noqa: E402

SYSTEM = (
    "You are a coding agent in a large Python repository. You run one shell command per "
    "turn and read its output before the next. Keep answers short. "
) * 12


def job(server: RemoteServer, name: str, turns: int, tool_s: float, alternate: bool) -> list:
    """One job's turns; (prompt tokens, cached tokens, TTFT, turn time) each."""
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Job {name}: find the failing test."}]  # fmt: skip
    rows = []
    for turn in range(turns):
        headers = {"X-data-parallel-rank": str(turn % 2)} if alternate else None
        body = {"messages": messages, "max_tokens": 12, "temperature": 0, "job_id": name,
                "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        start = time.perf_counter()
        ttft, usage, text = None, None, ""
        with requests.post(
            f"{server.base}/v1/chat/completions", json=body, headers=headers, stream=True,
            timeout=300,
        ) as resp:  # fmt: skip
            resp.raise_for_status()
            for line in resp.iter_lines():
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices", []):
                    delta = choice.get("delta", {}).get("content") or ""
                    if delta and ttft is None:
                        ttft = time.perf_counter() - start
                    text += delta
        elapsed = time.perf_counter() - start
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        rows.append((usage["prompt_tokens"], cached, ttft or elapsed, elapsed))
        # A tool's output, as agents' are: a few hundred tokens of log.
        tool_output = f"$ command {turn}\n" + f"test_{name}_{turn} passed in 0.01s\n" * 25
        messages += [{"role": "assistant", "content": text},
                     {"role": "user", "content": tool_output}]  # fmt: skip
        time.sleep(tool_s)
    return rows


def run(server: RemoteServer, args: argparse.Namespace, alternate: bool, tag: str) -> dict:
    with ThreadPoolExecutor(args.jobs) as pool:
        futures = [
            pool.submit(job, server, f"{tag}-{i}", args.turns, args.tool_s, alternate)
            for i in range(args.jobs)
        ]
        rows = [r for f in futures for r in f.result()]
    return {
        "cached": sum(r[1] for r in rows) / sum(r[0] for r in rows),
        "ttft": statistics.mean(r[2] for r in rows),
        "turn": statistics.mean(r[3] for r in rows),
    }


def placement_run(args: argparse.Namespace, pinned_weight: str) -> dict:
    """One server, jobs arriving ``args.arrival_s`` apart; the turns' figures and the jobs
    each engine served (the sessions of the blocks its KV events stored)."""
    import msgspec
    import zmq

    from vllm.distributed.kv_events import KVEventBatch
    from vllm.entrypoints.utils import get_open_port

    port = get_open_port()
    events = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"}
    serve = ("-dp", "2", "--scheduling-policy", "continuum", "--continuum-default-ttl", "30",
             "--max-model-len", "2048", "--kv-events-config", json.dumps(events))  # fmt: skip
    ctx = zmq.Context()
    subs = []
    for rank in (0, 1):
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{port + rank}")
        subs.append(sub)
    try:
        with RemoteServer(*serve, env={"VLLM_DP_PINNED_WEIGHT": pinned_weight}) as server:
            run(server, argparse.Namespace(jobs=2, turns=1, tool_s=0), False, "warm")
            start = time.perf_counter()
            with ThreadPoolExecutor(args.jobs) as pool:
                futures = []
                for i in range(args.jobs):
                    futures.append(
                        pool.submit(job, server, f"job-{i}", args.turns, args.tool_s, False)
                    )
                    time.sleep(args.arrival_s)
                rows = [r for f in futures for r in f.result()]
            makespan = time.perf_counter() - start
        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        jobs = []
        for sub in subs:
            seen = set()
            while sub.poll(500):
                batch = decoder.decode(sub.recv_multipart()[2])
                seen |= {getattr(e, "session_id", None) for e in batch.events
                         if getattr(e, "medium", None) == "GPU"}  # fmt: skip
            jobs.append(len({s for s in seen if s and s.startswith("job-")}))
    finally:
        ctx.destroy(linger=0)
    turns = sorted(r[3] for r in rows)
    return {
        "jobs": jobs,
        "turn": statistics.mean(turns),
        "turn_p90": turns[int(0.9 * (len(turns) - 1))],
        "ttft": statistics.mean(r[2] for r in rows),
        "makespan": makespan,
    }


def placement(args: argparse.Namespace) -> int:
    print(f"# {cpu_model()} ({vector_extensions()}), vllm serve -dp 2, 1 thread an engine")
    print(f"{args.jobs} jobs arriving {args.arrival_s} s apart, {args.turns} turns each, "
          f"{args.tool_s} s of tool between turns")  # fmt: skip
    results = {
        "vLLM's (requests only)": placement_run(args, "0"),
        "with pinned jobs": placement_run(args, "1"),
    }
    print("placement               jobs/engine  mean TTFT  mean turn  P90 turn  all jobs")
    for name, r in results.items():
        print(
            f"{name:22s}  {r['jobs'][0]:>5d} / {r['jobs'][1]:<3d}  {r['ttft'] * 1e3:6.0f} ms"
            f"  {r['turn'] * 1e3:6.0f} ms  {r['turn_p90'] * 1e3:5.0f} ms  {r['makespan']:6.1f} s"
        )
    base, ours = results["vLLM's (requests only)"], results["with pinned jobs"]
    print(f"vLLM's / with pinned jobs: TTFT {base['ttft'] / ours['ttft']:.2f}x, "
          f"turn {base['turn'] / ours['turn']:.2f}x, P90 turn "
          f"{base['turn_p90'] / ours['turn_p90']:.2f}x")  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--tool-s", type=float, default=0.5, help="seconds between turns")
    parser.add_argument(
        "--api-server-count", type=int, default=2,
        help="API servers in front of the engines (2: vLLM's default for -dp 2; a job's "
        "turns reach either, and follow its KV through the shared job table)",
    )  # fmt: skip
    parser.add_argument(
        "--placement", action="store_true",
        help="compare where new jobs go: vLLM's balance against one that counts pinned jobs",
    )  # fmt: skip
    parser.add_argument("--arrival-s", type=float, default=1.0, help="--placement: gap")
    args = parser.parse_args(argv)
    if args.placement:
        return placement(args)
    print(f"# {cpu_model()} ({vector_extensions()}), vllm serve -dp 2 --api-server-count "
          f"{args.api_server_count}, 1 thread an engine")  # fmt: skip
    serve = ("-dp", "2", "--api-server-count", str(args.api_server_count),
             "--scheduling-policy", "continuum", "--continuum-default-ttl", "30",
             "--max-model-len", "2048")  # fmt: skip
    with RemoteServer(*serve) as server:
        run(server, argparse.Namespace(jobs=2, turns=1, tool_s=0), False, "warm")
        results = {
            "affinity": run(server, args, alternate=False, tag="aff"),
            "alternating": run(server, args, alternate=True, tag="alt"),
        }
    print(f"{args.jobs} jobs x {args.turns} turns, {args.tool_s} s of tool between turns")
    print("routing      cached prompt tokens  mean TTFT   mean turn")
    for name, r in results.items():
        print(
            f"{name:11s}  {r['cached']:19.0%}  {r['ttft'] * 1e3:7.0f} ms  {r['turn'] * 1e3:7.0f} ms"
        )
    aff, alt = results["affinity"], results["alternating"]
    print(f"alternating / affinity: TTFT {alt['ttft'] / aff['ttft']:.2f}x, "
          f"turn {alt['turn'] / aff['turn']:.2f}x")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
