"""Guided decoding: front-end validation, the mask, and runs under the mask."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from vllm.config import ModelConfig
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import SamplingParams, StructuredOutputsParams
from vllm.v1.structured_output import StructuredOutputManager, validate_structured_outputs

MODEL = "SmolLM2-135M-Instruct"
VOCAB = 49152
EOS = 2  # <|im_end|>
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer"},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}


@dataclass
class Row:
    req_id: str
    sampling_params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)


def row(so: StructuredOutputsParams, req_id: str = "r") -> Row:
    return Row(req_id, SamplingParams(structured_outputs=so))


@pytest.fixture(scope="module")
def manager():
    config = SimpleNamespace(model_config=ModelConfig(model=MODEL))
    return StructuredOutputManager(config)


def allowed(manager, r: Row) -> torch.Tensor:
    logits = torch.zeros(1, VOCAB)
    manager.mask_logits(logits, [r])
    return logits[0] == 0


def run(manager, tokenizer, r: Row, logits_fn, max_steps: int = 200) -> str:
    """Sample greedily from ``logits_fn(step)`` under the mask until EOS."""
    for step in range(max_steps):
        logits = logits_fn(step).reshape(1, VOCAB).clone()
        manager.mask_logits(logits, [r])
        token = int(logits.argmax())
        manager.accept([r], [token])
        if token == EOS:
            return tokenizer.decode(r.output_token_ids)
        r.output_token_ids.append(token)
    raise AssertionError("no EOS within max_steps")


def test_params_need_exactly_one_constraint():
    with pytest.raises(VLLMValidationError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(VLLMValidationError, match="exactly one"):
        StructuredOutputsParams(json={"type": "object"}, regex="a+")


@pytest.mark.parametrize(
    "so",
    [
        StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "nope"}}}),
        StructuredOutputsParams(json="{not json"),
        StructuredOutputsParams(regex="(unclosed"),
        StructuredOutputsParams(grammar="start: undefined_rule"),
        StructuredOutputsParams(choice=["a", 3]),
    ],
)
def test_bad_constraints_are_validation_errors(so):
    with pytest.raises(VLLMValidationError) as e:
        validate_structured_outputs(so)
    assert e.value.param == "structured_outputs"


def test_processor_rejects_a_bad_schema_before_the_engine(tokenizer):
    from vllm.config import VllmConfig
    from vllm.v1.engine.processor import Processor

    processor = Processor(VllmConfig(), tokenizer, EOS)
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="(x"))
    with pytest.raises(VLLMValidationError):
        processor.process("hi", bad)


def test_mask_allows_only_valid_continuations(manager, tokenizer):
    r = row(StructuredOutputsParams(json=WEATHER))
    ok = allowed(manager, r)
    first = [tokenizer.decode([t]) for t in ok.nonzero().flatten().tolist()]
    assert first and all(w.startswith("{") for w in first)  # llguidance picks '{"'
    assert not ok[tokenizer.convert_tokens_to_ids("hello")]
    assert not ok[EOS]  # nothing is complete yet
    r.output_token_ids = tokenizer.encode('{"city": "Rome", "unit": "')
    manager.remove(["r"])  # a fresh matcher replays the tokens (as after a preemption)
    ok = allowed(manager, r)
    words = [tokenizer.decode([t]) for t in ok.nonzero().flatten().tolist()]
    assert words and all(("celsius".startswith(w) or "fahrenheit".startswith(w)) for w in words)


def test_random_logits_under_the_mask_give_schema_valid_json(manager, tokenizer):
    gen = torch.Generator().manual_seed(0)
    for i in range(5):
        r = row(StructuredOutputsParams(json=WEATHER), f"rand{i}")
        text = run(manager, tokenizer, r, lambda _: torch.randn(VOCAB, generator=gen))
        value = json.loads(text)
        assert set(value) == {"city", "unit", "days"}, text
        assert value["unit"] in ("celsius", "fahrenheit") and isinstance(value["days"], int)
        assert isinstance(value["city"], str) and len(value["city"]) <= 12


@pytest.mark.parametrize(
    "so, check",
    [
        (StructuredOutputsParams(choice=["yes", "no"]), lambda t: t in ("yes", "no")),
        (StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}"), lambda t: len(t) == 6),
        (StructuredOutputsParams(json_object=True), lambda t: isinstance(json.loads(t), dict)),
    ],
)
def test_other_constraints(manager, tokenizer, so, check):
    gen = torch.Generator().manual_seed(1)
    closing = torch.zeros(VOCAB)
    # Push random walks to close what they opened (a random key string never ends).
    closing[[EOS, *(tokenizer.encode(s)[0] for s in ("}", '"}', '"', '":', "1"))]] = 6.0
    r = row(so, f"other-{so}")
    text = run(manager, tokenizer, r, lambda _: torch.randn(VOCAB, generator=gen) + closing)
    assert check(text), text


def test_unconstrained_rows_are_untouched(manager):
    plain = Row("plain", SamplingParams())
    logits = torch.randn(2, VOCAB)
    before = logits.clone()
    manager.mask_logits(logits, [plain, row(StructuredOutputsParams(regex="a"), "c")])
    assert torch.equal(logits[0], before[0])
    assert torch.isinf(logits[1]).sum() > VOCAB - 10


@pytest.mark.slow
def test_greedy_model_run_yields_valid_json():
    from vllm import LLM

    llm = LLM(MODEL)
    params = SamplingParams(
        temperature=0,
        max_tokens=60,
        structured_outputs=StructuredOutputsParams(json=WEATHER),
    )
    out = llm.chat([{"role": "user", "content": "Weather in Paris for 3 days?"}], params)
    value = json.loads(out[0].outputs[0].text)
    assert set(value) == {"city", "unit", "days"}
    assert out[0].outputs[0].finish_reason == "stop"


# -- the logits' device (issue 27: on CUDA a host mask failed the whole step) -------------
def test_masks_reach_the_logits_device(manager):
    from tests.v1.sample.fake_device import FakeDevice

    rows = [
        Row("dev-plain", SamplingParams()),
        row(StructuredOutputsParams(json=WEATHER), "dev-json"),
        row(StructuredOutputsParams(choice=["yes", "no"]), "dev-choice"),
    ]
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(3))
    expected = logits.clone()
    assert manager.mask_logits(expected, rows) == {}
    manager.remove(["dev-json", "dev-choice"])  # fresh matchers in the same state
    dev = FakeDevice()  # a pretend cuda:0 that raises where CUDA would (tests/v1/sample)
    with dev:
        on_device = dev.tensor(logits)
        assert manager.mask_logits(on_device, rows) == {}
    assert torch.equal(on_device.as_subclass(torch.Tensor), expected)
    assert torch.isinf(expected[1:]).sum() > VOCAB  # the two constrained rows were masked
    assert dev.host_tensors == []  # the masks come from numpy, then one copy
    assert dev.blocking_uploads == []  # that does not wait (--async-scheduling)
    assert dev.device_reads == []  # and nothing is read back from the device
    manager.remove(["dev-json", "dev-choice"])


def test_a_mask_narrower_than_the_logits_fails_its_row_only(manager):
    # Logits wider than the tokenizer's vocabulary (a padded lm_head): the row cannot be
    # masked, so it fails alone instead of raising for the whole step.
    rows = [Row("wide-plain", SamplingParams()), row(StructuredOutputsParams(regex="a+"), "wide")]
    logits = torch.zeros(2, VOCAB + 256)
    failures = manager.mask_logits(logits, rows)
    assert set(failures) == {1} and "not 49408" in failures[1].message
    assert torch.isinf(logits[1]).all() and torch.equal(logits[0], torch.zeros(VOCAB + 256))
    manager.remove(["wide"])


TOOL_TAG = {
    "triggers": ["<function="],
    "structures": [
        {"begin": "<function=get_weather>", "schema": WEATHER, "end": "</function>"},
        {"begin": "<function=get_time>", "schema": {"type": "object"}, "end": "</function>"},
    ],
}


def _follow(manager, tokenizer, r: Row, text: str) -> int | None:
    """Feed ``text``'s tokens under the mask; the index of the first it forbids, or None."""
    for i, token in enumerate(tokenizer.encode(text)):
        if not allowed(manager, r)[token]:
            return i
        manager.accept([r], [token])
    return None


