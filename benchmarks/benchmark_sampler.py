"""Sampling a batch together against row by row, for rows with penalties and filters.

Until session 21 the sampler batched only greedy rows and rows with a temperature alone;
a row with a penalty (repetition, presence, frequency) or a filter (top-k, top-p, min-p)
was sampled by itself: ~10 small ops and two or three reads to the host each, which on a
GPU are a sync each (256 such rows: ~700 syncs a step). Now every row is sampled in one
pass (``sample_on_device``) and read back once. This times ``sample`` on a batch of N such
rows against ``sample`` called on each row alone (the old cost's shape), in the same run,
on the same logits, and checks they give the same tokens (seeded rows).

    .venv/bin/python benchmarks/benchmark_sampler.py [--num-requests 1 16 64 256]
        [--vocab 128256] [--prompt-len 512] [--output-len 128] [--device cpu|cuda]
        [--mix penalties|filters|both] [--repeats 5] [--json-out FILE]

``--top-p-ab`` times something else: two of top-p's methods of finding each row's nucleus
(``sampler.apply_top_p``, ``--top-p-methods``), by default ``torch.sort`` (which orders the
token ids too; until session 23 the sampler's only way) against the CPU's default,
numpy's ranking of the values alone, or on a GPU against the Triton search over the
probabilities' bits (``triton_top_p``), as ``sample`` on rows with a temperature and a
top-p, interleaved in one run, and checks that both draw the same tokens. ``--logits
real`` takes the rows from the embedded model (SmolLM2-135M-Instruct, vocabulary 49,152)
while it writes text, as a served model's nuclei are, and adds ``LLM.chat`` end to end
(on a CPU); ``random`` is standard-normal logits, a far wider nucleus (the worst case).

    .venv/bin/python benchmarks/benchmark_sampler.py --top-p-ab [--logits real|random]
        [--temperature 0.7] [--top-p 0.9] [--num-requests 1 16 64 256]
        [--top-p-methods sort numpy|triton]

``--penalty-table-ab`` times the penalties' two sources: the rows' histories, built
into (row, token) entries on the host each step (``apply_penalties_to_rows``'s sparse
way, the runner's until session 24), against the runner's per-request token tables on the
device (``penalty_table.PenaltyTable``), as ``sample`` on N rows of
``--mix``, interleaved, checking the same tokens; it also times the sparse way's host work
alone (building the entries), which a GPU step pays on the host every step and the tables
never.

    .venv/bin/python benchmarks/benchmark_sampler.py --penalty-table-ab [--mix penalties]
        [--vocab 49152] [--num-requests 1 16 64 256] [--end-to-end]

``--end-to-end`` adds ``LLM.chat`` of 16 greedy penalised chats with the embedded model,
the runner's penalties from its tables against the histories (CPU).

``--rejection-ab`` times speculative decoding's verification of sampled requests
(``rejection_sampler.verify_sampled_batch``): a step's N requests with K drafts each
(drawn from a q near the target's p, half of them checked against that q, half as point
masses), all verified together on the device with one read to the host (the default off
a CPU) against request by request, each row filtered only when reached (a CPU's default,
and every device's before session 36: ~4 reads a draft), checking the same tokens
(seeded requests).

    .venv/bin/python benchmarks/benchmark_sampler.py --rejection-ab [--num-spec-tokens 3]
        [--vocab 128256] [--num-requests 1 16 64 256]

Medians of ``--repeats`` timed calls after one warm-up. The figures are this machine's:
name its CPU (or GPU) with them.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from vllm.sampling_params import SamplingParams
from vllm.v1.sample import sampler
from vllm.v1.sample.penalty_table import PenaltyTable, has_penalty
from vllm.v1.sample.rejection_sampler import SampledDrafts, verify_sampled_batch
from vllm.v1.sample.sampler import PrefixView, SamplingRow, sample

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchmark_gpu  # noqa: E402  (the machine's description)

MIXES = {
    "penalties": dict(temperature=0.8, repetition_penalty=1.1, frequency_penalty=0.3),
    "filters": dict(temperature=0.8, top_p=0.9, top_k=50),
    "both": dict(temperature=0.8, top_p=0.9, presence_penalty=0.5, repetition_penalty=1.05),
}


def make_rows(n: int, args: argparse.Namespace, device: torch.device) -> list[SamplingRow]:
    rng = random.Random(0)
    rows = []
    for i in range(n):
        params = SamplingParams(seed=i, max_tokens=args.output_len, **MIXES[args.mix])
        output = [rng.randrange(args.vocab) for _ in range(args.output_len)]
        tokens = [rng.randrange(args.vocab) for _ in range(args.prompt_len)] + output
        gen = torch.Generator(device=device).manual_seed(i)
        # As the runner builds them: the prompt a view into the request's token list.
        rows.append(SamplingRow(params, gen, PrefixView(tokens, args.prompt_len), output))
    return rows


def reseed(rows: list[SamplingRow]) -> None:
    for i, r in enumerate(rows):
        r.generator.manual_seed(i)


def timed(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def interleaved(a, b, repeats: int, device: torch.device) -> tuple[bool, float, float]:
    """Whether ``a()`` and ``b()`` give the same (also their warm-up), and each one's
    median ms over ``repeats`` interleaved calls (drift hits both alike), rounded as
    printed, so that a ratio of the two agrees with the record."""
    same = a() == b()
    t_a, t_b = [], []
    for _ in range(repeats):
        t_a.append(timed(a, device))
        t_b.append(timed(b, device))
    return (same, round(statistics.median(t_a) * 1e3, 3), round(statistics.median(t_b) * 1e3, 3))


def measure(n: int, args: argparse.Namespace, device: torch.device) -> dict:
    logits = torch.randn(n, args.vocab, generator=torch.Generator().manual_seed(n)).to(device)
    rows = make_rows(n, args, device)

    def together():
        reseed(rows)
        return sample(logits, rows).token_ids

    def alone():
        reseed(rows)
        return [sample(logits[i : i + 1], [r]).token_ids[0] for i, r in enumerate(rows)]

    same, batch_ms, rows_ms = interleaved(together, alone, args.repeats, device)
    return dict(
        num_requests=n,
        together_ms=batch_ms,
        row_by_row_ms=rows_ms,
        speedup=round(rows_ms / batch_ms, 2),
        same_tokens=same,
    )


def rejection_ab(n: int, args: argparse.Namespace, device: torch.device) -> dict:
    k, vocab = args.num_spec_tokens, args.vocab
    rng = torch.Generator().manual_seed(n)
    logits = torch.randn(n * (k + 1), vocab, generator=rng).to(device)
    params = SamplingParams(temperature=0.8, top_p=0.95)
    reqs = []
    for i in range(n):
        block = logits[i * (k + 1) : (i + 1) * (k + 1)]
        # The drafter's q: the target's rows, a little off.
        noise = torch.randn(k, vocab, generator=rng).to(device) * 0.5
        q = ((block[:k] + noise) / params.temperature).softmax(-1)
        drafts = torch.multinomial(q, 1, generator=None).view(-1).tolist()
        gen = torch.Generator(device=device).manual_seed(i)
        reqs.append(SampledDrafts(block, drafts, params, gen, q if i % 2 else None))

    def reseeded():
        for i, r in enumerate(reqs):
            r.generator.manual_seed(i)
        return reqs

    def together():
        return verify_sampled_batch(reseeded(), together=True)

    def alone():
        return verify_sampled_batch(reseeded(), together=False)

    same, batch_ms, rows_ms = interleaved(together, alone, args.repeats, device)
    kept = sum(len(t) - 1 for t in together() if t is not None)
    return dict(
        num_requests=n,
        num_spec_tokens=k,
        together_ms=batch_ms,
        row_by_row_ms=rows_ms,
        speedup=round(rows_ms / batch_ms, 2),
        kept_per_request=round(kept / n, 2),
        same_tokens=same,
    )


def penalty_table_ab(n: int, args: argparse.Namespace, device: torch.device) -> dict:
    """``sample`` on ``n`` rows of ``--mix``, penalised from their histories and from a
    ``PenaltyTable``, interleaved; the same tokens; the sparse way's entries alone."""
    logits = torch.randn(n, args.vocab, generator=torch.Generator().manual_seed(n)).to(device)
    rows = make_rows(n, args, device)
    tables = PenaltyTable(args.vocab, device)
    with_tables = [
        dataclasses.replace(r, penalty_slot=tables.add(r.prompt_token_ids, r.output_token_ids))
        for r in rows
    ]  # the same generators: reseed() serves both

    def histories():
        reseed(rows)
        return sample(logits, rows).token_ids

    def from_tables():
        reseed(rows)
        return sample(logits, with_tables, tables).token_ids

    same, sparse_ms, dense_ms = interleaved(histories, from_tables, args.repeats, device)
    parts = [(i, [sampler._ids(r.prompt_token_ids), sampler._ids(r.output_token_ids)])
             for i, r in enumerate(rows)]  # fmt: skip
    entries = [timed(lambda: sampler._entries(parts, args.vocab, device), device)
               for _ in range(args.repeats)]  # fmt: skip
    return dict(
        num_requests=n,
        histories_ms=sparse_ms,
        tables_ms=dense_ms,
        ratio=round(sparse_ms / dense_ms, 2),
        same_tokens=same,
        host_entries_ms=round(statistics.median(entries) * 1e3, 3),
        table_mib=round(tables.capacity * args.vocab * 5 / 2**20, 2),
    )


