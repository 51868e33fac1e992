"""A constraint after the reasoning (``StructuredOutputsParams.after_reasoning``, set by
--reasoning-parser): free text up to the first end tag, then the constraint, through the
engine's own mask (``StructuredOutputManager``) with the embedded tokenizer."""

from __future__ import annotations

import json
import re

import pytest
import torch

from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import StructuredOutputsParams
from vllm.v1.structured_output import validate_structured_outputs
from vllm.v1.structured_output.grammar import gate_after_reasoning

from .test_guided_decoding import EOS, VOCAB, WEATHER, allowed, manager, row, run  # noqa: F401

REASONING = "<think>\nIs it <b>hot</b>? Not </thin at all.\n</think>"


def scripted_then_random(tokenizer, text: str, seed: int):
    """Logits that pick ``text``'s tokens first (as a model writing its reasoning would),
    then random ones."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    gen = torch.Generator().manual_seed(seed)

    def logits(step: int) -> torch.Tensor:
        out = torch.randn(VOCAB, generator=gen)
        if step < len(ids):
            out[ids[step]] = 1e4
        return out

    return logits


@pytest.mark.parametrize("seed", range(3))
def test_json_holds_after_the_reasoning(manager, tokenizer, seed):  # noqa: F811
    so = StructuredOutputsParams(json=WEATHER, after_reasoning="</think>")
    r = row(so, f"json{seed}")
    text = run(manager, tokenizer, r, scripted_then_random(tokenizer, REASONING, seed))
    reasoning, tag, answer = text.partition("</think>")
    assert reasoning + tag == REASONING  # the model's reasoning went through untouched
    value = json.loads(answer)
    assert set(value) == {"city", "unit", "days"}, text


@pytest.mark.parametrize(
    ("so", "check"),
    [
        (StructuredOutputsParams(choice=["yes", "no"]), lambda t: t in ("yes", "no")),
        (
            StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}"),
            lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t),
        ),
        (StructuredOutputsParams(grammar='start: "A" | "B"'), lambda t: t in ("A", "B")),
        (
            StructuredOutputsParams(
                json={
                    "type": "object",
                    "properties": {"ok": {"type": "boolean"}},
                    "required": ["ok"],
                }
            ),
            lambda t: isinstance(json.loads(t)["ok"], bool),
        ),
    ],
)
def test_every_kind_of_constraint_holds_after_the_reasoning(manager, tokenizer, so, check):  # noqa: F811
    so.after_reasoning = "</think>"
    r = row(so, f"kind-{id(so)}")
    text = run(manager, tokenizer, r, scripted_then_random(tokenizer, "Hmm.</think>\n", 1))
    reasoning, _, answer = text.partition("</think>")
    assert reasoning == "Hmm."
    assert check(answer.strip()), text


def test_while_reasoning_the_mask_allows_free_text(manager, tokenizer):  # noqa: F811
    r = row(StructuredOutputsParams(json=WEATHER, after_reasoning="</think>"), "free")
    ok = allowed(manager, r)
    assert ok.sum() > VOCAB * 0.9  # anything but what could not be text
    assert ok[tokenizer.convert_tokens_to_ids("hello")] and not ok[EOS]
    # After the tag only the JSON may follow.
    r.output_token_ids = tokenizer.encode("Fine.</think>", add_special_tokens=False)
    manager.remove(["free"])
    ok = allowed(manager, r)
    assert not ok[tokenizer.convert_tokens_to_ids("hello")]
    words = [tokenizer.decode([t]) for t in ok.nonzero().flatten().tolist()]
    assert words and all(w.strip() == "" or w.lstrip().startswith("{") for w in words)


def test_a_second_end_tag_is_not_reasoning_any_more(tokenizer):
    from llguidance import LLMatcher
    from llguidance.hf import from_tokenizer

    grammar = gate_after_reasoning(
        validate_structured_outputs(StructuredOutputsParams(regex="[a-z]+")), "</think>"
    )
    matcher = LLMatcher(from_tokenizer(tokenizer), grammar, log_level=0)
    ids = tokenizer.encode("a</think></think>", add_special_tokens=False)
    assert not all(matcher.consume_token(t) for t in ids)


def test_tags_with_regex_characters(manager, tokenizer):  # noqa: F811
    so = StructuredOutputsParams(choice=["ok"], after_reasoning="[/THINK]")
    r = row(so, "mistral")
    text = run(manager, tokenizer, r, scripted_then_random(tokenizer, "a.b*c[/THINK]", 2))
    head, tag, answer = text.partition("[/THINK]")
    assert head == "a.b*c" and tag and answer.strip() == "ok"
    assert len(answer) <= len("ok") + 8  # at most 8 whitespace characters between


@pytest.mark.parametrize("tag", ["", "x" * 65, 3])
def test_a_bad_tag_is_a_validation_error(tag):
    with pytest.raises(VLLMValidationError, match="after_reasoning"):
        validate_structured_outputs(StructuredOutputsParams(regex="a", after_reasoning=tag))
