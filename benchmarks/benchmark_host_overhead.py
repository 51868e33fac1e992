"""Host time of one decode step: the engine's own work around the model, per batch size.

On a GPU the forward and the lm_head are launched and run on the device (a CUDA graph
replays the whole forward in one launch), but scheduling, packing the inputs, building
the attention metadata, reading the sampled tokens back and updating the requests run on
the host, between steps: they add to every step's time. Issue 27's
batch-1 goal is 6.0 ms a step on an H100 for the 8B shape, of which reading the weights
takes 4.5-4.8 ms; this measures how much of the rest the engine itself takes.

It runs the offline ``LLM`` (engine core in process) on a one-layer model of hidden size
64 and a 512-token vocabulary (random weights, ``--load-format dummy``) in fp32 on the CPU,
so that the model's own work is small, and times each pure-decode engine step and, inside
it, the model's forward and ``compute_logits``. Host time = step - forward - logits:
scheduling, input packing, metadata, sampling (a 512-wide argmax), the scheduler's update.
The front end's output processing (detokenization) runs after the step and is not
counted: ``vllm serve`` runs it in the API process, beside the engine's next step.
Medians over the decode steps of ``--max-tokens`` tokens, for each ``--num-requests``.
The figures are this CPU's; the GPU machine's host CPU is another.

    .venv/bin/python benchmarks/benchmark_host_overhead.py [--num-requests 1 16 64 256]

``--ab-sampler K``: for each N, K runs with the runner's bare-greedy path (the argmax of
each row, no per-row sampler work) interleaved with K runs without it (every request
through ``sample``), in one process so the machine's drift hits both alike; prints the
medians of the host time and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchmark_gpu  # noqa: E402

SHAPE = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
             head_dim=32, intermediate_size=64, vocab_size=512, tie_word_embeddings=True,
             rope_theta=10000.0, rms_norm_eps=1e-5)  # fmt: skip


class Timed:
    """Wraps ``obj.name`` to add each call's seconds to ``self.seconds``."""

    def __init__(self, obj, name: str) -> None:
        self.seconds = 0.0
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        setattr(obj, name, timed)


def measure(llm, timers: list[Timed], n: int, prompt_len: int, max_tokens: int) -> dict:
    """One ``generate`` of ``n`` requests; ``timers``: the model's forward and logits."""
    from vllm import SamplingParams

    core = llm.engine_core
    step, schedule = core.step, core.scheduler.schedule
    rows: list[tuple[float, float]] = []  # (step, model) seconds of pure-decode steps
    last = []

    def recorded_schedule():
        last.append(schedule())
        return last[-1]

    def timed_step():
        before = sum(t.seconds for t in timers)
        start = time.perf_counter()
        out = step()
        elapsed = time.perf_counter() - start
        so = last.pop() if last else None
        if so is not None and so.total_num_scheduled_tokens == len(so.num_scheduled_tokens) > 0:
            rows.append((elapsed, sum(t.seconds for t in timers) - before))
        return out

    core.scheduler.schedule, core.step = recorded_schedule, timed_step
    try:
        prompts = benchmark_gpu.make_prompts(n, prompt_len, SHAPE["vocab_size"], seed=n)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        llm.reset_prefix_cache()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    finally:
        core.scheduler.schedule, core.step = schedule, step
    steps = [s for s, _ in rows]
    host = [s - m for s, m in rows]
    return {
        "num_requests": n,
        "decode_steps": len(rows),
        "step_ms": statistics.median(steps) * 1e3,
        "model_ms": statistics.median(m for _, m in rows) * 1e3,
        "host_ms": statistics.median(host) * 1e3,
        "host_us_per_request": statistics.median(host) * 1e6 / n,
    }


