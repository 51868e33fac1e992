"""AsyncLLM against a spawned fake engine core: streaming, abort, engine failure."""

from __future__ import annotations

import asyncio
import gc
import pickle

import pytest

from vllm.engine.arg_utils import EngineArgs
from vllm.exceptions import GenerationError
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1.engine import EngineCoreOutputType, EngineCoreReady, encode_message
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.core_client import EngineDeadError

from .test_core_proc import ENDLESS_TOKEN, POISON_TOKEN, fake_engine_factory, inject


@pytest.fixture(autouse=True)
def collect_garbage():
    yield
    gc.collect()  # see test_core_proc.collect_garbage


def run(scenario, **engine_args) -> None:
    async def main() -> None:
        # 255 usable blocks of 16: room for the 2,000-token requests that must outlast
        # their test (a request that cannot fit the pool is refused up front).
        args = EngineArgs(num_gpu_blocks_override=256, **engine_args)
        config = args.create_engine_config(2048)
        engine = AsyncLLM(config, engine_factory=fake_engine_factory)
        try:
            await engine.start()
            await scenario(engine)
        finally:
            engine.shutdown()

    asyncio.run(main())


def params(max_tokens: int, delta: bool = True) -> SamplingParams:
    kind = RequestOutputKind.DELTA if delta else RequestOutputKind.FINAL_ONLY
    return SamplingParams(max_tokens=max_tokens, output_kind=kind, ignore_eos=True)


def test_generate_streams_deltas_and_times_the_engine():
    async def scenario(engine: AsyncLLM) -> None:
        outs = [o async for o in engine.generate([1, 2, 3], params(4), "r")]
        assert [len(o.outputs[0].token_ids) for o in outs] == [1, 1, 1, 1]
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
        stream = await engine.add_request([1, 2], params(2, delta=False), "s")
        final = [o async for o in stream]
        assert len(final) == 1 and final[0].outputs[0].token_ids == [7, 7]
        assert 0 < stream.engine_latency_s < 5
        await engine.add_request([1], params(1), "dup")
        with pytest.raises(ValueError, match="request_id"):
            await engine.add_request([1], params(1), "dup")

    run(scenario)


def test_closing_a_stream_aborts_the_request():
    async def scenario(engine: AsyncLLM) -> None:
        stream = await engine.add_request([ENDLESS_TOKEN, 2], params(2000), "long")
        await stream.__anext__()
        await stream.aclose()
        assert not engine.output_processor.has_unfinished_requests()
        # The engine dropped it: another request is served alone and finishes.
        outs = [o async for o in engine.generate([1], params(2), "next")]
        assert outs[-1].finished

    run(scenario)


def test_the_output_loop_ends_at_shutdown_even_when_a_cancel_is_swallowed():
    # Python 3.11's asyncio.wait_for returns the message instead of raising when a cancel
    # lands as it arrives: the loop must still stop, not recv on the closed sockets.
    async def main() -> None:
        config = EngineArgs(num_gpu_blocks_override=256).create_engine_config(2048)
        engine = AsyncLLM(config, engine_factory=fake_engine_factory)
        await engine.start()
        received = swallowed = 0

        async def recv_ignoring_a_cancel(timeout_s: float = 1.0):
            nonlocal received, swallowed
            received += 1
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed += 1  # as wait_for does when its future completed meanwhile
            return None

        engine.client.recv = recv_ignoring_a_cancel
        await asyncio.sleep(0.05)  # the loop is now in the replaced recv
        engine.shutdown()
        calls = received
        for _ in range(50):
            await asyncio.sleep(0.01)
        assert swallowed == 1 and engine._loop_task.done()
        assert received == calls  # no recv after shutdown

    asyncio.run(main())


def test_a_request_failed_in_the_engine_raises_generation_error_alone():
    async def scenario(engine: AsyncLLM) -> None:
        ok = await engine.add_request([1], params(3), "ok")
        bad = await engine.add_request([POISON_TOKEN], params(3), "bad")
        with pytest.raises(GenerationError, match="poisoned"):
            async for _ in bad:
                pass
        outs = [o async for o in ok]
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
        assert engine.is_alive and not engine.output_processor.has_unfinished_requests()
        assert engine.num_unfinished_requests == 0

    run(scenario)


