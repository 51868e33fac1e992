"""/v1/responses: item conversion, refusals, the store and the event stream (no server),
then end to end with the official openai client (``slow``)."""

from __future__ import annotations

import json

import openai
import pytest
import requests
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter, ValidationError

from vllm.entrypoints.openai.protocol_responses import (
    ResponsesRequest,
    chat_response_format,
    chat_tool_choice,
    chat_tools,
    items_to_messages,
    normalize_input,
)
from vllm.entrypoints.openai.responses_store import ResponseStore, StoredResponse
from vllm.entrypoints.openai.responses_stream import ResponseEvents
from vllm.exceptions import VLLMValidationError

from .test_tool_calling_e2e import MODEL, agent_server

EVENT = TypeAdapter(ResponseStreamEvent)


def param_of(exc: pytest.ExceptionInfo) -> str | None:
    err = exc.value
    if isinstance(err, ValidationError):  # raised in a model validator
        err = err.errors()[0]["ctx"]["error"]
    return err.param


# -- items -> chat messages ---------------------------------------------------------------
def test_a_string_input_is_one_user_message():
    (item,) = normalize_input("Hi")
    assert item["type"] == "message" and item["id"].startswith("msg_")
    assert items_to_messages([item]) == [
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]}
    ]


def test_messages_calls_and_outputs_become_chat_messages():
    items = normalize_input(
        [
            {"role": "developer", "content": "Be brief."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "ls?"}]},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Running."}]},
            {"type": "function_call", "call_id": "c1", "name": "bash", "arguments": '{"a": 1}'},
            {"type": "function_call", "call_id": "c2", "name": "bash", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "a.py"},
            {
                "type": "function_call_output",
                "call_id": "c2",
                "output": [
                    {"type": "input_text", "text": "b"},
                    {"type": "input_text", "text": "c"},
                ],
            },
        ]
    )
    messages = items_to_messages(items)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "tool"]
    # The text and both calls are one assistant turn, as a chat client would send it.
    assistant = messages[2]
    assert assistant["content"] == [{"type": "text", "text": "Running."}]
    assert [c["id"] for c in assistant["tool_calls"]] == ["c1", "c2"]
    assert assistant["tool_calls"][0]["function"] == {"name": "bash", "arguments": '{"a": 1}'}
    assert messages[3] == {"role": "tool", "tool_call_id": "c1", "name": "bash", "content": "a.py"}
    assert messages[4]["content"] == "bc"
    assert items[2]["content"][0]["type"] == "output_text"  # listed as OpenAI lists it


def test_cache_breakpoints_reach_the_chat_parts():
    mark = {"mode": "explicit", "ttl": "30m"}
    (item,) = normalize_input(
        [
            {
                "role": "user",
                "content": [{"type": "input_text", "text": "x", "prompt_cache_breakpoint": mark}],
            }
        ]
    )
    (message,) = items_to_messages([item])
    assert message["content"][0]["prompt_cache_breakpoint"] == mark


@pytest.mark.parametrize(
    "item",
    [
        {"role": "tool", "content": "x"},
        {"role": "user", "content": [{"type": "input_file", "file_id": "f"}]},
        {"role": "user", "content": 3},
        {"type": "reasoning", "summary": [], "encrypted_content": "gAAAAB"},
        {"type": "reasoning", "content": [{"type": "output_text", "text": "x"}]},
        {"type": "reasoning", "summary": "x"},
        {"type": "item_reference", "id": "msg_1"},
        {"type": "function_call", "call_id": "c", "name": "f"},
        {"type": "function_call_output", "output": "x"},
    ],
)
def test_items_this_server_cannot_take_are_400s_naming_input(item):
    with pytest.raises(VLLMValidationError) as e:
        normalize_input([item])
    assert e.value.param == "input"


def test_an_output_without_its_call_is_a_400():
    items = normalize_input([{"type": "function_call_output", "call_id": "nope", "output": "x"}])
    with pytest.raises(VLLMValidationError, match="nope") as e:
        items_to_messages(items)
    assert e.value.param == "input"


