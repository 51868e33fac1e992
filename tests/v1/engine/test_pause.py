"""vLLM's pause of generation (``pause`` / ``resume`` / ``is_paused``), on a tiny random
Llama on the CPU.

The engine core's contract is driven through ``EngineCore`` in process: "abort" ends the
requests in flight, "wait" lets the running ones finish, "keep" freezes them with their
blocks; requests sent while paused wait, and after the resume every request produces the
greedy tokens of an engine never paused. One test runs the engine process behind
``AsyncLLM`` and the development routes (``VLLM_SERVER_DEV_MODE=1``): streams ended or
frozen, the "wait" answer deferred until the drain, no busy loop while paused, /health
still 200, a shutdown while paused that does not hang.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import time

import pytest
from prometheus_client import CollectorRegistry

from tests.entrypoints.test_generation_config import tiny_model
from vllm import LLM, SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints.openai.api_server import build_app
from vllm.entrypoints.openai.cli_args import FrontendArgs
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine import EngineCoreOutputs, FinishReason
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.core import EngineCore
from vllm.v1.metrics.prometheus import PrometheusStatLogger

PROMPT = "The tide came in over the flats while the gulls argued"
NUM_BLOCKS = 32


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(autouse=True)
def collect_garbage():
    yield
    gc.collect()  # see test_core_proc.collect_garbage


def make_llm(model: str, **kwargs) -> LLM:
    return LLM(
        model, max_model_len=128, num_gpu_blocks_override=NUM_BLOCKS, enable_prefix_caching=True,
        **kwargs,
    )  # fmt: skip


def add(llm: LLM, request_id: str, max_tokens: int = 12, extra_args: dict | None = None) -> None:
    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, extra_args=extra_args
    )
    ids = llm.processor.tokenize(PROMPT, True)
    _, core_reqs = llm.processor.process(ids, params, request_id)
    for r in core_reqs:
        llm.engine_core.add_request(r)


def collect(outputs: EngineCoreOutputs, tokens: dict[str, list[int]]) -> dict[str, FinishReason]:
    """Adds the outputs' tokens to ``tokens``; the finish reasons of those that ended."""
    for o in outputs.outputs:
        tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    return {o.request_id: o.finish_reason for o in outputs.outputs if o.finished}


def drain(core: EngineCore, tokens: dict[str, list[int]] | None = None) -> dict[str, list[int]]:
    tokens = {} if tokens is None else tokens
    while core.has_unfinished_requests():
        collect(core.step(), tokens)
    return tokens


def reference(llm: LLM, max_tokens: int = 12) -> list[int]:
    """The greedy tokens of PROMPT on an engine not paused."""
    add(llm, "reference", max_tokens)
    return drain(llm.engine_core)["reference"]


def assert_idle_while_paused(core: EngineCore) -> dict[str, list[int]]:
    """Steps of a paused engine with nothing running compute nothing."""
    tokens: dict[str, list[int]] = {}
    assert core.is_paused() and not core.has_work()
    for _ in range(3):
        assert collect(core.step(), tokens) == {}
    assert tokens == {}
    return tokens


def test_abort_ends_the_requests_in_flight_and_queued_ones_run_after_resume(model):
    llm = make_llm(model)
    core = llm.engine_core
    try:
        expected = reference(llm)
        add(llm, "a", 40)
        add(llm, "b", 40)
        core.step()
        assert core.scheduler.kv_cache_manager.usage > 0
        finished = collect(core.pause("abort"), {})
        assert finished == {"a": FinishReason.ABORT, "b": FinishReason.ABORT}
        assert core.scheduler.requests == {} and core.pause_drained()
        assert core.scheduler.kv_cache_manager.block_pool.num_cached_blocks > 0
        core.finish_pause(clear_cache=True)
        assert core.scheduler.kv_cache_manager.block_pool.num_cached_blocks == 0
        add(llm, "late")  # accepted, queued
        assert_idle_while_paused(core)
        assert core.scheduler.kv_cache_manager.usage == 0.0
        core.resume()
        assert not core.is_paused()
        assert drain(core) == {"late": expected}
        core.scheduler.check_invariants()
    finally:
        llm.shutdown()


