"""vLLM's queue limits (--max-num-queued-reqs, --max-num-queued-tokens): the counts kept by
the OutputProcessor, the checks, the shared count of several API servers, and AsyncLLM
refusing a request with nothing left behind."""

from __future__ import annotations

import asyncio
import gc
import multiprocessing

import pytest

from vllm.engine.arg_utils import EngineArgs
from vllm.exceptions import GenerationError, MaxQueuedTokensError, QueueOverflowError
from vllm.sampling_params import SamplingParams
from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest, FinishReason
from vllm.v1.engine.admission_control import AdmissionControl, SharedAdmissionStats
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.output_processor import OutputProcessor

from .test_core_proc import ENDLESS_TOKEN, POISON_TOKEN, fake_engine_factory

PROMPT = [1, 2, 3]  # 3 tokens


@pytest.fixture(autouse=True)
def collect_garbage():
    yield
    gc.collect()  # see test_core_proc.collect_garbage


def core(request_id: str, **params) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, list(PROMPT), SamplingParams(**params))


def counts(op: OutputProcessor) -> tuple[int, int]:
    return op.get_num_queued_requests(), op.get_num_queued_tokens()


def test_counts_follow_prefill_finish_and_abort(tokenizer):
    op = OutputProcessor(tokenizer)
    op.add_request("a", None, core("a"))
    op.add_request("b", None, [core("0_b"), core("1_b")])  # n=2 counts twice
    assert counts(op) == (3, 9)
    # A sample's first output ends its prefill: its prompt stops counting, not its slot.
    op.process_outputs([EngineCoreOutput("0_b", [5])])
    assert counts(op) == (3, 6)
    # A sample that finishes frees its slot alone; its sibling still counts.
    op.process_outputs([EngineCoreOutput("0_b", [5], finish_reason=FinishReason.LENGTH)])
    assert counts(op) == (2, 6)
    # Aborting b: only its unfinished, still prefilling sample is left to subtract.
    assert op.abort_request("b") == ["0_b", "1_b"]
    assert counts(op) == (1, 3)
    assert op.abort_request("b") == [] and counts(op) == (1, 3)  # twice: a no-op
    # Finished in its first output (an engine error, say): prefill and slot end together.
    op.process_outputs([EngineCoreOutput("a", [], finish_reason=FinishReason.ERROR)])
    assert counts(op) == (0, 0) and not op.has_unfinished_requests()


def test_a_stop_string_and_late_outputs_count_once(tokenizer):
    op = OutputProcessor(tokenizer)
    op.add_request("s", None, core("s", stop=["Hello"]))
    hello = tokenizer("Hello", add_special_tokens=False).input_ids
    results, to_stop = op.process_outputs([EngineCoreOutput("s", hello)])
    assert results[0].finished and to_stop == ["s"]
    assert counts(op) == (0, 0)
    op.process_outputs([EngineCoreOutput("s", [5], finish_reason=FinishReason.STOP)])
    assert counts(op) == (0, 0)  # the engine's own finish, after ours, changes nothing


def control(reqs=None, tokens=None, state=(0, 0), shared=None) -> tuple[AdmissionControl, list]:
    rejected: list[str] = []
    ac = AdmissionControl(reqs, tokens, lambda: state[0], lambda: state[1], shared, rejected.append)
    return ac, rejected


def test_request_limit_counts_n_and_token_limit_ignores_the_new_prompt():
    ac, rejected = control(reqs=4, state=(2, 0))
    ac.check(2)  # 2 + 2 <= 4
    with pytest.raises(QueueOverflowError) as e:
        ac.check(3)  # 2 + 3 > 4
    assert e.value.status == 503 and e.value.err_type == "Service Unavailable"
    assert rejected == ["max_num_queued_reqs"]

    ac, rejected = control(tokens=100, state=(0, 99))
    ac.check()  # 99 < 100, however long the new prompt
    ac, rejected = control(tokens=100, state=(0, 100))
    with pytest.raises(MaxQueuedTokensError):
        ac.check()
    assert rejected == ["max_num_queued_tokens"]

    ac, rejected = control(reqs=0, tokens=0)  # 0: nothing is admitted
    with pytest.raises(QueueOverflowError):
        ac.check()
    ac, rejected = control()  # no limits: never refuses
    ac.check(10**6)
    assert not ac.enabled and rejected == []


