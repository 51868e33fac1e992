"""``vllm bench serve``: vLLM's online serving benchmark, against any OpenAI-compatible server.

The flags, the printed report and the saved JSON keep vLLM's names, so that a command
line or a script that reads its results works on both. Requests stream from a client of
their own (aiohttp, as vLLM's); each request's time to first token, the gaps between its
chunks (ITL) and its end-to-end latency are taken as chunks arrive, and its output token
count from the stream's final usage (``stream_options.include_usage``).

Datasets: ``random`` (prompts of random tokens of the tokenizer's vocabulary, each its
length drawn around ``--random-input-len``, with an optional shared prefix), ``custom``
(a JSONL file, a ``"prompt"`` a line, optionally ``"output_tokens"``) and ``sharegpt``
(a local ShareGPT JSON file: each conversation's first human turn, its first reply's
length as the output length). Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from vllm.benchmarks.utils import percentile, server_root

BACKENDS = {"openai": "/v1/completions", "vllm": "/v1/completions",
            "openai-chat": "/v1/chat/completions"}  # fmt: skip
METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class SampleRequest:
    prompt: str
    prompt_len: int
    expected_output_len: int


@dataclass
class RequestResult:
    success: bool = False
    generated_text: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)  # gaps between chunks, seconds
    latency: float = 0.0
    start_time: float = 0.0  # perf_counter at send
    error: str = ""


# -- datasets ---------------------------------------------------------------------------
def _vocab_ids(tokenizer) -> list[int]:
    special = set(tokenizer.all_special_ids)
    return [i for i in range(len(tokenizer)) if i not in special]


def random_requests(
    tokenizer, num: int, input_len: int, output_len: int, range_ratio: float,
    prefix_len: int, seed: int,
) -> list[SampleRequest]:  # fmt: skip
    """Prompts of random vocabulary tokens: each request's input and output lengths drawn
    uniformly in ``[len * (1 - r), len * (1 + r)]``, after a prefix all of them share.
    The text is the tokens decoded, then re-encoded and cut to the drawn length (a decode
    can merge tokens), so the server sees close to the asked length."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    if input_len < 1 or output_len < 1 or prefix_len < 0:
        raise ValueError("--random-input-len and --random-output-len must be >= 1")
    rng = random.Random(seed)
    vocab = _vocab_ids(tokenizer)
    prefix = [rng.choice(vocab) for _ in range(prefix_len)]

    def drawn(n: int) -> int:
        return max(
            1, rng.randint(math.floor(n * (1 - range_ratio)), math.ceil(n * (1 + range_ratio)))
        )

    out = []
    for _ in range(num):
        length, expected = drawn(input_len), drawn(output_len)
        ids = prefix + [rng.choice(vocab) for _ in range(length)]
        text = tokenizer.decode(ids)
        ids = tokenizer.encode(text, add_special_tokens=False)[: prefix_len + length]
        text = tokenizer.decode(ids)
        out.append(SampleRequest(text, len(ids), expected))
    return out


