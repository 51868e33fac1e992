"""Run ab_benchmark over a list of loads, one fresh server per policy and load.

For each JPS value and each policy (interleaved, so that machine drift hits every policy
alike) a `vllm serve` starts on a free loopback port with the same KV pool and flags,
ab_benchmark plays the workload against it, and the result JSON lands in
`our_experiments/results/<machine>/<policy>_jps<jps>.json` (server logs in `logs/`).
A point whose file exists is skipped unless --force, so an interrupted sweep resumes; one
that exists from another workload (tool mix, seed, arrival window) stops the sweep.

    .venv/bin/python our_experiments/scripts/run_sweep.py --policies fcfs continuum \\
        --jps 0.02 0.04 0.06 0.08 --duration 120 --num-gpu-blocks 400

``--engine upstream`` runs the same points on upstream vLLM (its CPU build and our plugin
in ``--upstream-venv``, as ``make setup-upstream`` builds it), with the same KV pool in
blocks of 32 tokens (its CPU attention needs multiples of 32), the same step budget and
the job-fields middleware; results are named ``upstream-<policy>_jps<jps>.json``.

``--replicas N`` (N > 1) serves each point from N replicas behind vllm-router
(``vllm.benchmarks.router.ReplicaSet``, docs/router.md) with each ``--routing-policy``
(several are interleaved at each load): still one fresh start per point (N servers, one
router), each replica with ``--num-gpu-blocks`` blocks and one CPU thread. Jobs name
themselves by the ``X-Session-ID`` header (``--identity x-session-id``), which the router
routes by and each replica pins by, or also by the
router's Program identity (``--identity program_id``, required by ``--routing-policy
program``: the router's Program layer, ``--enable-program-scheduling``, over
consistent_hash, configured by ``program_scheduling_config`` with each replica's pool as its
token capacity, keys replaced by ``--program-config-json``). ``--router-arg`` passes more
flags to the router. The counters are summed over the replicas; the result also says which
replica served each turn (turns per replica, turns that moved replica) and each replica's
counters, and records the router's arguments ("router"). Results:
``<policy>+router<N>-<routing>_jps<jps>.json``.

    .venv/bin/python our_experiments/scripts/run_sweep.py --policies fcfs continuum \
        --replicas 2 --routing-policy consistent_hash --identity x-session-id --jps 0.04
    .venv/bin/python our_experiments/scripts/run_sweep.py --policies fcfs continuum \
        --replicas 2 --routing-policy consistent_hash round_robin cache_aware program \
        --identity program_id --jps 0.04 0.08 0.12
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time
from pathlib import Path

# Run as a file, this script sees only its own folder; the repository root makes
# `our_experiments` importable (vllm itself is installed).
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from our_experiments.scripts import ab_benchmark  # noqa: E402
from our_experiments.scripts.workload import IDENTITIES, ROOT, TOOL_MIXES, repo_relative  # noqa: E402
from vllm.benchmarks.router import (  # noqa: E402
    FAST_FAILOVER,
    PROGRAM_ROUTING,
    ROUTINGS,
    ReplicaSet,
    program_scheduling_config,
)
from vllm.benchmarks.server import RemoteServer  # noqa: E402
from vllm.benchmarks.upstream_server import (  # noqa: E402
    DEFAULT_VENV,
    UpstreamServer,
    upstream_engine_args,
    upstream_python,
)

RESULTS = ROOT / "our_experiments" / "results"


def default_machine() -> str:
    return f"cpu-{os.cpu_count()}core" if not _has_cuda() else "cuda"


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def result_path(out_dir: Path, policy: str, jps: float) -> Path:
    return out_dir / f"{policy}_jps{jps:g}.json"


# Study labels that are a policy with extra server flags (a label names the result files).
# An agent-aware policy's label may end in "-admission" / "-noadmission": job-level
# admission on / off (e.g. "continuum-admission", "context_serve-admission"). The first
# overload points ran with admission on by default, so their "continuum" files are the
# policy with admission; the 0.08 JPS study point ran without it.
ADMISSION_SUFFIX = re.compile(r"-(no)?admission$")
# A label may end in "+offload<k>x": the CPU KV tier sized at k times the engine's pool
# (--num-gpu-blocks blocks of --kv-block-bytes; at the default 400 blocks of SmolLM2's
# 720 KiB, 4x = 1.1 GiB, 16x = 4.4 GiB),
# e.g. "fcfs+offload4x" or "continuum-admission+offload16x"; or in "+autotier": the tier
# the engine sizes itself (--kv-offloading-size unset: for continuum and context_serve,
# the smaller of 16x the pool and half the free host memory). A label with neither runs
# without a tier (--kv-offloading-size 0), as every label did before the automatic tier.
OFFLOAD_SUFFIX = re.compile(r"\+(?:offload(\d+)x|autotier)$")
BLOCK_BYTES = 2 * 30 * 16 * 3 * 64 * 4  # SmolLM2: K and V, 30 layers, 16 tokens, 3 x 64, fp32
BLOCK_TOKENS = 16  # the server's default --block-size
ROUTER_IDENTITIES = ("x-session-id", "program_id")  # what the router can route by


UPSTREAM_PREFIX = "upstream-"


def upstream_server_args(args, policy: str) -> list[str]:
    """The same pool (in tokens), budget and limits as ``server_args`` on upstream."""
    return [
        *upstream_engine_args(
            args.num_gpu_blocks * 16, args.max_model_len, args.max_num_seqs, 2048, args.seed
        ),
        "--scheduling-policy", policy,
        "--middleware", "vllm_continuum.upstream.middleware.JobFieldsMiddleware",
        *args.server_arg,
    ]  # fmt: skip


def policy_flags(
    label: str, num_gpu_blocks: int, block_bytes: int = BLOCK_BYTES
) -> tuple[str, list[str]]:
    """A study label as ``--scheduling-policy``'s value and the extra server flags
    (``block_bytes``: one KV block of the served model, for ``+offload<k>x``)."""
    tier = OFFLOAD_SUFFIX.search(label)
    base = label[: tier.start()] if tier else label
    admission = ADMISSION_SUFFIX.search(base)
    name, extra = base, []
    if admission:
        name = base[: admission.start()]
        if name == "fcfs":
            raise ValueError(f"--policies: {label!r}: job admission is for agent-aware policies")
        extra = [
            "--no-continuum-job-admission" if admission.group(1) else "--continuum-job-admission"
        ]
    if tier is None:
        extra = [*extra, "--kv-offloading-size", "0"]
    elif tier.group(1) is not None:
        k = int(tier.group(1))
        if k < 1:
            raise ValueError(f"--policies: {label!r}: the tier must be at least 1x the pool")
        size_gib = k * num_gpu_blocks * block_bytes / 2**30
        extra = [*extra, "--kv-offloading-size", f"{size_gib:.3f}"]
    return name, extra


def server_args(args, policy: str) -> list[str]:
    name, extra = policy_flags(policy, args.num_gpu_blocks, args.kv_block_bytes)
    return [
        "--scheduling-policy",
        name,
        *extra,
        "--num-gpu-blocks-override",
        str(args.num_gpu_blocks),
        "--max-model-len",
        str(args.max_model_len),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--seed",
        str(args.seed),
        "--disable-log-requests",
        *args.server_arg,
    ]


def write_config(args, out_dir: Path) -> Path:
    """Record the sweep's arguments next to its results, paths relative to the repository.

    A resumed or extended sweep writes ``sweep_config.<n>.json`` rather than replace the
    record of the run that produced the earlier points.
    """
    config = {k: (repo_relative(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    config.update(cpu=platform.processor() or platform.machine(), started=time.ctime())
    path, n = out_dir / "sweep_config.json", 1
    while path.exists():
        n += 1
        path = out_dir / f"sweep_config.{n}.json"
    path.write_text(json.dumps(config, indent=1) + "\n")
    return path


def point_label(args, policy: str, routing: str | None = None) -> str:
    """A point's result name without the load: the policy, its engine, how jobs are named
    and, behind the router, how many replicas and which ``routing``."""
    label = policy if args.engine == "ours" else UPSTREAM_PREFIX + policy
    if args.identity == "prompt_cache_key":
        label += "+key"
    elif args.identity == "x-session-id" and args.replicas == 1:
        label += "+session"
    elif args.identity == "program_id" and args.replicas == 1:
        label += "+program_id"
    if args.replicas > 1:
        label += f"+router{args.replicas}-{routing}"
        if args.identity == "program_id" and routing != PROGRAM_ROUTING:
            label += "-pid"  # program routing implies it; the others default to the header
    return label


def routings(args) -> list[str | None]:
    """The routings of a sweep: ``--routing-policy`` behind a router, else none."""
    return list(args.routing_policy) if args.replicas > 1 else [None]


def program_config(args) -> dict | None:
    """The router's Program-scheduling config of a sweep with ``--routing-policy program``:
    each replica's pool (``--num-gpu-blocks`` blocks of 16 tokens) as its token capacity."""
    if PROGRAM_ROUTING not in routings(args):
        return None
    return program_scheduling_config(
        args.num_gpu_blocks * BLOCK_TOKENS, overrides=args.program_config_json
    )


