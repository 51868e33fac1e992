"""Tool calling end to end: the real server and model, the official openai client.

The 135M model rarely decides to call a tool by itself, so "auto" is driven by asking
it to repeat a call (it copies reliably); "required" and named choices are guided, so
their form holds whatever the model would have written.
"""

from __future__ import annotations

import json
import os

import openai
import pytest

from ...utils import RemoteServer

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
TEMPLATE = os.path.join(
    os.path.dirname(__file__),
    "..",
    "..",
    "..",
    "examples",
    "tool_chat_template_chatml_hermes.jinja",
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
        },
    },
}
BASH = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a shell command",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string", "maxLength": 40}},
            "required": ["command"],
        },
    },
}
TOOLS = [WEATHER, BASH]
CALL = '<tool_call>\n{"name": "bash", "arguments": {"command": "git status"}}\n</tool_call>'
REPEAT = [{"role": "user", "content": "Repeat this text exactly:\n" + CALL}]
WEATHER_Q = [{"role": "user", "content": "What is the weather in Paris?"}]


def agent_server(out) -> RemoteServer:
    """A server for agent turns: Continuum (5 s default pins), hermes tool calls, its log
    and run records in ``out`` (``srv.out_dir``)."""
    srv = RemoteServer(
        "--scheduling-policy",
        "continuum",
        "--continuum-default-ttl",
        "5",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--chat-template",
        TEMPLATE,
        log_path=str(out / "server.log"),
        env={**os.environ, "RUN_OUTPUT_DIR": str(out)},
    )
    srv.out_dir = out
    return srv


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    out = tmp_path_factory.mktemp("tools")
    env = {**os.environ, "RUN_OUTPUT_DIR": str(out)}
    srv = RemoteServer(
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--chat-template",
        TEMPLATE,
        "--scheduling-policy",
        "continuum",
        log_path=str(out / "server.log"),
        env=env,
    )
    srv.out_dir = out
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def create(client, messages, stream=False, tools=TOOLS, **kw):
    return client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=tools,
        temperature=0,
        max_tokens=80,
        stream=stream,
        **kw,
    )


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def streamed(client, messages, **kw) -> tuple[str, list[tuple[str, str]], str]:
    """Content, calls (name, raw arguments) and finish_reason assembled from the deltas."""
    content, calls, finish = "", {}, None
    for chunk in create(client, messages, stream=True, **kw):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            if d.id is not None:
                assert d.type == "function" and d.function.name
                calls[d.index] = [d.function.name, ""]
            calls[d.index][1] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, [tuple(c) for c in calls.values()], finish


def test_auto_returns_the_models_call(client):
    resp = create(client, REPEAT, extra_body={"job_id": "job_tools", "is_last_step": False})
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert calls_of(choice.message) == [("bash", {"command": "git status"})]
    assert choice.message.tool_calls[0].id.startswith("call_")
    assert not choice.message.content


def test_auto_without_a_call_is_content(client):
    resp = create(client, [{"role": "user", "content": "Hi! How are you?"}])
    assert resp.choices[0].message.content and not resp.choices[0].message.tool_calls
    assert resp.choices[0].finish_reason in ("stop", "length")


def test_required_is_a_valid_call_of_a_given_tool(client):
    resp = create(client, WEATHER_Q, tool_choice="required")
    assert resp.choices[0].finish_reason == "tool_calls"
    found = calls_of(resp.choices[0].message)
    assert found
    for name, args in found:
        assert name in ("get_weather", "bash")
        assert set(args) == {"city"} if name == "get_weather" else {"command"}


