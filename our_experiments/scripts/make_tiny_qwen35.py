"""The tiny random-weight Qwen3.5 of the hybrid-model study (docs/experiments.md, session
42): 4 layers (3 Gated DeltaNet : 1 full attention), hidden 128, the SmolLM2 tokenizer and
chat template, saved by transformers (fp32, torch seed 0) into ``--out``.

    .venv/bin/python our_experiments/scripts/make_tiny_qwen35.py \\
        --out our_experiments/models/tiny-qwen35
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests.utils


def main(argv: list[str] | None = None) -> None:
    import torch
    import transformers

    from tests.utils import copy_benchmark_tokenizer

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=Path("our_experiments/models/tiny-qwen35"))
    out = ap.parse_args(argv).out
    torch.manual_seed(0)
    config = transformers.Qwen3_5TextConfig(
        vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
        max_position_embeddings=8192, architectures=["Qwen3_5ForCausalLM"],
    )  # fmt: skip
    transformers.Qwen3_5ForCausalLM(config).save_pretrained(out)
    copy_benchmark_tokenizer(out, chat_template=True)


if __name__ == "__main__":
    main()
