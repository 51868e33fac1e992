"""Remote MCP tools in /v1/responses: the request's mcp tools resolved against the
configured servers (a fake tool server), the items they add and how they read back as
chat; then end to end (``slow``) with a real MCP server and the official openai client."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from vllm.entrypoints.openai.protocol_responses import items_to_messages, normalize_input
from vllm.entrypoints.openai.responses_mcp import (
    McpTools,
    as_mcp_items,
    call_item,
    prepare,
    run_call,
    split_tools,
)
from vllm.exceptions import VLLMValidationError


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    input_schema: dict
    annotations: dict | None


@dataclass(frozen=True)
class Server:
    label: str
    url: str


@dataclass(frozen=True)
class Result:
    output: str | None
    error: dict | None


class FakeToolServer:
    """``MCPToolServer``'s interface over one server "calc" with two tools."""

    def __init__(self):
        self.servers = {"calc": Server("calc", "http://127.0.0.1:9/mcp")}
        self.calls = []

    def find(self, label, url=None):
        for server in self.servers.values():
            if (url is not None and url == server.url) or (url is None and label == server.label):
                return server
        raise ValueError(f"no MCP server {label!r}")

    async def list_tools(self, server, headers=None):
        self.headers = headers
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
        return [Tool("add", "Add numbers", schema, {"readOnlyHint": True}),
                Tool("wipe", None, {"type": "object"}, None)]  # fmt: skip

    async def call(self, server, name, arguments, headers=None):
        self.calls.append((server.label, name, arguments, headers))
        if name == "wipe":
            return Result(None, {"type": "mcp_tool_execution_error", "content": []})
        return Result(str(sum(arguments.values())), None)


def resolve(specs, listed=(), taken=()):
    return asyncio.run(prepare(specs, FakeToolServer(), set(listed), set(taken)))


def mcp_tool(**kw):
    return {"type": "mcp", "server_label": "calc", "require_approval": "never", **kw}


def test_split_tools_keeps_the_function_tools_apart():
    fn = {"type": "function", "name": "f"}
    assert split_tools([fn, mcp_tool()]) == ([fn], [mcp_tool()])
    assert split_tools(None) == (None, [])


def test_an_mcp_tool_becomes_functions_and_a_listing():
    mcp = resolve([mcp_tool(server_description="arithmetic")])
    names = [f["function"]["name"] for f in mcp.functions]
    assert names == ["add", "wipe"] and set(mcp.routes) == {"add", "wipe"}
    assert mcp.functions[0]["function"]["description"] == "Add numbers (calc: arithmetic)"
    (listing,) = mcp.list_items
    assert listing["type"] == "mcp_list_tools" and listing["server_label"] == "calc"
    assert [t["name"] for t in listing["tools"]] == ["add", "wipe"]
    # already listed in the chain: not output again
    assert resolve([mcp_tool()], listed={"calc"}).list_items == []


@pytest.mark.parametrize(
    "allowed, names",
    [(["wipe"], ["wipe"]), ({"read_only": True}, ["add"]), ({"tool_names": ["add"]}, ["add"])],
)
def test_allowed_tools_filter_the_listing(allowed, names):
    mcp = resolve([mcp_tool(allowed_tools=allowed)])
    assert [f["function"]["name"] for f in mcp.functions] == names


@pytest.mark.parametrize(
    "spec, words",
    [
        (mcp_tool(require_approval="sometimes"), "require_approval must be"),
        (mcp_tool(require_approval={"always": {"names": ["add"]}}), "require_approval must be"),
        (mcp_tool(connector_id="connector_gmail"), "connector_id is not supported"),
        (mcp_tool(server_label="other"), "no MCP server 'other'"),
        (mcp_tool(server_url="http://evil.example/mcp"), "no MCP server"),
        (mcp_tool(allowed_tools="add"), "allowed_tools must be"),
        (mcp_tool(headers={"x": 1}), "headers must map"),
        (mcp_tool(bogus=1), "does not take: ['bogus']"),
    ],
)
def test_what_cannot_be_served_is_a_400_naming_tools(spec, words):
    with pytest.raises(VLLMValidationError, match=words.replace("[", r"\[")) as e:
        resolve([spec])
    assert e.value.param == "tools"


def test_a_name_clash_and_no_tool_server_are_400s():
    with pytest.raises(VLLMValidationError, match="given twice"):
        resolve([mcp_tool()], taken={"add"})
    with pytest.raises(VLLMValidationError, match="--tool-server"):
        asyncio.run(prepare([mcp_tool()], None, set(), set()))