def test_wait_lets_the_running_requests_finish_then_clears_the_cache(model):
    llm = make_llm(model)
    core = llm.engine_core
    try:
        expected = reference(llm)
        add(llm, "running", 8)
        tokens: dict[str, list[int]] = {}
        collect(core.step(), tokens)
        assert collect(core.pause("wait"), tokens) == {}  # nothing ends
        add(llm, "late")
        assert not core.pause_drained() and core.has_work()
        finished = {}
        while core.has_work():
            finished |= collect(core.step(), tokens)
        assert finished == {"running": FinishReason.LENGTH}
        assert tokens["running"] == expected[:8] and "late" not in tokens
        assert core.pause_drained()
        assert core.scheduler.requests["late"].num_computed_tokens == 0
        core.finish_pause(clear_cache=True)
        assert core.scheduler.kv_cache_manager.block_pool.num_cached_blocks == 0
        assert_idle_while_paused(core)
        core.resume()
        assert drain(core)["late"] == expected
        core.scheduler.check_invariants()
    finally:
        llm.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_keep_freezes_the_running_requests_with_their_blocks(model, async_scheduling):
    llm = make_llm(model, async_scheduling=async_scheduling)
    core = llm.engine_core
    try:
        expected = reference(llm, 20)
        add(llm, "kept", 20)
        tokens: dict[str, list[int]] = {}
        for _ in range(3):
            collect(core.step(), tokens)
        collect(core.pause("keep"), tokens)  # the step on the device is finished first
        assert core._in_flight is None and core.pause_drained()
        usage = core.scheduler.kv_cache_manager.usage
        frozen = list(tokens["kept"])
        assert 0 < len(frozen) < 20
        core.finish_pause(clear_cache=True)  # ignored: the kept request holds its blocks
        add(llm, "late", 20)
        assert_idle_while_paused(core)
        assert tokens["kept"] == frozen and core.scheduler.kv_cache_manager.usage == usage
        core.resume()
        drain(core, tokens)
        assert tokens == {"kept": expected, "late": expected}
        core.scheduler.check_invariants()
        assert core.scheduler.kv_cache_manager.usage == 0.0
    finally:
        llm.shutdown()


def test_a_bad_mode_is_refused_and_aborts_free_blocks_while_paused(model):
    llm = make_llm(model, enable_sleep_mode=True)
    core = llm.engine_core
    try:
        with pytest.raises(ValueError, match="abort, wait, keep"):
            core.pause("later")
        assert not core.is_paused()
        add(llm, "kept", 40)
        core.step()
        core.pause("keep")
        add(llm, "queued")
        core.abort_requests(["kept", "queued"])  # their clients left
        assert core.scheduler.kv_cache_manager.usage == 0.0 and not core.has_unfinished_requests()
        core.scheduler.check_invariants()
        # Sleep while paused aborts what is held; waking up ends the pause too (vLLM's).
        add(llm, "kept", 40)
        core.sleep(1)
        assert core.scheduler.requests == {}
        assert core.wake_up() is True and not core.is_paused()
        core.pause("keep")
        add(llm, "late", 4)
        assert_idle_while_paused(core)
        assert core.wake_up() is True and not core.is_paused()  # not asleep: it resumes
        assert len(drain(core)["late"]) == 4
    finally:
        llm.shutdown()


def test_clear_cache_releases_continuums_pins(model):
    llm = make_llm(model, scheduling_policy="continuum", kv_offloading_size=0)
    core = llm.engine_core
    sched = core.scheduler
    try:
        add(llm, "turn-1", 4, {"job_id": "job", "is_last_step": False})
        drain(core)
        assert len(sched.pins) == 1 and sched.kv_cache_manager.usage > 0  # pinned
        core.pause("wait", clear_cache=False)
        assert core.pause_drained()
        core.finish_pause(clear_cache=False)
        assert len(sched.pins) == 1  # kept for the job's next turn
        core.pause("abort")
        core.finish_pause(clear_cache=True)
        assert len(sched.pins) == 0 and sched.kv_cache_manager.usage == 0.0
        assert sched.kv_cache_manager.block_pool.num_cached_blocks == 0
        core.resume()
        add(llm, "turn-2", 4, {"job_id": "job", "is_last_step": True})
        drain(core)
        sched.check_invariants()
        assert sched.kv_cache_manager.usage == 0.0
    finally:
        llm.shutdown()


# -- the engine process behind AsyncLLM, and the development routes ----------------------


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,
    )


class Stream:
    """A request read in a task: its tokens so far and its finish reason."""

    def __init__(self, engine: AsyncLLM, request_id: str, max_tokens: int) -> None:
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self.started = asyncio.Event()
        self.task = asyncio.create_task(self._read(engine, request_id, max_tokens))

    async def _read(self, engine: AsyncLLM, request_id: str, max_tokens: int) -> None:
        async for out in engine.generate(PROMPT, greedy(max_tokens), request_id):
            self.tokens += out.outputs[0].token_ids
            self.finish_reason = out.outputs[0].finish_reason
            self.started.set()

    async def done(self, timeout_s: float = 30) -> Stream:
        await asyncio.wait_for(self.task, timeout_s)
        return self