def prefix_repetition_requests(
    tokenizer, num: int, prefix_len: int, suffix_len: int, num_prefixes: int, output_len: int,
    seed: int,
) -> list[SampleRequest]:  # fmt: skip
    """vLLM's ``prefix_repetition`` dataset: ``num_prefixes`` random prefixes, each shared
    by ``num // num_prefixes`` prompts that go on with their own random suffix, shuffled
    (a prefix cache's workload: every group but its first prompt can hit). Tokens are
    random vocabulary ids, re-encoded as ``random_requests``' are."""
    if num_prefixes < 1 or num < num_prefixes:
        raise ValueError(
            f"--num-prompts ({num}) must be >= --prefix-repetition-num-prefixes "
            f"({num_prefixes}), which must be >= 1"
        )
    if prefix_len < 0 or suffix_len < 1 or output_len < 1:
        raise ValueError("--prefix-repetition-suffix-len and -output-len must be >= 1")
    rng = random.Random(seed)
    vocab = _vocab_ids(tokenizer)

    def text_of(n: int) -> str:  # n random tokens as text that encodes back to n tokens
        ids = tokenizer.encode(
            tokenizer.decode([rng.choice(vocab) for _ in range(n)]), add_special_tokens=False
        )[:n]
        return tokenizer.decode(ids)

    out = []
    for _ in range(num_prefixes):
        prefix = text_of(prefix_len) if prefix_len else ""
        for _ in range(num // num_prefixes):
            prompt = prefix + text_of(suffix_len)
            length = len(tokenizer.encode(prompt, add_special_tokens=False))
            out.append(SampleRequest(prompt, length, output_len))
    rng.shuffle(out)
    return out


def custom_requests(
    tokenizer, path: str, num: int, output_len: int, seed: int
) -> list[SampleRequest]:
    """A JSONL file: ``{"prompt": ..., "output_tokens": ...}`` a line (the second is
    optional: ``output_len`` otherwise); ``num`` of them, shuffled by ``seed``."""
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise ValueError(f'{path}:{n}: each line must be an object with a string "prompt"')
            rows.append(row)
    return _sampled(
        tokenizer, [(r["prompt"], int(r.get("output_tokens", output_len))) for r in rows], num, seed
    )


def sharegpt_requests(
    tokenizer, path: str, num: int, output_len: int | None, seed: int
) -> list[SampleRequest]:
    """A ShareGPT JSON file: each conversation's first turn, and its reply's length (in the
    tokenizer's tokens) as the output length unless ``output_len`` is given."""
    with open(path) as f:
        data = json.load(f)
    pairs = []
    for item in data:
        turns = item.get("conversations") or item.get("conversation") or []
        if len(turns) < 2:
            continue
        prompt, reply = turns[0].get("value", ""), turns[1].get("value", "")
        if not prompt:
            continue
        length = output_len or len(tokenizer.encode(reply, add_special_tokens=False))
        if length >= 4:  # as vLLM: too short a reply says nothing of decode
            pairs.append((prompt, length))
    return _sampled(tokenizer, pairs, num, seed)


def _sampled(tokenizer, pairs: list[tuple[str, int]], num: int, seed: int) -> list[SampleRequest]:
    if not pairs:
        raise ValueError("the dataset holds no usable request")
    rng = random.Random(seed)
    rng.shuffle(pairs)
    chosen = [pairs[i % len(pairs)] for i in range(num)]  # cycled when there are fewer
    return [SampleRequest(p, len(tokenizer.encode(p)), n) for p, n in chosen]


# -- the requests -----------------------------------------------------------------------
def request_body(args, backend: str, model: str, req: SampleRequest) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": req.expected_output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if backend == "openai-chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
        body["max_completion_tokens"] = body.pop("max_tokens")
    else:
        body["prompt"] = req.prompt
    body["temperature"] = 0.0 if args.temperature is None else args.temperature
    for name in ("top_p", "top_k", "min_p"):
        if getattr(args, name) is not None:
            body[name] = getattr(args, name)
    if args.ignore_eos:
        body["ignore_eos"] = True
    return {**body, **(args.extra_body or {})}


async def send_request(
    session, url: str, headers: dict, body: dict, req: SampleRequest
) -> RequestResult:
    """One streamed request; times taken as its chunks arrive."""
    result = RequestResult(prompt_len=req.prompt_len)
    chat = "messages" in body
    start = result.start_time = time.perf_counter()
    last = start
    chunks = 0
    try:
        async with session.post(url, json=body, headers=headers) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:500]}"
                return result
            buffer = b""
            async for data in response.content.iter_any():
                buffer += data
                *events, buffer = buffer.split(b"\n\n")
                for event in events:
                    line = event.strip()
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        continue
                    message = json.loads(payload)
                    if "error" in message:
                        result.error = json.dumps(message["error"])[:500]
                        return result
                    choices = message.get("choices")
                    if choices:  # as vLLM's client, every chunk of a choice is timed,
                        # its text empty or not (a special token, a split character)
                        now = time.perf_counter()
                        if chunks == 0:
                            result.ttft = now - start
                        else:
                            result.itl.append(now - last)
                        last = now
                        chunks += 1
                        choice = choices[0]
                        delta = choice.get("delta") or {}
                        piece = delta.get("content") if chat else choice.get("text")
                        result.generated_text += piece or ""
                    usage = message.get("usage")
                    if usage:
                        result.output_tokens = usage.get("completion_tokens", 0)
            result.latency = time.perf_counter() - start
            if not result.output_tokens:
                result.output_tokens = chunks  # a server that sends no usage
            result.success = chunks > 0 or result.output_tokens > 0
            if not result.success:
                result.error = "no output"
    except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash
        result.error = f"{type(e).__name__}: {e}"
    return result