def test_headers_and_authorization_reach_the_server_and_calls_run():
    server = FakeToolServer()
    spec = mcp_tool(headers={"X-Team": "a"}, authorization="tok")
    mcp = asyncio.run(prepare([spec], server, set(), set()))
    assert server.headers == {"X-Team": "a", "Authorization": "Bearer tok"}
    items = as_mcp_items(
        [
            {
                "type": "function_call",
                "id": "fc_1",
                "call_id": "c",
                "name": "add",
                "arguments": '{"a": 2, "b": 3}',
                "status": "completed",
            },
            {
                "type": "function_call",
                "id": "fc_2",
                "call_id": "d",
                "name": "client_fn",
                "arguments": "{}",
                "status": "completed",
            },
        ],  # fmt: skip
        mcp,
    )
    assert [i["type"] for i in items] == ["mcp_call", "function_call"]
    bad = call_item("calc", "add", "[1]")
    asyncio.run(run_call(server, mcp, items[0]))
    asyncio.run(run_call(server, mcp, bad))
    failing = call_item("calc", "wipe", "{}")
    asyncio.run(run_call(server, mcp, failing))
    assert items[0]["output"] == "5" and items[0]["status"] == "completed"
    assert bad["status"] == "failed" and bad["error"]["type"] == "mcp_protocol_error"
    assert failing["status"] == "failed" and failing["error"]["type"] == "mcp_tool_execution_error"
    assert mcp.calls == 3 and len(server.calls) == 2  # the bad arguments never left
    assert server.calls[0][3] == {"X-Team": "a", "Authorization": "Bearer tok"}
    assert isinstance(McpTools(), McpTools)


@pytest.mark.parametrize(
    "approval, asks",
    [
        (None, {"add", "wipe"}),  # OpenAI's default: ask
        ("always", {"add", "wipe"}),
        ("never", set()),
        ({"never": {"tool_names": ["add"]}}, {"wipe"}),
        ({"never": {"read_only": True}}, {"wipe"}),
        ({"always": {"tool_names": ["wipe"]}}, {"wipe"}),
        ({"always": {"read_only": False}}, {"wipe"}),
    ],
)
def test_which_calls_wait_for_approval(approval, asks):
    spec = mcp_tool()
    spec.pop("require_approval")
    if approval is not None:
        spec["require_approval"] = approval
    assert resolve([spec]).asks == asks


def test_approval_responses_run_the_approved_calls_only():
    from vllm.entrypoints.openai.responses_mcp import approval_item, approved_calls

    mcp = resolve([mcp_tool()])
    ok, no = approval_item("calc", "add", '{"a": 1}'), approval_item("calc", "add", "{}")
    answers = normalize_input([
        {"type": "mcp_approval_response", "approval_request_id": ok["id"], "approve": True},
        {"type": "mcp_approval_response", "approval_request_id": no["id"], "approve": False},
    ])  # fmt: skip
    (call,) = approved_calls(mcp, [ok, no, *answers], answers)
    assert call["type"] == "mcp_call" and call["approval_request_id"] == ok["id"]
    assert call["arguments"] == '{"a": 1}' and call["status"] == "in_progress"
    # an answer to no request, or to one already run, is a 400 naming input
    for context in ([], [ok, {**call, "status": "completed"}]):
        with pytest.raises(VLLMValidationError, match="No pending approval request") as e:
            approved_calls(mcp, [*context, answers[0]], answers[:1])
        assert e.value.param == "input"
    with pytest.raises(VLLMValidationError, match="approve must be true or false"):
        normalize_input([{"type": "mcp_approval_response", "approval_request_id": "x"}])


def test_a_denied_call_reads_back_as_refused_and_an_approved_one_once():
    from vllm.entrypoints.openai.responses_mcp import approval_item

    asked = [approval_item("calc", "add", "{}"), approval_item("calc", "wipe", "{}")]
    ran = {**call_item("calc", "add", "{}"), "approval_request_id": asked[0]["id"],
           "output": "0", "status": "completed"}  # fmt: skip
    items = normalize_input([
        {"role": "user", "content": "go"}, *asked,
        {"type": "mcp_approval_response", "approval_request_id": asked[0]["id"],
         "approve": True},
        {"type": "mcp_approval_response", "approval_request_id": asked[1]["id"],
         "approve": False, "reason": "too risky"},
        ran,
    ])  # fmt: skip
    messages = items_to_messages(items)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant", "tool"]
    assert messages[1]["tool_calls"][0]["function"]["name"] == "wipe"
    assert messages[2]["content"] == "The user did not approve this call: too risky."
    assert messages[3]["tool_calls"][0]["function"]["name"] == "add"
    assert messages[4]["content"] == "0"


