"""Check Continuum's KV pin through /metrics, turn by turn, and print what is seen.

One agent job of --turns turns against a running server: after each non-last turn the
KV usage (`vllm:kv_cache_usage_perc`) is polled during a simulated tool gap and must
stay constant (the blocks are pinned, not freed); the next turn's cached tokens must
cover the previous context; after the last turn (is_last_step=True) usage must return
to its starting level. Run it on an otherwise idle server started with
`--scheduling-policy continuum`; under fcfs the "pinned" checks fail by design.

    .venv/bin/python our_experiments/scripts/pin_verify.py --base-url http://127.0.0.1:8000/v1

Exit status 0 when every check passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

# Run as a file, this script sees only its own folder; the repository root makes
# `our_experiments` importable (vllm itself is installed).
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from our_experiments.scripts.ab_benchmark import check_loopback  # noqa: E402
from our_experiments.scripts.workload import (  # noqa: E402
    IDENTITIES,
    SYSTEM_PROMPT,
    identity_fields,
    load_corpus,
    make_job,
)
from vllm.benchmarks.metrics_reader import scrape_metrics  # noqa: E402
from vllm.benchmarks.utils import openai_base_url  # noqa: E402

USAGE = "vllm:kv_cache_usage_perc"


def usage(base_url: str) -> float:
    return scrape_metrics(base_url).get(USAGE, float("nan"))


def verify(
    base_url: str, turns: int, gap_s: float, polls: int, seed: int, identity: str = "job_id"
) -> list[str]:
    """Play the job, print each observation, return the failed checks."""
    import openai

    client = openai.OpenAI(base_url=openai_base_url(base_url), api_key="EMPTY", max_retries=0)
    model = client.models.list().data[0].id
    job = make_job(f"pin_verify_{seed}", 0.0, turns, 32, load_corpus(), random.Random(seed))
    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    failures: list[str] = []
    start_usage = usage(base_url)
    print(f"KV usage before the job: {start_usage:.6f}")
    prev_prompt = 0
    for i, turn in enumerate(job.turns):
        last = i == turns - 1
        messages.append({"role": "user", "content": turn.user_content})
        resp = client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=turn.max_tokens,
            temperature=0,
            **identity_fields(identity, job.job_id, last, i),
        )
        messages.append({"role": "assistant", "content": resp.choices[0].message.content})
        details = resp.usage.prompt_tokens_details
        cached = (details.cached_tokens or 0) if details else 0
        after = usage(base_url)
        print(
            f"Turn {i + 1}/{turns} (is_last_step={last}): prompt {resp.usage.prompt_tokens} "
            f"tokens, cached {cached}, KV usage after = {after:.6f}"
        )
        # The pinned context is the previous prompt less its partial last block.
        if i > 0 and cached < prev_prompt - 16:
            failures.append(f"turn {i + 1}: cached {cached} < previous prompt {prev_prompt}")
        prev_prompt = resp.usage.prompt_tokens
        if last:
            break
        print(f"  Simulating tool execution ({gap_s:.1f}s) - KV should stay pinned...")
        for k in range(1, polls + 1):
            time.sleep(gap_s / polls)
            u = usage(base_url)
            ok = abs(u - after) < 1e-9 and u > start_usage
            print(f"    t+{k * gap_s / polls:.1f}s: KV usage = {u:.6f} {'ok' if ok else 'CHANGED'}")
            if not ok:
                failures.append(f"turn {i + 1}: usage {u} during the tool gap (expected {after})")
    time.sleep(0.5)
    end_usage = usage(base_url)
    print(f"KV usage after the last step: {end_usage:.6f} (before the job: {start_usage:.6f})")
    if end_usage > start_usage + 1e-9:
        failures.append(f"usage {end_usage} after the last step, expected {start_usage}")
    return failures


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--base-url", default="http://127.0.0.1:8000", help="with or without /v1")
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--gap", type=float, default=1.0, help="simulated tool time, s")
    ap.add_argument("--polls", type=int, default=3, help="usage polls per gap")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--allow-remote", action="store_true")
    ap.add_argument(
        "--identity",
        choices=IDENTITIES,
        default="job_id",
        help="how a turn names its job: extra_body job_id, or OpenAI's prompt_cache_key",
    )
    args = ap.parse_args()
    if not args.allow_remote:
        check_loopback(args.base_url)
    failures = verify(args.base_url, args.turns, args.gap, args.polls, args.seed, args.identity)
    print("PASS: blocks stayed pinned through every tool gap" if not failures else "FAIL:")
    for f in failures:
        print("  " + f)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
