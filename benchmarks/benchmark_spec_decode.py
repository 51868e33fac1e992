"""N-gram and suffix speculative decoding against plain decoding, on agent-like turns.

An agent's turns copy text that is already in the context: a file it read, then rewrites
with a change; a command it saw; a list it reorganises. This benchmark asks the model for
such turns (and a few that copy nothing), greedy by default, and runs the same requests
through two engines built the same way, without and with ``--speculative-config``
(n-gram, or suffix decoding with ``--method suffix``). It prints per engine: output
tokens, engine steps, output tok/s, and for speculation the drafts' acceptance
(accepted / proposed) and the tokens a request gets per step; then the speedup.
Greedy outputs must be identical (greedy speculation is exact); a mismatch is reported.
``--temperature`` above 0 measures sampled requests (drafts kept by rejection sampling).

    .venv/bin/python benchmarks/benchmark_spec_decode.py            # the embedded model
    .venv/bin/python benchmarks/benchmark_spec_decode.py --k 2 4 8 --concurrency 1 4
    .venv/bin/python benchmarks/benchmark_spec_decode.py --method ngram suffix

Suffix decoding's global tree keeps the outputs of earlier requests; a second pass over
the same turns would find its own answers there. So each of its runs gets a new engine
(an empty tree): what it drafts from is this pass's prompts and earlier turns' outputs.

Figures on the machine it runs on (it prints the CPU and its vector extensions); run it
on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmark_gpu import cpu_model, vector_extensions  # noqa: E402

FILE = '''import json
import os


def load_config(path):
    """Read a JSON config file and return it as a dict."""
    if not os.path.exists(path):
        raise FileNotFoundError(path)
    with open(path) as f:
        return json.load(f)


def save_config(path, config):
    with open(path, "w") as f:
        json.dump(config, f, indent=2)
'''

LOG = """2026-11-27 10:00:01 INFO server started on port 8000
2026-11-27 10:00:02 INFO loaded 3 workers
2026-11-27 10:00:05 WARNING slow request: GET /api/items took 2.3s
2026-11-27 10:00:09 ERROR database connection refused: host=db port=5432
2026-11-27 10:00:10 INFO retrying database connection
"""

TURNS = [
    # (kind, user message): "copy" turns reuse context text, "free" turns do not.
    ("copy", "Repeat this file exactly, then stop:\n\n" + FILE),
    ("copy", "Rename load_config to read_config in this file and show the whole file:\n\n" + FILE),
    ("copy", "Here is a log:\n" + LOG + "\nRepeat the ERROR and WARNING lines exactly."),
    (
        "copy",
        "Copy this list, one item per line: alpha, bravo, charlie, delta, echo, foxtrot, "
        "golf, hotel, india, juliett, kilo, lima",
    ),
    ("free", "Write a short poem about the sea."),
    ("free", "Explain in three sentences what a hash table is."),
]


class _Counting:
    """Wraps an engine core's ``step``: counts steps and the speculative decoding stats."""

    def __init__(self, core) -> None:
        self.core = core
        self.steps = self.drafts = self.draft_tokens = self.accepted = 0
        self._step = core.step
        core.step = self.step

    def step(self):
        out = self._step()
        outputs = out[0] if isinstance(out, tuple) else out
        stats = getattr(outputs, "scheduler_stats", None)
        if stats is not None and stats.num_scheduled_tokens > 0:
            self.steps += 1
        spec = getattr(stats, "spec_decoding_stats", None) if stats is not None else None
        if spec is not None:
            self.drafts += spec.num_drafts
            self.draft_tokens += spec.num_draft_tokens
            self.accepted += spec.num_accepted_tokens
        return out

    def reset(self) -> None:
        self.steps = self.drafts = self.draft_tokens = self.accepted = 0


def build(args, spec: dict | None, concurrency: int):
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=args.model,
        quantization=args.quantization,
        speculative_config=spec,
        max_num_seqs=max(concurrency, 1),
        enforce_eager=True,
    )
    llm.chat(
        [[{"role": "user", "content": TURNS[0][1]}]], SamplingParams(temperature=0, max_tokens=8)
    )
    return llm, _Counting(llm.engine_core)


def timed_run(llm, counting: _Counting, args, concurrency: int) -> dict:
    """One pass over the turns, ``concurrency`` at a time, from an empty prefix cache."""
    from vllm import SamplingParams

    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=0
    )
    messages = [[{"role": "user", "content": text}] for _, text in TURNS]
    llm.reset_prefix_cache()
    counting.reset()
    start = time.perf_counter()
    results = []
    for i in range(0, len(messages), concurrency):
        results += llm.chat(messages[i : i + concurrency], params)
    seconds = time.perf_counter() - start
    outputs = [r.outputs[0].token_ids for r in results]
    return {
        "seconds": seconds,
        "output_tokens": sum(len(o) for o in outputs),
        "steps": counting.steps,
        "drafts": counting.drafts,
        "draft_tokens": counting.draft_tokens,
        "accepted_tokens": counting.accepted,
        "outputs": outputs,
    }


