"""The structural tag's "format" form (xgrammar's, as vLLM's examples send it in
``response_format``): each node type compiled to Lark and run through a real matcher over
SmolLM2's tokens, what it allows and where it stops a text that breaks it; the 400s."""

from __future__ import annotations

import pytest

from vllm.entrypoints.openai.tool_calling import response_format_params
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import StructuredOutputsParams
from vllm.v1.structured_output.grammar import compile_grammar, new_matcher
from vllm.v1.structured_output.validator import build_ll_tokenizer

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
}
TAGS = [
    {"begin": "<function=get_weather>", "content": {"type": "json_schema", "json_schema": WEATHER},
     "end": "</function>"},
    {"type": "tag", "begin": "<function=note>", "content": {"type": "any_text"},
     "end": "</function>"},
]  # fmt: skip
TRIGGERED = {"type": "triggered_tags", "triggers": ["<function="], "tags": TAGS}
CALL = '<function=get_weather>{"city": "Paris", "unit": "c"}</function>'
NOTE = "<function=note>any text, even </b> or {</function>"


@pytest.fixture(scope="module")
def ll(tokenizer):
    return build_ll_tokenizer(tokenizer, len(tokenizer), tokenizer.eos_token_id)


@pytest.fixture(scope="module")
def follow(tokenizer, ll):
    def run(fmt: dict, text: str) -> str | None:
        """None if the format takes ``text`` whole (and may end there), else the text up
        to the first token it refuses."""
        tag = {"type": "structural_tag", "format": fmt}
        matcher = new_matcher(ll, compile_grammar(StructuredOutputsParams(structural_tag=tag)))
        assert not matcher.is_error(), matcher.get_error()
        ids = tokenizer.encode(text)
        for i, token in enumerate(ids):
            if not matcher.consume_token(token):
                return tokenizer.decode(ids[: i + 1])
        return None if matcher.is_accepting() else text + " <may not end here>"

    return run


def test_triggered_tags_leave_text_free_and_hold_each_tag(follow):
    text = f"I will check. {CALL} and {NOTE} done."
    assert follow(TRIGGERED, text) is None
    assert follow(TRIGGERED, "No tag at all.") is None
    assert follow(TRIGGERED, '<function=get_weather>{"city": "Paris"}</function>').endswith("}")
    assert follow(TRIGGERED, "x <function=rm>{}</function>").endswith("rm")


def test_at_least_one_opens_with_a_tag_and_stop_after_first_ends_after_it(follow):
    first = {**TRIGGERED, "at_least_one": True}
    assert follow(first, f"{CALL} then text {NOTE}") is None
    assert follow(first, f"Text first {CALL}") is not None
    assert follow(first, "") is not None  # a tag is owed
    once = {**TRIGGERED, "stop_after_first": True}
    assert follow(once, f"Text {CALL}") is None
    assert follow(once, f"Text {CALL} more").endswith(" more")
    only = {**TRIGGERED, "at_least_one": True, "stop_after_first": True}
    assert follow(only, NOTE) is None and follow(only, f"x{NOTE}") is not None


def test_tags_with_separator(follow):
    tws = {"type": "tags_with_separator", "tags": TAGS, "separator": ", "}
    assert follow(tws, f"{CALL}, {NOTE}") is None
    assert follow(tws, "") is None  # none at all, unless at_least_one
    assert follow({**tws, "at_least_one": True}, "") is not None
    assert follow(tws, f"{CALL} {NOTE}") is not None  # no separator
    assert follow({**tws, "stop_after_first": True}, f"{CALL}, {NOTE}") is not None


def test_the_other_nodes(follow):
    seq = {"type": "sequence", "elements": [
        {"type": "const_string", "value": "Answer: "},
        {"type": "regex", "pattern": "[0-9]+(/[0-9]+)?"},
        {"type": "or", "elements": [{"type": "const_string", "value": "!"},
                                    {"type": "const_string", "value": "."}]},
    ]}  # fmt: skip
    assert follow(seq, "Answer: 3/4.") is None and follow(seq, "Answer: 12!") is None
    assert follow(seq, "Answer: x") is not None and follow(seq, "Answer: 3?") is not None
    no_bad = {"type": "any_text", "excludes": ["bad"]}
    assert follow(no_bad, "all good") is None and follow(no_bad, "so bad") is not None
    ab = {"type": "const_string", "value": "ab"}
    assert follow({"type": "repeat", "min": 1, "max": 2, "content": ab}, "abab") is None
    assert follow({"type": "repeat", "min": 1, "max": 2, "content": ab}, "ababab") is not None
    assert follow({"type": "repeat", "min": 2, "max": -1, "content": ab}, "ab") is not None
    assert follow({"type": "plus", "content": ab}, "ababab") is None
    assert follow({"type": "star", "content": ab}, "") is None
    assert follow({"type": "optional", "content": ab}, "") is None
    tag_ends = {"type": "tag", "begin": "<a>", "content": {"type": "any_text"},
                "end": ["</a>", "</b>"]}  # fmt: skip
    assert follow(tag_ends, "<a>x</b>") is None and follow(tag_ends, "<a>x</b>y") is not None


def test_response_format_carries_it_as_vllms_examples_send_it():
    params = response_format_params({"type": "structural_tag", "format": TRIGGERED})
    assert params.structural_tag == {"format": TRIGGERED}
    compile_grammar(params)  # compiles


@pytest.mark.parametrize(
    "fmt, message",
    [
        ({"type": "grammar", "grammar": "root ::= x"}, "EBNF dialect is xgrammar's"),
        ({"type": "token_triggered_tags"}, "token-level"),
        ({"type": "nope"}, "unknown type"),
        ({"type": "const_string", "value": "x", "extra": 1}, "unknown keys"),
        ({"type": "json_schema", "json_schema": {}, "style": "qwen_xml"}, "style"),
        ({"type": "triggered_tags", "triggers": ["<f"], "tags": [
            {"begin": "<g>", "content": {"type": "any_text"}, "end": "</g>"}]},
         "format.tags\\[0\\] begin"),
        ({"type": "sequence", "elements": [{"type": "regex", "pattern": ""}]},
         "format.elements\\[0\\] pattern"),
        ({"type": "repeat", "min": 3, "max": 2, "content": {"type": "any_text"}}, "max must"),
    ],
)  # fmt: skip
def test_what_it_cannot_take_is_a_400_naming_the_node(fmt, message):
    params = StructuredOutputsParams(structural_tag={"type": "structural_tag", "format": fmt})
    with pytest.raises(VLLMValidationError, match=message) as e:
        compile_grammar(params)
    assert e.value.param == "structured_outputs"


def test_deep_nesting_is_bounded():
    fmt: dict = {"type": "const_string", "value": "x"}
    for _ in range(40):
        fmt = {"type": "optional", "content": fmt}
    params = StructuredOutputsParams(structural_tag={"format": fmt})
    with pytest.raises(VLLMValidationError, match="nests deeper than 32"):
        compile_grammar(params)
