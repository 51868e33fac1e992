"""What disaggregated prefill (--kv-transfer-config) saves the decoding instance, measured
in one run on one machine.

Two engines of one model in this process: a producer (``kv_role`` kv_producer) and a
consumer (kv_consumer), as vLLM's routers pair them. For each prompt length the producer
prefills a fresh prompt (``max_tokens`` 1, ``do_remote_decode``); then the consumer's time
to its first token is measured twice on that prompt:

- **fetched**: the consumer fetches the producer's blocks over TCP, stores them in its
  tier, loads them and computes the last partial block (what P/D costs the decoder);
- **computed**: a plain engine computes the prompt itself (what a decoder without P/D, or
  a failed fetch under "recompute", pays).

Then a job's turns on one consumer: each turn's prompt is the previous one plus new tokens;
the consumer keeps the history (its prefix cache), so only the new blocks travel. Prints
medians, MB/s of the fetch, and the ratio computed / fetched.

    .venv/bin/python benchmarks/benchmark_pd.py [--lengths 256 1024 2048] [--repeats 3]
    (default: the embedded SmolLM2-135M, served as vllm serve serves it)
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark_gpu import cpu_model, vector_extensions  # noqa: E402

from vllm import LLM, SamplingParams  # noqa: E402

TCP = "TcpConnector"


def engines(args: argparse.Namespace) -> tuple[LLM, LLM, LLM]:
    kw = {
        "max_model_len": max(args.lengths) + 64,
        "num_gpu_blocks_override": args.blocks,
        "kv_offloading_size": args.tier_gib,
    }
    if args.model:
        kw["model"] = args.model
    producer = LLM(kv_transfer_config={"kv_connector": TCP, "kv_role": "kv_producer"}, **kw)
    consumer = LLM(kv_transfer_config={"kv_connector": TCP, "kv_role": "kv_consumer"}, **kw)
    plain = LLM(**kw)
    return producer, consumer, plain


def params(n: int = 1, **transfer) -> SamplingParams:
    extra = {"kv_transfer_params": transfer} if transfer else None
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, extra_args=extra)


def timed(llm: LLM, ids: list[int], sp: SamplingParams):
    start = time.perf_counter()
    out = llm.generate({"prompt_token_ids": ids}, sp, use_tqdm=False)[0]
    return time.perf_counter() - start, out


def prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    # Ordinary token ids (past the special ones), fresh each time: no prefix hit anywhere.
    return [rng.randrange(1000, vocab - 1000) for _ in range(length)]


def one_length(engs, rng, length: int, repeats: int, vocab: int) -> dict:
    producer, consumer, plain = engs
    connector = consumer.engine_core.kv_connector
    prefill, fetched, computed, mbps = [], [], [], []
    for _ in range(repeats):
        ids = prompt(rng, length, vocab)
        seconds, out = timed(producer, ids, params(1, do_remote_decode=True))
        prefill.append(seconds)
        before = connector.totals()
        seconds, _ = timed(consumer, ids, params(1, **out.kv_transfer_params))
        after = connector.totals()
        fetched.append(seconds)
        moved = after.bytes_received - before.bytes_received
        wait = after.fetch_seconds - before.fetch_seconds
        mbps.append(moved / 2**20 / wait if wait > 0 else float("nan"))
        producer.engine_core.step()  # the producer's loop takes the served hold back
        seconds, _ = timed(plain, ids, params(1))
        computed.append(seconds)
    return {
        "prefill": statistics.median(prefill),
        "fetched": statistics.median(fetched),
        "computed": statistics.median(computed),
        "mbps": statistics.median(mbps),
        "mib": moved / 2**20,
    }


def job_turns(engs, rng, turns: int, first: int, step: int, vocab: int) -> list[tuple]:
    producer, consumer, _ = engs
    connector = consumer.engine_core.kv_connector
    ids, rows = prompt(rng, first, vocab), []
    for turn in range(1, turns + 1):
        _, out = timed(producer, ids, params(1, do_remote_decode=True))
        before = connector.totals().blocks_received
        seconds, got = timed(consumer, ids, params(1, **out.kv_transfer_params))
        moved = connector.totals().blocks_received - before
        producer.engine_core.step()
        rows.append((turn, len(ids), (len(ids) - 1) // 16, moved, seconds))
        ids = ids + got.outputs[0].token_ids + prompt(rng, step, vocab)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded model")
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--turn-tokens", type=int, default=256, help="new tokens a turn")
    parser.add_argument("--blocks", type=int, default=1024, help="KV blocks of each engine")
    parser.add_argument(
        "--tier-gib", type=float, default=1.0, help="each engine's CPU KV tier (GiB)"
    )
    args = parser.parse_args(argv)
    print(f"# {cpu_model()} ({vector_extensions()}), two engines in one process")
    engs = engines(args)
    vocab = engs[0].get_tokenizer().vocab_size
    rng = random.Random(0)
    # Warm-up, not timed: kernels, threads, sockets, and the pages of the tiers and of the
    # receive buffers (first touched here, as in a server that has run a while).
    one_length(engs, rng, max(args.lengths), 2, vocab)
    print("prompt  producer prefill  consumer TTFT fetched  computed  computed/fetched  fetch")
    for length in args.lengths:
        r = one_length(engs, rng, length, args.repeats, vocab)
        print(
            f"{length:6d}  {r['prefill'] * 1e3:13.1f} ms  {r['fetched'] * 1e3:16.1f} ms  "
            f"{r['computed'] * 1e3:6.1f} ms  {r['computed'] / r['fetched']:15.1f}x  "
            f"{r['mib']:.1f} MiB at {r['mbps']:.0f} MB/s"
        )
    print(f"\na job's turns on one consumer (+{args.turn_tokens} tokens a turn):")
    print("turn  prompt tokens  prompt blocks  blocks fetched  consumer TTFT")
    for turn, n, blocks, moved, seconds in job_turns(
        engs, rng, args.turns, args.lengths[0], args.turn_tokens, vocab
    ):
        print(f"{turn:4d}  {n:13d}  {blocks:13d}  {moved:14d}  {seconds * 1e3:10.1f} ms")
    for llm in engs:
        llm.engine_core.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