def compare(args, spec: dict, concurrency: int) -> tuple[dict, dict]:
    """Both engines built side by side, their runs alternated (the VM's speed drifts by
    10-20% over minutes: alternating keeps it out of the ratio); medians. Suffix decoding
    gets a new engine for each run (its global tree empty)."""
    fresh = spec["method"] == "suffix"
    engines = [build(args, None, concurrency), build(args, spec, concurrency)]
    runs: list[list[dict]] = [[], []]
    for repeat in range(args.repeats):
        if fresh and repeat > 0:
            engines[1][0].shutdown()
            engines[1] = build(args, spec, concurrency)
        for i, (llm, counting) in enumerate(engines):
            runs[i].append(timed_run(llm, counting, args, concurrency))
    for llm, _ in engines:
        llm.shutdown()
    figures = []
    for series in runs:
        best = dict(series[0])
        best["seconds"] = statistics.median(r["seconds"] for r in series)
        best["tok_s"] = best["output_tokens"] / best["seconds"]
        best["acceptance"] = best["accepted_tokens"] / max(best["draft_tokens"], 1)
        figures.append(best)
    return figures[0], figures[1]


def run_one(args, method: str, k: int, concurrency: int) -> dict:
    """One method at one k and concurrency against plain decoding: printed, returned."""
    spec: dict = {"method": method, "num_speculative_tokens": k}
    if method == "ngram":
        spec.update(prompt_lookup_min=args.ngram[0], prompt_lookup_max=args.ngram[1])
    if args.disable_by_batch_size is not None:
        spec["disable_by_batch_size"] = args.disable_by_batch_size
    base, got = compare(args, spec, concurrency)
    # Greedy speculation is exact; sampled outputs differ by their random numbers.
    same = got["outputs"] == base["outputs"] if args.temperature == 0 else "n/a"
    per_step = got["output_tokens"] / max(got["steps"], 1) / concurrency
    print(
        f"\nconcurrency {concurrency}: plain  {base['output_tokens']} tokens in "
        f"{base['steps']} steps, {base['seconds']:.2f} s, {base['tok_s']:.1f} tok/s"
    )
    print(
        f"concurrency {concurrency}: {method} k={k} {got['output_tokens']} tokens in "
        f"{got['steps']} steps, {got['seconds']:.2f} s, {got['tok_s']:.1f} tok/s; "
        f"acceptance {got['acceptance']:.0%} ({got['accepted_tokens']}/"
        f"{got['draft_tokens']}), ~{per_step:.2f} tokens a request-step; "
        f"speedup {got['tok_s'] / base['tok_s']:.2f}x; identical outputs: {same}"
    )
    return {
        "concurrency": concurrency,
        "method": method,
        "k": k,
        "plain": {key: v for key, v in base.items() if key != "outputs"},
        method: {key: v for key, v in got.items() if key != "outputs"},
        "speedup": got["tok_s"] / base["tok_s"],
        "identical": same,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--quantization", default=None, help="gguf / fp32 (default: auto)")
    parser.add_argument("--k", type=int, nargs="+", default=[4], help="num_speculative_tokens")
    parser.add_argument("--method", nargs="+", default=["ngram"], choices=["ngram", "suffix"])
    parser.add_argument("--ngram", type=int, nargs=2, default=[1, 3], metavar=("MIN", "MAX"))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 3])
    parser.add_argument(
        "--disable-by-batch-size", type=int, default=None, help="the config's key (default: none)"
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="above 0: sampled requests (drafts by rejection sampling; outputs then differ)",
    )
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()

    import torch

    print(f"machine: {cpu_model()} ({vector_extensions()}), {torch.get_num_threads()} threads")
    print(f"model: {args.model}, quantization {args.quantization or 'auto'}; "
          f"{len(TURNS)} turns ({sum(k == 'copy' for k, _ in TURNS)} copying), temperature "
          f"{args.temperature}, max_tokens {args.max_tokens}, median of {args.repeats} "
          "alternated runs")  # fmt: skip
    report = {"machine": cpu_model(), "vector_extensions": vector_extensions(), "runs": []}
    for concurrency in args.concurrency:
        for method in args.method:
            for k in args.k:
                report["runs"].append(run_one(args, method, k, concurrency))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
