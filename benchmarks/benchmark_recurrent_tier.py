"""What the CPU KV tier saves agents on a model with linear-attention layers under memory
pressure (docs/design.md, "Linear-attention layers"): ``--jobs`` jobs take turns, round
robin, each turn repeating the job's history (its last prompt and answer) plus a tool's
output. The KV pool holds about ``--pool-contexts`` jobs' contexts and the device has
``--max-num-seqs`` checkpoint slots, so by a job's next turn other jobs have pushed its
blocks and its recurrent-state checkpoints out. Without a tier the turn recomputes its
whole history; with one (``--kv-offloading-size``) its blocks come back from host memory
and its states from the tier's checkpoint slots.

A random-weight Qwen3.5-shaped model (as benchmarks/benchmark_state_checkpoints.py) in
this process, fp32, both modes in the same run: the mean later-turn latency, prompt
tokens computed and found cached, checkpoints offloaded and restored, and the ratio of
the later turns' latency without the tier to with it. Both modes must give the same
answers (greedy): the run says so.

    python benchmarks/benchmark_recurrent_tier.py [--json-out FILE]
"""

from __future__ import annotations

import argparse
import statistics
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

BLOCK = 16


def run(model_dir: Path, args: argparse.Namespace, tier_gib: float) -> dict:
    """The jobs' turns, round robin, with a CPU tier of ``tier_gib`` (0: none)."""
    from vllm import LLM, SamplingParams

    context = args.prompt_len + args.turns * (args.max_tokens + args.tool_len)
    blocks = int(args.pool_contexts * context) // BLOCK + 1
    llm = LLM(
        model=str(model_dir), load_format="dummy", dtype="float32", seed=0,
        max_model_len=context + 16, max_num_batched_tokens=args.chunk_tokens,
        num_gpu_blocks_override=blocks, max_num_seqs=args.max_num_seqs,
        kv_offloading_size=tier_gib,
    )  # fmt: skip
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        llm.generate({"prompt_token_ids": list(range(32))}, params)  # warm-up
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, VOCAB, (args.prompt_len,), generator=g).tolist()
                   for _ in range(args.jobs)]  # fmt: skip
        turns, answers = [], []
        for turn in range(args.turns):
            for job in range(args.jobs):
                start = time.perf_counter()
                out = llm.generate({"prompt_token_ids": prompts[job]}, params)[0]
                seconds = time.perf_counter() - start
                answer = list(out.outputs[0].token_ids)
                answers.append(answer)
                turns.append(dict(job=job, turn=turn, prompt_tokens=len(prompts[job]),
                                  seconds=seconds,
                                  cached_tokens=out.num_cached_tokens))  # fmt: skip
                tool = torch.randint(0, VOCAB, (args.tool_len,), generator=g).tolist()
                prompts[job] = prompts[job] + answer + tool
        checkpoints = llm.engine_core.scheduler.state_checkpoints
        later = [t for t in turns if t["turn"] > 0]
        return dict(
            tier_gib=tier_gib,
            kv_blocks=blocks,
            tier_blocks=llm.engine_core.num_cpu_blocks,
            tier_state_slots=llm.engine_core.num_host_state_slots,
            turns=turns,
            answers=answers,
            later_turn_s=statistics.mean(t["seconds"] for t in later),
            later_computed_tokens=sum(t["prompt_tokens"] - t["cached_tokens"] for t in later),
            later_cached_tokens=sum(t["cached_tokens"] for t in later),
            restores=checkpoints.restores,
            offloads=checkpoints.offloads,
            evictions=checkpoints.evictions,
        )
    finally:
        llm.shutdown()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--tool-len", type=int, default=64)
    ap.add_argument("--chunk-tokens", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument("--pool-contexts", type=float, default=1.5,
                    help="the KV pool, in jobs' full contexts")  # fmt: skip
    ap.add_argument("--max-num-seqs", type=int, default=2,
                    help="also the device's checkpoint slots")  # fmt: skip
    ap.add_argument("--tier-gib", type=float, default=0.5, help="--kv-offloading-size")
    ap.add_argument("--json-out", type=Path)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    info, measured_on = cpu_machine()
    print(f"{measured_on}: "
          f"Qwen3.5 shape, {args.layers} layers, hidden {args.hidden}, random weights, fp32; "
          f"{args.jobs} jobs x {args.turns} turns round robin, a {args.prompt_len}-token first "
          f"prompt, {args.max_tokens} tokens an answer, {args.tool_len} tool tokens a turn; "
          f"a KV pool of {args.pool_contexts} contexts, {args.max_num_seqs} device "
          f"checkpoint slots")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model(Path(tmp) / "model", args)
        runs = [run(model_dir, args, tier) for tier in (0.0, args.tier_gib)]
    base, ours = runs
    print(f"{'CPU tier':<20} {'later turns s':>14} {'computed':>9} {'cached':>8} "
          f"{'offloads':>9} {'restores':>9}")  # fmt: skip
    for r in runs:
        label = (f"{r['tier_gib']} GiB ({r['tier_blocks']} blocks, {r['tier_state_slots']} "
                 "slots)" if r["tier_gib"] else "none")  # fmt: skip
        print(f"{label:<20} {r['later_turn_s']:>14.3f} {r['later_computed_tokens']:>9} "
              f"{r['later_cached_tokens']:>8} {r['offloads']:>9} {r['restores']:>9}")  # fmt: skip
    same = base["answers"] == ours["answers"]
    ratio = base["later_turn_s"] / ours["later_turn_s"] if ours["later_turn_s"] else float("nan")
    print(f"later turns: {ratio:.2f}x faster with the tier; their prompt tokens computed "
          f"{base['later_computed_tokens']} -> {ours['later_computed_tokens']}; answers "
          f"{'identical' if same else 'DIFFER'}")  # fmt: skip
    write_result(args, info, runs, later_turn_speedup=ratio, same_answers=same)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
