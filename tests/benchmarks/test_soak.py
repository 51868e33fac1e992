"""The short soak in CI: clients that disconnect, time out, abort or never send their last
step leave no running, waiting or pinned request, no KV usage and no RSS growth behind,
and the server still serves a new job (benchmarks/benchmark_soak.py; docs/benchmarks.md).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "benchmark_soak.py"


def load_soak():
    """benchmarks/ is a folder of scripts, not a package: load the script by its path."""
    spec = importlib.util.spec_from_file_location("benchmark_soak", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_short_soak_leaves_nothing_behind(tmp_path):
    soak = load_soak()
    log = tmp_path / "server.log"
    args = soak.parse_args(["--duration", "20", "--seed", "1", "--server-log", str(log)])
    report = soak.run_soak(args)
    soak.print_report(report, args)  # shown by pytest on failure, with the server log's path
    assert report.leaks == [], f"server log: {log}"
    tally = report.tally
    # The soak exercised what it claims: every kind of client, and real early exits.
    assert all(tally.jobs[kind] > 0 for kind in soak.KINDS), tally.jobs
    assert sum(tally.aborts.values()) > 0, tally.aborts
    assert report.final.latency_s is not None