async def http(app, method: str, path: str, query: str = "") -> tuple[int, dict | str]:
    """One request to the ASGI ``app`` in this process: (status, the JSON or text body)."""
    scope = {
        "type": "http", "http_version": "1.1", "method": method, "path": path,
        "raw_path": path.encode(), "query_string": query.encode(), "scheme": "http",
        "root_path": "", "server": ("test", 0), "client": ("test", 0), "headers": [],
    }  # fmt: skip
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    await app(scope, receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    try:
        return status, json.loads(body)
    except json.JSONDecodeError:
        return status, body.decode()


def cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_pause_over_the_engine_process_and_the_routes(model, monkeypatch):
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")

    async def scenario(engine: AsyncLLM, app) -> None:
        expected = (await Stream(engine, "ref", 40).done()).tokens
        # abort: the stream in flight ends with finish_reason abort before /pause answers.
        a = Stream(engine, "a", 110)
        await a.started.wait()
        assert await http(app, "POST", "/pause") == (200, {"status": "paused"})
        assert a.task.done() and a.finish_reason == "abort"
        assert await http(app, "GET", "/is_paused") == (200, {"is_paused": True})
        # A request sent while paused waits; the idle engine neither spins nor looks hung.
        late = Stream(engine, "late", 40)
        pid = engine.client.proc.pid
        before, start = cpu_seconds(pid), time.monotonic()
        await asyncio.sleep(1.5)
        assert cpu_seconds(pid) - before < 0.5 * (time.monotonic() - start)
        assert engine.stalled_for() < 1.4  # the paused engine's stats keep coming
        assert await http(app, "GET", "/health") == (200, "")
        assert late.tokens == []
        assert await http(app, "POST", "/resume") == (200, {"status": "resumed"})
        assert (await late.done()).tokens == expected
        assert not await engine.is_paused()

        # wait: /pause answers once the running request has finished.
        w = Stream(engine, "w", 40)
        await w.started.wait()
        status, _ = await http(app, "POST", "/pause", "mode=wait&clear_cache=true")
        assert status == 200 and w.task.done() and w.tokens == expected
        queued = Stream(engine, "queued", 40)
        await asyncio.sleep(0.2)
        assert queued.tokens == []
        await engine.resume_generation()
        assert (await queued.done()).tokens == expected

        # keep: the stream freezes, and goes on after the resume as if never paused.
        k = Stream(engine, "k", 40)
        await k.started.wait()
        assert await http(app, "POST", "/pause", "mode=keep") == (200, {"status": "paused"})
        frozen = list(k.tokens)
        await asyncio.sleep(0.3)
        assert k.tokens == frozen and len(frozen) < 40 and not k.task.done()
        await engine.resume_generation()
        assert (await k.done()).tokens == expected

        # A resume before a "wait" pause has drained fails that pause.
        r = Stream(engine, "r", 110)
        await r.started.wait()
        pause = asyncio.create_task(engine.pause_generation("wait"))
        await asyncio.sleep(0)  # the pause is sent first
        await engine.resume_generation()
        with pytest.raises(ValueError, match="resumed before the pause completed"):
            await pause
        await r.done()

        status, body = await http(app, "POST", "/pause", "mode=later")
        assert status == 400 and "abort, wait, keep" in body["error"]["message"]
        with pytest.raises(VLLMValidationError):
            await engine.pause_generation("later")
        assert not await engine.is_paused()

        # Paused with a frozen and a queued request, the engine still shuts down at once.
        Stream(engine, "frozen", 110)
        await asyncio.sleep(0.1)
        await engine.pause_generation("keep")
        Stream(engine, "never", 10)

    async def main() -> None:
        args = EngineArgs(
            model=model, max_model_len=128, num_gpu_blocks_override=NUM_BLOCKS,
            enable_prefix_caching=True,
        )  # fmt: skip
        config = args.create_engine_config()
        stats = PrometheusStatLogger("m", registry=CollectorRegistry())
        engine = AsyncLLM(config, stat_loggers=[stats])
        try:
            await engine.start()
            await scenario(engine, build_app(config, FrontendArgs(), engine, stats))
        finally:
            start = time.monotonic()
            engine.shutdown()
            assert time.monotonic() - start < 5

    asyncio.run(main())
