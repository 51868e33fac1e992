"""fp32 vs GGUF-quantized weights (``--quantization gguf``), in one process, interleaved.

For each weight format: decode tok/s and TPOT at batch 1 and 16 (greedy, EOS ignored;
decode time = a run of ``--max-tokens`` minus a 1-token run of the same prompts) and prefill
tok/s (``--prefill-batch`` prompts of ~``--prefill-len`` tokens, 1 output token). Also the
bytes of weights a decode step reads, this machine's memory bandwidth (a large torch sum
= read-only, and a large copy), and each decode step's time against the bandwidth limit
(bytes per step / read bandwidth). ``--prefill-tokens N ...``: also the time of one prompt of
exactly N tokens with 1 output token (TTFT without a server). Medians over ``--repeats``,
formats interleaved; ratios against the first format.

``--formats``: fp32, gguf (the prefill dtype ``VLLM_CPU_GGUF_PREFILL_DTYPE`` and decode
activations ``VLLM_CPU_GGUF_DECODE_ACT`` give), gguf-fp32 / gguf-bf16 (that prefill dtype
forced at load): ``--formats gguf-fp32 gguf-bf16`` is the bf16 prefill against the exact one;
gguf-act-fp32 / gguf-act-int8 (those decode activations forced at load).

    .venv/bin/python benchmarks/benchmark_quant.py [--repeats 3] [--max-tokens 32]
        [--formats fp32 gguf] [--prefill-tokens 128 512 2048]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from unittest import mock

import torch

PREFILL_VAR = "VLLM_CPU_GGUF_PREFILL_DTYPE"
DECODE_VAR = "VLLM_CPU_GGUF_DECODE_ACT"
# name -> (--quantization, the switches set at load; unset ones: the environment's)
FORMATS = {
    "fp32": ("fp32", {}),
    "gguf": ("gguf", {}),
    "gguf-fp32": ("gguf", {PREFILL_VAR: "fp32"}),
    "gguf-bf16": ("gguf", {PREFILL_VAR: "bf16"}),
    "gguf-act-fp32": ("gguf", {DECODE_VAR: "fp32"}),
    "gguf-act-int8": ("gguf", {DECODE_VAR: "int8"}),
}


def memory_bandwidth(mib: int = 512, repeats: int = 5) -> tuple[float, float]:
    """(read GB/s, copy GB/s) over ``mib`` MiB: far larger than the 32 MiB L3."""
    src = torch.ones(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    reads, copies = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        src.sum()
        reads.append(src.numel() * 4 / (time.perf_counter() - t0) / 1e9)
        t0 = time.perf_counter()
        dst.copy_(src)
        copies.append(2 * src.numel() * 4 / (time.perf_counter() - t0) / 1e9)  # read + write
    return statistics.median(reads), statistics.median(copies)


def prompts(n: int, words: int, tag: str) -> list[str]:
    """Distinct prompts (fresh first words: no prefix-cache hits between runs)."""
    body = " ".join(["the river carried stones and stories down to the sea"] * (words // 10 + 1))
    return [f"{tag} {i}: " + " ".join(body.split()[:words]) for i in range(n)]


def generate_s(llm, texts: list[str], max_tokens: int) -> float:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.reset_prefix_cache()
    t0 = time.perf_counter()
    outs = llm.generate(texts, params)
    elapsed = time.perf_counter() - t0
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
    return elapsed


def measure(llm, args, run: int) -> dict[str, float]:
    """One round of every figure for one engine."""
    out = {}
    for batch in (1, 16):
        texts = prompts(batch, 24, f"r{run}b{batch}")
        prefill = generate_s(llm, texts, 1)
        total = generate_s(llm, texts, args.max_tokens)
        decode = max(total - prefill, 1e-9)
        out[f"tpot_ms_b{batch}"] = decode / (args.max_tokens - 1) * 1e3
        out[f"decode_tok_s_b{batch}"] = batch * (args.max_tokens - 1) / decode
    texts = prompts(args.prefill_batch, args.prefill_len, f"r{run}p")
    n_tokens = sum(len(llm.get_tokenizer()(t).input_ids) for t in texts)
    out["prefill_tok_s"] = n_tokens / generate_s(llm, texts, 1)
    for n in args.prefill_tokens:
        words = prompts(1, n, f"r{run}t{n}")[0]  # a word is at least a token
        ids = llm.get_tokenizer()(words).input_ids[:n]
        out[f"prefill_ms_{n}"] = generate_s(llm, [ids], 1) * 1e3
    return out


def load(name: str):
    """The engine of format ``name``, its switches set while it loads."""
    from vllm import LLM

    quantization, switches = FORMATS[name]
    with mock.patch.dict(os.environ, switches):
        return LLM(model="SmolLM2-135M-Instruct", quantization=quantization)


def weight_bytes(llm) -> int:
    from vllm.model_executor.layers.quantization.gguf import quantized_weight_bytes

    return quantized_weight_bytes(llm.engine_core.model_runner.model)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prefill-batch", type=int, default=4)
    ap.add_argument("--prefill-len", type=int, default=250, help="words per prefill prompt")
    ap.add_argument(
        "--prefill-tokens", type=int, nargs="*", default=[], help="one prompt of N tokens each"
    )
    ap.add_argument("--formats", nargs="+", choices=list(FORMATS), default=["fp32", "gguf"])
    args = ap.parse_args()

    llms = {name: load(name) for name in args.formats}
    read_gbs, copy_gbs = memory_bandwidth()
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in llms}
    for run in range(args.repeats):
        for name, llm in llms.items():  # interleaved: all see the same machine load
            rounds[name].append(measure(llm, args, run))
    med = {n: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for n, rs in rounds.items()}

    base, others = args.formats[0], args.formats[1:]
    print(f"memory bandwidth: read {read_gbs:.1f} GB/s, copy {copy_gbs:.1f} GB/s (read+write)")
    if others:
        print(f"ratios: {', '.join(others)} against {base} (above 1: faster or fewer bytes)")
    print(f"{'':22}" + "".join(f"{n:>12}" for n in llms) + "".join(f"{n:>13}" for n in others))
    mb = {n: weight_bytes(llm) / 1e6 for n, llm in llms.items()}
    print(f"{'weights MB / step':22}" + "".join(f"{mb[n]:12.0f}" for n in llms))
    limit = {n: mb[n] / 1e3 / read_gbs * 1e3 for n in llms}
    print(f"{'bandwidth limit ms':22}" + "".join(f"{limit[n]:12.1f}" for n in llms))
    for key in med[base]:
        row = "".join(f"{med[n][key]:12.1f}" for n in llms)
        # Ratios read "times better than the first format": time falls, tok/s rises.
        lower_better = key.startswith(("tpot", "prefill_ms"))
        ratios = [
            med[base][key] / med[n][key] if lower_better else med[n][key] / med[base][key]
            for n in others
        ]
        print(f"{key:22}{row}" + "".join(f"{r:12.2f}x" for r in ratios))
    for n in llms:
        frac = limit[n] / med[n]["tpot_ms_b1"]
        print(f"{n}: batch-1 step at {frac:.0%} of the bandwidth limit")


if __name__ == "__main__":
    main()
