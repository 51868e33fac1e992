"""Offline generation throughput: vllm-continuum's LLM vs transformers' generate.

Same model, prompts, greedy decoding and output length (EOS ignored) in one run; prints
output tokens/s, requests/s and the ratio, then our prefill and decode rates at batch
1 and 16.

    .venv/bin/python benchmarks/benchmark_throughput.py [--num-prompts 16] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

TOPICS = [
    "dragons",
    "the ocean",
    "a robot",
    "a lost key",
    "mountains",
    "a city at night",
    "the first computer",
    "a garden",
    "time travel",
    "a library",
    "winter",
    "a train",
    "volcanoes",
    "a chess game",
    "the moon",
    "a bakery",
]


def make_prompts(n: int) -> list[str]:
    return [f"Write a detailed story about {TOPICS[i % len(TOPICS)]} (part {i})." for i in range(n)]


def run_ours(llm, prompts: list[str], max_tokens: int) -> float:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
    return elapsed


def run_transformers(model, tokenizer, prompts: list[str], max_tokens: int) -> float:
    tokenizer.padding_side = "left"
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            **batch,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
    elapsed = time.perf_counter() - start
    assert out.shape[1] - batch.input_ids.shape[1] == max_tokens
    return elapsed


def phase_rates(llm, batch: int, max_tokens: int) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) at this batch size, from 1-token and N-token runs."""
    from vllm import SamplingParams

    prompts = make_prompts(batch)
    n_prompt = sum(len(llm.get_tokenizer()(p).input_ids) for p in prompts)
    llm.reset_prefix_cache()
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    prefill = time.perf_counter() - t0
    llm.reset_prefix_cache()
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    total = time.perf_counter() - t0
    return n_prompt / prefill, batch * (max_tokens - 1) / max(total - prefill, 1e-9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from vllm import LLM
    from vllm.model_executor.model_loader import resolve_model

    prompts = make_prompts(args.num_prompts)
    llm = LLM(num_gpu_blocks_override=1024, max_num_seqs=max(args.num_prompts, 16))
    hf = AutoModelForCausalLM.from_pretrained(
        resolve_model("SmolLM2-135M-Instruct"), dtype=torch.float32
    ).eval()
    run_ours(llm, prompts[:2], 4)  # warm-up
    run_transformers(hf, llm.get_tokenizer(), prompts[:2], 4)
    ours, theirs = [], []
    for _ in range(args.repeats):
        llm.reset_prefix_cache()
        ours.append(run_ours(llm, prompts, args.max_tokens))
        theirs.append(run_transformers(hf, llm.get_tokenizer(), prompts, args.max_tokens))
    out_tokens = args.num_prompts * args.max_tokens
    o, t = statistics.median(ours), statistics.median(theirs)
    print(
        f"{args.num_prompts} prompts x {args.max_tokens} output tokens, greedy, "
        f"median of {args.repeats}"
    )
    print(f"{'engine':<16} {'seconds':>8} {'out tok/s':>10} {'req/s':>7}")
    print(f"{'vllm-continuum':<16} {o:>8.2f} {out_tokens / o:>10.1f} {args.num_prompts / o:>7.2f}")
    print(f"{'transformers':<16} {t:>8.2f} {out_tokens / t:>10.1f} {args.num_prompts / t:>7.2f}")
    print(f"ratio (ours / transformers): {t / o:.2f}x")
    for batch in (1, 16):
        prefill, decode = phase_rates(llm, batch, args.max_tokens)
        print(f"batch {batch:>2}: prefill {prefill:>7.0f} tok/s, decode {decode:>6.1f} tok/s")


if __name__ == "__main__":
    main()
