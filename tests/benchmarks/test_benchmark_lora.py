"""benchmarks/benchmark_lora.py on the embedded model (the gguf path: its prompts reach the
dense bf16 prefill, whose products LoRA layers take), one short run of every case."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.utils import load_script

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "benchmark_lora.py"


def test_every_case_runs_and_is_reported(tmp_path, capsys):
    bench = load_script(SCRIPT)
    out = tmp_path / "lora.json"
    args = ["--batch", "2", "--adapters", "2", "--rank", "4", "--prompt-len", "80",
            "--max-tokens", "3", "--repeats", "1", "--json-out", str(out)]  # fmt: skip
    assert bench.main(args) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["batch"] == 2
    for case in ("base", "no-adapter", "one", "mixed"):
        assert row[f"{case}_tok_s"] > 0
    printed = capsys.readouterr().out
    assert "machine: " in printed and "mixed" in printed and "(1.00x)" in printed