# -- request fields -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "field, value",
    [
        ("reasoning", {"effort": None, "summary": "auto"}),
        ("reasoning", {"effort": "low", "generate_summary": "concise"}),
        ("include", ["message.output_text.logprobs"]),
        ("background", "true"),  # strict: a JSON boolean
        ("conversation", 7),  # an id, or {"id": ...}
        ("conversation", {"id": "conv_1", "x": 1}),
        ("prompt", {"id": "pmpt_1"}),
        ("top_logprobs", 3),
        ("service_tier", "flex"),
        ("stream_options", {"include_obfuscation": True}),
        ("store", "yes"),
        ("metadata", {"k": "v" * 513}),
        ("previous_response_id", 7),
    ],
)
def test_unimplemented_or_bad_fields_are_refused_by_name(field, value):
    with pytest.raises((VLLMValidationError, ValidationError)) as e:
        ResponsesRequest.model_validate({"input": "hi", field: value})
    if isinstance(e.value, VLLMValidationError) or e.value.errors()[0].get("ctx"):
        assert param_of(e) == field
    else:
        assert e.value.errors()[0]["loc"][0] == field


def test_defaults_that_ask_for_nothing_pass():
    request = ResponsesRequest.model_validate(
        {
            "input": "hi",
            "reasoning": {"effort": None, "summary": None},
            "include": [],
            "background": False,
            "truncation": "disabled",
            "service_tier": "auto",
            "top_logprobs": 0,
            "stream_options": {"include_obfuscation": False},
            "max_tool_calls": 3,
        }
    )
    assert request.stored  # OpenAI's default


def test_only_function_tools_and_their_choices():
    tool = {"type": "function", "name": "f", "description": "d", "parameters": None, "strict": True}
    assert chat_tools([tool]) == [
        {"type": "function", "function": {"name": "f", "description": "d", "strict": True}}
    ]
    with pytest.raises(VLLMValidationError) as e:
        chat_tools([tool, {"type": "web_search"}])
    assert e.value.param == "tools" and "tools[1]" in str(e.value)
    assert chat_tool_choice({"type": "function", "name": "f"}) == {
        "type": "function",
        "function": {"name": "f"},
    }
    assert chat_tool_choice("required") == "required"
    with pytest.raises(VLLMValidationError) as e:
        chat_tool_choice({"type": "file_search"})
    assert e.value.param == "tool_choice"


def test_text_format_is_chats_response_format():
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    fmt = {"format": {"type": "json_schema", "name": "a", "schema": schema, "strict": True}}
    assert chat_response_format(fmt) == {
        "type": "json_schema",
        "json_schema": {"name": "a", "schema": schema, "strict": True},
    }
    assert chat_response_format({"format": {"type": "text"}}) == {"type": "text"}
    for bad in ({"format": {"type": "xml"}}, {"verbosity": "high"}):
        with pytest.raises(VLLMValidationError) as e:
            chat_response_format(bad)
        assert e.value.param == "text"


# -- the store ----------------------------------------------------------------------------
def entry(rid: str, previous: str | None = None, job: str = "j", size: int = 0) -> StoredResponse:
    body = {"id": rid, "previous_response_id": previous, "output": [], "pad": "x" * size}
    return StoredResponse(body, [], job)


def test_store_is_lru_bounded_in_number_and_bytes():
    store = ResponseStore(max_responses=2, max_bytes=10_000)
    store.put(entry("a"))
    store.put(entry("b"))
    assert store.get("a") is not None  # a is now the most recent: b goes first
    store.put(entry("c"))
    assert store.get("b") is None and store.get("a") and store.get("c") and len(store) == 2
    store.put(entry("big", size=9_900))  # with any other entry, over 10,000 bytes
    assert len(store) == 1 and store.nbytes == store.get("big").nbytes <= 10_000
    assert not store.put(entry("huge", size=20_000)) and store.get("huge") is None
    assert store.delete("big") and not store.delete("big") and store.nbytes == 0


def test_a_chain_is_walked_to_its_first_response_and_breaks_without_it():
    store = ResponseStore(max_responses=3)
    for rid, prev in (("r1", None), ("r2", "r1"), ("r3", "r2")):
        store.put(entry(rid, prev))
    assert [e.id for e in store.chain("r3")] == ["r1", "r2", "r3"]
    store.put(entry("other"))  # walking made r1 the most recent: r3, the tip, goes
    assert store.get("r3") is None and store.chain("r2") is not None
    store.delete("r1")
    assert store.chain("r2") is None and store.chain("nope") is None


# -- the event stream ---------------------------------------------------------------------
def parse(events: list[str]) -> list:
    out = []
    for raw in events:
        kind_line, data_line = raw.strip().split("\n")
        payload = json.loads(data_line.removeprefix("data: "))
        assert kind_line == f"event: {payload['type']}"
        out.append(EVENT.validate_python(payload))
    return out