def ab_sampler(llm, timers: list[Timed], args: argparse.Namespace) -> dict:
    """Host ms per N with the bare-greedy path and without it, interleaved."""
    import vllm.v1.worker.model_runner as model_runner

    real = model_runner.is_bare_greedy
    print(f"{'N':>5} {'bare-greedy host ms':>20} {'general host ms':>16} {'ratio':>7}")
    out = {}
    try:
        for n in args.num_requests:
            host: dict[bool, list[float]] = {True: [], False: []}
            for i in range(2 * args.ab_sampler):
                bare = i % 2 == 0
                model_runner.is_bare_greedy = real if bare else (lambda p: False)
                row = measure(llm, timers, n, args.prompt_len, args.max_tokens)
                host[bare].append(row["host_ms"])
            fast, general = statistics.median(host[True]), statistics.median(host[False])
            out[str(n)] = {"bare_greedy_host_ms": host[True], "general_host_ms": host[False]}
            print(f"{n:>5} {fast:>20.3f} {general:>16.3f} {general / fast:>6.2f}x", flush=True)
    finally:
        model_runner.is_bare_greedy = real
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json-out", type=Path, default=None)
    ap.add_argument("--ab-sampler", type=int, default=0, metavar="K",
                    help="K interleaved runs with and without the bare-greedy path")  # fmt: skip
    args = ap.parse_args(argv)
    if min(args.num_requests) < 1 or args.max_tokens < 2:
        ap.error("--num-requests >= 1 and --max-tokens >= 2")
    import torch
    from transformers import LlamaConfig

    from vllm import LLM

    folder = Path("/tmp/vllm-host-overhead-model")
    folder.mkdir(parents=True, exist_ok=True)
    fields = dict(SHAPE)
    theta = fields.pop("rope_theta")
    config = LlamaConfig(**fields, max_position_embeddings=4096,
                         rope_parameters={"rope_type": "default", "rope_theta": theta})  # fmt: skip
    config.save_pretrained(folder)
    tokenizer = benchmark_gpu.default_tokenizer_dir()
    for name in benchmark_gpu.TOKENIZER_FILES:
        if (tokenizer / name).exists():
            (folder / name).write_bytes((tokenizer / name).read_bytes())
    top = max(args.num_requests)
    length = args.prompt_len + args.max_tokens
    llm = LLM(model=str(folder), load_format="dummy", dtype="float32", max_num_seqs=top,
              max_model_len=length, num_gpu_blocks_override=top * (-(-length // 16)) + 1,
              max_num_batched_tokens=max(2048, top * args.prompt_len))  # fmt: skip
    machine = benchmark_gpu.machine_info(torch.device("cpu"))
    print(f"machine: {machine['cpu']}, {machine['cpu_count']} cores, torch {machine['torch']}; "
          f"threads {torch.get_num_threads()}", flush=True)  # fmt: skip
    print(
        f"{'N':>5} {'steps':>6} {'step ms':>8} {'model ms':>9} {'host ms':>8} {'host us/req':>12}"
    )
    results = {"machine": machine, "args": vars(args) | {"json_out": None}, "rows": []}
    model = llm.engine_core.model_runner.model
    timers = [Timed(model, "forward"), Timed(model, "compute_logits")]
    try:
        measure(llm, timers, 1, args.prompt_len, 4)  # warm-up
        if args.ab_sampler:
            results["ab_sampler"] = ab_sampler(llm, timers, args)
            if args.json_out:
                args.json_out.write_text(json.dumps(results, indent=1) + "\n")
            return 0
        for n in args.num_requests:
            row = measure(llm, timers, n, args.prompt_len, args.max_tokens)
            results["rows"].append(row)
            line = (
                f"{n:>5} {row['decode_steps']:>6} {row['step_ms']:>8.3f} "
                f"{row['model_ms']:>9.3f} {row['host_ms']:>8.3f} "
                f"{row['host_us_per_request']:>12.1f}"
            )
            print(line, flush=True)
            if args.json_out:
                args.json_out.write_text(json.dumps(results, indent=1) + "\n")
    finally:
        llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
