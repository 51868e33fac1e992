"""What verifying drafts costs and saves on a model with linear-attention layers
(docs/design.md, "Linear-attention layers", speculative decoding): a step that verifies
``k`` drafts runs them a token at a time through the Gated DeltaNet layers, keeping the
states after each, and rolls the states back to the drafts kept.

A random model repeats nothing for an n-gram lookup to find, so the drafts here come from
an oracle: the target's own greedy continuation (measured first, without drafts), wrong
at a chosen rate (``--wrong``: each draft position is made wrong with that probability,
seeded). A random-weight Qwen3.5-shaped model (as benchmarks/benchmark_state_checkpoints.py)
in this process, fp32, ``--requests`` requests at once: decode tok/s without drafts, then
with ``k`` oracle drafts at each rate, and the answers must all be the same (greedy).

    python benchmarks/benchmark_recurrent_spec.py [--json-out FILE]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark_state_checkpoints import (  # noqa: E402
    VOCAB,
    cpu_machine,
    write_model,
    write_result,
)


def oracle(truth: list[list[int]], k: int, wrong: float, seed: int):
    """A ``propose`` drafting each request's true continuation, each draft wrong with
    probability ``wrong``."""
    rng = random.Random(seed)

    def propose(req_id, token_ids, limit, num_prompt_tokens=0):
        full = next(t for t in truth if list(token_ids) == t[: len(token_ids)])
        drafts = full[len(token_ids) : len(token_ids) + min(k, limit)]
        return [(d + 1) % VOCAB if rng.random() < wrong else d for d in drafts]

    return propose


def run(model_dir: Path, args: argparse.Namespace, prompts, truth, wrong: float | None) -> dict:
    """The requests at once; ``wrong`` None: no drafts, else oracle drafts at that rate."""
    from vllm import LLM, SamplingParams

    spec = None
    if wrong is not None:
        spec = {"method": "ngram", "num_speculative_tokens": args.k}
    llm = LLM(
        model=str(model_dir), load_format="dummy", dtype="float32", seed=0,
        max_model_len=args.prompt_len + args.max_tokens + 16, speculative_config=spec,
        kv_cache_memory="512MiB",
    )  # fmt: skip
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        llm.generate({"prompt_token_ids": list(range(32))}, params)  # warm-up
        if wrong is not None:
            llm.engine_core.scheduler.proposer.propose = oracle(truth, args.k, wrong, 0)
        drafts = accepted = 0
        observe = type(llm.engine_core.scheduler._spec_stats).observe

        def count(stats, n, a):
            nonlocal drafts, accepted
            drafts, accepted = drafts + n, accepted + a
            observe(stats, n, a)

        type(llm.engine_core.scheduler._spec_stats).observe = count
        try:
            start = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            seconds = time.perf_counter() - start
        finally:
            type(llm.engine_core.scheduler._spec_stats).observe = observe
    finally:
        llm.shutdown()
    answers = [list(o.outputs[0].token_ids) for o in outs]
    tokens = sum(map(len, answers))
    return dict(wrong=wrong, seconds=seconds, tok_s=tokens / seconds, answers=answers,
                drafts=drafts, accepted=accepted)  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--wrong", type=float, nargs="+", default=[0.0, 0.3, 1.0])
    ap.add_argument("--json-out", type=Path)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    info, measured_on = cpu_machine()
    print(f"{measured_on}: "
          f"Qwen3.5 shape, {args.layers} layers, hidden {args.hidden}, random weights, fp32; "
          f"{args.requests} requests of {args.prompt_len} prompt tokens, {args.max_tokens} "
          f"tokens each, {args.k} oracle drafts a step")  # fmt: skip
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (args.prompt_len,), generator=g).tolist()
               for _ in range(args.requests)]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model(Path(tmp) / "model", args)
        base = run(model_dir, args, prompts, None, None)
        truth = [p + a for p, a in zip(prompts, base["answers"], strict=True)]
        runs = [base] + [run(model_dir, args, prompts, truth, w) for w in args.wrong]
    print(f"{'drafts':<24} {'tok/s':>8} {'vs none':>8} {'drafted':>8} {'accepted':>9}")
    for r in runs:
        label = "none" if r["wrong"] is None else f"{args.k}, each wrong at {r['wrong']:.0%}"
        print(f"{label:<24} {r['tok_s']:>8.1f} {r['tok_s'] / base['tok_s']:>7.2f}x "
              f"{r['drafts']:>8} {r['accepted']:>9}")  # fmt: skip
    same = all(r["answers"] == base["answers"] for r in runs)
    print(f"answers {'identical' if same else 'DIFFER'}")
    for r in runs:
        r.pop("answers")
    write_result(args, info, runs, same_answers=same)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