def test_events_of_text_then_two_calls_follow_openais_types():
    ev = ResponseEvents()
    raw = ev.text("Let me ") + ev.text("look.")
    raw += ev.tool_call(
        {
            "index": 0,
            "id": "call_1",
            "type": "function",
            "function": {"name": "f", "arguments": "{"},
        }
    )
    raw += ev.tool_call({"index": 0, "function": {"arguments": "}"}})
    raw += ev.tool_call(
        {"index": 1, "id": "call_2", "type": "function", "function": {"name": "g", "arguments": ""}}
    )
    raw += ev.finish("completed")
    events = parse(raw)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    message, first, second = ev.items
    assert message["content"][0]["text"] == "Let me look." and message["status"] == "completed"
    assert (first["call_id"], first["arguments"]) == ("call_1", "{}")
    assert (second["name"], second["arguments"], second["status"]) == ("g", "", "completed")
    assert [e.output_index for e in events if e.type == "response.output_item.done"] == [0, 1, 2]


# -- end to end ---------------------------------------------------------------------------
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
    },
}
INSTRUCTIONS = (
    "You are a weather assistant. Call get_weather to learn the weather of a city, then "
    "answer in one short sentence."
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    out = tmp_path_factory.mktemp("responses")
    srv = agent_server(out)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def ask(client, text="What is the capital of France?", **kw):
    kw = {"max_output_tokens": 24, "temperature": 0, **kw}
    return client.responses.create(model=MODEL, input=text, **kw)


def call_weather(client, city="Paris", **kw):
    return client.responses.create(
        model=MODEL,
        instructions=INSTRUCTIONS,
        input=f"What is the weather in {city}?",
        tools=[WEATHER],
        tool_choice="required",
        max_output_tokens=40,
        temperature=0,
        **kw,
    )


@pytest.mark.slow
def test_plain_text_response_is_openais_object(server, client):
    resp = ask(client, metadata={"run": "1"}, user="u1")
    assert resp.id.startswith("resp_") and resp.object == "response"
    assert resp.status == "completed" and resp.output_text
    assert resp.model == MODEL and resp.metadata == {"run": "1"} and resp.store is True
    (item,) = resp.output
    assert item.type == "message" and item.role == "assistant"
    u = resp.usage
    assert u.total_tokens == u.input_tokens + u.output_tokens and 0 < u.output_tokens <= 24
    assert u.output_tokens_details.reasoning_tokens == 0
    assert u.input_tokens_details.cached_tokens >= 0
    # The raw body passes the openai package's own (validating) model.
    raw = requests.post(
        server.url_for_openai + "/responses",
        json={"model": MODEL, "input": "Hi", "max_output_tokens": 4},
        timeout=60,
    )
    assert raw.status_code == 200
    Response.model_validate(raw.json())


@pytest.mark.slow
def test_cut_by_max_output_tokens_is_incomplete(client):
    resp = ask(client, "Write a long story about a dragon.", max_output_tokens=16)
    assert resp.status == "incomplete"
    assert resp.incomplete_details.reason == "max_output_tokens"


@pytest.mark.slow
def test_streaming_events_assemble_the_non_streamed_text(client):
    want = ask(client).output_text
    events = list(ask(client, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == want == events[-1].response.output_text
    with client.responses.stream(
        model=MODEL, input="What is the capital of France?", max_output_tokens=24, temperature=0
    ) as stream:
        final = stream.get_final_response()
    assert final.output_text == want and final.usage.output_tokens > 0


@pytest.mark.slow
def test_required_tool_choice_gives_function_calls(client):
    resp = call_weather(client)
    calls = [o for o in resp.output if o.type == "function_call"]
    assert calls and not resp.output_text
    for call in calls:
        assert call.name == "get_weather" and call.call_id.startswith("call_")
        assert set(json.loads(call.arguments)) == {"city"}
    events = list(call_weather(client, stream=True))
    final = events[-1].response
    assert events[-1].type == "response.completed"
    streamed = [(o.name, o.arguments) for o in final.output if o.type == "function_call"]
    assert streamed == [(c.name, c.arguments) for c in calls]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == "".join(a for _, a in streamed)


@pytest.mark.slow
def test_a_second_turn_continues_the_chain_with_the_tool_output(client):
    first = call_weather(client)
    call = next(o for o in first.output if o.type == "function_call")
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 22 C"}
    second = client.responses.create(
        model=MODEL,
        instructions=INSTRUCTIONS,  # as agents do: sent again on every turn
        previous_response_id=first.id,
        input=[output],
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=24,
        temperature=0,
    )
    assert second.previous_response_id == first.id and second.output_text
    # The prompt holds the first turn's input and its call, then the tool's output.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    items = client.responses.input_items.list(second.id)
    assert [i.type for i in items.data] == ["function_call_output"]
    assert items.data[0].call_id == call.call_id


@pytest.mark.slow
def test_retrieve_list_input_items_and_delete(client):
    resp = client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "One"},
            {"role": "assistant", "content": "Two"},
            {"role": "user", "content": "Three"},
        ],
        max_output_tokens=4,
    )
    got = client.responses.retrieve(resp.id)
    assert got.id == resp.id and got.output_text == resp.output_text
    items = client.responses.input_items.list(resp.id)  # newest first, as OpenAI
    texts = [i.content[0].text for i in items.data]
    assert texts == ["Three", "Two", "One"] and not items.has_more
    assert items.first_id == items.data[0].id and items.last_id == items.data[-1].id
    page = client.responses.input_items.list(resp.id, order="asc", limit=1)
    assert [i.content[0].text for i in page.data] == ["One"] and page.has_more
    rest = client.responses.input_items.list(resp.id, order="asc", after=page.last_id)
    assert [i.content[0].text for i in rest.data] == ["Two", "Three"]
    client.responses.delete(resp.id)
    for fn in (
        client.responses.retrieve,
        client.responses.delete,
        client.responses.input_items.list,
    ):
        with pytest.raises(openai.NotFoundError) as e:
            fn(resp.id)
        assert e.value.body["message"].startswith("Response with id")