def ramp_rate(strategy: str, start: float, end: float, index: int, num: int) -> float:
    """vLLM's ramp-up: request ``index``'s rate, from ``start`` (the first request's) to
    ``end`` (the last one's), linearly or geometrically in the request's position."""
    progress = index / max(num - 1, 1)
    if strategy == "linear":
        return start + (end - start) * progress
    return start * (end / start) ** progress


def arrival_gaps(
    num: int, rate: float, burstiness: float, seed: int,
    ramp: tuple[str, float, float] | None = None,
) -> list[float]:  # fmt: skip
    """Seconds to wait before each request: all at once for an infinite rate, otherwise
    gamma-distributed gaps of mean ``1 / rate`` (``burstiness`` 1: Poisson; lower: burstier).
    ``ramp`` (strategy, start, end): each gap's rate is ``ramp_rate``'s instead."""
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    if ramp is None and math.isinf(rate):
        return [0.0] * num
    if ramp is None and rate <= 0:
        raise ValueError(f"--request-rate must be > 0, got {rate}")
    rng = random.Random(seed)
    rates = [rate if ramp is None else ramp_rate(*ramp, i, num) for i in range(num)]
    return [rng.gammavariate(burstiness, 1.0 / (r * burstiness)) for r in rates]


async def run_requests(
    args, url: str, headers: dict, model: str, backend: str, samples: list[SampleRequest]
) -> tuple[list[RequestResult], float]:
    import aiohttp

    ramp = None
    if args.ramp_up_strategy is not None:
        ramp = (args.ramp_up_strategy, args.ramp_up_start_rps, args.ramp_up_end_rps)
    gaps = arrival_gaps(len(samples), args.request_rate, args.burstiness, args.seed, ramp)
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    timeout = aiohttp.ClientTimeout(total=6 * 60 * 60)
    progress = None
    if not args.disable_tqdm:
        from tqdm import tqdm

        progress = tqdm(total=len(samples))

    async def one(session, req: SampleRequest, index: int, bar=progress) -> RequestResult:
        body = request_body(args, backend, model, req)
        named = {**headers, "X-Request-Id": f"{args.request_id_prefix}{index}"}
        async with limit if limit is not None else contextlib.nullcontext():
            result = await send_request(session, url, named, body, req)
        if bar is not None:
            bar.update(1)
        return result

    connector = aiohttp.TCPConnector(limit=0, ssl=False if args.insecure else None)
    async with aiohttp.ClientSession(
        timeout=timeout, connector=connector, trust_env=True
    ) as session:
        if args.num_warmups:  # vLLM's: the first request, unmeasured, that many times
            print(f"Warming up with {args.num_warmups} requests...")
            warmups = [one(session, samples[0], -1 - i, None) for i in range(args.num_warmups)]
            failed = [r.error for r in await asyncio.gather(*warmups) if not r.success]
            if failed:
                raise RuntimeError(f"a warm-up request failed: {failed[0]}")
        root = server_root(url)
        if args.profile:
            await _profile(session, root + "/start_profile", headers)
        start = time.perf_counter()
        tasks = []
        for index, (gap, req) in enumerate(zip(gaps, samples, strict=True)):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(session, req, index)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        if args.profile:
            await _profile(session, root + "/stop_profile", headers)
    if progress is not None:
        progress.close()
    return list(results), duration


