"""/v1/responses ``truncation``: which items "auto" may drop (no server), then a chain that
outgrows a small context window (``slow``): "disabled" refuses it, "auto" drops its oldest
items."""

from __future__ import annotations

import shutil

import openai
import pytest
from pydantic import ValidationError

from tests.entrypoints.test_generation_config import TOKENIZER_FILES
from tests.tiny_models import save_tiny_llama
from vllm.benchmarks.server import RemoteServer
from vllm.config import DEFAULT_MODEL
from vllm.entrypoints.openai.protocol_responses import ResponsesRequest, normalize_input
from vllm.entrypoints.openai.responses_truncation import drop_oldest, droppable_units
from vllm.model_executor.model_loader import resolve_model

MODEL = "tiny"
MAX_MODEL_LEN = 512


def items(*specs):
    return normalize_input(list(specs))


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def call(call_id):
    return {"type": "function_call", "call_id": call_id, "name": "f", "arguments": "{}"}


def output(call_id):
    return {"type": "function_call_output", "call_id": call_id, "output": "x"}


def reasoning(text):
    return {
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def texts(kept):
    return [i.get("call_id") or i["content"][0]["text"] for i in kept]


# -- the rule -----------------------------------------------------------------------------
def test_a_call_and_its_output_go_together_and_reasoning_with_its_turn():
    context = items(
        user("q1"), reasoning("r1"), assistant("a1"), call("c1"), output("c1"),
        reasoning("r2"), call("c2"), output("c2"), assistant("a2"), user("q2"),
    )  # fmt: skip
    units = droppable_units(context, first_new=9)
    assert units == [[0], [1, 2, 3, 4], [5, 6, 7], [8]]
    assert texts(drop_oldest(context, 9, 1)) == ["r1", "a1", "c1", "c1", "r2", "c2", "c2", "a2",
                                                "q2"]  # fmt: skip
    assert texts(drop_oldest(context, 9, 2)) == ["r2", "c2", "c2", "a2", "q2"]
    assert texts(drop_oldest(context, 9, 99)) == ["q2"]


def test_an_output_apart_from_its_call_keeps_what_lies_between():
    context = items(user("q1"), call("c1"), user("meanwhile"), output("c1"), user("q2"))
    assert droppable_units(context, 4) == [[0], [1, 2, 3]]


def test_instructions_and_the_newest_input_are_kept():
    context = items(
        {"role": "developer", "content": "dev"}, user("q1"), assistant("a1"),
        {"role": "system", "content": "sys"}, user("q2"), assistant("a2"), user("q3"),
    )  # fmt: skip
    assert texts(drop_oldest(context, 6, 99)) == ["dev", "sys", "q3"]
    # A whole conversation sent as input: its last user message on is the newest input.
    assert texts(drop_oldest(context, 0, 99)) == ["dev", "sys", "q3"]


def test_a_new_output_keeps_its_call_and_the_model_turn():
    context = items(user("q1"), assistant("a1"), call("c1"), output("c1"))
    assert droppable_units(context, 3) == [[0]]  # the call's turn goes with its new output
    assert texts(drop_oldest(context, 3, 5)) == ["a1", "c1", "c1"]


def test_truncation_is_a_field():
    assert (
        ResponsesRequest.model_validate({"input": "hi", "truncation": "auto"}).truncation == "auto"
    )
    with pytest.raises(ValidationError):
        ResponsesRequest.model_validate({"input": "hi", "truncation": "middle"})


# -- end to end ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    out = tmp_path_factory.mktemp("truncation")
    path = out / "model"
    path.mkdir()
    save_tiny_llama(path, vocab_size=49152, max_position_embeddings=4096)
    for name in TOKENIZER_FILES:
        shutil.copy(f"{resolve_model(DEFAULT_MODEL)}/{name}", path / name)
    srv = RemoteServer(
        "--model", str(path), "--served-model-name", MODEL,
        "--max-model-len", str(MAX_MODEL_LEN), "--shutdown-timeout", "1",
        log_path=str(out / "server.log"),
    )  # fmt: skip
    yield srv
    srv.stop()


@pytest.mark.slow
def test_a_chain_past_the_context_window(server):
    client = server.client()
    long_text = "apple " * 150  # about 150 tokens a turn

    def turn(previous, truncation, max_output_tokens=16):
        return client.responses.create(
            model=MODEL, input=long_text, previous_response_id=previous,
            max_output_tokens=max_output_tokens, temperature=0, truncation=truncation,
        )  # fmt: skip

    previous, first = None, None
    for _ in range(4):  # the 4th turn's context no longer fits: "auto" drops the oldest
        resp = turn(previous, "auto")
        assert resp.truncation == "auto"
        assert resp.usage.input_tokens <= MAX_MODEL_LEN - 16
        previous, first = resp.id, first or resp.id
    with pytest.raises(openai.BadRequestError) as e:
        turn(previous, "disabled")
    assert e.value.body["param"] == "input"
    resp = turn(previous, "auto", max_output_tokens=32)
    assert resp.status in ("completed", "incomplete") and resp.truncation == "auto"
    assert resp.usage.input_tokens <= MAX_MODEL_LEN - 32
    # The stored chain stays whole: its first turn is still there, and it still does not fit.
    assert len(client.responses.input_items.list(first).data) == 1
    with pytest.raises(openai.BadRequestError):
        turn(resp.id, "disabled")
    plain = client.responses.create(model=MODEL, input="Hi", max_output_tokens=4)
    assert plain.truncation == "disabled"
