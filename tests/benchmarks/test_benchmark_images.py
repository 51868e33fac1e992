"""benchmarks/benchmark_images.py on the tiny shape: every timing printed, the image's
tiles and tokens counted (a 50 x 70 image: 2 x 2 tiles and the whole, 4 tokens each)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.utils import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "benchmark_images.py"


def test_tiny_run_prints_each_size(monkeypatch, capsys, tmp_path):
    bench = load_script(SCRIPT)
    out_file = tmp_path / "out.json"
    args = ["--shape", "tiny", "--sizes", "70x50", "--repeats", "1", "--json-out", str(out_file)]
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), *args])
    bench.main()
    out = capsys.readouterr().out
    assert "machine:" in out
    (row,) = json.loads(out_file.read_text())["rows"]
    assert row["size"] == "70x50" and row["tiles"] == 5
    assert row["prompt_tokens"] > 5 * 4  # the tiles' tokens and their markers, and the text
    assert row["text_ms"] > 0 and row["image_ms"] > 0 and row["cached_ms"] > 0
    assert "image/text" in out
