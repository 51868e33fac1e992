"""benchmarks/eval_perplexity.py on a short slice: fp32 and --quantization gguf perplexities
agree within 0.1% (the same weights; only float rounding differs), one token per forward so
that the decode kernels (batch-1 linear, paged decode attention) are the ones compared."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.model_executor.test_gguf_quantization import ACCURACY_TEXT
from tests.utils import load_script

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "eval_perplexity.py"
TOLERANCE = 1e-3  # |ppl_gguf / ppl_fp32 - 1|


def test_fp32_and_gguf_perplexity_agree_on_a_short_slice():
    script = load_script(SCRIPT)
    ids = script.text_tokens(ACCURACY_TEXT, 48)  # frozen: the live docs drift
    ppl = script.perplexities(ids, tokens_per_step=1)
    print(f"perplexity on 48 tokens: {ppl}")
    assert all(math.isfinite(v) and 1 < v < 1000 for v in ppl.values())
    assert abs(ppl["gguf"] / ppl["fp32"] - 1) < TOLERANCE
