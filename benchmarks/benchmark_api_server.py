"""The API server's own CPU per streamed token: what one `vllm serve` front end can carry.

`vllm serve` runs two processes: the engine core (scheduling, the model) and the API
server (HTTP, the chat template, detokenizing, one SSE chunk per engine output). On a GPU
the engine can outrun the API server: 256 requests decoding on the H200 produce ~20k
tokens a second (benchmarks.md), and a front end that spends 60 us of CPU on a token tops
out near 16k. This measures that CPU time where the engine is cheap: a one-layer, 64-wide
random Llama with SmolLM2's 49k-token vocabulary and tokenizer (`--load-format dummy`,
fp32), so detokenizing is real. ``--shape`` serves one of benchmark_gpu's shapes instead
(random weights made by the engine), e.g. on a GPU, where the question is whether one API
process keeps up with the engine: ``--shape llama-3.1-8b --dtype bfloat16 --serve-args
"--async-scheduling"``.

N concurrent streaming greedy chat completions (``ignore_eos``, ``--max-tokens`` each) go
through a lean client of raw HTTP/1.1 (no openai/httpx stack, which would cost as much CPU
as the server on a 2-core machine); it counts the SSE events and reads the usage. The API
server's and the engine core's CPU time (user + system, ``psutil``) over the run, divided
by the tokens streamed, are the figures (the CPU times tick at 10 ms: runs of a few
seconds, as here, make them exact to about 1%). "events/token" is SSE chunks per token: below 1
where a stream interval gathers tokens, or where the server merged outputs that a stream
had not yet sent (its reader behind).

    .venv/bin/python benchmarks/benchmark_api_server.py [--num-requests 64 256] [--repeats 3]
        [--stream-intervals 1 4 16]

``--stream-intervals``: each request asks that ``stream_interval`` (vLLM's: the first token
at once, then a chunk every K tokens, the rest at the end); several values run
interleaved against one server. ``--api-server-counts``: one server per value, with that
many API server processes (``vllm serve --api-server-count``); "API us/tok" is then the CPU
of all of them (and of the process that supervises them) per token. ``--upstream-venv``
(``make setup-upstream``'s virtualenv): upstream vLLM's server on the same model folder
and requests afterwards, its API process and engine core counted the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchmark_gpu  # noqa: E402

SHAPE = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
             head_dim=32, intermediate_size=64, vocab_size=49152, tie_word_embeddings=True,
             rope_theta=10000.0, rms_norm_eps=1e-5)  # fmt: skip
# The default shape, made in benchmark_gpu's way (its other shapes serve too: --shape).
benchmark_gpu.SHAPES.setdefault("api-tiny", SHAPE)
MODEL_DIR = Path("/tmp/vllm-api-server-model")
WORDS = "agent tool call shell file cache block token model queue job turn output".split()


async def read_chunked(reader: asyncio.StreamReader):
    """The body of a chunked HTTP/1.1 response, chunk by chunk."""
    while True:
        size = int((await reader.readline()).split(b";")[0], 16)
        if size == 0:
            await reader.readline()
            return
        data = await reader.readexactly(size + 2)
        yield data[:-2]


async def one_stream(port: int, body: bytes) -> tuple[int, int]:
    """One streaming chat completion over its own connection: (SSE events with a delta,
    the first one, the role's, not counted; completion tokens from the usage chunk)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    writer.write(head.encode() + body)
    await writer.drain()
    status = await reader.readline()
    if b" 200 " not in status:
        raise RuntimeError(f"server answered {status!r}: {await reader.read(2000)!r}")
    chunked = False
    while (line := await reader.readline()) not in (b"\r\n", b""):
        chunked |= line.lower().startswith(b"transfer-encoding: chunked")
    if not chunked:
        raise RuntimeError("expected a chunked SSE body")
    events = tokens = 0
    buf = b""
    async for data in read_chunked(reader):
        buf += data
        *complete, buf = buf.split(b"\n\n")
        for event in complete:
            if not event.startswith(b"data: ") or event == b"data: [DONE]":
                continue
            if b'"completion_tokens"' in event:
                tokens = json.loads(event[6:])["usage"]["completion_tokens"]
            if b'"delta":' in event:
                events += 1
    writer.close()
    return events - 1, tokens


async def run_streams(
    port: int, model: str, n: int, max_tokens: int, tag: str, interval: int
) -> tuple[int, int]:
    async def one(i: int) -> tuple[int, int]:
        words = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(24))
        body = json.dumps({
            "model": model, "messages": [{"role": "user", "content": f"{tag}{i}: {words}"}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "stream_interval": interval,
        }).encode()  # fmt: skip
        return await one_stream(port, body)

    got = await asyncio.gather(*(one(i) for i in range(n)))
    return sum(e for e, _ in got), sum(t for _, t in got)


def cpu_seconds(procs) -> float:
    """User + system CPU seconds of ``procs`` (threads included)."""
    return sum(t.user + t.system for t in (p.cpu_times() for p in procs))


def server_processes(server, is_engine) -> tuple[list, list]:
    """A server's processes, multiprocessing's resource tracker aside, as (the API side,
    the engine side): the engine side is the one process ``is_engine`` picks and its
    own children (upstream's CPU build runs the model in a Worker under its EngineCore),
    the API side all the others (a `vllm serve` process and the API servers it started)."""
    import psutil

    top = psutil.Process(server.proc.pid)
    tree = [p for p in (top, *top.children(recursive=True))
            if "resource_tracker" not in " ".join(p.cmdline())]  # fmt: skip
    roots = [p for p in tree if is_engine(p)]
    if len(roots) != 1:
        raise RuntimeError(f"no single engine core among {tree}")
    engine = [roots[0], *roots[0].children(recursive=True)]
    return [p for p in tree if p not in engine], engine


def engine_pid(log_path: Path) -> int:
    """Our engine core's pid, as the API server logs it once the engine is ready."""
    return int(re.search(r"Engine core ready: .*\(pid (\d+)\)", log_path.read_text()).group(1))


def measure(
    server, api, engine, n: int, max_tokens: int, tag: str, interval: int = 1, timeout_s=600.0
) -> dict:
    """One run of ``n`` streams; ``TimeoutError`` past ``timeout_s`` (a stalled server).
    ``api`` and ``engine``: lists of processes whose CPU is counted."""
    api0, engine0 = cpu_seconds(api), cpu_seconds(engine)
    start = time.perf_counter()
    streams = run_streams(server.port, "model", n, max_tokens, tag, interval)
    events, tokens = asyncio.run(asyncio.wait_for(streams, timeout_s))
    wall = time.perf_counter() - start
    api_s, engine_s = cpu_seconds(api) - api0, cpu_seconds(engine) - engine0
    if tokens != n * max_tokens:
        raise RuntimeError(f"{tokens} tokens streamed, expected {n * max_tokens}")
    return {
        "num_requests": n,
        "stream_interval": interval,
        "tokens": tokens,
        "wall_s": wall,
        "tok_per_s": tokens / wall,
        "api_us_per_token": api_s * 1e6 / tokens,
        "engine_us_per_token": engine_s * 1e6 / tokens,
        "api_busy": api_s / wall,
        "events_per_token": events / tokens,
    }


def run_counts(server, api, engine, count: int, args, results: dict, name="ours") -> None:
    """Every ``--num-requests`` on one server, the intervals interleaved; prints medians
    (the first column: the API server count, or the server's ``name`` if not ours)."""
    for n in args.num_requests:
        runs: dict[int, list[dict]] = {k: [] for k in args.stream_intervals}
        for r in range(args.repeats):  # interleaved: the machine's drift hits all alike
            for k in args.stream_intervals:
                runs[k].append(measure(server, api, engine, n, args.max_tokens,
                                       f"{count}.{n}.{k}.{r}.", k))  # fmt: skip
        for k, rows in runs.items():
            med = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
            results["rows"].append({"server": name, "api_server_count": count,
                                    "num_requests": n, "stream_interval": k, "median": med,
                                    "runs": rows})  # fmt: skip
            label = count if name == "ours" else name
            print(f"{label:>11} {n:>5} {k:>8} {med['tok_per_s']:>8.0f} "
                  f"{med['api_us_per_token']:>11.1f} {med['engine_us_per_token']:>14.1f} "
                  f"{med['api_busy']:>9.2f} {med['events_per_token']:>11.3f}",
                  flush=True)  # fmt: skip


def run_upstream(args, serve_args: list[str], results: dict) -> None:
    """Upstream vLLM's server, same model folder, limits and requests; its rows are
    labelled ``"server": "upstream"``. Its engine side is the child titled EngineCore
    and the Worker under it."""
    from vllm.benchmarks.upstream_server import UPSTREAM_BLOCK, UpstreamServer

    with tempfile.TemporaryDirectory() as tmp:
        log = Path(args.server_log or Path(tmp) / "upstream.log").with_name("upstream.log")
        # Its api_server module takes the model by --model (`vllm serve`'s positional).
        upstream_args = ["--model", *serve_args, "--block-size", str(UPSTREAM_BLOCK),
                         "--uvicorn-log-level", "warning"]  # fmt: skip
        server = UpstreamServer(args.upstream_venv, upstream_args, log)
        try:
            api, engine = server_processes(server, lambda p: "EngineCore" in " ".join(p.cmdline()))
            measure(server, api, engine, 8, 8, "warm.")
            run_counts(server, api, engine, 1, args, results, name="upstream")
        finally:
            server.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--stream-intervals", type=int, nargs="+", default=[1], metavar="K",
                    help="each request's stream_interval; several: interleaved runs")  # fmt: skip
    ap.add_argument("--api-server-counts", type=int, nargs="+", default=[1], metavar="N",
                    help="API server processes (--api-server-count); several: one server "
                    "each, in turn")  # fmt: skip
    ap.add_argument("--upstream-venv", type=Path, default=None,
                    help="also upstream vLLM's server, from this virtualenv")  # fmt: skip
    ap.add_argument("--json-out", type=Path, default=None)
    ap.add_argument("--model-dir", type=Path, default=MODEL_DIR, help="where the model is made")
    ap.add_argument(
        "--shape",
        default="api-tiny",
        choices=list(benchmark_gpu.SHAPES),
        help="the random model's shape (benchmark_gpu's), e.g. llama-3.1-8b on a GPU",
    )
    ap.add_argument("--dtype", default="float32", choices=list(benchmark_gpu.DTYPES))
    ap.add_argument("--serve-args", default="", help="more `vllm serve` flags, one string")
    ap.add_argument("--server-log", default=None)
    args = ap.parse_args(argv)
    if min(args.num_requests) < 1 or args.max_tokens < 2 or args.repeats < 1:
        ap.error("--num-requests >= 1, --max-tokens >= 2, --repeats >= 1")
    if min(args.stream_intervals) < 1:
        ap.error("--stream-intervals >= 1")
    if min(args.api_server_counts) < 1:
        ap.error("--api-server-counts >= 1")
    import torch

    from vllm.benchmarks.server import RemoteServer

    benchmark_gpu.write_config_dir(
        args.shape, args.model_dir, benchmark_gpu.default_tokenizer_dir()
    )
    top = max(args.num_requests)
    serve_args = [
        str(args.model_dir), "--served-model-name", "model", "--load-format", "dummy",
        "--dtype", args.dtype, "--max-model-len", "512", "--max-num-seqs", str(top),
        "--max-num-batched-tokens", str(max(2048, top * 64)), *shlex.split(args.serve_args),
    ]  # fmt: skip
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    machine = benchmark_gpu.machine_info(device)
    print(f"machine: {machine['device_name']} (host {machine['cpu']}, "
          f"{machine['cpu_count']} cores); {args.shape} {args.dtype}; "
          f"{args.max_tokens} tokens a stream", flush=True)  # fmt: skip
    results: dict = {"machine": machine, "args": {k: str(v) for k, v in vars(args).items()},
                     "rows": []}  # fmt: skip
    print(f"{'API servers':>11} {'N':>5} {'interval':>8} {'tok/s':>8} {'API us/tok':>11} "
          f"{'engine us/tok':>14} {'API busy':>9} {'events/tok':>11}")  # fmt: skip
    for count in args.api_server_counts:
        with tempfile.TemporaryDirectory() as tmp:
            log = Path(args.server_log or Path(tmp) / "server.log")
            with RemoteServer(*serve_args, "--api-server-count", str(count),
                              log_path=str(log)) as server:  # fmt: skip
                ours = engine_pid(log)
                api, engine = server_processes(server, lambda p, pid=ours: p.pid == pid)
                measure(server, api, engine, 8, 8, "warm.")
                run_counts(server, api, engine, count, args, results)
    if args.upstream_venv is not None:
        run_upstream(args, serve_args, results)
    if args.json_out:
        args.json_out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
