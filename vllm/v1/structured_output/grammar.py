"""``StructuredOutputsParams`` -> an llguidance grammar (no tokenizer needed)."""

from __future__ import annotations

import json

from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import StructuredOutputsParams

# json.dumps' separators and no free whitespace: the form small models imitate best, and
# without free whitespace a weak model cannot loop on newlines inside the object.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def compile_grammar(params: StructuredOutputsParams) -> str:
    """The llguidance grammar text of ``params`` (``ValueError`` if it cannot be built)."""
    from llguidance import LLMatcher

    if params.json is not None:
        schema = params.json
        if isinstance(schema, str):
            schema = json.loads(schema)
        return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if params.json_object:
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if params.regex is not None:
        return LLMatcher.grammar_from_regex(params.regex)
    if params.choice is not None:
        # Lark string literals take JSON's escapes, so json.dumps quotes each choice.
        return LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in params.choice)
        )
    return LLMatcher.grammar_from_lark(params.grammar)


def validate_structured_outputs(params: StructuredOutputsParams) -> str:
    """The compiled grammar, or ``VLLMValidationError`` naming ``structured_outputs``.

    Runs in the front end, so that a bad schema is a 400 and never reaches the engine."""
    if params.choice is not None and (
        not isinstance(params.choice, list)
        or not params.choice
        or not all(isinstance(c, str) and c for c in params.choice)
    ):
        raise VLLMValidationError(
            "structured_outputs.choice must be a non-empty list of non-empty strings",
            "structured_outputs",
        )
    try:
        grammar = compile_grammar(params)
    except (ValueError, TypeError, RuntimeError) as e:  # llguidance raises ValueError
        raise VLLMValidationError(f"invalid structured output: {e}", "structured_outputs") from e
    from llguidance import LLMatcher

    error = LLMatcher.validate_grammar(grammar)
    if error and not error.startswith("WARNING"):
        raise VLLMValidationError(f"invalid structured output: {error}", "structured_outputs")
    return grammar
