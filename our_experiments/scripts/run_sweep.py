"""Run ab_benchmark over a list of loads, one fresh server per policy and load.

For each JPS value and each policy (interleaved, so that machine drift hits every policy
alike) a `vllm serve` starts on a free loopback port with the same KV pool and flags,
ab_benchmark plays the workload against it, and the result JSON lands in
`our_experiments/results/<machine>/<policy>_jps<jps>.json` (server logs in `logs/`).
A point whose file exists is skipped unless --force, so an interrupted sweep resumes.

    .venv/bin/python our_experiments/scripts/run_sweep.py --policies fcfs continuum \\
        --jps 0.02 0.04 0.06 0.08 --duration 120 --num-gpu-blocks 400
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

# Run as a file, this script sees only its own folder; the repository root makes
# `our_experiments` importable (vllm itself is installed).
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from our_experiments.scripts import ab_benchmark  # noqa: E402
from our_experiments.scripts.workload import ROOT, TOOL_MIXES, repo_relative  # noqa: E402
from vllm.benchmarks.server import RemoteServer  # noqa: E402

RESULTS = ROOT / "our_experiments" / "results"


def default_machine() -> str:
    return f"cpu-{os.cpu_count()}core" if not _has_cuda() else "cuda"


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def result_path(out_dir: Path, policy: str, jps: float) -> Path:
    return out_dir / f"{policy}_jps{jps:g}.json"


# Study labels that are a policy with extra server flags (a label names the result files).
VARIANTS: dict[str, tuple[str, list[str]]] = {
    "continuum-noadmission": ("continuum", ["--no-continuum-job-admission"]),
}


def server_args(args, policy: str) -> list[str]:
    name, extra = VARIANTS.get(policy, (policy, []))
    return [
        "--scheduling-policy",
        name,
        *extra,
        "--num-gpu-blocks-override",
        str(args.num_gpu_blocks),
        "--max-model-len",
        str(args.max_model_len),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--seed",
        str(args.seed),
        "--disable-log-requests",
        *args.server_arg,
    ]


def write_config(args, out_dir: Path) -> Path:
    """Record the sweep's arguments next to its results, paths relative to the repository.

    A resumed or extended sweep writes ``sweep_config.<n>.json`` rather than replace the
    record of the run that produced the earlier points.
    """
    config = {k: (repo_relative(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    config.update(cpu=platform.processor() or platform.machine(), started=time.ctime())
    path, n = out_dir / "sweep_config.json", 1
    while path.exists():
        n += 1
        path = out_dir / f"sweep_config.{n}.json"
    path.write_text(json.dumps(config, indent=1) + "\n")
    return path


def bench_args(args, base_url: str, policy: str, jps: float, out: Path) -> list[str]:
    argv = [
        "--base-url", base_url,
        "--policy", policy,
        "--jps", str(jps),
        "--duration", str(args.duration),
        "--turns", str(args.turns),
        "--max-tokens", str(args.max_tokens),
        "--seed", str(args.seed),
        "--drain-timeout", str(args.drain_timeout),
        "--tool-mix", args.tool_mix,
        "--output", str(out),
    ]  # fmt: skip
    return argv + (["--trace", str(args.trace)] if args.trace else [])


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--policies", nargs="+", default=["fcfs", "continuum"])
    ap.add_argument("--jps", nargs="+", type=float, default=[0.02, 0.04, 0.06, 0.08])
    ap.add_argument("--duration", type=float, default=120.0)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--trace", type=Path, default=None)
    ap.add_argument("--tool-mix", choices=TOOL_MIXES, default="fork")
    ap.add_argument("--num-gpu-blocks", type=int, default=400, help="KV pool, blocks of 16")
    ap.add_argument("--max-model-len", type=int, default=6144)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--drain-timeout", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--machine", default=None, help="results subfolder (default: cpu-<n>core)")
    ap.add_argument("--results-dir", type=Path, default=RESULTS)
    ap.add_argument("--server-arg", action="append", default=[], help="extra `vllm serve` arg")
    ap.add_argument("--force", action="store_true", help="rerun points that have a result")
    args = ap.parse_args()

    out_dir = args.results_dir / (args.machine or default_machine())
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    write_config(args, out_dir)
    for jps in args.jps:
        for policy in args.policies:
            out = result_path(out_dir, policy, jps)
            if out.exists() and not args.force:
                print(f"skip {out.name} (exists)")
                continue
            log = out_dir / "logs" / f"{policy}_jps{jps:g}.log"
            server = RemoteServer(*server_args(args, policy), log_path=str(log))
            try:
                ab_benchmark.main(bench_args(args, server.base, policy, jps, out))
            except SystemExit as e:  # a point that cannot run does not end the sweep
                print(f"{policy} jps={jps:g}: {e}", file=sys.stderr)
            finally:
                server.stop()


if __name__ == "__main__":
    main()
