"""Guided decoding hardening: limits, the full check with the tokenizer, strict schemas,
per-row failures in the engine, and compiles off the event loop."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from vllm.config import ModelConfig
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import SamplingParams, StructuredOutputsParams
from vllm.v1.structured_output import (
    StructuredOutputManager,
    StructuredOutputValidator,
    strict_json_schema,
)
from vllm.v1.structured_output import grammar as g

MODEL = "SmolLM2-135M-Instruct"
VOCAB = 49152
EOS = 2
REF_LOOP = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}
RUN_BASH = {
    "type": "object",
    "properties": {"command": {"type": "string"}},
    "required": ["command"],
}


@dataclass
class Row:
    req_id: str
    sampling_params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)


def so_row(req_id: str, **kw) -> Row:
    return Row(req_id, SamplingParams(structured_outputs=StructuredOutputsParams(**kw)))


@pytest.fixture(scope="module")
def validator(tokenizer):
    v = StructuredOutputValidator(tokenizer, len(tokenizer), EOS)
    v.ll_tokenizer()  # built once here, not inside a timed test
    return v


@pytest.fixture(scope="module")
def manager():
    config = SimpleNamespace(model_config=ModelConfig(model=MODEL))
    return StructuredOutputManager(config)


def rejected(validator, **kw) -> str:
    with pytest.raises(VLLMValidationError) as e:
        validator.validate(StructuredOutputsParams(**kw))
    assert e.value.param == "structured_outputs"
    return str(e.value)


# -- limits --------------------------------------------------------------------------
def test_100k_choices_are_refused_before_any_compile(validator):
    start = time.monotonic()
    msg = rejected(validator, choice=[f"option {i}" for i in range(100_000)])
    assert time.monotonic() - start < 0.5
    assert str(g.MAX_CHOICES) in msg and "100000" in msg


@pytest.mark.parametrize(
    "kw, limit",
    [
        ({"choice": ["x" * 1024] * 129}, g.MAX_CHOICE_BYTES),
        ({"json": {"description": "d" * g.MAX_JSON_SCHEMA_BYTES}}, g.MAX_JSON_SCHEMA_BYTES),
        ({"json": json.dumps({"description": "d" * g.MAX_JSON_SCHEMA_BYTES})}, None),
        ({"regex": "a" * (g.MAX_REGEX_CHARS + 1)}, g.MAX_REGEX_CHARS),
        ({"grammar": 'start: "a"' + " " * g.MAX_GRAMMAR_CHARS}, g.MAX_GRAMMAR_CHARS),
    ],
)
def test_each_limit_is_a_400_giving_its_value(validator, kw, limit):
    msg = rejected(validator, **kw)
    assert "too large" in msg and str(limit or g.MAX_JSON_SCHEMA_BYTES) in msg


def test_at_the_limits_grammars_compile_quickly(validator):
    words = [f"w{i}x" for i in range(g.MAX_CHOICES)]
    start = time.monotonic()
    validator.validate(StructuredOutputsParams(choice=words))
    validator.validate(StructuredOutputsParams(regex="a" * g.MAX_REGEX_CHARS))
    assert time.monotonic() - start < 2.0


def test_a_deep_chain_of_rules_compiles_without_crashing(validator):
    # ~3,000 nested rules overflow an 8 MiB stack (SIGSEGV); this one fills the limit.
    n = 9000
    grammar = "start: r0\n" + "\n".join(f"r{i}: r{i + 1}" for i in range(n)) + f'\nr{n}: "end"\n'
    assert len(grammar) <= g.MAX_GRAMMAR_CHARS
    validator.validate(StructuredOutputsParams(grammar=grammar))


# -- the full check, with the tokenizer ------------------------------------------------
@pytest.mark.parametrize(
    "kw, words",
    [
        ({"json": REF_LOOP}, "matches no text"),
        ({"json": {"$ref": "#"}}, "matches no text"),
        ({"grammar": 'start: "a" <|no_such_token|>'}, "unknown special token"),
        ({"grammar": 'start: "a" <[99999]>'}, "99999"),
    ],
)
def test_grammars_the_engine_cannot_run_are_400s(validator, kw, words):
    assert words in rejected(validator, **kw)


def test_a_recursive_schema_that_can_end_is_served(validator):
    tree = {"type": "object", "properties": {"child": {"$ref": "#"}}}
    validator.validate(StructuredOutputsParams(json=tree))


def test_errors_are_bounded_excerpts(validator):
    big = "x" * 5000
    msg = rejected(validator, grammar=f'start: "{big}" <|{big}|>')
    assert len(msg) < 2 * g.MAX_ERROR_CHARS


def test_2001_choices_are_served_constrained(validator, manager, tokenizer):
    words = [f"word{i}z" for i in range(2001)]
    validator.validate(StructuredOutputsParams(choice=words))
    target = tokenizer.encode(words[-1])
    r = so_row("c2001", choice=words)
    for token in [*target, EOS]:  # the last choice (past the old 2,000-item row) is allowed
        logits = torch.zeros(1, VOCAB)
        assert manager.mask_logits(logits, [r]) == {}
        assert logits[0, token] == 0, tokenizer.decode(r.output_token_ids)
        if token != EOS:
            manager.accept([r], [token])
            r.output_token_ids.append(token)
    manager.remove(["c2001"])


# -- compiles off the event loop --------------------------------------------------------
def test_validate_async_leaves_the_loop_free_and_has_a_budget(validator):
    n = 9000
    deep = "start: r0\n" + "\n".join(f"r{i}: r{i + 1}" for i in range(n)) + f'\nr{n}: "end"\n'
    params = StructuredOutputsParams(grammar=deep)

    async def main():
        ticks, gaps = 0, []

        async def ticker():
            nonlocal ticks
            last = time.monotonic()
            while True:
                await asyncio.sleep(0.005)
                gaps.append(time.monotonic() - last)
                last = time.monotonic()
                ticks += 1

        task = asyncio.create_task(ticker())
        await validator.validate_async(params)
        with pytest.raises(VLLMValidationError, match="longer than 0.001 s"):
            await validator.validate_async(params, timeout_s=0.001)
        task.cancel()
        return ticks, max(gaps)

    ticks, worst_gap = asyncio.run(main())
    assert ticks > 5 and worst_gap < 0.1


# -- strict schemas ---------------------------------------------------------------------
def test_strict_schema_closes_every_object_it_does_not_set():
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "object", "properties": {"b": {"type": "string"}}},
            "list": {"type": "array", "items": {"properties": {"c": {}}}},
            "tuple": {"prefixItems": [{"type": "object"}]},
            "open": {"type": "object", "additionalProperties": True},
            "typed": {"type": "object", "additionalProperties": {"type": "object"}},
            "either": {"anyOf": [{"type": "object"}, {"type": "string"}]},
            "both": {"allOf": [{"type": "object", "properties": {"x": {}}}]},
        },
        "$defs": {"d": {"type": ["object", "null"]}},
    }
    before = json.dumps(schema)
    s = strict_json_schema(schema)
    assert json.dumps(schema) == before  # not mutated
    p = s["properties"]
    assert s["additionalProperties"] is False
    assert p["a"]["additionalProperties"] is False
    assert p["list"]["items"]["additionalProperties"] is False
    assert p["tuple"]["prefixItems"][0]["additionalProperties"] is False
    assert p["open"]["additionalProperties"] is True
    assert p["typed"]["additionalProperties"] == {
        "type": "object",
        "additionalProperties": False,
    }
    assert p["either"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in p["either"]["anyOf"][1]
    assert "additionalProperties" not in p["both"]["allOf"][0]
    assert s["$defs"]["d"]["additionalProperties"] is False


def walk(manager, tokenizer, r: Row, text: str) -> str:
    """How far the mask lets ``text`` go: "all" or the text it stopped before."""
    ids = tokenizer.encode(text)
    for k, token in enumerate(ids):
        logits = torch.zeros(1, VOCAB)
        assert manager.mask_logits(logits, [r]) == {}
        if logits[0, token] != 0:
            return tokenizer.decode(ids[:k])
        manager.accept([r], [token])
        r.output_token_ids.append(token)
    return "all"


@pytest.mark.parametrize(
    "text",
    ['{"command": "ls", "file_path": "x"}', '{"command": "ls", "command": "x"}'],
)
def test_a_one_property_schema_allows_no_other_or_repeated_key(manager, tokenizer, text):
    r = so_row(f"strict-{text}", json=RUN_BASH)
    stopped = walk(manager, tokenizer, r, text)
    assert stopped != "all" and stopped.startswith('{"command": "ls'), stopped
    manager.remove([r.req_id])
    ok = so_row("strict-ok", json=RUN_BASH)
    assert walk(manager, tokenizer, ok, '{"command": "ls"}') == "all"
    manager.remove([ok.req_id])


def test_an_explicit_additional_properties_is_kept(manager, tokenizer):
    r = so_row("open", json={**RUN_BASH, "additionalProperties": {"type": "string"}})
    assert walk(manager, tokenizer, r, '{"command": "ls", "file_path": "x"}') == "all"
    manager.remove(["open"])


# -- the engine: a failing grammar fails its row alone ------------------------------------
def test_a_failing_matcher_fails_its_row_only_and_is_logged_once(manager, caplog):
    bad = StructuredOutputsParams(grammar='start: "a" <|no_such_token|>')
    children = [Row(f"{i}_req", SamplingParams(structured_outputs=bad)) for i in range(3)]
    plain = Row("plain", SamplingParams())
    logits = torch.randn(4, VOCAB)
    before = logits.clone()
    with caplog.at_level(logging.WARNING, logger="vllm.v1.structured_output.manager"):
        failures = manager.mask_logits(logits, [children[0], plain, children[1], children[2]])
    assert set(failures) == {0, 2, 3}
    assert all(not f.internal and "unknown special token" in f.message for f in failures.values())
    assert torch.isinf(logits[[0, 2, 3]]).all()  # nothing can be sampled from those rows
    assert torch.equal(logits[1], before[1])
    logged = [r for r in caplog.records if "grammar failed" in r.getMessage()]
    assert len(logged) == 1 and len(logged[0].getMessage()) < 1000
    manager.remove([c.req_id for c in children])


def test_children_share_one_compile(manager, monkeypatch):
    from vllm.v1.structured_output import manager as mod

    calls = []
    real = mod.new_matcher
    monkeypatch.setattr(mod, "new_matcher", lambda *a: calls.append(1) or real(*a))
    so = StructuredOutputsParams(regex="[a-z]{2,5}-shared")
    rows = [Row(f"{i}_share", SamplingParams(structured_outputs=so)) for i in range(4)]
    manager.mask_logits(torch.zeros(4, VOCAB), rows)
    assert len(calls) == 1
    manager.remove([r.req_id for r in rows])


def test_processor_checks_once_and_async(tokenizer):
    from vllm.config import VllmConfig
    from vllm.v1.engine.processor import Processor

    processor = Processor(VllmConfig(), tokenizer, EOS)
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(json=REF_LOOP))
    with pytest.raises(VLLMValidationError):
        processor.process("hi", bad)
    with pytest.raises(VLLMValidationError):
        asyncio.run(processor.check_structured_outputs(bad))
    _, reqs = processor.process("hi", bad, structured_outputs_checked=True)  # caller did it
    assert len(reqs) == 1
