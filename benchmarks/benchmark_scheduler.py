"""Time per scheduler step (schedule + update_from_output) with fake model outputs.

Prints a table: running x waiting x prefix hits -> median microseconds per step, and
the growth ratio against the smallest configuration measured in the same run.

    .venv/bin/python benchmarks/benchmark_scheduler.py [--repeats 5] [--steps 50]
"""

from __future__ import annotations

import argparse
import statistics
import time

from vllm.config import CacheConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.clock import FakeClock
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.core.sched.policy import create_policy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm_continuum.policy import policy_names

BLOCK = 16
PROMPT = 64


def build(num_running: int, num_waiting: int, prefix_hits: bool, policy: str) -> Scheduler:
    # Room for exactly the running requests (prompt + 200 decode tokens each), so the
    # waiting ones stay waiting and every step schedules num_running decodes.
    blocks_per_req = (PROMPT + 200) // BLOCK + 1
    config = VllmConfig(
        cache_config=CacheConfig(block_size=BLOCK),
        scheduler_config=SchedulerConfig(
            max_num_seqs=num_running,
            max_num_batched_tokens=max(8192, num_running * PROMPT),
            max_model_len=4096,
            policy=policy,
        ),
    )
    clock = FakeClock()
    decode = lambda ids: "```bash\nls\n```"  # noqa: E731 - every turn ran `ls`
    sched = Scheduler(
        config, num_running * blocks_per_req + 2, create_policy(config, decode, clock), clock
    )
    hasher = get_request_block_hasher(BLOCK)
    shared = list(range(PROMPT - 1))
    for i in range(num_running + num_waiting):
        prompt = (shared + [10_000 + i]) if prefix_hits else [i * PROMPT + t for t in range(PROMPT)]
        sched.add_request(
            Request(
                f"r{i}",
                prompt,
                SamplingParams(max_tokens=10_000, ignore_eos=True),
                block_hasher=hasher,
            )
        )
    return sched


def step(sched: Scheduler) -> None:
    so = sched.schedule()
    sampled = {r: [1] for r in so.num_scheduled_tokens}
    sched.update_from_output(so, ModelRunnerOutput(list(sampled), sampled))


def measure(
    num_running: int, num_waiting: int, prefix_hits: bool, steps: int, repeats: int, policy: str
) -> tuple[float, int]:
    medians = []
    for _ in range(repeats):
        sched = build(num_running, num_waiting, prefix_hits, policy)
        step(sched)  # admits the running set (prefill)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step(sched)
            times.append(time.perf_counter() - t0)
        medians.append(statistics.median(times))
        running = len(sched.running)
    return statistics.median(medians) * 1e6, running


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--scheduling-policy", choices=policy_names(), default="fcfs")
    args = ap.parse_args()
    policy = args.scheduling_policy
    measure(64, 1_000, False, args.steps, 1, policy)  # warm-up (imports, allocator)
    rows = []
    for hits in (False, True):
        for running in (64, 256):
            for waiting in (1_000, 10_000):
                us, n = measure(running, waiting, hits, args.steps, args.repeats, policy)
                rows.append((running, waiting, hits, n, us))
    base = rows[0][4]
    print(
        f"{'running':>8} {'waiting':>8} {'prefix hits':>11} {'scheduled':>9} "
        f"{'us/step':>9} {'us/req':>7} {'vs 64/1k':>8}"
    )
    for running, waiting, hits, n, us in rows:
        print(
            f"{running:>8} {waiting:>8} {str(hits):>11} {n:>9} {us:>9.0f} "
            f"{us / n:>7.2f} {us / base:>7.2f}x"
        )


if __name__ == "__main__":
    main()
