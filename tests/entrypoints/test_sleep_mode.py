"""Sleep mode offline (``LLM(enable_sleep_mode=True)``), on a tiny random Llama on the CPU.

Level 1 frees the KV cache (the weights stay: the CPU has nothing to move them to), level 2
the weights too, reloaded from the checkpoint by ``wake_up``; greedy outputs after waking
equal those before. The engine core's own contract (requests in flight aborted, requests
sent while asleep waiting) is driven through ``EngineCore`` directly.
"""

from __future__ import annotations

import gc
import weakref

import pytest

from tests.entrypoints.test_generation_config import tiny_model
from vllm import LLM, SamplingParams
from vllm.v1.engine import FinishReason

PROMPTS = ["The tide came in over the flats while the gulls argued", "1, 2, 3,"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
NUM_BLOCKS = 32


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return tiny_model(tmp_path_factory.mktemp("tiny"))


def make_llm(model: str, **kwargs) -> LLM:
    return LLM(
        model, max_model_len=128, num_gpu_blocks_override=NUM_BLOCKS, enable_prefix_caching=True,
        **kwargs,
    )  # fmt: skip


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def assert_kv_freed(llm: LLM) -> None:
    core = llm.engine_core
    assert core.model_runner.kv_caches == []
    assert core.model_runner.decode_graphs is None
    pool = core.scheduler.kv_cache_manager.block_pool
    assert pool.num_cached_blocks == 0  # the prefix cache was reset
    assert core.scheduler.kv_cache_manager.usage == 0.0
    core.scheduler.check_invariants()


def assert_kv_back(llm: LLM) -> None:
    kv = llm.engine_core.model_runner.kv_caches
    assert len(kv) == 2 and all(t.shape[1] == NUM_BLOCKS for t in kv)  # as many blocks


def test_sleep_is_refused_without_the_flag(model):
    llm = make_llm(model)
    try:
        with pytest.raises(ValueError, match="--enable-sleep-mode"):
            llm.sleep(1)
        assert not llm.is_sleeping()
        assert llm.engine_core.model_runner.kv_caches  # nothing was freed
    finally:
        llm.shutdown()


def test_level_1_frees_the_kv_cache_and_keeps_the_outputs(model):
    llm = make_llm(model, enable_sleep_mode=True)
    try:
        before = tokens(llm)
        assert llm.engine_core.scheduler.kv_cache_manager.block_pool.num_cached_blocks > 0
        weights = llm.engine_core.model_runner.model
        kv_ref = weakref.ref(llm.engine_core.model_runner.kv_caches[0])
        llm.sleep(level=1)
        gc.collect()
        assert kv_ref() is None  # the cache's storage is gone
        assert_kv_freed(llm)
        assert llm.engine_core.model_runner.model is weights  # on the CPU: kept in place
        assert llm.is_sleeping()
        with pytest.raises(ValueError, match="sleeping"):
            llm.generate(PROMPTS, GREEDY)
        assert llm.engine_core.scheduler.requests == {}  # the refusal queued nothing
        assert llm.wake_up() is True
        assert not llm.is_sleeping()
        assert_kv_back(llm)
        assert tokens(llm) == before
    finally:
        llm.shutdown()


@pytest.mark.parametrize("load_format", ["auto", "dummy"])
def test_level_2_reloads_the_weights(model, load_format):
    llm = make_llm(model, enable_sleep_mode=True, load_format=load_format)
    try:
        runner = llm.engine_core.model_runner
        before = tokens(llm)
        weight_ref = weakref.ref(next(runner.model.parameters()))
        llm.sleep(level=2)
        gc.collect()
        assert runner.model is None and weight_ref() is None  # the weights are gone
        assert_kv_freed(llm)
        with pytest.raises(ValueError, match="tags"):
            llm.wake_up(["bogus"])
        # One tag at a time: still asleep until both are back; the kernels are warmed up
        # and the CUDA graphs captured (none on the CPU) only once both are.
        calls = []
        runner.capture_model = lambda: calls.append("capture")
        assert llm.wake_up(["weights"]) is False
        assert runner.model is not None and runner.kv_caches == [] and calls == []
        assert llm.is_sleeping()
        assert llm.wake_up(["kv_cache"]) is True
        assert calls == ["capture"]
        assert runner.attn_backend is not None
        assert_kv_back(llm)
        assert tokens(llm) == before
    finally:
        llm.shutdown()


def add(llm: LLM, request_id: str, max_tokens: int = 40) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = llm.processor.tokenize(PROMPTS[0], True)
    _, core_reqs = llm.processor.process(ids, params, request_id)
    for r in core_reqs:
        llm.engine_core.add_request(r)


def test_sleep_aborts_requests_in_flight_and_queued_ones_wait(model):
    llm = make_llm(model, enable_sleep_mode=True)
    core = llm.engine_core
    try:
        add(llm, "running")
        add(llm, "waiting")
        core.step()
        assert core.scheduler.kv_cache_manager.usage > 0
        out = core.sleep(1)
        finished = {o.request_id: o.finish_reason for o in out.outputs if o.finished}
        assert finished == {"running": FinishReason.ABORT, "waiting": FinishReason.ABORT}
        assert core.scheduler.requests == {}
        assert_kv_freed(llm)
        # A request sent while asleep waits: no step runs it, nothing is allocated.
        add(llm, "late", max_tokens=3)
        for _ in range(3):
            assert core.step().outputs == []
        assert core.has_unfinished_requests() and core.scheduler.kv_cache_manager.usage == 0
        assert core.wake_up() is True
        new_tokens = []
        while core.has_unfinished_requests():
            new_tokens += [t for o in core.step().outputs for t in o.new_token_ids]
        assert len(new_tokens) == 3
        core.scheduler.check_invariants()
        assert core.scheduler.kv_cache_manager.usage == 0.0
    finally:
        llm.shutdown()


def test_level_0_pauses_scheduling_only(model):
    llm = make_llm(model, enable_sleep_mode=True)
    try:
        before = tokens(llm)
        llm.sleep(level=0)
        assert llm.is_sleeping() and llm.engine_core.model_runner.kv_caches  # nothing freed
        assert llm.engine_core.scheduler.kv_cache_manager.block_pool.num_cached_blocks > 0
        assert llm.wake_up(["scheduling"]) is True
        assert tokens(llm) == before
    finally:
        llm.shutdown()