def test_mcp_items_read_back_as_the_assistants_calls_and_the_tools_answers():
    done = {**call_item("calc", "add", '{"a": 1}', "mcp_1"), "output": "1",
            "status": "completed"}  # fmt: skip
    failed = {**call_item("calc", "wipe", "{}", "mcp_2"), "status": "failed",
              "error": {"type": "http_error", "code": 502, "message": "down"}}  # fmt: skip
    listing = {"type": "mcp_list_tools", "server_label": "calc", "tools": []}
    items = normalize_input([
        {"role": "user", "content": "add"}, listing,
        {"role": "assistant", "content": "Let me add."}, done, failed,
    ])  # fmt: skip
    messages = items_to_messages(items)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant", "tool"]
    assert messages[1]["content"][0]["text"] == "Let me add."
    assert messages[1]["tool_calls"][0]["id"] == "mcp_1"
    assert messages[2] == {"role": "tool", "tool_call_id": "mcp_1", "name": "add", "content": "1"}
    assert messages[4]["content"].startswith("Error: ") and "down" in messages[4]["content"]
    with pytest.raises(VLLMValidationError, match="name must be a string"):
        normalize_input([{"type": "mcp_call", "server_label": "calc", "arguments": "{}"}])


# -- end to end -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served(mcp_served):
    return mcp_served  # tests/entrypoints/conftest.py


def calc(**kw):
    return {"type": "mcp", "server_label": "calc", "require_approval": "never", **kw}


def create(served, **kw):
    import requests

    from .test_tool_calling_e2e import MODEL

    body = {"model": MODEL, "input": "What is 2 plus 3? Use the add tool.", "temperature": 0,
            "max_output_tokens": 40, "tools": [calc(allowed_tools=["add", "echo"])],
            **kw}  # fmt: skip

    return requests.post(f"{served.base}/v1/responses", json=body, timeout=300)


@pytest.mark.slow
def test_the_server_runs_the_models_mcp_calls_and_answers(served):
    import json

    from openai.types.responses import Response

    r = create(served, tool_choice={"type": "mcp", "server_label": "calc", "name": "add"},
               max_tool_calls=2)  # fmt: skip
    assert r.status_code == 200, r.text
    body = r.json()
    resp = Response.model_validate(body)  # the official client's types take it
    kinds = [item.type for item in resp.output]
    assert kinds[0] == "mcp_list_tools" and kinds[1] == "mcp_call", kinds
    listing = resp.output[0]
    assert listing.server_label == "calc"
    assert sorted(t.name for t in listing.tools) == ["add", "echo"]  # allowed_tools
    calls = [i for i in resp.output if i.type == "mcp_call"]
    assert 1 <= len(calls) <= 2  # max_tool_calls: then the model must answer
    first = calls[0]
    args = json.loads(first.arguments)
    assert first.name == "add" and first.status == "completed" and first.error is None
    assert first.output == str(args["a"] + args["b"])  # the MCP server's answer
    assert kinds[-1] == "message" and resp.status in ("completed", "incomplete")
    usage = body["usage"]
    assert usage["input_tokens_details"]["cached_tokens"] > 0  # the loop's later rounds
    # Continuum pinned the job's KV while the MCP server ran the call, and the next
    # generation of the loop hit the pin.
    import requests

    metrics = requests.get(f"{served.base}/metrics", timeout=60).text
    hits = [line for line in metrics.splitlines() if line.startswith("vllm:pin_hits_total")]
    assert hits and float(hits[0].split()[-1]) >= 1, hits
    # The chain goes on: the listing is not repeated, the calls read back as context.
    r2 = create(served, previous_response_id=resp.id, input="Thanks. And 4 plus 5?",
                tool_choice={"type": "mcp", "server_label": "calc", "name": "add"},
                max_tool_calls=1)  # fmt: skip
    assert r2.status_code == 200, r2.text
    kinds2 = [i["type"] for i in r2.json()["output"]]
    assert "mcp_list_tools" not in kinds2 and kinds2[0] == "mcp_call"


@pytest.mark.slow
@pytest.mark.parametrize(
    "kw, status, words",
    [
        ({"tools": [calc(require_approval="ask")]}, 400, "require_approval"),
        ({"tools": [calc(server_label="nope")]}, 400, "no MCP server 'nope'"),
        ({"tools": [calc(server_url="http://169.254.169.254/mcp")]}, 400, "no MCP server"),
        ({"background": True, "store": False}, 400, "background=true needs store=true"),
        (
            {"tool_choice": {"type": "mcp", "server_label": "calc", "name": "wipe"}},
            400,
            "tool_choice",
        ),
    ],
)
def test_what_the_server_cannot_run_is_refused(served, kw, status, words):
    r = create(served, **kw)
    assert r.status_code == status, r.text
    assert words in r.json()["error"]["message"]


