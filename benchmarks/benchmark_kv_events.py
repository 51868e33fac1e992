"""What KV cache events (--kv-events-config) cost a scheduler step, against the same steps
without them, measured in one run.

A churning agent-like workload with fake model outputs: requests of distinct 512-token
prompts arrive every step, run 32 decode steps and finish, in a KV pool small enough that
every step evicts cached blocks; so each step records stored and removed blocks. With
events on, the step's batch goes to a ZeroMQ publisher thread (encoding and sending there,
under the same GIL) and a subscriber drains it, as a router would. Prints the median
microseconds per step (schedule + update) off and on, their ratio, and the events and bytes
published per step.

    .venv/bin/python benchmarks/benchmark_kv_events.py [--steps 300] [--repeats 5]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import threading
import time
from pathlib import Path

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchmark_gpu  # noqa: E402  (the machine's description)

from vllm.config import CacheConfig, KVEventsConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.clock import FakeClock  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher  # noqa: E402
from vllm.v1.core.sched.policy import create_policy  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

BLOCK = 16
PROMPT = 512
DECODE = 32
ARRIVALS = 2  # new requests per step


def build(events: bool, endpoint: str) -> Scheduler:
    kv_events = {"enable_kv_cache_events": True, "endpoint": endpoint} if events else None
    config = VllmConfig(
        cache_config=CacheConfig(block_size=BLOCK),
        scheduler_config=SchedulerConfig(
            max_num_seqs=64, max_num_batched_tokens=4096, max_model_len=4096
        ),
        kv_events_config=KVEventsConfig(kv_events),
    )
    clock = FakeClock()
    # ~24 requests' worth of blocks: the pool turns over every few steps.
    blocks = 24 * ((PROMPT + DECODE) // BLOCK + 1)
    return Scheduler(config, blocks, create_policy(config, lambda ids: "", clock), clock)


def run(events: bool, steps: int, endpoint: str) -> tuple[float, float, float]:
    """(median µs per step, events per step, bytes per step) of one fresh scheduler."""
    sched = build(events, endpoint)
    received = [0, 0]  # batches' events, bytes
    stop = threading.Event()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 50)
    sub.connect(endpoint.replace("*", "127.0.0.1"))

    def drain():
        while not stop.is_set():
            try:
                frames = sub.recv_multipart()
            except zmq.Again:
                continue
            received[0] += 1
            received[1] += len(frames[2])

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    time.sleep(0.2)  # the subscription reaches the publisher
    hasher = get_request_block_hasher(BLOCK)
    ids = itertools.count()
    times = []
    try:
        for _ in range(steps):
            for _ in range(ARRIVALS):
                i = next(ids)
                prompt = [(i * PROMPT + t) % 49000 + 100 for t in range(PROMPT)]
                params = SamplingParams(max_tokens=DECODE, ignore_eos=True)
                sched.add_request(Request(f"r{i}", prompt, params, block_hasher=hasher))
            t0 = time.perf_counter()
            so = sched.schedule()
            sampled = {r: [7] for r in so.num_scheduled_tokens}
            sched.update_from_output(so, ModelRunnerOutput(list(sampled), sampled))
            times.append(time.perf_counter() - t0)
        sched.shutdown()
        time.sleep(0.2)
    finally:
        stop.set()
        reader.join(2)
        ctx.destroy(linger=0)
    warm = times[steps // 5 :]  # after the pool first fills
    return statistics.median(warm) * 1e6, received[0] / steps, received[1] / steps


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    from vllm.entrypoints.utils import get_open_port

    print(f"# {benchmark_gpu.cpu_model()} ({benchmark_gpu.vector_extensions()})")
    print(f"# {ARRIVALS} arrivals/step, {PROMPT}-token prompts, {DECODE} decode steps each")
    off, on, batches, size = [], [], [], []
    for _ in range(args.repeats):  # interleaved: drift hits both alike
        endpoint = f"tcp://*:{get_open_port()}"
        off.append(run(False, args.steps, endpoint)[0])
        us, per_step, bytes_per_step = run(True, args.steps, endpoint)
        on.append(us)
        batches.append(per_step)
        size.append(bytes_per_step)
    a, b = statistics.median(off), statistics.median(on)
    print(f"step without events: {a:8.1f} us (median of {args.repeats} runs' medians)")
    print(f"step with events:    {b:8.1f} us  ratio {b / a:.3f}")
    print(f"published: {statistics.median(batches):.2f} batches/step, "
          f"{statistics.median(size):.0f} bytes/step")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
