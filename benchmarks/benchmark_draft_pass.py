"""GPU benchmark: a draft model's proposal pass against the target's decode step.

Times ``DraftModelProposer.propose`` (vllm/v1/spec_decode/draft_model.py) alone, not tokens
a step: random weights accept nothing meaningful. The target (``--target-shape``, default
llama-3.1-8b) and the draft (``--draft-shape``, default llama-3.2-1b: the same vocabulary)
are benchmark_gpu.py's shapes, loaded by our engine with random weights made on the device
(``--load-format dummy``), in bf16 on CUDA (fp32 on a CPU).

Two engines, one after the other: as configured (the target's decode steps and the draft's
single-token steps replayed from CUDA graphs on CUDA; a CPU captures none) and with
``enforce_eager``. Each speculates the largest k of ``--num-spec-tokens``; a pass of a
smaller k sets the proposer's ``k`` for the measurement (the pass reads nothing else of
the config; the scheduler's lookahead slots for the largest k cover it). For each batch of
``--batches``, ``batch`` random prompts of ``--prompt-len`` tokens generate, greedy, and
inside the first engine step in which every one of them decoded (after the runner's own
draft pass) the benchmark times, on those requests' real states and blocks:

- the draft pass of each k, as the runner's ``_propose_drafts`` makes it after a step
  whose drafts the target rejected: one row a request to catch up (its new token), then
  k - 1 single-token forwards, each with the draft's lm_head and argmax, one read-back;
- the target's decode step at the same batch: one row a request (its last token, whose
  KV that step writes anyway), ``DecodeGraphs.run`` where graphs were captured, else
  eagerly, then the lm_head and argmax.

Each figure: ``--warmup`` unmeasured runs, then the median of ``--repeats``, each between
two device syncs; the states' draft bookkeeping is put back afterwards, and the engine
finishes its requests. The question (docs/gpu.md, item (11)): whether a pass costs well
under k target steps, and how much the draft's graphs save over its eager pass.

``--method eagle`` / ``eagle3`` times an EAGLE head's pass instead
(vllm/v1/spec_decode/eagle.py, ``EagleProposer.propose_step``): a one-layer head of the
target's shape (its config written next to the target's; EAGLE-3's with a 32,000-token
draft vocabulary where the target's is larger, as the public Llama-3.1-8B head), random
weights; the catch-up row reads a hidden state of the target's width a request (EAGLE-3:
three, through the head's ``fc``), then k - 1 single-token forwards. ``--draft-shape`` is
then unused.

    python benchmarks/benchmark_draft_pass.py --json-out /tmp/draft-pass.json   # CUDA
    python benchmarks/benchmark_draft_pass.py --target-shape tiny --draft-shape tiny-draft \\
        --num-spec-tokens 2 --batches 1 2 --prompt-len 16 --repeats 3    # CPU, seconds
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchmark_gpu as gpu  # noqa: E402

ENGINES = ("default", "eager")  # as configured (CUDA graphs on CUDA), enforce_eager


def median_ms(
    run: Callable[[], None], device: torch.device, warmup: int, repeats: int,
    prepare: Callable[[], None] | None = None,
) -> float:  # fmt: skip
    """Median milliseconds of ``run()`` between two device syncs, after ``warmup``
    unmeasured runs; ``prepare()`` before each, outside the time."""
    times = []
    for i in range(warmup + repeats):
        if prepare is not None:
            prepare()
        gpu.sync(device)
        start = time.perf_counter()
        run()
        gpu.sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def draft_pass(runner, states: list, ends: list[int], k: int) -> tuple[Callable, Callable]:
    """(prepare, run) of the draft's pass of ``k`` drafts over ``states``: each request's
    draft KV valid up to its last token (the rejected drafts' case: one catch-up row)."""
    from vllm.v1.spec_decode.eagle import EagleProposer

    drafter, reqs = runner.drafter, []
    if isinstance(drafter, EagleProposer):
        return eagle_pass(drafter, states, ends, k)

    def prepare() -> None:
        reqs.clear()
        for state, end in zip(states, ends, strict=True):
            state.draft_valid, state.draft_ahead, state.draft_probs = end - 1, [], None
            planned = drafter.plan(state, end, sampled=True)
            if planned is None or planned.num_drafts != k:
                got = None if planned is None else planned.num_drafts
                raise RuntimeError(f"request {state.req_id} would propose {got}, not {k}")
            reqs.append(planned)

    return prepare, lambda: drafter.propose(reqs)


def eagle_pass(drafter, states: list, ends: list[int], k: int) -> tuple[Callable, Callable]:
    """(prepare, run) of an EAGLE head's pass of ``k`` drafts: the catch-up of each
    request's last computed row (position end - 2, whose next token the step sampled)
    from a target hidden state of the right width (random: its values change no
    timing), then k - 1 single-token forwards."""
    model, reqs = drafter.model, []
    width, dtype = model.target_hidden_width, model.fc.weight.dtype
    hidden = torch.randn(len(states), width, dtype=dtype, device=drafter.device)

    def prepare() -> None:
        reqs.clear()
        for row, (state, end) in enumerate(zip(states, ends, strict=True)):
            state.draft_probs = None
            planned = drafter.plan_step(state, end - 2, 1, row, sampled=True)
            if planned is None or planned.num_drafts != k:
                got = None if planned is None else planned.num_drafts
                raise RuntimeError(f"request {state.req_id} would propose {got}, not {k}")
            reqs.append(planned)

    return prepare, lambda: drafter.propose_step(reqs, hidden)


def write_eagle_dir(target_dir: Path, out: Path, method: str) -> Path:
    """An EAGLE head's config folder for the target's shape (random weights: no files):
    one layer; EAGLE-3 with the public Llama-3.1-8B head's 32,000-token draft
    vocabulary where the target's is larger."""
    config = json.loads((target_dir / "config.json").read_text())
    n = config["num_hidden_layers"]
    config["num_hidden_layers"] = 1
    if method == "eagle3":
        config["architectures"] = ["LlamaForCausalLMEagle3"]
        config["draft_vocab_size"] = min(32000, config["vocab_size"])
        if len({2, n // 2, n - 3}) < 3 or n < 5:  # the default layers (a tiny target)
            config["eagle_aux_hidden_state_layer_ids"] = [0, n // 2, n]
    else:
        config["architectures"] = ["LlamaForCausalLM"]
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def target_step(runner, states: list, ends: list[int]) -> Callable[[], None]:
    """The target's decode step over ``states``: each request's last token (the KV the
    next real step writes too), replayed where graphs were captured, then lm_head and
    argmax."""
    from vllm.utils.device import to_device

    ids = [s.token_ids[end - 1] for s, end in zip(states, ends, strict=True)]
    positions = [end - 1 for end in ends]
    seqs = [(end - 1, 1, s.full_table) for s, end in zip(states, ends, strict=True)]

    def run() -> None:
        graphs = runner.decode_graphs
        hidden = graphs.run(ids, positions, seqs) if graphs is not None else None
        if hidden is None:
            meta = runner.attn_backend.build_metadata(seqs)
            hidden = runner.model(
                to_device(ids, torch.long, runner.device),
                to_device(positions, torch.long, runner.device),
                meta,
                runner.kv_caches,
            )
        runner.model.compute_logits(hidden).argmax(dim=-1)

    return run


def replays(graphs) -> int:
    return 0 if graphs is None else graphs.num_replays


def measure_batch(runner, states: list, ends: list[int], args: argparse.Namespace) -> dict:
    """Every k's draft pass and the target's step over these decoding requests; how many
    graph replays each made (0: eager)."""
    device, drafter = runner.device, runner.drafter
    out: dict = {"context": statistics.fmean(ends), "draft": {}}
    before = replays(runner.decode_graphs)
    out["target_step_ms"] = median_ms(
        target_step(runner, states, ends), device, args.warmup, args.repeats
    )
    runs = args.warmup + args.repeats
    out["target_replays_per_step"] = (replays(runner.decode_graphs) - before) / runs
    configured = drafter.k
    try:
        for k in args.num_spec_tokens:
            drafter.k = k
            prepare, run = draft_pass(runner, states, ends, k)
            before = replays(drafter.graphs)
            ms = median_ms(run, device, args.warmup, args.repeats, prepare)
            per_pass = (replays(drafter.graphs) - before) / runs
            out["draft"][str(k)] = {"pass_ms": ms, "replays_per_pass": per_pass}
    finally:
        drafter.k = configured
    return out


def measure_in_decode(llm, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    """Generate ``prompts``; inside the first step in which all of them decoded (after the
    runner's own draft pass), ``measure_batch`` on their states; their draft bookkeeping
    is put back before the engine goes on."""
    from vllm import SamplingParams

    runner, found = llm.engine_core.model_runner, {}
    hook = "_propose_drafts" if args.method == "draft_model" else "_propose_eagle"
    original = getattr(runner, hook)

    def propose_then_measure(so, order, out, *rest):
        drafts = original(so, order, out, *rest)
        states = [runner.requests[r] for r in order if r not in out.errors]
        decoding = len(states) == len(prompts) and all(
            out.sampled_token_ids.get(s.req_id) and len(s.output_token_ids) >= 2 for s in states
        )
        if decoding and not found:
            saved = [(s.draft_valid, s.draft_ahead, s.draft_probs) for s in states]
            ends = [len(s.token_ids) for s in states]
            try:
                found.update(measure_batch(runner, states, ends, args))
            except Exception as e:  # noqa: BLE001 - recorded; the engine finishes its requests
                traceback.print_exc()
                found["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            finally:
                for s, (valid, ahead, probs) in zip(states, saved, strict=True):
                    s.draft_valid, s.draft_ahead, s.draft_probs = valid, ahead, probs
        return drafts

    # Room for the drafts of the largest k after the first decode step (plan() stops a
    # request's drafts max_tokens short).
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True,
                            detokenize=False)  # fmt: skip
    setattr(runner, hook, propose_then_measure)
    try:
        llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    finally:
        delattr(runner, hook)  # the class's method again
    if not found:
        raise RuntimeError(f"no step decoded all {len(prompts)} requests at once")
    return found


def engine_phase(args: argparse.Namespace, dirs: dict[str, Path], engine: str, results: dict):
    """One engine's figures for every batch, saved after each."""
    from vllm import LLM

    kw = gpu.engine_kwargs(engine_args_namespace(args), args.dtype)
    kw["speculative_config"] = {
        "method": args.method,
        "model": str(dirs["draft"]),
        "num_speculative_tokens": max(args.num_spec_tokens),
    }
    if engine == "eager":
        kw["enforce_eager"] = True
    start = time.perf_counter()
    llm = LLM(model=str(dirs["target"]), **kw)
    results["timings_s"][f"{engine} start-up"] = time.perf_counter() - start
    try:
        runner = llm.engine_core.model_runner
        results["graphs"][engine] = {
            "target": runner.decode_graphs is not None,
            "draft": runner.drafter.graphs is not None,
        }
        vocab = min(gpu.SHAPES[args.target_shape]["vocab_size"], len(llm.get_tokenizer()))
        for batch in args.batches:
            prompts = gpu.make_prompts(batch, args.prompt_len, vocab, args.seed + batch)
            try:
                figures = measure_in_decode(llm, prompts, args)
            except Exception as e:  # noqa: BLE001 - the other batches are still worth having
                figures = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            results["engines"].setdefault(engine, {})[str(batch)] = figures
            results["rows"] = summary_rows(results["engines"], args)
            save(results, args)
            print(progress_line(engine, batch, figures), flush=True)
    finally:
        llm.shutdown()


def progress_line(engine: str, batch: int, f: dict) -> str:
    if "error" in f:
        return f"{engine}, batch {batch}: failed: {f['error']}"
    passes = ", ".join(
        f"k={k} {d['pass_ms']:.3f} ms ({d['replays_per_pass']:g} replays)"
        for k, d in f["draft"].items()
    )
    return (
        f"{engine}, batch {batch} at context {f['context']:g}: target step "
        f"{f['target_step_ms']:.3f} ms ({f['target_replays_per_step']:g} replays); "
        f"draft pass {passes}"
    )


def engine_args_namespace(args: argparse.Namespace) -> argparse.Namespace:
    """What ``benchmark_gpu.engine_kwargs`` reads: a pool that holds the largest batch
    whole, dummy weights."""
    return argparse.Namespace(
        num_requests=args.batches, prompt_len=args.prompt_len, max_tokens=args.max_tokens,
        seed=args.seed, skip_hf=True, engine_args=args.engine_args,
    )  # fmt: skip


def summary_rows(engines: dict, args: argparse.Namespace) -> list[dict]:
    """One row per (k, batch): the pass with graphs (None where the draft replayed none:
    a CPU, or a batch past the captured sizes), eagerly, the target's step (from the
    default engine: replayed on CUDA), the pass over k target steps, graphs over eager."""
    rows = []
    for k in args.num_spec_tokens:
        for batch in args.batches:
            default, eager = (measured(engines, e, batch) for e in ENGINES)
            pass_d = default["draft"][str(k)] if default else None
            graphs_ms = pass_d["pass_ms"] if pass_d and pass_d["replays_per_pass"] else None
            eager_ms = eager["draft"][str(k)]["pass_ms"] if eager else None
            target = default or eager
            target_ms = target["target_step_ms"] if target else None
            row = {
                "k": k, "batch": batch, "context": target["context"] if target else None,
                "draft_pass_ms_graphs": graphs_ms, "draft_pass_ms_eager": eager_ms,
                "target_step_ms": target_ms,
                "target_step_graphs": bool(target and target["target_replays_per_step"]),
                "target_step_ms_eager": eager["target_step_ms"] if eager else None,
            }  # fmt: skip
            row["ratio_graphs"] = ratio(graphs_ms, k * target_ms if target_ms else None)
            row["ratio_eager"] = ratio(eager_ms, k * target_ms if target_ms else None)
            row["graphs_speedup"] = ratio(eager_ms, graphs_ms)
            rows.append(row)
    return rows


def measured(engines: dict, engine: str, batch: int) -> dict | None:
    """The engine's figures at ``batch``; None when it did not run or failed there."""
    figures = engines.get(engine, {}).get(str(batch))
    return None if figures is None or "error" in figures else figures


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def save(results: dict, args: argparse.Namespace) -> None:
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1, default=str) + "\n")


def fmt(value: float | None, width: int, suffix: str = "") -> str:
    return format("-" if value is None else f"{value:.3g}{suffix}", f">{width}")


def print_table(results: dict) -> None:
    m = results["machine"]
    print(f"\n{m['device_name']}: draft {results['draft_shape']} against target "
          f"{results['target_shape']}, {results['dtype']}; medians of "
          f"{results['args']['repeats']} (ms)")  # fmt: skip
    print(f"{'k':>3} {'batch':>5} {'pass graphs':>11} {'pass eager':>10} {'target':>8} "
          f"{'graphs/(k*tgt)':>14} {'eager/(k*tgt)':>13} {'graphs speedup':>14}")  # fmt: skip
    for r in results["rows"]:
        target = fmt(r["target_step_ms"], 8, "" if r["target_step_graphs"] else "e")
        print(f"{r['k']:>3} {r['batch']:>5} {fmt(r['draft_pass_ms_graphs'], 11)} "
              f"{fmt(r['draft_pass_ms_eager'], 10)} {target} {fmt(r['ratio_graphs'], 14)} "
              f"{fmt(r['ratio_eager'], 13)} {fmt(r['graphs_speedup'], 14, 'x')}")  # fmt: skip
    print("pass graphs '-': no draft graph replayed (a CPU, or a batch past the captured "
          "sizes); target 'e': the target's step ran eagerly")  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # fmt: off
    ap.add_argument("--target-shape", choices=sorted(gpu.SHAPES), default="llama-3.1-8b")
    ap.add_argument("--draft-shape", choices=sorted(gpu.SHAPES), default="llama-3.2-1b")
    ap.add_argument("--method", choices=("draft_model", "eagle", "eagle3"),
                    default="draft_model",
                    help="eagle/eagle3: an EAGLE head of the target's shape, not a draft")
    ap.add_argument("--dtype", choices=("auto", *gpu.DTYPES), default="auto",
                    help="auto: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--num-spec-tokens", type=int, nargs="+", default=[2, 4, 6],
                    help="k: drafts a pass proposes")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--prompt-len", type=int, default=512,
                    help="the requests' context when measured: this and a few tokens")
    ap.add_argument("--repeats", type=int, default=20, help="timed runs a figure (median)")
    ap.add_argument("--warmup", type=int, default=3, help="unmeasured runs a figure first")
    ap.add_argument("--seed", type=int, default=0, help="weights and prompts")
    ap.add_argument("--engine-args", default=None,
                    help="JSON of more LLM arguments, e.g. '{\"attention_backend\": ...}'")
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp/vllm-bench-models"),
                    help="where the two config folders go (SHAPE-DTYPE-dummy)")
    ap.add_argument("--tokenizer-dir", type=Path, default=None,
                    help="SmolLM2 tokenizer files (default: what `make gpu-wheels` carries)")
    ap.add_argument("--json-out", default=None, help="every figure and the machine, as JSON")
    # fmt: on
    args = ap.parse_args(argv)
    if min(args.num_spec_tokens) < 1 or min(args.batches) < 1 or args.prompt_len < 1:
        ap.error("--num-spec-tokens, --batches and --prompt-len must be >= 1")
    if args.repeats < 1 or args.warmup < 0:
        ap.error("--repeats >= 1 and --warmup >= 0")
    vocab = {gpu.SHAPES[s]["vocab_size"] for s in (args.target_shape, args.draft_shape)}
    if len(vocab) != 1 and args.method == "draft_model":
        ap.error(f"the draft needs the target's vocabulary, not {sorted(vocab)}")
    args.num_spec_tokens = sorted(set(args.num_spec_tokens))
    args.batches = sorted(set(args.batches))
    # The first decode step may keep every draft (k + 2 tokens), then the largest k more.
    args.max_tokens = 2 * max(args.num_spec_tokens) + 4
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.dtype == "auto":
        args.dtype = "bfloat16" if device.type == "cuda" else "float32"
    machine = gpu.machine_info(device)
    print(f"machine: {machine['device_name']} ({device.type}; host {machine['cpu']}, "
          f"{gpu.vector_extensions()}), torch {machine['torch']}", flush=True)  # fmt: skip
    machine["vector_extensions"] = gpu.vector_extensions()
    tokenizer_dir = args.tokenizer_dir or gpu.default_tokenizer_dir()
    dirs = {
        role: gpu.write_config_dir(shape, args.model_dir / f"{shape}-{args.dtype}-dummy",
                                   tokenizer_dir)
        for role, shape in (("target", args.target_shape), ("draft", args.draft_shape))
        if role == "target" or args.method == "draft_model"
    }  # fmt: skip
    if args.method != "draft_model":
        dirs["draft"] = write_eagle_dir(
            dirs["target"], args.model_dir / f"{args.target_shape}-{args.method}-head",
            args.method,
        )  # fmt: skip
    results: dict = {
        "machine": machine, "args": vars(args), "target_shape": args.target_shape,
        "draft_shape": args.draft_shape if args.method == "draft_model" else args.method,
        "method": args.method, "dtype": args.dtype, "timings_s": {}, "graphs": {},
        "engines": {}, "rows": [],
    }  # fmt: skip
    for engine in ENGINES:
        engine_phase(args, dirs, engine, results)
    save(results, args)
    print_table(results)
    failed = [f"{e} {b}" for e, by in results["engines"].items() for b, f in by.items()
              if "error" in f]  # fmt: skip
    if failed:
        print(f"failed: {', '.join(failed)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
