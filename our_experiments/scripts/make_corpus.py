"""Build the shipped corpus of simulated tool outputs from real material.

Agents read listings, source files, grep hits, test logs and diffs. Rather than lorem
ipsum, the corpus is cut from a real code base (this repository, at the commit it is
built from): `git ls-files` listings, real source files, real `grep -n` hits, real pytest
logs (a passing run and a failing one) and real `git show` diffs. The output is a JSON
file committed next to this script, so the benchmark needs neither git nor pytest.

    .venv/bin/python our_experiments/scripts/make_corpus.py
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "our_experiments" / "corpus" / "tool_outputs.json"
MAX_CHARS = 4000  # longer entries are cut; the workload cuts again to the drawn size
GREP_PATTERNS = [
    "def ",
    "block_ids",
    "num_computed_tokens",
    "raise ValueError",
    "job_id",
    "ref_cnt",
    "import torch",
    "logger.",
    "class ",
    "return None",
]
PASSING_TARGETS = (
    "tests/v1/core/test_block_pool.py",
    "tests/v1/core/test_ttl.py",
    "tests/v1/core/test_kv_cache_utils.py",
    "tests/v1/core/sched/test_request_queue.py",
    "tests/v1/core/test_estimate_with_func.py",
    "tests/v1/engine/test_detokenizer.py",
)
FAILING_TEST = """
import pytest

def parse_ttl(text):
    value, unit = text[:-1], text[-1]
    return float(value) * {"s": 1, "m": 60}[unit]

@pytest.mark.parametrize("text,expected", [("2s", 2.0), ("1m", 60.0), ("500ms", 0.5)])
def test_parse_ttl(text, expected):
    assert parse_ttl(text) == expected

def test_pin_release_order():
    pins = sorted([(3.0, "b"), (1.0, "a"), (2.0, "c")])
    assert [p[1] for p in pins] == ["a", "c", "b", "d"]
"""


def _run(cmd: list[str], cwd: Path = ROOT) -> str:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False).stdout


def listings(files: list[str]) -> list[str]:
    dirs = sorted({str(Path(f).parent) for f in files})
    out = []
    for d in dirs:
        below = [f for f in files if f.startswith(d + "/") or d == "."]
        if len(below) >= 3:
            out.append("\n".join(below[:120]))
    return out


def sources(files: list[str]) -> list[str]:
    out = []
    for f in files:
        if f.endswith((".py", ".cpp", ".toml", ".txt")) and (ROOT / f).stat().st_size > 400:
            text = (ROOT / f).read_text(errors="replace")
            numbered = "\n".join(f"{i + 1:>4}  {line}" for i, line in enumerate(text.splitlines()))
            out.append(numbered)
    return out


def grep_hits() -> list[str]:
    return [h for p in GREP_PATTERNS if (h := _run(["git", "grep", "-n", p, "--", "*.py"]))]


def test_logs() -> list[str]:
    logs = []
    for target in PASSING_TARGETS:
        logs.append(_run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", target]))
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "test_failing.py").write_text(FAILING_TEST)
        for flags in ([], ["-v"], ["-x", "--tb=short"], ["--tb=line", "-rA"]):
            cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *flags]
            logs.append(_run([*cmd, "test_failing.py"], Path(tmp)))
    return [log for log in logs if log.strip()]


def diffs(n: int) -> list[str]:
    revs = _run(["git", "rev-list", f"--max-count={n}", "HEAD"]).split()
    fmt = "--format=commit %h%n%n    %s%n"
    return [_run(["git", "show", "--stat", "-p", fmt, r]) for r in revs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--max-per-kind", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    files = _run(["git", "ls-files"]).split()
    rng = random.Random(args.seed)
    kinds = {
        "listing": listings(files),
        "source": sources(files),
        "grep": grep_hits(),
        "test_log": test_logs(),
        "diff": diffs(args.max_per_kind),
    }
    corpus = {}
    for kind, entries in kinds.items():
        entries = [e[:MAX_CHARS] for e in entries if e.strip()]
        rng.shuffle(entries)
        corpus[kind] = entries[: args.max_per_kind]
        print(f"{kind:<9} {len(corpus[kind]):>3} entries", file=sys.stderr)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(corpus, indent=1) + "\n")
    print(f"wrote {args.out} ({args.out.stat().st_size // 1024} KiB)", file=sys.stderr)


if __name__ == "__main__":
    main()
