"""Perplexity of the embedded model on a shipped text, fp32 against ``--quantization gguf``.

Both formats run in one process on one load (the fp32 weights are the GGUF dequantized;
the gguf format multiplies by the same blocks with the native kernels), over the same
tokens, ``--tokens-per-step`` tokens per forward: 1-4 run the batch-1..4 decode kernels
(the path generated tokens take), 5-47 the tiled kernel, 48+ the dequantize + GEMM
prefill path: bit-identical to fp32 with ``VLLM_CPU_GGUF_PREFILL_DTYPE=fp32``, in bf16 by
default on CPUs with bf16 hardware. Prints each format's perplexity and their ratio.

    .venv/bin/python benchmarks/eval_perplexity.py [--text docs/design.md] [--max-tokens 4096]
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TEXT = REPO / "docs" / "design.md"


def text_tokens(path: Path, max_tokens: int) -> list[int]:
    from vllm.transformers_utils.tokenizer import get_tokenizer

    ids = get_tokenizer("SmolLM2-135M-Instruct")(path.read_text()).input_ids
    return ids[:max_tokens]


def negative_log_likelihood(runner, ids: list[int], tokens_per_step: int) -> float:
    """Summed -log p(ids[i + 1] | ids[: i + 1]) over i, teacher-forced, ``tokens_per_step``
    tokens per forward (the KV cache carries the context between forwards)."""
    from vllm.benchmarks.model_runner import forward

    total = 0.0
    for start in range(0, len(ids) - 1, tokens_per_step):
        chunk = ids[start : start + tokens_per_step]
        logits = runner.model.compute_logits(forward(runner, chunk, start))
        targets = torch.tensor(ids[start + 1 : start + 1 + len(chunk)])
        logp = torch.log_softmax(logits[: len(targets)].double(), dim=-1)
        total -= logp.gather(1, targets[:, None]).sum().item()
    return total


def perplexities(
    ids: list[int], tokens_per_step: int, formats: tuple[str, ...] = ("fp32", "gguf")
) -> dict[str, float]:
    """{format: perplexity} over ``ids``, fp32 first (the gguf switch happens in place)."""
    from vllm.benchmarks.model_runner import load_runner, quantize

    runner = load_runner(len(ids))
    out = {}
    for name in formats:
        if name == "gguf":
            quantize(runner)
        elif name != "fp32":
            raise ValueError(f"unknown format {name!r}")
        out[name] = math.exp(negative_log_likelihood(runner, ids, tokens_per_step) / (len(ids) - 1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="a UTF-8 text file")
    ap.add_argument("--max-tokens", type=int, default=4096, help="first N tokens of the text")
    ap.add_argument("--tokens-per-step", type=int, default=4, help="tokens per forward")
    args = ap.parse_args()

    ids = text_tokens(args.text, args.max_tokens)
    start = time.perf_counter()
    ppl = perplexities(ids, args.tokens_per_step)
    elapsed = time.perf_counter() - start
    path = args.text.resolve()
    name = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    print(f"text: {name}, {len(ids)} tokens, {args.tokens_per_step} tokens per forward")
    for fmt, value in ppl.items():
        print(f"{fmt:>6} perplexity {value:.4f}")
    print(f" ratio gguf / fp32 {ppl['gguf'] / ppl['fp32']:.6f}  ({elapsed:.0f} s)")


if __name__ == "__main__":
    main()
