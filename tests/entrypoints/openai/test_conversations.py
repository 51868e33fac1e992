"""OpenAI's Conversations API: the store (bounds, eviction, pagination, item ids,
deletes; in memory and shared in one SQLite file), the ``conversation`` of a Responses
request, then end to end with the official openai client (``slow``)."""

from __future__ import annotations

import asyncio

import openai
import pytest
from pydantic import ValidationError

from vllm.entrypoints.openai.conversations import (
    ConversationStore,
    append_turn,
    conversation_history,
    normalize_items,
)
from vllm.entrypoints.openai.protocol_responses import ResponsesRequest
from vllm.entrypoints.openai.responses_store import SharedResponseStore
from vllm.exceptions import VLLMValidationError

from .test_tool_calling_e2e import MODEL, agent_server


def msgs(*texts: str) -> list[dict]:
    return normalize_items([{"role": "user", "content": t} for t in texts])


# -- the store ----------------------------------------------------------------------------
def test_a_conversation_keeps_its_items_in_order_with_ids():
    store = ConversationStore()
    conv = store.create({"topic": "demo"}, msgs("a", "b"))
    assert conv["id"].startswith("conv_") and conv["object"] == "conversation"
    assert conv["metadata"] == {"topic": "demo"} and isinstance(conv["created_at"], int)
    added = store.add_items(conv["id"], msgs("c"))
    items = store.items(conv["id"])
    assert [i["content"][0]["text"] for i in items] == ["a", "b", "c"]
    assert all(i["id"].startswith("msg_") for i in items) and added == items[2:]
    assert store.get_item(conv["id"], items[1]["id"]) == items[1]
    assert store.get("conv_nope") is None and store.items("conv_nope") is None
    assert store.add_items("conv_nope", msgs("x")) is None


def test_an_id_already_in_the_conversation_is_replaced():
    store = ConversationStore()
    item = normalize_items([{"id": "msg_1", "role": "user", "content": "hi"}])[0]
    conv = store.create(items=[item])
    (again,) = store.add_items(conv["id"], [item])
    assert again["id"] != "msg_1" and again["id"].startswith("msg_")
    other = store.create(items=[item])  # ids are per conversation
    assert store.items(other["id"])[0]["id"] == "msg_1"


def test_any_string_a_json_body_holds_is_stored():
    store = ConversationStore()
    lone = "\ud800"  # a lone surrogate: valid in JSON, not in UTF-8
    item = normalize_items([{"id": lone, "role": "user", "content": lone}])[0]
    conv = store.create({"k": lone}, [item])
    (stored,) = store.items(conv["id"])
    assert stored["content"][0]["text"] == lone and stored["id"].startswith("item_")
    assert store.get(conv["id"])["metadata"] == {"k": lone}
    with pytest.raises(VLLMValidationError):
        conversation_history(store, lone)


def test_pagination_by_after_limit_and_order():
    store = ConversationStore()
    conv = store.create(items=msgs(*"abcde"))["id"]
    ids = [i["id"] for i in store.items(conv)]
    page = store.list_items(conv, limit=2)  # desc by default: the newest first
    assert [i["id"] for i in page["data"]] == ids[::-1][:2]
    assert page["first_id"] == ids[4] and page["last_id"] == ids[3] and page["has_more"]
    page = store.list_items(conv, after=page["last_id"], limit=2)
    assert [i["id"] for i in page["data"]] == [ids[2], ids[1]] and page["has_more"]
    page = store.list_items(conv, after=ids[1], limit=2)
    assert [i["id"] for i in page["data"]] == [ids[0]] and not page["has_more"]
    page = store.list_items(conv, order="asc", after=ids[0], limit=10)
    assert [i["id"] for i in page["data"]] == ids[1:] and not page["has_more"]
    empty = store.list_items(conv, order="asc", after=ids[4])
    assert empty["data"] == [] and empty["first_id"] is None and not empty["has_more"]
    with pytest.raises(VLLMValidationError) as e:
        store.list_items(conv, after="msg_nope")
    assert e.value.param == "after"
    assert store.list_items("conv_nope") is None


def test_deletes():
    store = ConversationStore()
    conv = store.create(items=msgs("a", "b"))["id"]
    first = store.items(conv)[0]["id"]
    assert store.delete_item(conv, first) and not store.delete_item(conv, first)
    assert [i["content"][0]["text"] for i in store.items(conv)] == ["b"]
    assert store.totals()[0] == 1
    assert store.delete(conv) and not store.delete(conv) and store.get(conv) is None
    assert len(store) == 0 and store.totals() == (0, 0)