def test_engine_failure_fails_pending_requests_and_health():
    async def scenario(engine: AsyncLLM) -> None:
        stream = await engine.add_request([1], params(2000), "explode")
        with pytest.raises(EngineDeadError, match="step exploded"):
            async for _ in stream:
                pass
        assert not engine.is_alive
        with pytest.raises(EngineDeadError):
            await engine.add_request([1], params(1), "after")

    run(scenario)


@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        ([b"\x7f", pickle.dumps(None)], "unknown EngineCoreOutputType"),
        (encode_message(EngineCoreOutputType.READY, EngineCoreReady(1, 1)), "unexpected READY"),
    ],
    ids=["unknown type", "READY again"],
)
def test_a_message_breaking_the_protocol_is_an_engine_error(frames, reason):
    async def scenario(engine: AsyncLLM) -> None:
        stream = await engine.add_request([ENDLESS_TOKEN], params(2000), "long")
        inject(engine.client.output_addr, frames)
        with pytest.raises(EngineDeadError, match=reason):
            async for _ in stream:
                pass
        assert not engine.is_alive

    run(scenario)


def test_a_reader_behind_the_engine_gets_what_arrived_meanwhile_as_one_output():
    async def scenario(engine: AsyncLLM) -> None:
        stream = await engine.add_request([1, 2, 3], params(6), "slow")
        first = await stream.__anext__()
        assert first.outputs[0].token_ids == [7]
        await asyncio.sleep(1.0)  # the engine finishes the other 5 steps meanwhile
        rest = [o async for o in stream]
        assert len(rest) == 1 and rest[0].finished  # five deltas, merged
        assert rest[0].outputs[0].token_ids == [7] * 5
        assert rest[0].outputs[0].finish_reason == "length"
        # Cumulative outputs: the newest replaces the ones not read.
        kind = RequestOutputKind.CUMULATIVE
        sampling = SamplingParams(max_tokens=4, output_kind=kind, ignore_eos=True)
        stream = await engine.add_request([1], sampling, "cumulative")
        await asyncio.sleep(1.0)
        outs = [o async for o in stream]
        assert len(outs) == 1 and outs[0].outputs[0].token_ids == [7] * 4

    run(scenario)


def test_an_error_is_not_merged_away():
    from vllm.outputs import CompletionOutput, RequestOutput
    from vllm.v1.engine.async_llm import RequestStream

    async def main() -> None:
        stream = RequestStream(None, "r", ["r"], [1], RequestOutputKind.DELTA)
        for text in "ab":
            stream.put(RequestOutput("r", None, [1], [CompletionOutput(0, text, [2])], False))
        stream.put(GenerationError("boom"))
        stream.put(RequestOutput("r", None, [1], [CompletionOutput(0, "c", [3])], True))
        merged = await stream.__anext__()
        assert merged.outputs[0].text == "ab" and merged.outputs[0].token_ids == [2, 2]
        stream._engine = _NoAbort()
        with pytest.raises(GenerationError):
            await stream.__anext__()

    asyncio.run(main())


class _NoAbort:
    async def abort(self, request_id: str) -> None:
        pass


def test_the_engines_stream_interval_gathers_tokens_and_a_request_may_raise_it():
    # --stream-interval 3 reaches the output processor: the first token at once, then
    # every 3, the rest at the end; a request's own interval of 4 raises it, 2 does not
    # lower it.
    async def scenario(engine: AsyncLLM) -> None:
        async def sizes(request_id: str, interval: int | None) -> list[int]:
            p = params(8)
            p.stream_interval = interval
            return [
                len(o.outputs[0].token_ids) async for o in engine.generate([1, 2], p, request_id)
            ]

        assert await sizes("a", None) == [1, 3, 3, 1]
        assert await sizes("b", 4) == [1, 4, 3]
        assert await sizes("c", 2) == [1, 3, 3, 1]

    run(scenario, stream_interval=3)


def test_utility_calls_answer_with_results_errors_and_a_dead_engine():
    async def scenario(engine: AsyncLLM) -> None:
        assert await engine.reset_prefix_cache() is True
        with pytest.raises(ValueError, match="no profiler here"):
            await engine.call_utility("profile", True)  # the engine goes on
        assert await engine.call_utility("reset_prefix_cache") is True
        # A method the engine does not offer breaks the protocol: the engine stops, and
        # the call fails as every pending request does.
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(engine.call_utility("shutdown"), 30)
        assert not engine.is_alive

    run(scenario)
