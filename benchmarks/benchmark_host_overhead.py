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

Each row also counts the garbage collections during its ``generate`` (the full ones,
generation 2, and their longest pause) and the slowest decode step: medians hide a pause
that stalls one step in a hundred. ``--gc-ab K``: for each N, K sessions of ``--gc-runs``
generates in a row with the engine's start-up heap frozen out of collections (its
default, vllm/utils/gc_utils.py) interleaved with K sessions with it thawed
(``gc.unfreeze`` and a full collection: a process that never froze it); prints each arm's
median wall time, full collections (count, total and longest pause) and longest step.

"front ms": the output processor's time per step (``LLM.generate`` runs it in process,
after each engine step: detokenizing, stop strings, the outputs), which on a GPU adds to
every synchronous step as the host time above does. ``--ab-detok K``: for each N, K
generates whose final-only detokenizers decode the text once at the end (their default)
interleaved with K that decode every token as it comes; prints the medians of the front
end's ms per step and of the wall time.
"""

from __future__ import annotations

import argparse
import functools
import gc
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
        self.calls = 0
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            self.calls += 1
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        setattr(obj, name, timed)


class GCPauses:
    """A ``gc.callbacks`` entry while in a ``with``: each collection's (generation, ms)."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float]] = []
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.pauses.append((info["generation"], (time.perf_counter() - self._start) * 1e3))

    def __enter__(self) -> GCPauses:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)

    def full(self) -> list[float]:
        return [ms for generation, ms in self.pauses if generation == 2]


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

    front = Timed(llm.output_processor, "process_outputs")  # after each step, in process
    core.scheduler.schedule, core.step = recorded_schedule, timed_step
    try:
        prompts = benchmark_gpu.make_prompts(n, prompt_len, SHAPE["vocab_size"], seed=n)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        llm.reset_prefix_cache()
        with GCPauses() as collections:
            start = time.perf_counter()
            llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            wall = time.perf_counter() - start
    finally:
        core.scheduler.schedule, core.step = schedule, step
        del llm.output_processor.process_outputs  # the class's again
    steps = [s for s, _ in rows]
    host = [s - m for s, m in rows]
    full = collections.full()
    return {
        "num_requests": n,
        "decode_steps": len(rows),
        "step_ms": statistics.median(steps) * 1e3,
        "model_ms": statistics.median(m for _, m in rows) * 1e3,
        "host_ms": statistics.median(host) * 1e3,
        "host_us_per_request": statistics.median(host) * 1e6 / n,
        "max_step_ms": max(steps) * 1e3,
        "generate_s": wall,
        # The output processor (detokenizing, stop strings, outputs): its mean per step.
        "front_ms_per_step": front.seconds * 1e3 / max(front.calls, 1),
        "collections": len(collections.pauses),
        "full_collections": len(full),
        "full_collection_ms": sum(full),
        "max_full_collection_ms": max(full, default=0.0),
    }


def interleaved(k: int, arms: tuple[str, str], enter, run) -> dict[str, list]:
    """``k`` runs of each of the two ``arms``, alternating, so that the machine's drift
    hits both alike: ``enter(arm)`` sets an arm up, ``run()`` is one run's result."""
    results: dict[str, list] = {arm: [] for arm in arms}
    for i in range(2 * k):
        arm = arms[i % 2]
        enter(arm)
        results[arm].append(run())
    return results


def ab_sampler(llm, timers: list[Timed], args: argparse.Namespace) -> dict:
    """Host ms per N with the bare-greedy path and without it, interleaved."""
    import vllm.v1.worker.model_runner as model_runner

    real = model_runner.is_bare_greedy

    def enter(arm: str) -> None:
        model_runner.is_bare_greedy = real if arm == "bare" else (lambda p: False)

    print(f"{'N':>5} {'bare-greedy host ms':>20} {'general host ms':>16} {'ratio':>7}")
    out = {}
    try:
        for n in args.num_requests:
            run = functools.partial(measure, llm, timers, n, args.prompt_len, args.max_tokens)
            rows = interleaved(args.ab_sampler, ("bare", "general"), enter, run)
            host = {arm: [r["host_ms"] for r in arm_rows] for arm, arm_rows in rows.items()}
            fast, general = statistics.median(host["bare"]), statistics.median(host["general"])
            out[str(n)] = {"bare_greedy_host_ms": host["bare"], "general_host_ms": host["general"]}
            print(f"{n:>5} {fast:>20.3f} {general:>16.3f} {general / fast:>6.2f}x", flush=True)
    finally:
        model_runner.is_bare_greedy = real
    return out


def ab_detok(llm, timers: list[Timed], args: argparse.Namespace) -> dict:
    """Per N: generates whose detokenizers decode once at the end (``deferred``: no stop
    strings, and ``LLM.generate`` reads the text only then; "lazy") interleaved with ones
    that decode every token as it comes (``deferred`` forced off, as with stop strings:
    "eager"); the front end's ms per step and the wall time."""
    import vllm.v1.engine.detokenizer as detokenizer

    real = detokenizer.IncrementalDetokenizer.__init__

    def eager(self, *a, **kw):
        real(self, *a, **kw)
        self.deferred = False

    def enter(arm: str) -> None:
        detokenizer.IncrementalDetokenizer.__init__ = real if arm == "lazy" else eager

    print(f"{'N':>5} {'front ms lazy':>14} {'front ms eager':>15} {'generate s lazy':>16} "
          f"{'generate s eager':>17}")  # fmt: skip
    out = {}
    try:
        for n in args.num_requests:
            run = functools.partial(measure, llm, timers, n, args.prompt_len, args.max_tokens)
            arms = interleaved(args.ab_detok, ("lazy", "eager"), enter, run)
            med = {
                (arm, key): statistics.median(r[key] for r in rows)
                for arm, rows in arms.items()
                for key in ("front_ms_per_step", "generate_s")
            }
            out[str(n)] = arms
            print(f"{n:>5} {med['lazy', 'front_ms_per_step']:>14.3f} "
                  f"{med['eager', 'front_ms_per_step']:>15.3f} {med['lazy', 'generate_s']:>16.3f} "
                  f"{med['eager', 'generate_s']:>17.3f}", flush=True)  # fmt: skip
    finally:
        detokenizer.IncrementalDetokenizer.__init__ = real
    return out