def test_metadata_update():
    store = ConversationStore()
    conv = store.create({"a": "1"})["id"]
    assert store.update(conv, {"b": "2"})["metadata"] == {"b": "2"}
    assert store.update(conv, None)["metadata"] == {}
    assert store.update("conv_nope", {}) is None


def test_the_least_recently_used_conversation_goes_first():
    store = ConversationStore(max_conversations=2)
    a, b = store.create()["id"], store.create()["id"]
    store.get(a)  # a use: b is now the least recently used
    c = store.create()["id"]
    assert store.get(b) is None and store.get(a) and store.get(c) and len(store) == 2


def test_the_item_bound_evicts_others_and_refuses_one_alone_over_it():
    store = ConversationStore(max_items=4)
    a = store.create(items=msgs("1", "2"))["id"]
    b = store.create(items=msgs("3", "4"))["id"]
    store.add_items(b, msgs("5"))  # 5 items: a (least recently used) goes
    assert store.get(a) is None and store.totals()[0] == 3
    with pytest.raises(VLLMValidationError) as e:
        store.add_items(b, msgs("6", "7"))  # b alone would hold 5
    assert e.value.param == "items" and len(store.items(b)) == 3  # nothing added


def test_the_byte_bound():
    store = ConversationStore(max_bytes=2_000)
    a = store.create(items=msgs("x" * 700))["id"]
    b = store.create(items=msgs("y" * 700))["id"]
    store.add_items(b, msgs("z" * 500))
    assert store.get(a) is None and store.totals()[1] <= 2_000
    with pytest.raises(VLLMValidationError):
        store.create(items=msgs("w" * 3_000))


def test_processes_share_the_responses_sqlite_file(tmp_path):
    path = str(tmp_path / "responses.sqlite")
    responses = SharedResponseStore(path)
    one, two = ConversationStore.sharing(responses), ConversationStore.sharing(responses)
    assert ConversationStore.sharing(None).path == ":memory:"
    conv = one.create(items=msgs("hi"))["id"]
    two.add_items(conv, msgs("there"))
    assert [i["content"][0]["text"] for i in one.items(conv)] == ["hi", "there"]
    assert two.delete(conv) and one.get(conv) is None
    for store in (one, two, responses):
        store.close()


def test_items_are_normalized_as_responses_input_and_named_items():
    items = normalize_items(
        [
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"},
            {"role": "assistant", "content": "done"},
        ]
    )
    assert [i["id"][:3] for i in items] == ["fc_", "fco", "msg"]
    assert items[2]["content"][0]["type"] == "output_text"
    with pytest.raises(VLLMValidationError) as e:
        normalize_items([{"type": "web_search_call"}])
    assert e.value.param == "items" and "items[0]" in str(e.value)


# -- the Responses request's conversation -------------------------------------------------
def test_a_responses_conversation_is_an_id_or_an_object():
    assert ResponsesRequest(input="hi", conversation="conv_1").conversation_id == "conv_1"
    assert ResponsesRequest(input="hi", conversation={"id": "conv_1"}).conversation_id == "conv_1"
    with pytest.raises(ValidationError) as e:
        ResponsesRequest(input="hi", conversation="conv_1", previous_response_id="resp_1")
    assert e.value.errors()[0]["ctx"]["error"].param == "conversation"


def test_a_turn_appends_its_input_then_output_unless_it_failed():
    store = ConversationStore()
    conv = store.create(items=msgs("before"))["id"]
    assert [i["content"][0]["text"] for i in conversation_history(store, conv)] == ["before"]
    assert conversation_history(store, None) == []
    with pytest.raises(VLLMValidationError) as e:
        conversation_history(store, "conv_nope")
    assert e.value.param == "conversation" and e.value.code == "not_found"
    out = normalize_items([{"role": "assistant", "content": "answer"}])
    append_turn(store, conv, "failed", msgs("lost"), out)
    append_turn(store, conv, "completed", msgs("question"), out)
    append_turn(store, "conv_gone", "completed", msgs("x"), out)  # logged, no error
    texts = [i["content"][0]["text"] for i in store.items(conv)]
    assert texts == ["before", "question", "answer"]


# -- end to end ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = agent_server(tmp_path_factory.mktemp("conversations"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def texts(items) -> list[tuple[str, str]]:
    return [(i.role, "".join(p.text for p in i.content)) for i in items]