async def _profile(session, url: str, headers: dict) -> None:
    """--profile: POST the server's profiling route (it needs --profiler-config)."""
    async with session.post(url, headers=headers) as response:
        if response.status != 200:
            raise RuntimeError(
                f"{url}: HTTP {response.status} (start the server with --profiler-config)"
            )
    print(f"{url.rsplit('/', 1)[1]}: done")


# -- the figures ------------------------------------------------------------------------
def compute_metrics(
    results: Sequence[RequestResult], duration: float, percentiles: Sequence[float],
    selected: Sequence[str], goodput: dict[str, float] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """vLLM's result keys: counts, throughputs and, per metric, mean/median/std/pNN in ms.
    ``goodput`` (--goodput, SLOs in ms of ttft / tpot / e2el): ``request_goodput``, the
    completed requests per second that met every one (a one-token output's TPOT is 0)."""
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    values = {
        "ttft": [r.ttft for r in ok],
        "tpot": [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.latency for r in ok],
    }
    out: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": total_out / duration if duration else 0.0,
        "total_token_throughput": (total_in + total_out) / duration if duration else 0.0,
        **_peaks(ok),
    }
    if goodput:
        good = sum(all(_slo_value(r, name) * 1000 <= limit for name, limit in goodput.items())
                   for r in ok)  # fmt: skip
        out["request_goodput"] = good / duration if duration else 0.0
    for name in selected:
        ms = [v * 1000 for v in values[name]]
        out[f"mean_{name}_ms"] = statistics.fmean(ms) if ms else 0.0
        out[f"median_{name}_ms"] = statistics.median(ms) if ms else 0.0
        out[f"std_{name}_ms"] = statistics.pstdev(ms) if ms else 0.0
        for p in percentiles:
            out[f"p{_label(p)}_{name}_ms"] = percentile(ms, p) if ms else 0.0
    return out