@pytest.mark.parametrize("as_text", [False, True])
def test_structural_tag_leaves_text_free_and_holds_tagged_calls_to_their_schema(
    manager, tokenizer, as_text
):
    tag = json.dumps(TOOL_TAG) if as_text else TOOL_TAG
    good = ('Let me check. <function=get_weather>{"city": "Paris", "unit": "celsius", '
            '"days": 2}</function> Anything after, <b>even markup</b>.')  # fmt: skip
    r = row(StructuredOutputsParams(structural_tag=tag), f"tag-ok-{as_text}")
    assert _follow(manager, tokenizer, r, good) is None
    assert allowed(manager, r)[EOS]  # free text again: it may end
    bad = 'Sure <function=get_weather>{"city": "Paris", "unit": "kelvin"'
    r = row(StructuredOutputsParams(structural_tag=tag), f"tag-bad-{as_text}")
    stop = _follow(manager, tokenizer, r, bad)
    assert stop is not None  # the schema's enum forbids "kelvin"
    assert tokenizer.decode(tokenizer.encode(bad)[:stop]).endswith('"unit": "')


def test_a_structural_tag_of_at_most_one_structure_ends_the_output_after_it(manager, tokenizer):
    from vllm.v1.structured_output.grammar import structural_tag_grammar

    one = StructuredOutputsParams(
        grammar=structural_tag_grammar(TOOL_TAG["structures"], TOOL_TAG["triggers"], True)
    )
    r = row(one, "tag-one")
    call = 'Sure. <function=get_weather>{"city": "Paris", "unit": "celsius", "days": 2}</function>'
    assert _follow(manager, tokenizer, r, call) is None
    mask = allowed(manager, r)
    assert mask[EOS] and mask.sum() == 1  # the call was the last thing: only the end
    free = row(one, "tag-one-free")  # no call at all is fine too
    assert _follow(manager, tokenizer, free, "Nothing to call.") is None
    assert allowed(manager, free)[EOS]
    manager.remove(["tag-one", "tag-one-free"])


@pytest.mark.parametrize(
    "tag, message",
    [
        ({"triggers": [], "structures": TOOL_TAG["structures"]}, "triggers must be"),
        ({"triggers": ["<tool>"], "structures": TOOL_TAG["structures"]}, "none of the triggers"),
        ({"triggers": ["<f"], "structures": [{"begin": "<f>", "schema": 3, "end": ""}]},
         "schema must be a JSON schema object"),
        ({"format": {"type": "triggered_tags"}}, "format.triggers must be a list"),
        ({"format": {"type": "grammar", "grammar": "root ::= x"}}, "EBNF dialect is xgrammar"),
        ("{not json", "is not JSON"),
    ],
)  # fmt: skip
def test_bad_structural_tags_are_400s_naming_the_problem(tag, message):
    with pytest.raises(VLLMValidationError, match=message):
        validate_structured_outputs(StructuredOutputsParams(structural_tag=tag))


def test_response_format_takes_vllms_structural_tag_type():
    from vllm.entrypoints.openai.tool_calling import response_format_params

    params = response_format_params({"type": "structural_tag", **TOOL_TAG})
    assert params.structural_tag == TOOL_TAG