def test_several_api_servers_share_the_request_count():
    array = multiprocessing.get_context("spawn").RawArray("q", SharedAdmissionStats.num_counters(2))
    mine = [0, 0]
    servers = [
        control(reqs=3, state=mine, shared=SharedAdmissionStats(array, 2, i))[0] for i in range(2)
    ]
    mine[0] = 2
    servers[0].publish()
    assert servers[1].num_queued_requests() == 2
    servers[1].check(1)
    with pytest.raises(QueueOverflowError):
        servers[1].check(2)
    with pytest.raises(ValueError, match="client_index"):
        SharedAdmissionStats(array, 2, 2)


def test_config_refuses_a_negative_limit():
    with pytest.raises(ValueError, match="max_num_queued_reqs"):
        EngineArgs(max_num_queued_reqs=-1).create_engine_config(2048)


class FakeStatLogger:
    def __init__(self) -> None:
        self.rejections: list[str] = []

    def record(self, *args) -> None:
        pass

    def record_admission_rejection(self, reason: str) -> None:
        self.rejections.append(reason)


def run(scenario, **engine_args) -> None:
    async def main() -> None:
        args = EngineArgs(num_gpu_blocks_override=256, **engine_args)
        stats = FakeStatLogger()
        engine = AsyncLLM(args.create_engine_config(2048), [stats], fake_engine_factory)
        try:
            await engine.start()
            await scenario(engine, stats)
        finally:
            engine.shutdown()

    asyncio.run(main())


def params(max_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True)


def queued(engine: AsyncLLM) -> int:
    return engine.output_processor.get_num_queued_requests()


def test_async_llm_refuses_past_the_request_limit_and_leaves_nothing():
    async def scenario(engine: AsyncLLM, stats: FakeStatLogger) -> None:
        a = await engine.add_request([ENDLESS_TOKEN, 2], params(2000), "a")
        b = await engine.add_request([ENDLESS_TOKEN, 2], params(2000), "b")
        with pytest.raises(QueueOverflowError):
            await engine.add_request([1, 2], params(2), "c")
        assert stats.rejections == ["max_num_queued_reqs"]
        assert queued(engine) == 2 and engine.num_unfinished_requests == 2
        assert not engine.output_processor.child_ids("c")
        await a.aclose()  # an abort frees its slot at once
        assert queued(engine) == 1
        with pytest.raises(QueueOverflowError):  # n=2 needs two slots
            await engine.add_request([1], params(2, n=2), "c2")
        # Finished requests free theirs.
        outs = [o async for o in engine.generate([1], params(3), "c")]
        assert outs[-1].finished and queued(engine) == 1
        # A request failed in the engine frees its slot once its stream is closed.
        bad = await engine.add_request([POISON_TOKEN], params(3), "bad")
        with pytest.raises(GenerationError):
            async for _ in bad:
                pass
        assert queued(engine) == 1
        await b.aclose()
        outs = [o async for o in engine.generate([1], params(2, n=2), "d")]
        assert len(outs[-1].outputs) == 2 and queued(engine) == 0
        assert stats.rejections == ["max_num_queued_reqs"] * 2

    run(scenario, max_num_queued_reqs=2)


def test_async_llm_token_limit_counts_prompts_until_their_first_output():
    async def scenario(engine: AsyncLLM, stats: FakeStatLogger) -> None:
        long = await engine.add_request([ENDLESS_TOKEN, *range(2, 9)], params(2000), "long")
        # Almost always no output yet (the engine's round trip outlasts this); if the
        # first token already came, the rejection cannot be shown and is skipped.
        if engine.output_processor.get_num_queued_tokens() == 8:
            with pytest.raises(MaxQueuedTokensError):
                await engine.add_request([1], params(2), "refused")
            assert stats.rejections == ["max_num_queued_tokens"]
        await long.__anext__()  # its first token: its prefill is over
        assert engine.output_processor.get_num_queued_tokens() == 0
        outs = [o async for o in engine.generate([1], params(2), "after")]
        assert outs[-1].finished
        await long.aclose()
        assert queued(engine) == 0

    run(scenario, max_num_queued_tokens=8)
