"""A request that fails inside the engine gets an OpenAI-style 500; the others and the
server go on (issue 16).

The real app and AsyncLLM over a spawned fake engine core (``test_core_proc.FakeEngine``:
a prompt starting with POISON_TOKEN fails in its first step, as ``EngineCore`` reports a
request whose step raised). No debug hook can make the real model fail from outside, so
this is as far out as the test goes; the engine side is ``tests/v1/engine/
test_step_failure.py`` (fake runner) and ``test_step_failure_model.py`` (the real one).
"""

from __future__ import annotations

import asyncio
import gc
import json

import pytest
from prometheus_client import CollectorRegistry

from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints.openai.api_server import build_app
from vllm.entrypoints.openai.cli_args import FrontendArgs
from vllm.entrypoints.openai.run_batch import asgi_post as post  # the app in process
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.metrics.prometheus import PrometheusStatLogger

from ...v1.engine.test_core_proc import POISON_TOKEN, fake_engine_factory


@pytest.fixture(autouse=True)
def collect_garbage():
    yield
    gc.collect()  # see test_core_proc.collect_garbage


def serve(scenario) -> None:
    """``scenario(engine, app)`` over a started AsyncLLM of the fake engine core."""

    async def main() -> None:
        config = EngineArgs(num_gpu_blocks_override=32).create_engine_config(2048)
        stats = PrometheusStatLogger("m", registry=CollectorRegistry())
        engine = AsyncLLM(config, stat_loggers=[stats], engine_factory=fake_engine_factory)
        try:
            await engine.start()
            await scenario(engine, build_app(config, FrontendArgs(), engine, stats))
        finally:
            engine.shutdown()

    asyncio.run(main())


def test_a_request_failed_in_the_engine_is_a_500_and_the_server_goes_on():
    async def scenario(engine: AsyncLLM, app) -> None:
        ok = {"prompt": [1, 2], "max_tokens": 3}
        bad = {"prompt": [POISON_TOKEN, 2], "max_tokens": 3}
        (status, body), (ok_status, _) = await asyncio.gather(
            post(app, "/v1/completions", bad), post(app, "/v1/completions", ok)
        )
        assert status == 500 and ok_status == 200
        error = json.loads(body)["error"]
        assert error["type"] == "InternalServerError" and error["code"] == 500
        assert "poisoned" in error["message"]
        status, body = await post(app, "/v1/completions", {**bad, "stream": True})
        assert status == 200  # the stream had started: the error is in-band
        events = [line[6:] for line in body.decode().splitlines() if line.startswith("data:")]
        assert json.loads(events[0])["error"]["code"] == 500 and events[-1] == "[DONE]"
        assert (await post(app, "/v1/completions", ok))[0] == 200
        assert engine.is_alive and engine.num_unfinished_requests == 0

    serve(scenario)


def test_one_prompt_of_a_batch_failing_fails_the_batch_and_aborts_the_rest():
    # /v1/completions with a batch of prompts: one engine request each. One failing in
    # the engine is the whole response's error, and its siblings stop at once.
    async def scenario(engine: AsyncLLM, app) -> None:
        batch = {"prompt": [[1, 2], [POISON_TOKEN, 2], [3]], "max_tokens": 1000}
        status, body = await post(app, "/v1/completions", batch)
        assert status == 500 and "poisoned" in json.loads(body)["error"]["message"]
        assert engine.num_unfinished_requests == 0  # the others aborted, not run out
        status, body = await post(app, "/v1/completions", {**batch, "stream": True})
        events = [line[6:] for line in body.decode().splitlines() if line.startswith("data:")]
        assert status == 200 and events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == 500
        assert engine.num_unfinished_requests == 0
        ok = {"prompt": [[1, 2], [3]], "max_tokens": 3, "n": 2}
        status, body = await post(app, "/v1/completions", ok)
        reply = json.loads(body)
        assert status == 200 and [c["index"] for c in reply["choices"]] == [0, 1, 2, 3]
        assert reply["usage"] == {
            "prompt_tokens": 3, "completion_tokens": 12, "total_tokens": 15,
            "prompt_tokens_details": {"cached_tokens": 0},
        }  # fmt: skip
        assert engine.is_alive and engine.num_unfinished_requests == 0

    serve(scenario)
