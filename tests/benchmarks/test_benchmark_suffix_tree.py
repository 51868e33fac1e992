"""benchmarks/benchmark_suffix_tree.py on a short run: both trees timed, their drafts the
same, the native tree smaller."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.utils import load_script
from vllm.v1.spec_decode.suffix_tree import native_tree_class

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "benchmark_suffix_tree.py"


@pytest.mark.skipif(native_tree_class() is None, reason="native kernels not built")
def test_short_run_times_both_trees(monkeypatch, capsys):
    bench = load_script(SCRIPT)
    args = ["--prompt-tokens", "400", "--steps", "20"]
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), *args])
    bench.main()
    out = capsys.readouterr().out
    assert "machine:" in out
    line = next(line for line in out.splitlines() if line.startswith("N="))
    native, python = (int(n) for n in re.findall(r"(\d+) nodes", line))
    assert 0 < native < python
    assert "faster to build" in line and "drafts a step" in line