def gc_arm_line(n: int, arm: str, sessions: list[dict]) -> str:
    """One arm's line: medians over its sessions of the wall time, the full collections,
    their total and longest pause and the longest step; the median decode host time."""

    def median(key: str) -> float:
        return statistics.median(r[key] for r in sessions)

    return (
        f"{n:>5} {arm:>7} {median('generate_s'):>11.3f} {median('full_collections'):>9.1f} "
        f"{median('full_collection_ms'):>11.1f} {median('max_full_collection_ms'):>11.1f} "
        f"{median('max_step_ms'):>12.2f} {median('host_ms'):>8.3f}"
    )


def gc_session(llm, timers: list[Timed], n: int, args: argparse.Namespace) -> dict:
    """``--gc-runs`` generates in a row: what a collection's timing depends on (the objects
    that reach the oldest generation) builds up over many requests, not within one run."""
    rows = [measure(llm, timers, n, args.prompt_len, args.max_tokens) for _ in range(args.gc_runs)]
    return {
        "generate_s": sum(r["generate_s"] for r in rows),
        "full_collections": sum(r["full_collections"] for r in rows),
        "full_collection_ms": sum(r["full_collection_ms"] for r in rows),
        "max_full_collection_ms": max(r["max_full_collection_ms"] for r in rows),
        "max_step_ms": max(r["max_step_ms"] for r in rows),
        "host_ms": statistics.median(r["host_ms"] for r in rows),
    }


def ab_gc(llm, timers: list[Timed], args: argparse.Namespace) -> dict:
    """Per N: sessions with the engine's start-up heap frozen (as it starts) and thawed (a
    process that never froze it, right after a full collection), interleaved."""
    from vllm.utils.gc_utils import freeze_gc_heap

    def enter(arm: str) -> None:
        llm._gc_freeze.release()
        if arm == "frozen":
            llm._gc_freeze = freeze_gc_heap("LLM engine")
        else:
            gc.collect()  # a process that never froze its heap

    print(f"{'N':>5} {'heap':>7} {'generate s':>11} {'full GCs':>9} {'GC ms sum':>11} "
          f"{'longest GC':>11} {'max step ms':>12} {'host ms':>8}")  # fmt: skip
    out = {}
    try:
        for n in args.num_requests:
            run = functools.partial(gc_session, llm, timers, n, args)
            arms = interleaved(args.gc_ab, ("frozen", "thawed"), enter, run)
            for arm, sessions in arms.items():
                print(gc_arm_line(n, arm, sessions), flush=True)
            frozen, thawed = (statistics.median(r["generate_s"] for r in arms[a]) for a in arms)
            print(f"{n:>5} thawed/frozen generate time: {thawed / frozen:.3f}x", flush=True)
            out[str(n)] = arms
    finally:
        llm._gc_freeze.release()
        llm._gc_freeze = freeze_gc_heap("LLM engine")  # as the LLM left start-up
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json-out", type=Path, default=None)
    ap.add_argument("--ab-sampler", type=int, default=0, metavar="K",
                    help="K interleaved runs with and without the bare-greedy path")  # fmt: skip
    ap.add_argument("--ab-detok", type=int, default=0, metavar="K",
                    help="K interleaved runs: text decoded at the end / per token")  # fmt: skip
    ap.add_argument("--gc-ab", type=int, default=0, metavar="K",
                    help="K interleaved sessions, start-up heap frozen and thawed")  # fmt: skip
    ap.add_argument("--gc-runs", type=int, default=8, metavar="R",
                    help="--gc-ab: generates in a row per session (default 8)")  # fmt: skip
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
        f" {'front ms':>9}"
    )
    results = {"machine": machine, "args": vars(args) | {"json_out": None}, "rows": []}
    model = llm.engine_core.model_runner.model
    timers = [Timed(model, "forward"), Timed(model, "compute_logits")]
    try:
        measure(llm, timers, 1, args.prompt_len, 4)  # warm-up
        if args.gc_ab:
            results["ab_gc"] = ab_gc(llm, timers, args)
            if args.json_out:
                args.json_out.write_text(json.dumps(results, indent=1) + "\n")
            return 0
        if args.ab_detok:
            results["ab_detok"] = ab_detok(llm, timers, args)
            if args.json_out:
                args.json_out.write_text(json.dumps(results, indent=1) + "\n")
            return 0
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
                f"{row['host_us_per_request']:>12.1f} {row['front_ms_per_step']:>9.3f}"
            )
            print(line, flush=True)
            if args.json_out:
                args.json_out.write_text(json.dumps(results, indent=1) + "\n")
    finally:
        llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
