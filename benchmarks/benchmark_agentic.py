"""A small multi-turn agent workload under each scheduling policy, same KV pool.

For each policy: start `vllm serve` on a free loopback port, run --jobs agent jobs of
--turns turns (staggered starts, a simulated tool run between turns, the whole history
sent each turn), then print the average and P90 job completion time, the prefix-cache
hit rate and the pin counters, and the ratio of each policy against the first one.

    .venv/bin/python benchmarks/benchmark_agentic.py --policies fcfs continuum
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.utils import RemoteServer  # noqa: E402

SYSTEM = (
    "You are a coding agent. Reply with exactly one ```bash``` block holding one "
    "command.\nExample:\n```bash\nls\n```"
)
TOOL_OUTPUT = (
    "src/app.py:12: def handle(request):\nsrc/app.py:40:     return render(request)\n"
    "tests/test_app.py:8: def test_handle():\ntests/test_app.py:19:     assert ok\n"
    "README.md: usage notes\nsetup.py: install_requires=['flask']\n"
)
TASKS = [
    "Find where requests are handled.",
    "Show the test file.",
    "Run the tests.",
    "Check the git diff.",
    "Fix the failing assertion.",
    "Run the tests again.",
]


async def run_job(
    client,
    model: str,
    job: int,
    turns: int,
    rng: random.Random,
    tool_s: tuple[float, float],
    max_tokens: int,
) -> tuple[float, list[int]]:
    messages = [{"role": "system", "content": SYSTEM}]
    start = time.monotonic()
    cached = []
    for t in range(turns):
        messages.append(
            {
                "role": "user",
                "content": TASKS[t % len(TASKS)] + (f"\nOutput:\n{TOOL_OUTPUT * 3}" if t else ""),
            }
        )
        resp = await client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=max_tokens,
            temperature=0,
            extra_body={"job_id": f"job-{job}", "is_last_step": t == turns - 1},
        )
        cached.append(resp.usage.prompt_tokens_details.cached_tokens)
        messages.append({"role": "assistant", "content": resp.choices[0].message.content})
        if t < turns - 1:
            await asyncio.sleep(rng.uniform(*tool_s))  # the tool runs
    return time.monotonic() - start, cached


async def run_workload(server: RemoteServer, args) -> list[float]:
    import openai

    client = openai.AsyncOpenAI(
        base_url=server.base + "/v1", api_key="x", timeout=600, max_retries=0
    )
    model = (await client.models.list()).data[0].id
    rng = random.Random(args.seed)
    gaps = [rng.uniform(0, args.stagger) for _ in range(args.jobs)]

    async def delayed(i: int):
        await asyncio.sleep(sum(gaps[:i]))
        return await run_job(
            client,
            model,
            i,
            args.turns,
            random.Random(args.seed + i),
            (args.tool_min, args.tool_max),
            args.max_tokens,
        )

    results = await asyncio.gather(*(delayed(i) for i in range(args.jobs)))
    await client.close()
    return [r[0] for r in results]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policies", nargs="+", default=["fcfs", "continuum"])
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--stagger", type=float, default=1.0, help="max seconds between starts")
    ap.add_argument("--tool-min", type=float, default=0.3)
    ap.add_argument("--tool-max", type=float, default=1.5)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=120, help="KV pool (blocks of 16)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    rows = []
    for policy in args.policies:
        server = RemoteServer(
            "--scheduling-policy",
            policy,
            "--num-gpu-blocks-override",
            str(args.num_blocks),
            "--max-model-len",
            "2048",
            "--disable-log-requests",
        )
        try:
            durations = asyncio.run(run_workload(server, args))
            m = server.metrics()
        finally:
            server.stop()
        q = m.get("vllm:prefix_cache_queries_total", 0.0)
        hit = m.get("vllm:prefix_cache_hits_total", 0.0) / q if q else 0.0
        pins = m.get("vllm:pins_total", 0.0)
        rows.append(
            (
                policy,
                statistics.mean(durations),
                statistics.quantiles(durations, n=10)[-1],
                hit,
                m.get("vllm:num_preemptions_total", 0.0),
                pins,
                m.get("vllm:pin_hits_total", 0.0),
            )
        )
    base = rows[0][1]
    print(
        f"{args.jobs} jobs x {args.turns} turns, tool {args.tool_min}-{args.tool_max} s, "
        f"{args.num_blocks} KV blocks"
    )
    print(
        f"{'policy':<14} {'avg job s':>9} {'p90 s':>7} {'hit rate':>8} {'preempt':>7} "
        f"{'pins':>5} {'pin hits':>8} {'vs first':>8}"
    )
    for policy, avg, p90, hit, pre, pins, pin_hits in rows:
        print(
            f"{policy:<14} {avg:>9.2f} {p90:>7.2f} {hit:>8.1%} {pre:>7.0f} {pins:>5.0f} "
            f"{pin_hits:>8.0f} {avg / base:>7.2f}x"
        )


if __name__ == "__main__":
    main()