@pytest.mark.slow
def test_a_streamed_mcp_response_has_openais_events_in_order(served):
    import json

    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    event_type = TypeAdapter(ResponseStreamEvent)
    r = create(served, stream=True, max_tool_calls=1,
               tool_choice={"type": "mcp", "server_label": "calc", "name": "add"})  # fmt: skip
    assert r.status_code == 200, r.text
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    for event in events:
        event_type.validate_python(event)  # each one is OpenAI's
    kinds = [e["type"] for e in events]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    order = ["response.created", "response.mcp_list_tools.in_progress",
             "response.mcp_list_tools.completed", "response.mcp_call_arguments.delta",
             "response.mcp_call_arguments.done", "response.mcp_call.in_progress",
             "response.mcp_call.completed", "response.completed"]  # fmt: skip
    positions = [kinds.index(k) for k in order]
    assert positions == sorted(positions), kinds
    final = events[-1]["response"]
    call = next(i for i in final["output"] if i["type"] == "mcp_call")
    args = json.loads(call["arguments"])
    assert call["output"] == str(args["a"] + args["b"]) and call["status"] == "completed"
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [i["id"] for i in done] == [i["id"] for i in final["output"]]
    assert final["output"][-1]["type"] == "message"  # answered after the one call
    assert final["usage"]["input_tokens_details"]["cached_tokens"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("approve", [True, False])
def test_a_call_waits_for_the_clients_approval(served, approve):
    import json

    from openai.types.responses import Response

    force = {"type": "mcp", "server_label": "calc", "name": "add"}
    tool = {"type": "mcp", "server_label": "calc", "allowed_tools": ["add"]}  # default: ask
    r = create(served, tools=[tool], tool_choice=force)
    assert r.status_code == 200, r.text
    first = Response.model_validate(r.json())
    kinds = [i.type for i in first.output]
    assert kinds == ["mcp_list_tools", "mcp_approval_request"], kinds  # nothing ran
    asked = first.output[1]
    answer = {"type": "mcp_approval_response", "approval_request_id": asked.id,
              "approve": approve}  # fmt: skip
    r2 = create(served, tools=[tool], previous_response_id=first.id, input=[answer],
                max_tool_calls=1)  # fmt: skip
    assert r2.status_code == 200, r2.text
    second = Response.model_validate(r2.json())
    calls = [i for i in second.output if i.type == "mcp_call"]
    if approve:
        assert calls[0].approval_request_id == asked.id
        args = json.loads(calls[0].arguments)
        assert calls[0].output == str(args["a"] + args["b"])
        assert second.output[0].type == "mcp_call"  # run before the model generates
    else:
        assert not any(c.approval_request_id == asked.id for c in calls)
    # answering it again is a 400
    r3 = create(served, tools=[tool], previous_response_id=second.id, input=[answer])
    assert r3.status_code == 400 and "No pending approval request" in r3.text


@pytest.mark.slow
def test_a_streamed_approval_request_is_sent_whole(served):
    import json

    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    force = {"type": "mcp", "server_label": "calc", "name": "add"}
    tool = {"type": "mcp", "server_label": "calc", "require_approval": "always"}
    r = create(served, tools=[tool], tool_choice=force, stream=True)
    assert r.status_code == 200, r.text
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    for event in events:
        TypeAdapter(ResponseStreamEvent).validate_python(event)
    kinds = [e["type"] for e in events]
    assert not any(k.startswith("response.mcp_call") for k in kinds), kinds
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [i["type"] for i in done] == ["mcp_list_tools", "mcp_approval_request"]
    assert json.loads(done[1]["arguments"]).keys() == {"a", "b"}
    assert events[-1]["response"]["output"] == done


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_a_background_mcp_response_runs_the_loop_and_is_stored(served, stream):
    import json
    import time

    import requests

    force = {"type": "mcp", "server_label": "calc", "name": "add"}
    r = create(served, background=True, stream=stream, tool_choice=force, max_tool_calls=1)
    assert r.status_code == 200, r.text
    if stream:  # the events, as they are logged
        events = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: ")]
        kinds = [e["type"] for e in events]
        assert "response.mcp_call.completed" in kinds and kinds[-1] == "response.completed"
        response_id = events[0]["response"]["id"]
    else:
        assert r.json()["status"] == "queued"
        response_id = r.json()["id"]
    deadline = time.monotonic() + 120
    while True:
        body = requests.get(f"{served.base}/v1/responses/{response_id}", timeout=30).json()
        if body["status"] not in ("queued", "in_progress") or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert body["status"] == "completed" and body["background"] is True
    kinds = [i["type"] for i in body["output"]]
    assert kinds[:2] == ["mcp_list_tools", "mcp_call"] and kinds[-1] == "message", kinds
    call = body["output"][1]
    args = json.loads(call["arguments"])
    assert call["output"] == str(args["a"] + args["b"])