def _slo_value(r: RequestResult, name: str) -> float:
    if name == "ttft":
        return r.ttft
    if name == "tpot":
        return (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
    return r.latency


def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """--goodput's KEY:VALUE pairs (ttft, tpot, e2el; milliseconds, >= 0); ``ValueError``
    naming the flag."""
    slos = {}
    for item in items:
        name, sep, value = item.partition(":")
        try:
            limit = float(value)
        except ValueError:
            limit = -1.0
        if not sep or name not in ("ttft", "tpot", "e2el") or limit < 0:
            raise ValueError(
                f"--goodput takes KEY:VALUE pairs, a metric (ttft, tpot, e2el) and its "
                f"limit in ms (>= 0), got {item!r}"
            )
        slos[name] = limit
    return slos


def _peaks(ok: Sequence[RequestResult]) -> dict[str, float]:
    """The most output tokens in one wall-clock second, and the most requests in flight at
    once (vLLM's "peak" lines); tokens are placed at their chunks' arrival times."""
    if not ok:
        return {"max_output_tokens_per_s": 0.0, "max_concurrent_requests": 0}
    t0 = min(r.start_time for r in ok)
    per_second: dict[int, float] = {}
    events = []
    for r in ok:
        times = [r.start_time + r.ttft]
        for gap in r.itl:
            times.append(times[-1] + gap)
        share = r.output_tokens / len(times)  # a chunk may carry several tokens
        for t in times:
            per_second[int(t - t0)] = per_second.get(int(t - t0), 0.0) + share
        events += [(r.start_time, 1), (r.start_time + r.latency, -1)]
    running = peak = 0
    for _, step in sorted(events):
        running += step
        peak = max(peak, running)
    return {"max_output_tokens_per_s": max(per_second.values()), "max_concurrent_requests": peak}


def _label(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def report(metrics: dict[str, Any], selected: Sequence[str], percentiles: Sequence[float]) -> str:
    names = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
             "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}  # fmt: skip
    lines = [
        "{s:{c}^50}".format(s=" Serving Benchmark Result ", c="="),
        f"{'Successful requests:':<40}{metrics['completed']:<10}",
        f"{'Failed requests:':<40}{metrics['failed']:<10}",
        f"{'Benchmark duration (s):':<40}{metrics['duration']:<10.2f}",
        f"{'Total input tokens:':<40}{metrics['total_input_tokens']:<10}",
        f"{'Total generated tokens:':<40}{metrics['total_output_tokens']:<10}",
        f"{'Request throughput (req/s):':<40}{metrics['request_throughput']:<10.2f}",
        *(
            [f"{'Request goodput (req/s):':<40}{metrics['request_goodput']:<10.2f}"]
            if "request_goodput" in metrics
            else []
        ),  # fmt: skip
        f"{'Output token throughput (tok/s):':<40}{metrics['output_throughput']:<10.2f}",
        f"{'Peak output token throughput (tok/s):':<40}{metrics['max_output_tokens_per_s']:<10.2f}",
        f"{'Peak concurrent requests:':<40}{metrics['max_concurrent_requests']:<10}",
        f"{'Total token throughput (tok/s):':<40}{metrics['total_token_throughput']:<10.2f}",
    ]
    for name in selected:
        upper = name.upper()
        lines.append("{s:{c}^50}".format(s=f" {names[name]} ", c="-"))
        lines.append(f"{f'Mean {upper} (ms):':<40}{metrics[f'mean_{name}_ms']:<10.2f}")
        lines.append(f"{f'Median {upper} (ms):':<40}{metrics[f'median_{name}_ms']:<10.2f}")
        for p in percentiles:
            label = _label(p)
            lines.append(f"{f'P{label} {upper} (ms):':<40}{metrics[f'p{label}_{name}_ms']:<10.2f}")
    lines.append("=" * 50)
    return "\n".join(lines)


# -- the command ------------------------------------------------------------------------
def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--backend",
        choices=sorted(BACKENDS),
        default="openai",
        help="openai / vllm: /v1/completions; openai-chat: /v1/chat/completions.",
    )
    p.add_argument("--base-url", default=None, help="The server's URL (else --host and --port).")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default=None, help="The API path (default: the backend's).")
    p.add_argument(
        "--model", default=None, help="The served model (default: the first /v1/models lists)."
    )
    p.add_argument("--tokenizer", default=None, help="The tokenizer (default: the model's).")
    p.add_argument(
        "--served-model-name",
        default=None,
        help="The name the requests give as their model (default: --model's).",
    )
    p.add_argument(
        "--dataset-name",
        choices=("random", "custom", "sharegpt", "prefix_repetition"),
        default="random",
    )
    p.add_argument(
        "--dataset-path", default=None, help="The custom (JSONL) or ShareGPT (JSON) file."
    )
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--random-prefix-len", type=int, default=0)
    p.add_argument("--custom-output-len", type=int, default=256)
    p.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    p.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    p.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    p.add_argument("--prefix-repetition-output-len", type=int, default=128)
    p.add_argument("--sharegpt-output-len", type=int, default=None)
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Requests per second (Poisson, shaped by --burstiness); inf: all at once.",
    )
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument(
        "--ramp-up-strategy",
        choices=("linear", "exponential"),
        default=None,
        help="vLLM's: the request rate goes from --ramp-up-start-rps (the first request's) to "
        "--ramp-up-end-rps (the last one's) over the run, instead of --request-rate.",
    )
    p.add_argument("--ramp-up-start-rps", type=float, default=None)
    p.add_argument("--ramp-up-end-rps", type=float, default=None)
    p.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="KEY:VALUE",
        help="Service-level objectives in ms (ttft, tpot, e2el), e.g. 'ttft:500 tpot:50': "
        "also report the requests per second that met all of them.",
    )
    p.add_argument(
        "--num-warmups", type=int, default=0, help="Unmeasured requests sent first (vLLM's)."
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="Profile the run: POST /start_profile before it and /stop_profile after (the "
        "server needs --profiler-config).",
    )
    p.add_argument(
        "--request-id-prefix",
        default=f"bench-{uuid.uuid4().hex[:8]}-",
        help="Each request's X-Request-Id is this and its position.",
    )
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--temperature", type=float, default=None, help="Default 0 (greedy).")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument(
        "--extra-body",
        type=json.loads,
        default=None,
        help='More request fields, a JSON object (e.g. \'{"job_id": "j1"}\').',
    )
    p.add_argument(
        "--header",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="A request header (repeatable). OPENAI_API_KEY, if set, is the bearer token.",
    )
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl")
    p.add_argument("--metric-percentiles", default="99")
    p.add_argument("--save-result", action="store_true")
    p.add_argument("--result-dir", default=None)
    p.add_argument("--result-filename", default=None)
    p.add_argument("--label", default=None)
    p.add_argument(
        "--append-result",
        action="store_true",
        help="Append the result as one JSON line to the result file (else it is rewritten).",
    )
    p.add_argument(
        "--save-detailed",
        action="store_true",
        help="Keep each request's lengths, times, text and error in the result file.",
    )
    p.add_argument(
        "--metadata",
        nargs="+",
        default=None,
        metavar="KEY=VALUE",
        help="More fields for the result file (the machine, the commit...).",
    )
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument(
        "--insecure", action="store_true", help="Do not verify an HTTPS server's certificate."
    )
    p.add_argument(
        "--ready-check-timeout-sec",
        type=int,
        default=0,
        help="Wait up to this long for the server's /health first (0: do not).",
    )