@pytest.mark.slow
def test_store_false_is_not_retrievable_nor_continuable(client):
    resp = ask(client, store=False)
    assert resp.store is False and resp.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(resp.id)
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, previous_response_id=resp.id)
    assert e.value.body["param"] == "previous_response_id"


@pytest.mark.slow
@pytest.mark.parametrize(
    "kw, param",
    [
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"reasoning": {"effort": "high", "summary": "auto"}}, "reasoning"),
        ({"background": True, "store": False}, "background"),
        ({"truncation": "middle"}, "truncation"),
        ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"text": {"format": {"type": "xml"}}}, "text"),
        ({"tool_choice": "required"}, "tool_choice"),
    ],
)
def test_refusals_name_the_field(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**{"model": MODEL, "input": "Hi", **kw})
    assert e.value.body["param"] == param


@pytest.mark.slow
def test_an_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="gpt-5", input="Hi")
    assert e.value.body["param"] == "model" and e.value.body["code"] == "model_not_found"


@pytest.mark.slow
def test_a_chain_is_one_job_pinned_between_its_turns(server, client):
    before = server.metrics()
    first = call_weather(client, city="Oslo")  # no earlier request shares its prompt
    call = next(o for o in first.output if o.type == "function_call")
    second = client.responses.create(
        model=MODEL,
        instructions=INSTRUCTIONS,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Rain"}],
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=16,
        temperature=0,
    )
    after = server.metrics()
    assert after["vllm:pin_hits_total"] - before["vllm:pin_hits_total"] == 1
    assert after["vllm:pins_total"] - before["vllm:pins_total"] >= 1
    # Turn 2 reuses turn 1's context: its system prompt, question and call.
    assert second.usage.input_tokens_details.cached_tokens > first.usage.input_tokens // 2
    # The job is named after the chain's first response (no prompt_cache_key was sent).
    log = (server.out_dir / "server.log").read_text()
    # Turn 1 called a function: pinned. Turn 2 answered in text: the job ended there, its
    # KV freed at once (last_step_unless_tool_call), with no pin decision logged.
    assert log.count(f"job {first.id!r}: func_call=") == 1
    assert f"job {first.id!r}: func_call=get_weather -> pin" in log
    assert f"responses request {second.id}: job_id={first.id!r}" in log


@pytest.mark.slow
def test_prompt_cache_key_names_the_job(server, client):
    resp = call_weather(client, prompt_cache_key="agent-run-7")
    log = (server.out_dir / "server.log").read_text()
    assert f"responses request {resp.id}: job_id='agent-run-7'" in log
    assert "job 'agent-run-7': func_call=" in log
