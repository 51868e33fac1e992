"""Reference numbers for EAGLE-1/EAGLE-3 speculative decoding from upstream vLLM 0.32 (CPU).

Run with the upstream virtualenv (from anywhere, /work/main included):

    .venv-upstream/bin/python scripts/upstream_eagle_parity.py --out-dir DIR \\
        [--method eagle|eagle3 ...] [--variant NAME ...] [--k 3] [--json-out FILE]

Builds, or reuses when present with the same options, a tiny random Llama target
(DIR/target) and one EAGLE draft folder per variant (tests/eagle_checkpoints.py):

    eagle       EAGLE-1, embed_tokens left out (the target's are shared)
    eagle3      EAGLE-3, aux layers [1, n // 2, n], embed_tokens written (equal to the
                target's: upstream shares them)
    eagle3_d2t  EAGLE-3, draft_vocab_size 128 with d2t/t2d
    eagle3_nbr  EAGLE-3, norm_before_residual, no aux layer key (upstream's default ids)
    eagle3_qwen3_speculators
                the eagle3 head with per-head q/k norms (a Qwen3 layer), in the
                speculators library's format (upstream: Eagle3Qwen3ForCausalLM); the
                reference reads the same head in the EAGLE format (``reference_draft``)

then runs upstream's ``vllm.LLM`` greedily (temperature 0, ignore_eos) over fixed token-id
prompts: once without speculative decoding (the baseline), and per variant with
``speculative_config={"method", "model", "num_speculative_tokens": k}``: all prompts in
one batch, then each prompt alone. It records each prompt's output token ids and the
spec-decode counters (num_drafts, num_draft_tokens, num_accepted_tokens, accepted per
position) from ``llm.get_metrics()``, as deltas around each ``generate``. Checks: every
output equals the baseline's (greedy), and every variant's acceptance rate
(accepted / draft tokens) is within [--min-rate, --max-rate]. Prints the JSON (and writes
it to --json-out; stdout carries nothing else, upstream's logs go to stderr); exits 1
when a check fails.

Upstream imports its package as ``vllm``, like ours: this script leaves the repository
root off ``sys.path``, runs from a temporary directory and sets PYTHONSAFEPATH=1 (upstream
starts helpers with ``python -m``), and imports tests/eagle_checkpoints.py by file path.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import importlib.util
import json
import operator
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

VARIANTS = {
    "eagle": ("eagle", {}),
    "eagle3": ("eagle3", {"with_embed_tokens": True}),
    "eagle3_d2t": ("eagle3", {"draft_vocab_size": 128}),
    "eagle3_nbr": ("eagle3", {"norm_before_residual": True, "aux_layer_ids": None}),
    "eagle3_qwen3_speculators": ("eagle3", {"with_embed_tokens": True}),
}
# Variants written in the speculators format over a layer of this model_type, from the
# head built with the variant's options.
SPECULATORS = {"eagle3_qwen3_speculators": "qwen3"}
SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def prompts() -> list[list[int]]:
    """Six fixed prompts (token ids < 256): four seeded random ones of lengths 5, 17, 33,
    60 and two with repeated patterns (24 and 42 tokens)."""
    import torch

    gen = torch.Generator().manual_seed(1234)
    out = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 17, 33, 60)]
    out.append([7, 8, 9, 10] * 6)
    out.append([200, 13, 13, 13, 45, 99] * 7)
    return out


def isolate_from_repo() -> None:
    """Keep our own ``vllm`` (the repository root) away from upstream's imports."""
    os.environ["PYTHONSAFEPATH"] = "1"
    repo = str(REPO)
    sys.path[:] = [p for p in sys.path if p not in ("", ".", repo) and Path(p).resolve() != REPO]
    if os.environ.get("PYTHONPATH"):
        keep = [
            p for p in os.environ["PYTHONPATH"].split(os.pathsep) if p and Path(p).resolve() != REPO
        ]
        os.environ["PYTHONPATH"] = os.pathsep.join(keep)
    os.chdir(tempfile.mkdtemp(prefix="upstream-eagle-"))