@pytest.mark.slow
def test_the_conversations_api_with_the_official_client(client):
    conv = client.conversations.create(
        items=[{"role": "user", "content": f"m{i}"} for i in range(5)], metadata={"k": "v"}
    )
    assert conv.object == "conversation" and conv.metadata == {"k": "v"}
    assert client.conversations.retrieve(conv.id).id == conv.id
    assert client.conversations.update(conv.id, metadata={"k": "w"}).metadata == {"k": "w"}
    added = client.conversations.items.create(
        conv.id, items=[{"type": "message", "role": "assistant", "content": "m5"}]
    )
    assert added.object == "list" and len(added.data) == 1 and added.first_id == added.last_id
    page = client.conversations.items.list(conv.id, limit=2)  # newest first
    assert texts(page.data) == [("assistant", "m5"), ("user", "m4")] and page.has_more
    every = list(client.conversations.items.list(conv.id, limit=2, order="asc"))  # all pages
    assert [t for _, t in texts(every)] == [f"m{i}" for i in range(6)]
    item = client.conversations.items.retrieve(every[0].id, conversation_id=conv.id)
    assert item.id == every[0].id
    left = client.conversations.items.delete(every[0].id, conversation_id=conv.id)
    assert left.id == conv.id and left.object == "conversation"
    assert len(client.conversations.items.list(conv.id, limit=100).data) == 5
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.retrieve(every[0].id, conversation_id=conv.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.conversations.items.list(conv.id, include=["message.output_text.logprobs"])
    assert e.value.body["param"] == "include"
    with pytest.raises(openai.BadRequestError) as e:
        client.conversations.items.list(conv.id, limit=101)
    assert e.value.body["param"] == "limit"
    with pytest.raises(openai.BadRequestError) as e:
        client.conversations.create(items=[{"role": "user", "content": "x"}] * 21)
    assert e.value.body["param"] == "items"
    deleted = client.conversations.delete(conv.id)
    assert deleted.deleted and deleted.object == "conversation.deleted"
    for call in (
        lambda: client.conversations.retrieve(conv.id),
        lambda: client.conversations.delete(conv.id),
        lambda: client.conversations.update(conv.id, metadata={}),
        lambda: client.conversations.items.list(conv.id),
        lambda: client.conversations.items.create(conv.id, items=[]),
    ):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["type"] == "NotFoundError" and conv.id in e.value.body["message"]


@pytest.mark.slow
def test_responses_in_a_conversation_are_one_job(server, client):
    conv = client.conversations.create(
        items=[{"role": "developer", "content": "You are a terse assistant. The code is 4417."}]
    )
    kw = {"model": MODEL, "max_output_tokens": 12, "temperature": 0}
    first = client.responses.create(conversation=conv.id, input="What is the code?", **kw)
    assert first.conversation.id == conv.id
    items = list(client.conversations.items.list(conv.id, order="asc"))
    assert [i.type for i in items] == ["message"] * 3
    assert items[1].role == "user" and [o.id for o in first.output] == [items[2].id]
    second = client.responses.create(
        conversation={"id": conv.id}, input="Repeat the code.", store=False, **kw
    )
    assert second.conversation.id == conv.id
    items = list(client.conversations.items.list(conv.id, order="asc"))
    assert texts(items)[3] == ("user", "Repeat the code.") and items[4].id == second.output[0].id
    # The second turn saw the first: its prompt holds it, mostly served from the cache.
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0
    log = (server.out_dir / "server.log").read_text()
    for r in (first, second):
        assert f"responses request {r.id}: job_id={conv.id!r}" in log
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(conversation=conv.id, previous_response_id=first.id, input="x")
    assert e.value.body["param"] == "conversation"
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(conversation="conv_nope", input="x", **kw)
    assert e.value.body["param"] == "conversation"


@pytest.mark.slow
def test_an_agents_sdk_conversations_session(server):
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=server.base + "/v1", api_key="x", max_retries=0, timeout=120)
    agent = agents.Agent(
        name="terse",
        instructions="Answer in one short sentence.",
        model=agents.OpenAIResponsesModel(model=MODEL, openai_client=client),
        model_settings=agents.ModelSettings(temperature=0, max_tokens=128),
    )

    async def two_turns() -> tuple[str, list]:
        session = agents.OpenAIConversationsSession(openai_client=client)
        await agents.Runner.run(agent, "My name is Ada.", session=session)
        await agents.Runner.run(agent, "What is my name?", session=session)
        return await session._get_session_id(), await session.get_items()

    conv_id, items = asyncio.run(two_turns())
    assert conv_id.startswith("conv_")
    users = [i for i in items if i.get("role") == "user"]
    assert len(users) == 2 and len(items) >= 4