def _check(args) -> tuple[list[str], list[float]]:
    selected = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    unknown = [m for m in selected if m not in METRICS]
    if unknown:
        raise ValueError(f"--percentile-metrics: unknown {unknown}; choose from {list(METRICS)}")
    try:
        percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    except ValueError:
        raise ValueError(
            f"--metric-percentiles: numbers, got {args.metric_percentiles!r}"
        ) from None
    if any(not 0 < p <= 100 for p in percentiles):
        raise ValueError("--metric-percentiles must be in (0, 100]")
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    if args.ramp_up_strategy is not None:
        if not math.isinf(args.request_rate):
            raise ValueError("--ramp-up-strategy sets the rate: leave --request-rate out")
        start, end = args.ramp_up_start_rps, args.ramp_up_end_rps
        if start is None or end is None:
            raise ValueError("--ramp-up-strategy needs --ramp-up-start-rps and --ramp-up-end-rps")
        if start <= 0 or end <= 0:
            raise ValueError("--ramp-up-start-rps and --ramp-up-end-rps must be > 0")
    if args.num_warmups < 0:
        raise ValueError("--num-warmups must be >= 0")
    for item in args.metadata or ():
        if "=" not in item:
            raise ValueError(f"--metadata takes KEY=VALUE, got {item!r}")
    if args.dataset_name not in ("random", "prefix_repetition") and not args.dataset_path:
        raise ValueError(f"--dataset-name {args.dataset_name} needs --dataset-path")
    if args.extra_body is not None and not isinstance(args.extra_body, dict):
        raise ValueError("--extra-body must be a JSON object")
    return selected, percentiles


def _headers(args) -> dict[str, str]:
    headers = {}
    key = os.environ.get("OPENAI_API_KEY")
    if key:
        headers["Authorization"] = f"Bearer {key}"
    for item in args.header:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ValueError(f"--header must be KEY=VALUE, got {item!r}")
        headers[name.strip()] = value.strip()
    return headers


def _served_model(root: str, headers: dict, verify: bool) -> str:
    import requests

    r = requests.get(root + "/v1/models", headers=headers, timeout=30, verify=verify)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def _wait_ready(root: str, timeout_s: int, verify: bool) -> None:
    import requests

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(requests.RequestException):
            if requests.get(root + "/health", timeout=2, verify=verify).status_code == 200:
                return
        time.sleep(1)
    raise RuntimeError(f"the server at {root} was not ready within {timeout_s} s")