def chat_ab(llm, params: SamplingParams, arms: dict, repeats: int) -> tuple[dict, dict]:
    """``llm.chat`` of ``len(REAL_PROMPTS) * 2`` chats with ``params`` inside each arm's
    context manager (``arms``: name -> a function making one), interleaved, ``repeats //
    2`` rounds (at least one): each arm's median output tok/s, and its last run's tokens."""
    prompts = [[{"role": "user", "content": p}] for p in REAL_PROMPTS * 2]
    rates: dict[str, list[float]] = {name: [] for name in arms}
    tokens: dict[str, list] = {}
    for _ in range(max(repeats // 2, 1)):
        for name, arm in arms.items():
            with arm():
                start = time.perf_counter()
                outs = llm.chat(prompts, params)
                elapsed = time.perf_counter() - start
            rates[name].append(sum(len(o.outputs[0].token_ids) for o in outs) / elapsed)
            tokens[name] = [o.outputs[0].token_ids for o in outs]
    return {name: round(statistics.median(r), 1) for name, r in rates.items()}, tokens


def penalty_end_to_end(args: argparse.Namespace) -> dict:
    """``chat_ab`` of greedy chats of 64 tokens with a repetition and a frequency
    penalty, the runner's penalties from the rows' histories and from its tables
    (``ModelRunner.use_penalty_tables``), after a warm-up: output tok/s (medians) and
    whether both wrote the same tokens."""
    from vllm import LLM

    llm = LLM(max_num_seqs=len(REAL_PROMPTS) * 2)
    runner = llm.engine_core.model_runner

    @contextlib.contextmanager
    def tables(on: bool):
        runner.use_penalty_tables = on
        yield

    try:
        params = SamplingParams(temperature=0.0, repetition_penalty=1.1, frequency_penalty=0.3,
                                max_tokens=64, ignore_eos=True)  # fmt: skip
        llm.chat([[{"role": "user", "content": p}] for p in REAL_PROMPTS * 2], params)
        arms = {"histories": lambda: tables(False), "tables": lambda: tables(True)}
        rate, tokens = chat_ab(llm, params, arms, args.repeats)
    finally:
        llm.shutdown()
    return dict(requests=len(REAL_PROMPTS) * 2, max_tokens=64,
                histories_tok_per_s=rate["histories"], tables_tok_per_s=rate["tables"],
                ratio=round(rate["tables"] / rate["histories"], 2),
                same_tokens=tokens["histories"] == tokens["tables"])  # fmt: skip


def table(header: list[str], cells: list, rows) -> list[dict]:
    """Print a markdown table, a line per result of ``rows`` as it comes (``cells``: one
    function per column), and return the results."""
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    results = []
    for r in rows:
        results.append(r)
        print("| " + " | ".join(str(cell(r)) for cell in cells) + " |", flush=True)
    return results


REAL_PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a hash map works and when to use one.",
    "List five ideas for a weekend trip near the mountains, with reasons.",
    "Describe the water cycle to a ten-year-old.",
    "What are the pros and cons of working from home?",
    "Write a poem about autumn leaves.",
    "Summarize the plot of a detective novel you would like to read.",
    "Give advice to someone learning to play the guitar.",
]


def real_logits(llm, count: int, args: argparse.Namespace) -> torch.Tensor:
    """``count`` rows of ``llm``'s logits, one per token it wrote (sampled with the A/B's
    own temperature and top-p), captured from ``compute_logits``."""
    model = llm.engine_core.model_runner.model
    captured: list[torch.Tensor] = []
    compute = model.compute_logits

    def capture(hidden):
        out = compute(hidden)
        captured.append(out.detach().clone())
        return out

    model.compute_logits = capture
    try:
        per_prompt = -(-count // len(REAL_PROMPTS)) + 1
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=0,
                                max_tokens=per_prompt, ignore_eos=True)  # fmt: skip
        llm.chat([[{"role": "user", "content": p}] for p in REAL_PROMPTS], params)
    finally:
        model.compute_logits = compute
    rows = torch.cat(captured)
    return rows[torch.randperm(len(rows), generator=torch.Generator().manual_seed(0))][:count]


@contextlib.contextmanager
def nucleus_by(method: str):
    """``sampler.apply_top_p`` with its method fixed, inside the ``with`` block."""
    default = sampler.apply_top_p
    sampler.apply_top_p = lambda x, top_p: default(x, top_p, method=method)
    try:
        yield
    finally:
        sampler.apply_top_p = default


def end_to_end(llm, args: argparse.Namespace) -> dict:
    """``chat_ab`` of chats of 64 tokens sampled with the temperature and top-p: output
    tok/s by each of the two methods (medians)."""
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=1,
                            max_tokens=64, ignore_eos=True)  # fmt: skip
    a, b = args.top_p_methods
    arms = {m: lambda m=m: nucleus_by(m) for m in (a, b)}
    rate, _ = chat_ab(llm, params, arms, args.repeats)
    return dict(requests=len(REAL_PROMPTS) * 2, max_tokens=64, methods=[a, b],
                **{f"{m}_tok_per_s": rate[m] for m in (a, b)},
                speedup=round(rate[b] / rate[a], 2))  # fmt: skip


