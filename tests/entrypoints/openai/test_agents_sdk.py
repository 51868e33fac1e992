"""The OpenAI Agents SDK (`openai-agents`), unmodified, drives Continuum through
/v1/responses: a three-tool agent's turns are one job (chained by
``previous_response_id``), pinned between turns, and its second turn hits the cache."""

from __future__ import annotations

import asyncio

import pytest

from .test_responses import INSTRUCTIONS, MODEL, server  # noqa: F401 - the module's server

pytestmark = pytest.mark.slow
agents = pytest.importorskip("agents")


def weather_agent(base_url: str, calls: list[tuple[str, str]]):
    from agents import Agent, ModelSettings, OpenAIResponsesModel, function_tool
    from openai import AsyncOpenAI

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        calls.append(("get_weather", city))
        return "Rain, 12 C"

    @function_tool
    def get_time(city: str) -> str:
        """Get the local time in a city."""
        calls.append(("get_time", city))
        return "14:05"

    @function_tool
    def get_population(city: str) -> str:
        """Get the population of a city."""
        calls.append(("get_population", city))
        return "2.1 million"

    client = AsyncOpenAI(base_url=base_url, api_key="EMPTY", max_retries=0, timeout=300)
    return Agent(
        name="weather",
        instructions=INSTRUCTIONS,
        tools=[get_weather, get_time, get_population],
        model=OpenAIResponsesModel(model=MODEL, openai_client=client),
        # The first turn must call get_weather (guided decoding holds it to the schema);
        # the SDK then resets tool_choice to auto, and the model answers.
        model_settings=ModelSettings(tool_choice="get_weather", temperature=0, max_tokens=40),
    )


def test_an_agents_sdk_agent_is_one_job_pinned_between_its_turns(server):  # noqa: F811
    from agents import Runner, set_tracing_disabled

    set_tracing_disabled(True)  # no export to OpenAI's tracing service
    calls: list[tuple[str, str]] = []
    agent = weather_agent(server.base + "/v1", calls)
    before = server.metrics()
    result = asyncio.run(
        Runner.run(
            agent, "What is the weather in Paris?", max_turns=4, auto_previous_response_id=True
        )
    )
    after = server.metrics()
    assert calls and calls[0][0] == "get_weather"
    turns = result.raw_responses
    assert len(turns) >= 2 and isinstance(result.final_output, str)
    first_id = turns[0].response_id
    # One job: every turn's request is logged under the chain's first response id.
    log = (server.out_dir / "server.log").read_text()
    assert log.count(f"job_id={first_id!r}") == len(turns)
    # Pinned between turns, and the next turn hit the pinned context.
    assert after["vllm:pins_total"] - before["vllm:pins_total"] >= 1
    assert after["vllm:pin_hits_total"] - before["vllm:pin_hits_total"] >= 1
    assert all(t.usage.input_tokens_details.cached_tokens > 0 for t in turns[1:])
