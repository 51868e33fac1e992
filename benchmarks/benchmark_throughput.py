"""Offline generation throughput: vllm-continuum's LLM vs transformers' generate.

Two workloads in one run, greedy, EOS ignored, each engine on the same prompts:

- **fixed**: ``--num-prompts`` prompts of similar length, all asking ``--max-tokens``;
  transformers generates them as one padded batch.
- **variable** (the shape of real traffic and of vLLM's own throughput benchmark):
  ``--var-num-prompts`` prompts of different lengths, each with its own ``max_tokens``
  drawn from ``--output-len-dist uniform:LO:HI`` (seeded). transformers runs them in
  arrival order in batches of ``--batch-size`` (left padding); a batch runs until its
  longest request is done. We get all prompts at once with ``max_num_seqs=--batch-size``.
  Only the tokens each request asked for count as output.

Prints output tokens/s per engine and the ratio for both workloads (medians over
``--repeats``); ``--phase-rates`` adds our prefill and decode rates at batch 1 and 16.

    .venv/bin/python benchmarks/benchmark_throughput.py [--output-len-dist uniform:16:128]
"""

from __future__ import annotations

import argparse
import random
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


DETAILS = [
    "Describe the weather in every scene.",
    "Give each character a name and a secret.",
    "Use short sentences and vivid verbs.",
    "Include a twist near the end.",
    "Mention at least three colours.",
    "Let the story span several years.",
    "End with a question to the reader.",
    "Add a conversation between two strangers.",
]


def make_prompts(n: int) -> list[str]:
    return [f"Write a detailed story about {TOPICS[i % len(TOPICS)]} (part {i})." for i in range(n)]


def make_variable_workload(n: int, dist: str, seed: int) -> tuple[list[str], list[int]]:
    """``n`` prompts of different lengths (0-24 extra instructions) and their max_tokens."""
    kind, lo, hi = dist.split(":")
    if kind != "uniform" or not 1 <= int(lo) <= int(hi):
        raise ValueError(f"--output-len-dist {dist!r}: expected uniform:LO:HI with 1 <= LO <= HI")
    rng = random.Random(seed)
    prompts = [
        " ".join(
            [f"Write a detailed story about {TOPICS[i % len(TOPICS)]} (part {i})."]
            + [rng.choice(DETAILS) for _ in range(rng.randint(0, 24))]
        )
        for i in range(n)
    ]
    return prompts, [rng.randint(int(lo), int(hi)) for _ in range(n)]


def run_ours(llm, prompts: list[str], max_tokens: list[int]) -> float:
    from vllm import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outs] == max_tokens
    return elapsed


def run_transformers(
    model, tokenizer, prompts: list[str], max_tokens: list[int], batch_size: int
) -> float:
    """Padded static batches in arrival order; each runs to its longest request."""
    tokenizer.padding_side = "left"
    elapsed = 0.0
    for i in range(0, len(prompts), batch_size):
        batch = tokenizer(prompts[i : i + batch_size], return_tensors="pt", padding=True)
        longest = max(max_tokens[i : i + batch_size])
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                **batch,
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
        elapsed += time.perf_counter() - start
        assert out.shape[1] - batch.input_ids.shape[1] == longest
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


def compare(llm, hf, prompts, max_tokens, batch_size, repeats) -> tuple[float, float]:
    """Median seconds (ours, transformers) for this workload, runs interleaved."""
    ours, theirs = [], []
    for _ in range(repeats):
        llm.reset_prefix_cache()  # no prefix hits carried over from the previous repeat
        ours.append(run_ours(llm, prompts, max_tokens))
        theirs.append(run_transformers(hf, llm.get_tokenizer(), prompts, max_tokens, batch_size))
    return statistics.median(ours), statistics.median(theirs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=16, help="fixed workload: prompts")
    ap.add_argument("--max-tokens", type=int, default=64, help="fixed workload: output length")
    ap.add_argument("--var-num-prompts", type=int, default=32, help="variable workload: prompts")
    ap.add_argument("--output-len-dist", default="uniform:16:128", help="variable max_tokens")
    ap.add_argument("--batch-size", type=int, default=16, help="max_num_seqs / HF batch size")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--phase-rates", action="store_true", help="also our prefill/decode rates")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from vllm import LLM
    from vllm.model_executor.model_loader import resolve_model

    llm = LLM(num_gpu_blocks_override=1024, max_num_seqs=args.batch_size)
    hf = AutoModelForCausalLM.from_pretrained(
        resolve_model("SmolLM2-135M-Instruct"), dtype=torch.float32
    ).eval()
    run_ours(llm, make_prompts(2), [4, 4])  # warm-up
    run_transformers(hf, llm.get_tokenizer(), make_prompts(2), [4, 4], 2)
    var_prompts, var_tokens = make_variable_workload(
        args.var_num_prompts, args.output_len_dist, args.seed
    )
    tok = llm.get_tokenizer()
    prompt_lens = [len(tok(p).input_ids) for p in var_prompts]
    workloads = [
        (
            f"fixed {args.num_prompts} x {args.max_tokens}",
            make_prompts(args.num_prompts),
            [args.max_tokens] * args.num_prompts,
        ),
        (f"variable {args.var_num_prompts}, {args.output_len_dist}", var_prompts, var_tokens),
    ]
    print(
        f"greedy, EOS ignored, batch {args.batch_size}, median of {args.repeats}; variable "
        f"prompts {min(prompt_lens)}-{max(prompt_lens)} tokens, outputs "
        f"{min(var_tokens)}-{max(var_tokens)} (seed {args.seed})"
    )
    print(f"{'workload':<32} {'out tokens':>10} {'ours tok/s':>11} {'HF tok/s':>9} {'ratio':>6}")
    for name, prompts, max_tokens in workloads:
        o, t = compare(llm, hf, prompts, max_tokens, args.batch_size, args.repeats)
        n = sum(max_tokens)
        print(f"{name:<32} {n:>10} {n / o:>11.1f} {n / t:>9.1f} {t / o:>5.2f}x")
    if args.phase_rates:
        for batch in (1, 16):
            prefill, decode = phase_rates(llm, batch, args.max_tokens)
            print(f"batch {batch:>2}: prefill {prefill:>7.0f} tok/s, decode {decode:>6.1f} tok/s")


if __name__ == "__main__":
    main()