def router_record(args, routing: str, fleet) -> dict:
    """What the result JSON records of the router in front of a point."""
    return {
        "replicas": args.replicas,
        "routing_policy": routing,
        "identity": args.identity,
        "router_args": fleet.router_args,
        "extra_router_args": args.router_arg,
        "program_scheduling": args.program_scheduling if routing == PROGRAM_ROUTING else None,
        "fast_failover": list(FAST_FAILOVER),
    }


def start_point(args, policy: str, log: Path, routing: str | None = None):
    """The fresh server(s) of one point: ``.base`` to send to, ``.stop()``."""
    if args.engine == "upstream":
        return UpstreamServer(args.upstream_venv, upstream_server_args(args, policy), log)
    if routing is not None:
        return ReplicaSet(
            args.replicas,
            server_args(args, policy),
            policy=routing,
            router_args=args.router_arg,
            log_dir=str(log.with_suffix("")),
            program_config=args.program_scheduling if routing == PROGRAM_ROUTING else None,
        )
    return RemoteServer(*server_args(args, policy), log_path=str(log))


# A fresh server compiles kernels as it meets new shapes (Triton specialises each kernel
# on its sizes; on a GPU machine the first server of a call finds the compile caches
# empty). Unwarmed, the first point of a GPU study paid it inside its measured window:
# its first 10 s ran 110-755 prompt tokens/s against 3,500-4,300 for the points after it
# (H200, docs/experiments.md), so it started behind and queued. The warm-up sends prompts
# of spread lengths (8 at once: mixed prefill batches), then the same prompts extended
# (prefills over cached contexts), outside the workload: the counters a result reports are
# deltas taken after it, and its prompts share no prefix with the workload's.
WARMUP_MAX_TOKENS = 8
WORD_TOKENS = 4  # at most, for a word "w<number>" and its space (SmolLM2's tokenizer: ~3.9)


