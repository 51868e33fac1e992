"""``vllm bench latency`` and ``vllm bench throughput``: vLLM's offline benchmarks, the
engine in this process (``LLM``), with vLLM's flags, printed lines and JSON keys.

- **latency**: one batch of ``--batch-size`` random prompts of ``--input-len`` tokens,
  each generating ``--output-len`` (EOS ignored), ``--num-iters-warmup`` times untimed,
  then ``--num-iters`` times timed: the average and percentiles of a batch's latency.
- **throughput**: ``--num-prompts`` requests at once (``random``: ``--input-len`` tokens,
  ``--output-len`` out, drawn around them with ``--random-range-ratio``; or a ``custom``
  JSONL / local ``sharegpt`` file as ``vllm bench serve`` reads them): requests, total
  and output tokens per second.

Sampling is vLLM's for these benchmarks: temperature 1, top-p 1, EOS ignored. Every
other flag is an engine flag, as ``vllm serve`` takes it.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

from vllm.benchmarks.utils import percentile

PERCENTILES = (10, 25, 50, 75, 90, 99)


def add_latency_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--n", type=int, default=1, help="Sequences per prompt.")
    p.add_argument("--num-iters-warmup", type=int, default=10)
    p.add_argument("--num-iters", type=int, default=30)
    p.add_argument("--output-json", default=None, help="Write the results here (JSON).")
    _engine_args(p)


def add_throughput_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset-name", choices=("random", "custom", "sharegpt"), default="random")
    p.add_argument("--dataset-path", default=None)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--n", type=int, default=1, help="Sequences per prompt.")
    p.add_argument("--output-json", default=None, help="Write the results here (JSON).")
    _engine_args(p)  # its --seed seeds the dataset too


def _engine_args(p: argparse.ArgumentParser) -> None:
    from vllm.engine.arg_utils import EngineArgs

    EngineArgs.add_cli_args(p)


def _llm(args: argparse.Namespace):
    from dataclasses import fields

    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.llm import LLM

    engine = EngineArgs.from_cli_args(args)  # as vllm serve reads its flags
    return LLM(**{f.name: getattr(engine, f.name) for f in fields(engine)})


def _params(args, max_tokens: int):
    from vllm.sampling_params import SamplingParams

    return SamplingParams(
        n=args.n, temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=max_tokens
    )


def _check(args, names: tuple[str, ...]) -> None:
    for name in names:
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")


def latency(args: argparse.Namespace) -> dict[str, Any]:
    _check(args, ("input_len", "output_len", "batch_size", "n", "num_iters"))
    if args.num_iters_warmup < 0:
        raise ValueError("--num-iters-warmup must be >= 0")
    llm = _llm(args)
    vocab = len(llm.get_tokenizer())
    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randrange(min(vocab, 10_000)) for _ in range(args.input_len)]}
        for _ in range(args.batch_size)
    ]
    params = _params(args, args.output_len)

    def run() -> float:
        start = time.perf_counter()
        llm.generate(prompts, params)
        return time.perf_counter() - start

    for _ in range(args.num_iters_warmup):
        run()
    latencies = [run() for _ in range(args.num_iters)]
    result = {
        "avg_latency": statistics.fmean(latencies),
        "latencies": latencies,
        "percentiles": {str(p): percentile(latencies, p) for p in PERCENTILES},
    }
    print(f"Avg latency: {result['avg_latency']} seconds")
    for p in PERCENTILES:
        print(f"{p}% percentile latency: {result['percentiles'][str(p)]} seconds")
    _write(args.output_json, result)
    return result


def throughput(args: argparse.Namespace) -> dict[str, Any]:
    _check(args, ("input_len", "output_len", "num_prompts", "n"))
    if args.dataset_name != "random" and not args.dataset_path:
        raise ValueError(f"--dataset-name {args.dataset_name} needs --dataset-path")
    from vllm.benchmarks import serve

    llm = _llm(args)
    tokenizer = llm.get_tokenizer()
    if args.dataset_name == "random":
        samples = serve.random_requests(tokenizer, args.num_prompts, args.input_len,
                                        args.output_len, args.random_range_ratio, 0,
                                        args.seed or 0)  # fmt: skip
    elif args.dataset_name == "custom":
        samples = serve.custom_requests(tokenizer, args.dataset_path, args.num_prompts,
                                        args.output_len, args.seed or 0)  # fmt: skip
    else:
        samples = serve.sharegpt_requests(tokenizer, args.dataset_path, args.num_prompts,
                                          None, args.seed or 0)  # fmt: skip
    prompts = [s.prompt for s in samples]
    params = [_params(args, s.expected_output_len) for s in samples]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    total = prompt_tokens + output_tokens
    print(
        f"Throughput: {len(outputs) / elapsed:.2f} requests/s, {total / elapsed:.2f} total "
        f"tokens/s, {output_tokens / elapsed:.2f} output tokens/s"
    )
    print(f"Total num prompt tokens:  {prompt_tokens}")
    print(f"Total num output tokens:  {output_tokens}")
    result = {
        "elapsed_time": elapsed,
        "num_requests": len(outputs),
        "total_num_tokens": total,
        "total_num_output_tokens": output_tokens,
        "requests_per_second": len(outputs) / elapsed,
        "tokens_per_second": total / elapsed,
        "output_tokens_per_second": output_tokens / elapsed,
    }
    _write(args.output_json, result)
    return result


def _write(path: str | None, result: dict[str, Any]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=4)
