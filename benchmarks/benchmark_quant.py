"""fp32 vs GGUF-quantized weights (``--quantization gguf``), in one process, interleaved.

For each weight format: decode tok/s and TPOT at batch 1 and 16 (greedy, EOS ignored;
decode time = a run of ``--max-tokens`` minus a 1-token run of the same prompts) and prefill
tok/s (``--prefill-batch`` prompts of ~``--prefill-len`` tokens, 1 output token). Also the
bytes of weights a decode step reads, this machine's memory bandwidth (a large torch sum
= read-only, and a large copy), and each decode step's time against the bandwidth limit
(bytes per step / read bandwidth). Medians over ``--repeats``, formats interleaved.

    .venv/bin/python benchmarks/benchmark_quant.py [--repeats 3] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

FORMATS = {"fp32": None, "gguf": "gguf"}


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
    return out


def weight_bytes(llm) -> int:
    from vllm.model_executor.layers.quantization.gguf import quantized_weight_bytes

    return quantized_weight_bytes(llm.engine_core.model_runner.model)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prefill-batch", type=int, default=4)
    ap.add_argument("--prefill-len", type=int, default=250, help="words per prefill prompt")
    args = ap.parse_args()

    from vllm import LLM

    llms = {name: LLM(model="SmolLM2-135M-Instruct", quantization=q) for name, q in FORMATS.items()}
    read_gbs, copy_gbs = memory_bandwidth()
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in llms}
    for run in range(args.repeats):
        for name, llm in llms.items():  # interleaved: both see the same machine load
            rounds[name].append(measure(llm, args, run))
    med = {n: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for n, rs in rounds.items()}

    print(f"memory bandwidth: read {read_gbs:.1f} GB/s, copy {copy_gbs:.1f} GB/s (read+write)")
    print(f"{'':22}" + "".join(f"{n:>12}" for n in llms) + f"{'ratio':>10}")
    mb = {n: weight_bytes(llm) / 1e6 for n, llm in llms.items()}
    print(f"{'weights MB / step':22}" + "".join(f"{mb[n]:12.0f}" for n in llms))
    limit = {n: mb[n] / 1e3 / read_gbs * 1e3 for n in llms}
    print(f"{'bandwidth limit ms':22}" + "".join(f"{limit[n]:12.1f}" for n in llms))
    for key in med["fp32"]:
        a, b = med["fp32"][key], med["gguf"][key]
        ratio = a / b if key.startswith("tpot") else b / a
        print(f"{key:22}{a:12.1f}{b:12.1f}{ratio:9.2f}x")
    for n in llms:
        frac = limit[n] / med[n]["tpot_ms_b1"]
        print(f"{n}: batch-1 step at {frac:.0%} of the bandwidth limit")


if __name__ == "__main__":
    main()