def warmup_prompts(n: int, max_tokens: int) -> list[str]:
    """``n`` prompts of spread lengths, the longest at most about ``max_tokens`` tokens,
    distinct from their first word on."""
    longest = max(8, max_tokens // WORD_TOKENS)  # words
    return [
        f"warm-up {i}: " + " ".join(f"w{(i * 7919 + j) % 997}" for j in range(words))
        for i, words in enumerate(
            int(8 + (longest - 8) * (k / max(1, n - 1)) ** 2) for k in range(n)
        )
    ]


def warmup_tokens(args) -> int:
    """The longest warm-up prompt: a quarter of what one request may hold (the model's
    length or the whole pool), so that 8 at once fit beside one another."""
    return min(args.max_model_len, args.num_gpu_blocks * BLOCK_TOKENS) // 4


def warm_up(base_urls: list[str], n: int, max_tokens: int) -> float:
    """Send the warm-up to each server (see WARMUP_MAX_TOKENS; prompts of up to about
    ``max_tokens`` tokens); the seconds it took."""
    import asyncio

    import openai

    from vllm.benchmarks.utils import openai_base_url

    prompts = warmup_prompts(n, max_tokens)

    async def one_server(url: str) -> None:
        client = openai.AsyncOpenAI(base_url=openai_base_url(url), api_key="EMPTY", max_retries=0)
        model = (await client.models.list()).data[0].id
        limit = asyncio.Semaphore(8)

        async def send(prompt: str) -> None:
            async with limit:
                await client.completions.create(
                    model=model, prompt=prompt, max_tokens=WARMUP_MAX_TOKENS, temperature=0.0
                )

        for suffix in ("", " and then some more words to extend it"):
            await asyncio.gather(*(send(p + suffix) for p in prompts))
        await client.close()

    start = time.monotonic()
    for url in base_urls:
        asyncio.run(one_server(url))
    return time.monotonic() - start


def bench_args(args, base_url: str, policy: str, jps: float, out: Path) -> list[str]:
    argv = [
        "--base-url", base_url,
        "--policy", policy,
        "--jps", str(jps),
        "--duration", str(args.duration),
        "--turns", str(args.turns),
        "--max-tokens", str(args.max_tokens),
        "--seed", str(args.seed),
        "--drain-timeout", str(args.drain_timeout),
        "--tool-mix", args.tool_mix,
        "--output", str(out),
        "--identity", args.identity,
    ]  # fmt: skip
    return argv + (["--trace", str(args.trace)] if args.trace else [])


def make_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--policies", nargs="+", default=["fcfs", "continuum"])
    ap.add_argument("--jps", nargs="+", type=float, default=[0.02, 0.04, 0.06, 0.08])
    ap.add_argument("--duration", type=float, default=120.0)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--trace", type=Path, default=None)
    ap.add_argument("--tool-mix", choices=TOOL_MIXES, default="fork")
    ap.add_argument("--num-gpu-blocks", type=int, default=400, help="KV pool, blocks of 16")
    ap.add_argument("--max-model-len", type=int, default=6144)
    ap.add_argument(
        "--kv-block-bytes",
        type=int,
        default=BLOCK_BYTES,
        help="bytes of one KV block of the served model, which sizes +offload<k>x tiers "
        "(default: SmolLM2-135M's in fp32, 720 KiB)",
    )
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument(
        "--warmup-requests",
        type=int,
        default=16 if _has_cuda() else 0,
        help="prompts of spread lengths sent to each fresh server (twice: then extended) "
        "before the workload, so that no point pays for compiling kernels in its window "
        "(default: 16 where CUDA is present, 0 on a CPU, which compiles nothing at run time)",
    )
    ap.add_argument("--drain-timeout", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--machine", default=None, help="results subfolder (default: cpu-<n>core)")
    ap.add_argument("--results-dir", type=Path, default=RESULTS)
    ap.add_argument("--server-arg", action="append", default=[], help="extra `vllm serve` arg")
    ap.add_argument("--force", action="store_true", help="rerun points that have a result")
    ap.add_argument("--engine", choices=("ours", "upstream"), default="ours")
    ap.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="replicas behind vllm-router per point (1: one server, no router); the KV "
        "pool (--num-gpu-blocks) is per replica",
    )
    ap.add_argument(
        "--routing-policy",
        nargs="+",
        choices=ROUTINGS,
        default=["consistent_hash"],
        help="the router's --policy, or program: its Program layer "
        "(--enable-program-scheduling) over consistent_hash; several are interleaved at "
        "each load, as --policies are",
    )
    ap.add_argument(
        "--program-config-json",
        type=json.loads,
        default=None,
        help="with --routing-policy program: keys replacing those of our Program-scheduling "
        "config (vllm.benchmarks.router.program_scheduling_config), as a JSON object",
    )
    ap.add_argument(
        "--router-arg",
        action="append",
        default=[],
        help="one more vllm-router argument, recorded in the results (repeat: "
        "--router-arg=--cache-threshold --router-arg=0.9)",
    )
    ap.add_argument(
        "--identity",
        choices=IDENTITIES,
        default="job_id",
        help="how turns name their job: extra_body job_id, OpenAI's prompt_cache_key (results "
        "labelled <policy>+key), the X-Session-ID header, or program_id: the router's "
        "Program identity (vllm_xargs.agentic_context) plus that header",
    )
    ap.add_argument(
        "--upstream-venv",
        type=Path,
        default=DEFAULT_VENV,
        help="virtualenv with upstream vLLM and our plugin (make setup-upstream)",
    )
    return ap


def check_args(ap: argparse.ArgumentParser, args) -> None:
    """Refuse (``ap.error``) what cannot run, before any point starts."""
    if args.replicas < 1:
        ap.error(f"--replicas must be at least 1, got {args.replicas}")
    if args.warmup_requests < 0:
        ap.error(f"--warmup-requests must be at least 0, got {args.warmup_requests}")
    if args.replicas > 1 and (args.engine != "ours" or args.identity not in ROUTER_IDENTITIES):
        # The router hashes no body field of a chat request: with job_id or
        # prompt_cache_key alone every job would land on one replica.
        ap.error("--replicas > 1 needs --engine ours and --identity x-session-id or program_id")
    if PROGRAM_ROUTING in routings(args):
        if args.identity != "program_id":  # else no request opts in to the Program layer
            ap.error("--routing-policy program needs --identity program_id")
    elif args.program_config_json is not None:
        ap.error("--program-config-json needs --replicas > 1 and --routing-policy program")
    if args.router_arg and args.replicas == 1:
        ap.error("--router-arg needs --replicas > 1 (no router in front of one server)")
    if args.engine == "upstream":
        upstream_python(args.upstream_venv)


def workload_mismatch(result: dict, args) -> str | None:
    """How an existing point's workload differs from the one this sweep would play (its
    tool mix, seed or arrival window), or None: a resumed sweep skips only its own points,
    never, say, a fork-mix point of the same policy and load when it asks the guided mix.
    A field the result does not record (older results) is not compared."""
    wanted = {
        "tool_mix": None if args.trace else args.tool_mix,
        "seed": args.seed,
        "duration_s": args.duration,
    }
    diffs = [
        f"{key} {result[key]!r}, not {value!r}"
        for key, value in wanted.items()
        if key in result and result[key] != value
    ]
    return "; ".join(diffs) or None


def run_point(args, out_dir: Path, policy: str, jps: float, routing: str | None) -> None:
    """One point: fresh server(s), the workload, the result JSON (skipped if it exists)."""
    label = point_label(args, policy, routing)
    out = result_path(out_dir, label, jps)
    if out.exists() and not args.force:
        why = workload_mismatch(json.loads(out.read_text()), args)
        if why:
            raise SystemExit(
                f"{out} exists from another workload ({why}): --force replaces it, "
                "--machine gives this sweep's points a folder of their own"
            )
        print(f"skip {out.name} (exists)")
        return
    log = out_dir / "logs" / f"{label}_jps{jps:g}.log"
    server = start_point(args, policy, log, routing)
    argv = bench_args(args, server.base, label, jps, out)
    for replica in getattr(server, "replicas", ()):
        argv += ["--metrics-url", replica.base]
    try:
        if args.warmup_requests > 0:
            urls = [r.base for r in getattr(server, "replicas", ())] or [server.base]
            try:
                took = warm_up(urls, args.warmup_requests, warmup_tokens(args))
                print(f"{label} jps={jps:g}: warmed up in {took:.1f} s", flush=True)
            except Exception as e:  # the workload then meets the server as it is
                print(f"{label} jps={jps:g}: the warm-up failed: {e!r}", file=sys.stderr)
        result = ab_benchmark.main(argv)
        if routing is not None:
            result["router"] = router_record(args, routing, server)
            out.write_text(json.dumps(result, indent=1) + "\n")
    except SystemExit as e:  # a point that cannot run does not end the sweep
        print(f"{label} jps={jps:g}: {e}", file=sys.stderr)
    finally:
        server.stop()


def main() -> None:
    ap = make_parser()
    args = ap.parse_args()
    check_args(ap, args)
    args.program_scheduling = program_config(args)  # recorded in sweep_config too
    out_dir = args.results_dir / (args.machine or default_machine())
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    write_config(args, out_dir)
    for jps in args.jps:  # routings and policies interleaved at each load
        for routing in routings(args):
            for policy in args.policies:
                run_point(args, out_dir, policy, jps, routing)


if __name__ == "__main__":
    main()