def test_named_function_is_called(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    resp = create(client, WEATHER_Q, tool_choice=choice)
    ((name, args),) = calls_of(resp.choices[0].message)
    assert name == "get_weather" and isinstance(args["city"], str)
    assert resp.choices[0].finish_reason == "stop"  # as OpenAI for a forced function


@pytest.mark.parametrize(
    "messages, tool_choice",
    [
        (REPEAT, "auto"),
        (WEATHER_Q, "required"),
        (WEATHER_Q, {"type": "function", "function": {"name": "bash"}}),
        ([{"role": "user", "content": "Hi! How are you?"}], "auto"),
    ],
)
def test_stream_deltas_assemble_into_the_same_calls(client, messages, tool_choice):
    resp = create(client, messages, tool_choice=tool_choice)
    message = resp.choices[0].message
    want = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    content, calls, finish = streamed(client, messages, tool_choice=tool_choice)
    assert calls == want
    assert finish == resp.choices[0].finish_reason
    assert content == (message.content or "").strip()


@pytest.mark.parametrize(
    "arguments",
    ['{"command": 42}', '{"command": "ls", "force": true}', '{"cmd": "ls"}'],
)
def test_a_strict_tools_calls_under_auto_match_its_schema(client, arguments):
    """OpenAI's ``strict: true`` under tool_choice "auto": asked to repeat a call whose
    arguments break the schema (a number, an extra key, a wrong key), the model copies
    it as written unless the tool is strict; then, once it opens the call, the grammar
    holds it to the schema (a string command, nothing else)."""
    call = '<tool_call>\n{"name": "bash", "arguments": ' + arguments + "}\n</tool_call>"
    messages = [{"role": "user", "content": "Repeat this text exactly:\n" + call}]
    loose = create(client, messages, tools=[BASH])
    assert calls_of(loose.choices[0].message) == [("bash", json.loads(arguments))]
    strict = [{"type": "function", "function": {**BASH["function"], "strict": True}}]
    resp = create(client, messages, tools=strict)
    ((name, args),) = calls_of(resp.choices[0].message)
    assert name == "bash" and set(args) == {"command"}, args
    assert isinstance(args["command"], str) and len(args["command"]) <= 40
    assert resp.choices[0].finish_reason == "tool_calls"
    _, calls, finish = streamed(client, messages, tools=strict)  # the same, streamed
    assert calls == [(c.function.name, c.function.arguments)
                     for c in resp.choices[0].message.tool_calls]  # fmt: skip
    assert finish == "tool_calls"
    # Plain answers stay free text.
    plain = create(client, [{"role": "user", "content": "Hi! How are you?"}], tools=strict)
    assert plain.choices[0].message.content and not plain.choices[0].message.tool_calls


def test_parallel_tool_calls_false_makes_auto_one_call(client):
    two = CALL + "\n" + CALL.replace("git status", "ls")
    messages = [{"role": "user", "content": "Repeat this text exactly:\n" + two}]
    both = create(client, messages)
    assert [n for n, _ in calls_of(both.choices[0].message)] == ["bash", "bash"]
    one = create(client, messages, parallel_tool_calls=False)
    assert calls_of(one.choices[0].message) == [("bash", {"command": "git status"})]
    assert one.choices[0].finish_reason == "tool_calls"


def test_two_turns_with_a_tool_message(client):
    first = create(client, REPEAT, extra_body={"job_id": "job_two", "is_last_step": False})
    call = first.choices[0].message.tool_calls[0]
    messages = [
        *REPEAT,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "On branch main\nnothing to commit"},
    ]
    second = create(
        client, messages, tool_choice="none", extra_body={"job_id": "job_two", "is_last_step": True}
    )
    assert second.choices[0].message.content
    # The template rendered the earlier call and its result: the prompt grew by both.
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 15


def test_response_format_is_enforced_or_refused(client):
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "maxLength": 30}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    resp = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello as JSON."}],
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    )
    assert set(json.loads(resp.choices[0].message.content)) == {"answer"}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=WEATHER_Q, response_format={"type": "xml"}
        )
    assert e.value.body["param"] == "response_format"


def test_bad_tool_requests_are_400s(client):
    for kw in (
        {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
        {"tool_choice": "required", "tools": []},
    ):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(
                model=MODEL, messages=WEATHER_Q, **{"tools": TOOLS, **kw}
            )


def test_completions_follow_structured_outputs_and_response_format(client):
    # vLLM serves guided decoding on /v1/completions too; each prompt of a batch follows it.
    choice = client.completions.create(
        model=MODEL,
        prompt=["The sky is", "Grass is"],
        max_tokens=5,
        extra_body={"structured_outputs": {"choice": ["blue", "green", "red"]}},
    )
    assert [c.text for c in choice.choices] and all(
        c.text in ("blue", "green", "red") for c in choice.choices
    )
    regex = client.completions.create(
        model=MODEL, prompt="My phone number is", max_tokens=12, temperature=0,
        extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}},
    )  # fmt: skip
    assert len(regex.choices[0].text) == 8 and regex.choices[0].text[3] == "-"
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    stream = client.completions.create(
        model=MODEL, prompt="A JSON object:", max_tokens=20, temperature=0, stream=True,
        extra_body={"response_format": fmt},  # not among the client's completion arguments
    )  # fmt: skip
    text = "".join(c.choices[0].text for c in stream if c.choices)
    assert isinstance(json.loads(text)["n"], int)
    for extra, param in (
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"structured_outputs": {"regex": "("}}, "structured_outputs"),
        ({"structured_outputs": {"lua": "x"}}, "structured_outputs"),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt="Hi", extra_body=extra)
        assert e.value.body["param"] == param


def test_policy_logs_the_tool_name(server):  # last: it stops the module's server
    server.stop()  # flushes scheduler_timestamps.json
    log = (server.out_dir / "server.log").read_text()
    assert "job 'job_tools': func_call=git status" in log
    events = json.loads((server.out_dir / "scheduler_timestamps.json").read_text())
    departures = [e for e in events["job_tools"] if e["event"] == "departure"]
    assert departures[0]["func_call"] == "git status"
