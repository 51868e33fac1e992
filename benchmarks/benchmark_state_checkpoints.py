"""What checkpoints of recurrent states save an agent on a model with linear-attention
layers (docs/design.md, "Linear-attention layers"): each turn of a job repeats the last
turn's prompt and answer and adds a tool's output; with prefix caching the turn restarts
from a checkpoint of the Gated DeltaNet states at a block boundary (and the full-attention
layers' cached blocks), without it the whole history is computed again.

A random-weight Qwen3.5-shaped model (``--layers`` layers, three linear-attention layers
to one full-attention layer, as Qwen3.5) on this machine, the engine in this process,
``--jobs`` jobs of ``--turns`` turns run one after the other: a first prompt of
``--prompt-len`` tokens, ``--max-tokens`` tokens an answer, ``--tool-len`` tokens of tool
output a turn. Both modes in the same run: each turn's latency (the prompt's prefill and
its answer), the prompt tokens computed and found cached, and the ratio of the mean later
turn's latency without checkpoints to with them. Both modes must give the same answers
(greedy): the run says so.

    python benchmarks/benchmark_state_checkpoints.py [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchmark_gpu  # noqa: E402  (the tokenizer's folder and machine facts)

VOCAB = 49152  # SmolLM2's tokenizer


def write_model(out: Path, args: argparse.Namespace) -> Path:
    """A config-only Qwen3.5 folder (``--load-format dummy`` makes the weights)."""
    import shutil

    import transformers

    out.mkdir(parents=True, exist_ok=True)
    config = transformers.Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=2,
        head_dim=args.hidden // 8, linear_num_key_heads=4, linear_num_value_heads=8,
        linear_key_head_dim=args.hidden // 8, linear_value_head_dim=args.hidden // 8,
        max_position_embeddings=32768, architectures=["Qwen3_5ForCausalLM"],
    )  # fmt: skip
    config.save_pretrained(out)
    tokenizer_dir = benchmark_gpu.default_tokenizer_dir()
    for name in benchmark_gpu.TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    return out


def cpu_machine() -> tuple[dict, str]:
    """This machine's facts (``benchmark_gpu.machine_info`` and the CPU's vector
    extensions) and the figures' heading: "Measured on CPU, N cores (extensions)"."""
    info = benchmark_gpu.machine_info(torch.device("cpu"))
    info["vector_extensions"] = benchmark_gpu.vector_extensions()
    return (
        info,
        f"Measured on {info['cpu']}, {info['cpu_count']} cores ({info['vector_extensions']})",
    )


def write_result(args: argparse.Namespace, info: dict, runs: list[dict], **figures) -> None:
    """The run's JSON at ``--json-out`` (if given): the machine, the arguments (as text,
    ``--json-out`` left out: no machine path is recorded), the runs and ``figures``."""
    if not args.json_out:
        return
    recorded = {k: str(v) for k, v in vars(args).items() if k != "json_out"}
    result = dict(machine=info, args=recorded, runs=runs, **figures)
    args.json_out.write_text(json.dumps(result, indent=2))


def run(model_dir: Path, args: argparse.Namespace, caching: bool) -> dict:
    """The jobs' turns, one after the other, with or without prefix caching."""
    from vllm import LLM, SamplingParams

    total = args.prompt_len + args.turns * (args.max_tokens + args.tool_len) + 16
    llm = LLM(
        model=str(model_dir), load_format="dummy", dtype="float32", seed=0,
        max_model_len=total, max_num_batched_tokens=args.chunk_tokens,
        enable_prefix_caching=caching, kv_cache_memory="512MiB",
    )  # fmt: skip
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        llm.generate({"prompt_token_ids": list(range(32))}, params)  # warm-up
        g = torch.Generator().manual_seed(0)
        turns, answers = [], []
        for _ in range(args.jobs):
            prompt = torch.randint(0, VOCAB, (args.prompt_len,), generator=g).tolist()
            for turn in range(args.turns):
                start = time.perf_counter()
                out = llm.generate({"prompt_token_ids": prompt}, params)[0]
                seconds = time.perf_counter() - start
                answer = list(out.outputs[0].token_ids)
                answers.append(answer)
                turns.append(dict(turn=turn, prompt_tokens=len(prompt), seconds=seconds,
                                  cached_tokens=out.num_cached_tokens))  # fmt: skip
                tool = torch.randint(0, VOCAB, (args.tool_len,), generator=g).tolist()
                prompt = prompt + answer + tool
        checkpoints = llm.engine_core.scheduler.state_checkpoints
        later = [t["seconds"] for t in turns if t["turn"] > 0]
        return dict(
            prefix_caching=caching,
            turns=turns,
            answers=answers,
            first_turn_s=statistics.mean(t["seconds"] for t in turns if t["turn"] == 0),
            later_turn_s=statistics.mean(later) if later else 0.0,
            computed_tokens=sum(t["prompt_tokens"] - t["cached_tokens"] for t in turns),
            cached_tokens=sum(t["cached_tokens"] for t in turns),
            restores=checkpoints.restores if checkpoints is not None else 0,
            saves=checkpoints.saves if checkpoints is not None else 0,
        )
    finally:
        llm.shutdown()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--tool-len", type=int, default=64)
    ap.add_argument("--chunk-tokens", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument("--json-out", type=Path)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    info, measured_on = cpu_machine()
    print(f"{measured_on}: "
          f"Qwen3.5 shape, {args.layers} layers (3 Gated DeltaNet : 1 full attention), hidden "
          f"{args.hidden}, random weights, fp32; {args.jobs} jobs x {args.turns} turns, a "
          f"{args.prompt_len}-token first prompt, {args.max_tokens} tokens an answer, "
          f"{args.tool_len} tool tokens a turn")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model(Path(tmp) / "model", args)
        runs = [run(model_dir, args, caching) for caching in (False, True)]
    base, ours = runs
    print(f"{'prefix caching':<16} {'turn 1 s':>9} {'later turns s':>14} {'computed':>9} "
          f"{'cached':>8} {'restores':>9}")  # fmt: skip
    for r in runs:
        print(f"{'on' if r['prefix_caching'] else 'off':<16} {r['first_turn_s']:>9.3f} "
              f"{r['later_turn_s']:>14.3f} {r['computed_tokens']:>9} {r['cached_tokens']:>8} "
              f"{r['restores']:>9}")  # fmt: skip
    same = base["answers"] == ours["answers"]
    ratio = base["later_turn_s"] / ours["later_turn_s"] if ours["later_turn_s"] else float("nan")
    print(f"later turns: {ratio:.2f}x faster with checkpoints; prompt tokens computed "
          f"{base['computed_tokens']} -> {ours['computed_tokens']}; answers "
          f"{'identical' if same else 'DIFFER'}")  # fmt: skip
    write_result(args, info, runs, later_turn_speedup=ratio, same_answers=same)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
