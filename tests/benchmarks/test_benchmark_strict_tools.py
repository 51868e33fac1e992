"""benchmarks/benchmark_strict_tools.py: every format's grammar takes the benchmark's own
free text and call (else the benchmark raises), and the table has a row a format."""

from __future__ import annotations

from pathlib import Path

from tests.utils import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "benchmark_strict_tools.py"


def test_every_format_takes_its_call_and_prints_a_row(capsys):
    bench = load_script(SCRIPT)
    assert bench.main(["--tools", "2", "--repeat", "1"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()
            if not line.startswith(("#", "format"))]  # fmt: skip
    assert [r[0] for r in rows] == ["required", *bench.FORMATS]
    assert all(r[1] == "2" and float(r[2]) > 0 and float(r[4]) > 0 for r in rows)
