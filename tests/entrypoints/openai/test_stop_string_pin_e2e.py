"""A turn that ends on a stop string finishes in the engine as stopped, so Continuum pins
it like any other finished turn (ReAct-style agents send ``stop=["Observation:"]``).

The front end's detokenizer sees the stop string and tells the engine (STOP, not ABORT);
before, the engine aborted such a turn, skipped the policy, and never pinned it.
"""

from __future__ import annotations

import time

import pytest

from ...utils import RemoteServer

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
USAGE = "vllm:kv_cache_usage_perc"
SYSTEM = "You are a coding agent. Think, then reply with one ```bash``` block."


def wait_for_pin(server, timeout_s: float = 5.0) -> dict[str, float]:
    """The response left when the front end saw the stop string; the engine pins the
    turn when the STOP message arrives a moment later, and publishes its stats then."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = server.metrics()
        if m["vllm:num_pinned_requests"] > 0 or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def test_turn_ended_by_a_stop_string_is_pinned_through_the_tool_gap():
    server = RemoteServer(
        "--scheduling-policy", "continuum", "--continuum-default-ttl", "5",
        "--num-gpu-blocks-override", "128",
    )  # fmt: skip
    try:
        client = server.client()
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "List the files, then show README.md."},
        ]
        first = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=48,
            temperature=0,
            stop=["\n"],  # every line-based agent format ends its step on some marker
            extra_body={"job_id": "react", "is_last_step": False},
        )
        choice = first.choices[0]
        assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == "\n"
        m = wait_for_pin(server)
        assert m["vllm:pins_total"] == 1 and m["vllm:num_pinned_requests"] == 1
        usage = m[USAGE]
        assert usage > 0.0
        time.sleep(0.5)  # the tool runs: the blocks stay pinned
        assert server.metrics()[USAGE] == usage
        messages += [
            {"role": "assistant", "content": choice.message.content},
            {"role": "user", "content": "Output:\nREADME.md\nsetup.py"},
        ]
        second = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=8,
            temperature=0,
            extra_body={"job_id": "react", "is_last_step": True},
        )
        assert second.usage.prompt_tokens_details.cached_tokens >= 16
        m = server.metrics()
        assert m["vllm:pin_hits_total"] == 1 and m["vllm:num_pinned_requests"] == 0
        assert m[USAGE] == 0.0
    finally:
        server.stop()
