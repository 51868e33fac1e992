"""Train ContextServe's XGBoost layer offline from `scheduler_timestamps.json` files.

Each recorded job is a list of events (the recorder's format); a tool's duration is the
job's next "arrival" after a non-last "departure". The command is the departure's
"command" (ContextServe runs record it) or, for other runs, its "func_call" name. Labels:
fast when the duration is within --fast-threshold. The model loads with
`vllm serve --scheduling-policy context_serve --context-serve-model PATH`.

    .venv/bin/python our_experiments/scripts/train_context_serve.py \\
        our_experiments/results/ --output context_serve_model.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from pathlib import Path

from vllm_continuum.context_serve.config import ContextServeConfig
from vllm_continuum.context_serve.xgb import FAST_CLASS, SLOW_CLASS, duration_class, train_model
from vllm_continuum.recorder import FILE_NAME


def timestamp_files(paths: Iterable[str]) -> list[Path]:
    """The given files, and every scheduler_timestamps.json under the given folders."""
    files: list[Path] = []
    for p in map(Path, paths):
        files += sorted(p.rglob(FILE_NAME)) if p.is_dir() else [p]
    return files


def job_samples(events: list[dict]) -> list[tuple[str, float]]:
    """(command, seconds) of every tool call of one job."""
    samples = []
    pending: tuple[str, float] | None = None
    for event in sorted(events, key=lambda e: e.get("time", 0.0)):
        kind = event.get("event")
        if kind == "arrival" and pending is not None:
            samples.append((pending[0], max(event["time"] - pending[1], 0.0)))
            pending = None
        elif kind == "departure":
            command = event.get("command") or event.get("func_call")
            last = event.get("is_last_step", False)
            pending = (command, event["time"]) if command and not last else None
    return samples


def load_samples(paths: Iterable[str]) -> tuple[list[str], list[float]]:
    commands: list[str] = []
    durations: list[float] = []
    for path in timestamp_files(paths):
        with open(path, encoding="utf-8") as f:
            jobs = json.load(f)
        for events in jobs.values():
            for command, seconds in job_samples(events):
                commands.append(command)
                durations.append(seconds)
    return commands, durations


def main(argv: list[str] | None = None) -> int:
    defaults = ContextServeConfig()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", help="timestamp files or folders holding them")
    parser.add_argument("--output", required=True, help="model file (.json or .ubj)")
    parser.add_argument("--fast-threshold", type=float, default=defaults.fast_threshold_s)
    parser.add_argument("--slow-threshold", type=float, default=defaults.slow_threshold_s)
    parser.add_argument("--rounds", type=int, default=defaults.xgb_rounds)
    parser.add_argument("--max-depth", type=int, default=defaults.xgb_max_depth)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    args = parser.parse_args(argv)
    config = ContextServeConfig(
        fast_threshold_s=args.fast_threshold,
        slow_threshold_s=max(args.slow_threshold, args.fast_threshold),
        xgb_rounds=args.rounds,
        xgb_max_depth=args.max_depth,
        seed=args.seed,
    )
    commands, durations = load_samples(args.paths)
    model = train_model(commands, durations, config)
    if model is None:
        print(f"need tool calls of two duration classes; found {len(commands)} samples",
              file=sys.stderr)  # fmt: skip
        return 1
    model.save(args.output)
    classes = [duration_class(d, config) for d in durations]
    hits = sum(model.predicted_class(c) == k for c, k in zip(commands, classes, strict=True))
    n = len(classes)
    fast, slow = classes.count(FAST_CLASS) / n, classes.count(SLOW_CLASS) / n
    print(f"{'samples':>10} {'fast share':>11} {'slow share':>11} {'train accuracy':>15}")
    print(f"{n:>10} {fast:>11.2f} {slow:>11.2f} {hits / n:>15.3f}")
    print(f"model written to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
