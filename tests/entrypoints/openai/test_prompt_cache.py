"""The OpenAI API's own prompt-caching fields drive Continuum: ``prompt_cache_key`` names
the job when no ``job_id`` is sent, ``prompt_cache_options.ttl`` (and breakpoints' ttls) is
a floor on the turn's pin, ``prompt_cache_retention`` says whether the host-memory tier
may keep the context. Values we cannot honour are 400s naming the field."""

from __future__ import annotations

import time

import openai
import pytest

from vllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from vllm.exceptions import VLLMValidationError

from ...utils import RemoteServer

MODEL = "SmolLM2-135M-Instruct"


def chat(messages=None, **fields) -> ChatCompletionRequest:
    messages = messages or [{"role": "user", "content": "hi"}]
    return ChatCompletionRequest.model_validate({"messages": messages, **fields})


def extra(req) -> dict:
    return req.to_sampling_params(max_tokens=8, logprobs=None, stream=False).extra_args or {}


def test_prompt_cache_key_names_the_job_and_a_job_id_wins():
    assert extra(chat(prompt_cache_key="conv-1"))["job_id"] == "conv-1"
    assert extra(chat(prompt_cache_key="conv-1", job_id="j"))["job_id"] == "j"
    assert extra(chat(prompt_cache_key="k", vllm_xargs={"job_id": "x"}))["job_id"] == "x"
    assert "job_id" not in extra(chat())
    completion = CompletionRequest.model_validate({"prompt": "hi", "prompt_cache_key": "c"})
    assert extra(completion)["job_id"] == "c"


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"prompt_cache_key": ""}, "prompt_cache_key"),
        ({"prompt_cache_key": 5}, "prompt_cache_key"),
        ({"prompt_cache_options": {"ttl": "forever"}}, "prompt_cache_options.ttl"),
        ({"prompt_cache_options": {"ttl": "0m"}}, "prompt_cache_options.ttl"),
        ({"prompt_cache_options": {"mode": "explicit"}}, "prompt_cache_options.mode"),
        ({"prompt_cache_options": {"ttl": "30m", "size": 3}}, "prompt_cache_options"),
        ({"prompt_cache_retention": "7d"}, "prompt_cache_retention"),
    ],
)
def test_values_we_cannot_honour_are_refused_naming_the_field(fields, param):
    with pytest.raises((VLLMValidationError, ValueError)) as info:
        extra(chat(**fields))
    assert param in str(info.value) or getattr(info.value, "param", None) == param


def test_ttls_become_a_pin_floor_and_retention_a_tier_hint():
    got = extra(chat(prompt_cache_options={"ttl": "30m"}, prompt_cache_retention="in_memory"))
    assert (got["cache_ttl_s"], got["cache_retention"]) == (1800.0, "in_memory")
    assert "cache_ttl_s" not in extra(chat(prompt_cache_options={"mode": "implicit"}))
    assert extra(chat(prompt_cache_options={"ttl": "90s"}))["cache_ttl_s"] == 90.0


def test_breakpoints_are_accepted_and_their_longest_ttl_is_the_floor():
    parts = [
        {"type": "text", "text": "system rules", "prompt_cache_breakpoint": {"mode": "explicit"}},
        {
            "type": "text",
            "text": " more",
            "prompt_cache_breakpoint": {"mode": "explicit", "ttl": "12h"},
        },
    ]
    req = chat([{"role": "user", "content": parts}], prompt_cache_options={"mode": "explicit"})
    assert req.messages[0].content == "system rules more"
    assert extra(req)["cache_ttl_s"] == 12 * 3600.0
    inherit = chat([{"role": "user", "content": parts[:1]}], prompt_cache_options={"ttl": "30m"})
    assert extra(inherit)["cache_ttl_s"] == 1800.0
    bad = [{"type": "text", "text": "x", "prompt_cache_breakpoint": {"mode": "sometimes"}}]
    with pytest.raises(ValueError, match="prompt_cache_breakpoint"):  # a 400 on the server
        chat([{"role": "user", "content": bad}])
    assert "prompt_cache_breakpoint" in parts[0]  # the caller's messages are left as given
    with pytest.raises(ValueError, match="explicit"):  # a completion has no parts
        CompletionRequest.model_validate(
            {"prompt": "hi", "prompt_cache_options": {"mode": "explicit"}}
        )


# -- end to end, with the official client's own keyword arguments --------------------------

SYSTEM = (
    "You are a coding agent. Reply with exactly one ```bash``` block holding one "
    "command.\nExample:\n```bash\nls\n```"
)
TURNS = ["List the files in the project.", "Show main.py.", "Check git status."]


def run_job(client, **identity) -> list[int]:
    """Three turns with tool outputs between them; the cached tokens of each turn."""
    messages = [{"role": "system", "content": SYSTEM}]
    cached = []
    for i, task in enumerate(TURNS):
        messages.append({"role": "user", "content": task})
        resp = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=16, temperature=0, **identity
        )
        cached.append(resp.usage.prompt_tokens_details.cached_tokens)
        messages.append({"role": "assistant", "content": resp.choices[0].message.content})
        messages.append({"role": "user", "content": f"Output:\nfile{i}.py\nREADME.md"})
        time.sleep(0.3)  # the tool runs
    return cached


@pytest.mark.slow
def test_an_agent_sending_only_prompt_cache_key_gets_the_pins_of_a_job_id():
    # Continuum pins only named jobs: without the key as the job, nothing would be pinned.
    args = ("--scheduling-policy", "continuum", "--continuum-default-ttl", "5")
    with RemoteServer(*args) as server:
        client = server.client()
        by_key = run_job(client, prompt_cache_key="conversation-1")
        m = server.metrics()
        pins, hits = m["vllm:pins_total"], m["vllm:pin_hits_total"]
        assert pins >= 2 and hits == 2 and all(c > 0 for c in by_key[1:])
        by_job = run_job(client, extra_body={"job_id": "conversation-2"})
        m = server.metrics()
        assert m["vllm:pin_hits_total"] - hits == 2 and m["vllm:pins_total"] - pins >= 2
        assert all(c > 0 for c in by_job[1:])  # its first turn shares the system prompt


@pytest.mark.slow
def test_a_ttl_floor_pins_under_fcfs_and_bad_values_are_400s():
    with RemoteServer("--continuum-max-ttl", "4") as server:  # fcfs: no pins of its own
        client = server.client()
        messages = [{"role": "user", "content": "Say hi."}]
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=4,
            prompt_cache_key="c1",
            extra_body={"prompt_cache_options": {"ttl": "30m"}},
        )
        assert server.metrics()["vllm:num_pinned_requests"] == 1
        assert server.wait_metric("vllm:num_pinned_requests", 0.0, timeout_s=10) == 0.0
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=4, prompt_cache_retention="7d"
            )
        assert info.value.body["param"] == "prompt_cache_retention"
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_tokens=4,
                extra_body={"prompt_cache_options": {"mode": "explicit"}},
            )
        assert info.value.body["param"] == "prompt_cache_options.mode"