def load_checkpoints_module():
    path = REPO / "tests" / "eagle_checkpoints.py"
    spec = importlib.util.spec_from_file_location("eagle_checkpoints", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def folder_hashes(folder: Path) -> dict:
    return {name: sha256(folder / name) for name in ("config.json", "model.safetensors")}


def build(ec, out_dir: Path, names: list[str], seed: int, noise, rebuild: bool) -> dict:
    """Build or reuse the target and the drafts; returns {name: (folder, method, options,
    the folder the reference reads)}."""
    target = out_dir / "target"
    if rebuild or not ec.checkpoint_ready(target):
        print(f"building {target}", file=sys.stderr)
        ec.save_tiny_target(target)
    built = {}
    for name in names:
        method, options = VARIANTS[name]
        options = dict(options, seed=seed)
        if noise is not None:
            options["noise"] = noise
        folder = out_dir / name
        current = False
        if not rebuild and ec.checkpoint_ready(folder):
            config = json.loads((folder / "config.json").read_text())
            recorded = config.get("eagle_checkpoints", {})
            current = recorded.get("method") == method and recorded.get(
                "options"
            ) == ec.recorded_options(method, **options)
            current = current and recorded.get("target_sha256") == sha256(
                target / "model.safetensors"
            )
        if not current:
            print(f"building {folder}", file=sys.stderr)
            ec.save_eagle(folder, target, method, **options)
        built[name] = (folder, method, options, folder)
        if name in SPECULATORS:  # derived each run: cheap, and never stale
            qk = out_dir / f"{name}_eagle_format"
            speculators = out_dir / f"{name}_speculators"
            built[name] = _speculators_variant(
                ec, folder, qk, speculators, SPECULATORS[name], method, options
            )
    return built


def _speculators_variant(ec, head: Path, qk: Path, out: Path, model_type: str, method, options):
    """``head`` with per-head q/k norms (``qk``, EAGLE format: the reference's) and the
    same in the speculators format over a ``model_type`` layer (``out``: upstream's)."""
    import shutil

    for folder in (qk, out):
        shutil.rmtree(folder, ignore_errors=True)
    ec.add_qk_norms(head, qk)
    ec.save_as_speculators(qk, out, model_type)
    return out, method, options, qk


def spec_metrics(llm) -> dict:
    """The spec-decode counters summed over label sets (engines)."""
    totals = {key: 0 for key in SPEC_COUNTERS.values()}
    per_pos: list[int] = []
    for metric in llm.get_metrics():
        if metric.name in SPEC_COUNTERS:
            totals[SPEC_COUNTERS[metric.name]] += int(metric.value)
        elif metric.name == PER_POS:
            per_pos = vector_sum(per_pos, [int(v) for v in metric.values])
    totals["accepted_per_pos"] = per_pos
    return totals


def vector_sum(a: list[int], b: list[int], sign: int = 1) -> list[int]:
    n = max(len(a), len(b))
    a, b = a + [0] * (n - len(a)), b + [0] * (n - len(b))
    return [x + sign * y for x, y in zip(a, b, strict=True)]


def delta(after: dict, before: dict) -> dict:
    out = {key: after[key] - before[key] for key in SPEC_COUNTERS.values()}
    out["accepted_per_pos"] = vector_sum(after["accepted_per_pos"], before["accepted_per_pos"], -1)
    return out


def add(into: dict, more: dict) -> dict:
    out = {key: into.get(key, 0) + more[key] for key in SPEC_COUNTERS.values()}
    out["accepted_per_pos"] = vector_sum(into.get("accepted_per_pos", []), more["accepted_per_pos"])
    return out


def rates(counters: dict) -> dict:
    drafts, tokens = counters["num_drafts"], counters["num_draft_tokens"]
    accepted = counters["num_accepted_tokens"]
    return {
        "acceptance_rate": accepted / tokens if tokens else None,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "acceptance_rate_per_pos": [a / drafts for a in counters["accepted_per_pos"]]
        if drafts
        else [],
    }


def run_engine(target: Path, spec: dict | None, prompt_ids: list[list[int]], max_tokens: int):
    """One upstream engine: the prompts as one batch, then one by one. Returns
    (batched outputs, batched counters, per-prompt outputs, per-prompt counters, extra)."""
    from vllm.inputs import TokensPrompt

    from vllm import LLM, SamplingParams

    kwargs = dict(
        model=str(target),
        dtype="float32",
        enforce_eager=True,
        skip_tokenizer_init=True,
        seed=0,
        max_model_len=512,
        max_num_seqs=len(prompt_ids),
        disable_log_stats=False,  # get_metrics() needs the stat loggers
    )
    if spec is not None:
        kwargs["speculative_config"] = spec
    started = time.monotonic()
    llm = LLM(**kwargs)
    extra = {"engine_start_s": round(time.monotonic() - started, 1)}
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        requests = [TokensPrompt(prompt_token_ids=p) for p in prompt_ids]
        before = spec_metrics(llm)
        results = llm.generate(requests, params, use_tqdm=False)
        batched_counters = delta(spec_metrics(llm), before)
        batched = [list(r.outputs[0].token_ids) for r in results]
        singles, single_counters = [], []
        for request in requests:
            before = spec_metrics(llm)
            result = llm.generate([request], params, use_tqdm=False)[0]
            single_counters.append(delta(spec_metrics(llm), before))
            singles.append(list(result.outputs[0].token_ids))
        if spec is not None and spec["method"] == "eagle3":
            try:
                # attrgetter: plain pickle can send it (not a function of this __main__)
                get = operator.attrgetter("model.aux_hidden_state_layers")
                extra["target_aux_hidden_state_layers"] = list(llm.apply_model(get)[0])
            except Exception as exc:  # informative only
                extra["target_aux_hidden_state_layers"] = f"unavailable: {exc!r}"
        return batched, batched_counters, singles, single_counters, extra
    finally:
        engine_core = getattr(llm.llm_engine, "engine_core", None)
        if engine_core is not None:
            try:
                engine_core.shutdown()
            except Exception as exc:
                print(f"engine shutdown: {exc!r}", file=sys.stderr)
        del llm
        gc.collect()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", required=True, type=Path)
    parser.add_argument(
        "--method",
        action="append",
        choices=["eagle", "eagle3"],
        help="only the variants of these methods (repeatable)",
    )
    parser.add_argument(
        "--variant",
        action="append",
        choices=sorted(VARIANTS),
        help="only these variants (repeatable)",
    )
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0, help="drafts' seed")
    parser.add_argument(
        "--noise",
        type=float,
        default=None,
        help="drafts' noise (default: eagle_checkpoints.DEFAULT_NOISE)",
    )
    parser.add_argument("--rebuild", action="store_true", help="rebuild every checkpoint")
    parser.add_argument("--min-rate", type=float, default=0.10)
    parser.add_argument("--max-rate", type=float, default=0.90)
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    out_dir = args.out_dir.resolve()
    json_out = args.json_out.resolve() if args.json_out else None
    names = [
        name
        for name, (method, _) in VARIANTS.items()
        if (not args.method or method in args.method) and (not args.variant or name in args.variant)
    ]
    if not names:
        parser.error("no variant selected")

    # stdout carries only the JSON: upstream logs to stdout (its worker processes too,
    # inheriting the file descriptor), so point fd 1 at stderr and keep a copy for us.
    json_stream = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    # The CPU build's defaults, kept small; a caller's environment wins.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    # One unbound OpenMP thread: a tiny model gains nothing from more, and spinning
    # threads slow to a crawl when other processes share the two cores.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # apply_model(aux_layers)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    isolate_from_repo()

    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    ec = load_checkpoints_module()
    out_dir.mkdir(parents=True, exist_ok=True)
    built = build(ec, out_dir, names, args.seed, args.noise, args.rebuild)

    import vllm

    if "site-packages" not in (vllm.__file__ or ""):
        raise RuntimeError(f"imported vllm from {vllm.__file__}, not upstream's")
    target = out_dir / "target"
    prompt_ids = prompts()
    report = {
        "upstream_vllm": getattr(vllm, "__version__", "?"),
        "k": args.k,
        "max_tokens": args.max_tokens,
        "sampling": {"temperature": 0.0, "ignore_eos": True, "max_tokens": args.max_tokens},
        "engine": {
            "dtype": "float32",
            "enforce_eager": True,
            "seed": 0,
            "max_model_len": 512,
            "skip_tokenizer_init": True,
            "max_num_seqs": len(prompt_ids),
        },
        "rate_bounds": [args.min_rate, args.max_rate],
        "prompts": prompt_ids,
        "target": {
            "path": str(target),
            "files_sha256": folder_hashes(target),
            "config": json.loads((target / "config.json").read_text()),
        },
        "variants": {},
        "failures": [],
    }
    print("baseline (no speculative decoding)", file=sys.stderr)
    base, _, base_singles, _, extra = run_engine(target, None, prompt_ids, args.max_tokens)
    report["baseline"] = {
        "outputs": base,
        "outputs_one_by_one_equal": base_singles == base,
        **extra,
    }
    if base_singles != base:
        report["failures"].append("baseline: batched and one-by-one outputs differ")

    for name in names:
        folder, method, options, reference = built[name]
        spec = {"method": method, "model": str(folder), "num_speculative_tokens": args.k}
        print(f"{name}: {spec}", file=sys.stderr)
        outputs, counters, singles, single_counters, extra = run_engine(
            target, spec, prompt_ids, args.max_tokens
        )
        summed = {}
        for c in single_counters:
            summed = add(summed, c)
        config = json.loads((folder / "config.json").read_text())
        entry = {
            "method": method,
            "draft": str(folder),
            "reference_draft": str(reference),
            "options": {k: v for k, v in options.items()},
            "draft_config": config,
            "files_sha256": folder_hashes(folder),
            "speculative_config": spec,
            **extra,
            "outputs": outputs,
            "metrics": counters,
            **rates(counters),
            "one_by_one": {
                "outputs_equal_batched": singles == outputs,
                "metrics": single_counters,
                "metrics_sum": summed,
                "metrics_sum_equal_batched": summed == counters,
            },
            "outputs_equal_baseline": outputs == base and singles == base,
        }
        rate = entry["acceptance_rate"]
        entry["rate_in_bounds"] = rate is not None and args.min_rate <= rate <= args.max_rate
        if not entry["outputs_equal_baseline"]:
            bad = [i for i, (o, b) in enumerate(zip(outputs, base, strict=True)) if o != b]
            report["failures"].append(f"{name}: outputs differ from the baseline for prompts {bad}")
        if not entry["rate_in_bounds"]:
            report["failures"].append(f"{name}: acceptance rate {rate} out of bounds")
        report["variants"][name] = entry
        print(
            f"{name}: acceptance {rate if rate is None else round(rate, 3)} "
            f"{counters} equal_baseline={entry['outputs_equal_baseline']}",
            file=sys.stderr,
        )

    text = json.dumps(report, indent=1)
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(text + "\n")
    json_stream.write(text + "\n")
    json_stream.flush()
    for failure in report["failures"]:
        print(f"FAIL {failure}", file=sys.stderr)
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