def top_p_ab(n: int, logits: torch.Tensor, args: argparse.Namespace) -> dict:
    """``sample`` on ``n`` rows with a temperature and a top-p, the nucleus found by each
    of the two methods (``apply_top_p``), interleaved; the same tokens; nucleus sizes."""
    device = logits.device
    x = logits[:n].to(device)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=0)
    rows = [SamplingRow(params, torch.Generator(device=device), [], []) for _ in range(n)]

    def run(method: str):
        with nucleus_by(method):
            reseed(rows)
            return sample(x, rows).token_ids

    a, b = args.top_p_methods
    same, a_ms, b_ms = interleaved(lambda: run(a), lambda: run(b), args.repeats, device)
    top_p = torch.full((n,), args.top_p, dtype=torch.float64, device=device)
    kept = torch.isfinite(sampler.apply_top_p(x / args.temperature, top_p)).sum(-1).float()
    return {
        "num_requests": n,
        f"{a}_ms": a_ms,
        f"{b}_ms": b_ms,
        "speedup": round(a_ms / b_ms, 2),
        "same_tokens": same,
        "nucleus_median": int(kept.median()),
        "nucleus_max": int(kept.max()),
    }


def main_top_p(args: argparse.Namespace, device: torch.device, machine: dict) -> int:
    if args.top_p_methods is None:  # the CPU's and the GPU's candidate against the sort
        args.top_p_methods = ["sort", "numpy" if device.type == "cpu" else "triton"]
    a, b = args.top_p_methods
    count = max(args.num_requests)
    e2e = None
    if args.logits == "real":
        from vllm import LLM

        llm = LLM(max_num_seqs=len(REAL_PROMPTS) * 2)
        try:
            logits = real_logits(llm, count, args)
            if device.type == "cpu":  # the engine's own device
                e2e = end_to_end(llm, args)
        finally:
            llm.shutdown()
    else:
        logits = torch.randn(count, args.vocab, generator=torch.Generator().manual_seed(0))
    print(f"# {machine['device_name']} ({machine.get('vector_extensions', device.type)}), "
          f"{torch.get_num_threads()} threads, {args.logits} logits, vocab {logits.shape[1]}, "
          f"temperature {args.temperature}, top_p {args.top_p}")  # fmt: skip
    results = table(
        ["N", f"{a} ms", f"{b} ms", f"speedup of {b}", "same tokens", "nucleus median / max"],
        [lambda r: r["num_requests"], lambda r: r[f"{a}_ms"], lambda r: r[f"{b}_ms"],
         lambda r: f"{r['speedup']}x", lambda r: r["same_tokens"],
         lambda r: f"{r['nucleus_median']} / {r['nucleus_max']}"],
        (top_p_ab(n, logits, args) for n in args.num_requests),
    )  # fmt: skip
    if e2e is not None:
        print(f"end to end: {e2e['requests']} chats x {e2e['max_tokens']} tokens, "
              f"{e2e[f'{a}_tok_per_s']} tok/s by {a}, "
              f"{e2e[f'{b}_tok_per_s']} by {b} ({e2e['speedup']}x)")  # fmt: skip
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(dict(device=str(device), machine=machine, args=vars(args),
                           top_p_ab=results, end_to_end=e2e), f, indent=1)  # fmt: skip
    return 0 if all(r["same_tokens"] for r in results) else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-requests", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--vocab", type=int, default=128256, help="Llama-3's by default")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--mix", choices=sorted(MIXES), default="both")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json-out", help="write the results here too")
    ap.add_argument(
        "--top-p-ab", action="store_true", help="torch.sort against numpy for top-p (module doc)"
    )
    ap.add_argument(
        "--logits",
        choices=["real", "random"],
        default="real",
        help="--top-p-ab's rows: the embedded model's, or standard normal",
    )
    ap.add_argument(
        "--penalty-table-ab",
        action="store_true",
        help="penalties from the rows' histories against device token tables (module doc)",
    )
    ap.add_argument(
        "--end-to-end",
        action="store_true",
        help="--penalty-table-ab: also LLM.chat with the embedded model, both ways (CPU)",
    )
    ap.add_argument(
        "--top-p-methods",
        nargs=2,
        choices=sampler.TOP_P_METHODS,
        default=None,
        help="--top-p-ab's two methods (default: sort and numpy on a CPU, sort and triton "
        "on a GPU)",
    )
    ap.add_argument(
        "--rejection-ab",
        action="store_true",
        help="spec decode's verification of sampled requests, batched against alone",
    )
    ap.add_argument("--num-spec-tokens", type=int, default=3, help="--rejection-ab's K")
    ap.add_argument("--temperature", type=float, default=0.7, help="--top-p-ab's")
    ap.add_argument("--top-p", type=float, default=0.9, help="--top-p-ab's")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    device = torch.device(args.device)
    machine = benchmark_gpu.machine_info(device)
    if device.type == "cpu":
        machine["vector_extensions"] = benchmark_gpu.vector_extensions()
    if args.top_p_ab:
        return main_top_p(args, device, machine)
    if args.penalty_table_ab and not has_penalty(SamplingParams(**MIXES[args.mix])):
        ap.error(f"--penalty-table-ab needs a --mix with penalties, not {args.mix}")
    if args.end_to_end and not (args.penalty_table_ab and device.type == "cpu"):
        ap.error("--end-to-end goes with --penalty-table-ab on the CPU (the engine's device)")
    what = f"mix {args.mix}: {MIXES[args.mix]}"
    if args.rejection_ab:
        what = f"{args.num_spec_tokens} drafts a request, temperature 0.8, top-p 0.95"
    print(f"# {machine['device_name']} ({machine.get('vector_extensions', device.type)}), "
          f"{torch.get_num_threads()} threads, vocab {args.vocab}, {what}")  # fmt: skip
    e2e = None
    if args.rejection_ab:
        results = table(
            ["N", "K", "together ms", "one by one ms", "speedup", "kept a request",
             "same tokens"],
            [lambda r: r["num_requests"], lambda r: r["num_spec_tokens"],
             lambda r: r["together_ms"], lambda r: r["row_by_row_ms"],
             lambda r: f"{r['speedup']}x", lambda r: r["kept_per_request"],
             lambda r: r["same_tokens"]],
            (rejection_ab(n, args, device) for n in args.num_requests),
        )  # fmt: skip
    elif args.penalty_table_ab:
        results = table(
            ["N", "histories ms", "tables ms", "ratio", "same tokens", "host entries ms",
             "tables MiB"],
            [lambda r: r["num_requests"], lambda r: r["histories_ms"], lambda r: r["tables_ms"],
             lambda r: f"{r['ratio']}x", lambda r: r["same_tokens"],
             lambda r: r["host_entries_ms"], lambda r: r["table_mib"]],
            (penalty_table_ab(n, args, device) for n in args.num_requests),
        )  # fmt: skip
        if args.end_to_end:
            e2e = penalty_end_to_end(args)
            print(f"end to end: {e2e['requests']} chats x {e2e['max_tokens']} tokens, "
                  f"{e2e['histories_tok_per_s']} tok/s from histories, "
                  f"{e2e['tables_tok_per_s']} from tables ({e2e['ratio']}x), "
                  f"same tokens {e2e['same_tokens']}")  # fmt: skip
    else:
        results = table(
            ["N", "together ms", "row by row ms", "speedup", "same tokens"],
            [lambda r: r["num_requests"], lambda r: r["together_ms"],
             lambda r: r["row_by_row_ms"], lambda r: f"{r['speedup']}x",
             lambda r: r["same_tokens"]],
            (measure(n, args, device) for n in args.num_requests),
        )  # fmt: skip
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(dict(device=str(device), machine=machine, args=vars(args),
                           results=results, end_to_end=e2e), f, indent=1)  # fmt: skip
    checked = results + ([e2e] if e2e else [])
    return 0 if all(r["same_tokens"] for r in checked) else 1


if __name__ == "__main__":
    sys.exit(main())