def main(args: argparse.Namespace) -> int:
    """Run the benchmark; 0 if any request succeeded (1: none did)."""
    selected, percentiles = _check(args)
    goodput = parse_goodput(args.goodput) if args.goodput else None
    headers = _headers(args)
    root = server_root(args.base_url or f"http://{args.host}:{args.port}")
    verify = not args.insecure
    if args.ready_check_timeout_sec > 0:
        _wait_ready(root, args.ready_check_timeout_sec, verify)
    model = args.model or _served_model(root, headers, verify)
    from vllm.transformers_utils.tokenizer import get_tokenizer

    tokenizer = get_tokenizer(args.tokenizer or model)
    if args.dataset_name == "random":
        samples = random_requests(tokenizer, args.num_prompts, args.random_input_len,
                                   args.random_output_len, args.random_range_ratio,
                                   args.random_prefix_len, args.seed)  # fmt: skip
    elif args.dataset_name == "prefix_repetition":
        samples = prefix_repetition_requests(
            tokenizer, args.num_prompts, args.prefix_repetition_prefix_len,
            args.prefix_repetition_suffix_len, args.prefix_repetition_num_prefixes,
            args.prefix_repetition_output_len, args.seed,
        )  # fmt: skip
    elif args.dataset_name == "custom":
        samples = custom_requests(tokenizer, args.dataset_path, args.num_prompts,
                                   args.custom_output_len, args.seed)  # fmt: skip
    else:
        samples = sharegpt_requests(tokenizer, args.dataset_path, args.num_prompts,
                                     args.sharegpt_output_len, args.seed)  # fmt: skip
    url = root + (args.endpoint or BACKENDS[args.backend])
    rate = args.request_rate
    if args.ramp_up_strategy is not None:
        rate = (f"{args.ramp_up_strategy} ramp-up from {args.ramp_up_start_rps} to "
                f"{args.ramp_up_end_rps}")  # fmt: skip
    served = args.served_model_name or model
    print(f"Benchmarking {served} at {url}: {len(samples)} requests, rate {rate}, "
          f"max concurrency {args.max_concurrency}")  # fmt: skip
    results, duration = asyncio.run(run_requests(args, url, headers, served, args.backend, samples))
    metrics = compute_metrics(results, duration, percentiles, selected, goodput)
    print(report(metrics, selected, percentiles))
    errors = [r.error for r in results if not r.success]
    if errors:
        print(f"{len(errors)} requests failed; the first: {errors[0]}", file=sys.stderr)
    if args.save_result or args.append_result:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        name = (
            args.result_filename
            or f"{args.label or args.backend}-{args.request_rate}qps-{stamp}.json"
        )
        path = os.path.join(args.result_dir or ".", name)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        record = {
            "date": stamp, "backend": args.backend, "label": args.label, "model_id": model,
            "tokenizer_id": args.tokenizer or model, "num_prompts": args.num_prompts,
            "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
            "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
            **dict(item.split("=", 1) for item in args.metadata or ()),
            **metrics,
        }  # fmt: skip
        if args.ramp_up_strategy is not None:
            record.update(ramp_up_strategy=args.ramp_up_strategy,
                          ramp_up_start_rps=args.ramp_up_start_rps,
                          ramp_up_end_rps=args.ramp_up_end_rps)  # fmt: skip
        if args.save_detailed:  # vLLM's: per request, only when asked
            record.update(
                input_lens=[r.prompt_len for r in results],
                output_lens=[r.output_tokens for r in results],
                ttfts=[r.ttft for r in results],
                itls=[r.itl for r in results],
                generated_texts=[r.generated_text for r in results],
                errors=[r.error for r in results],
            )
        if args.append_result:  # one JSON line per run
            with open(path, "a") as f:
                f.write(json.dumps(record) + "\n")
        else:
            with open(path, "w") as f:
                json.dump(record, f, indent=2)
        print(f"Results: {path}")
    return 0 if metrics["completed"] else 1
