"""``StructuredOutputsParams`` -> an llguidance grammar, and the checks on it.

What a client controls is bounded before anything compiles (``check_limits``), and a
grammar is only accepted once a matcher built with the real tokenizer has computed its
first mask without error (``check_grammar``): llguidance reports some errors (an unknown
special token, a token id past the vocabulary, a ``$ref`` loop) only then.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import StructuredOutputsParams
from vllm.v1.structured_output.json_schema import strict_json_schema

# -- limits on what a client sends (each a 400 naming structured_outputs) ---------------
MAX_CHOICES = 4096
"""Most strings in ``choice``. 4,096 one-line choices compile in ~30 ms on one core."""
MAX_CHOICE_BYTES = 128 * 1024
"""Most UTF-8 bytes of all ``choice`` strings together."""
MAX_JSON_SCHEMA_BYTES = 256 * 1024
"""Most bytes of a JSON schema (serialized): a 160 KiB schema of 120 tools compiles in
~70 ms. Tool-call schemas (all the tools' parameters) count too."""
MAX_REGEX_CHARS = 16 * 1024
"""Most characters of a ``regex``."""
MAX_GRAMMAR_CHARS = 128 * 1024
"""Most characters of a Lark ``grammar``. Also bounds the depth of a chain of rules
(~11k at most), which llguidance compiles recursively (see ``thread.py``)."""
MAX_ERROR_CHARS = 200
"""An llguidance error (it may quote the grammar) is cut to this many characters in
messages and logs."""

# json.dumps' separators and no free whitespace: the form small models imitate best, and
# without free whitespace a weak model cannot loop on newlines inside the object.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def excerpt(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """``text`` cut to ``limit`` characters, saying how long it was when cut."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


def _too_big(what: str, size: int, limit: int, unit: str) -> VLLMValidationError:
    return VLLMValidationError(
        f"structured_outputs.{what} is too large: {size} {unit} (the limit is {limit})",
        "structured_outputs",
    )


def _schema_bytes(schema: dict[str, Any] | str) -> int:
    if isinstance(schema, str):
        return len(schema.encode("utf-8", "surrogatepass"))
    try:
        return len(json.dumps(schema, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    except RecursionError as e:
        raise VLLMValidationError(
            "structured_outputs.json is too deeply nested", "structured_outputs"
        ) from e
    except (TypeError, ValueError) as e:
        raise VLLMValidationError(
            f"structured_outputs.json is not JSON: {e}", "structured_outputs"
        ) from e


def check_limits(params: StructuredOutputsParams) -> None:
    """``VLLMValidationError`` if ``params`` is malformed or past a limit above; cheap
    (linear in the input), so it runs before any compile, on the caller's thread."""
    if params.choice is not None:
        choice = params.choice
        if not isinstance(choice, list) or not choice:
            raise VLLMValidationError(
                "structured_outputs.choice must be a non-empty list of non-empty strings",
                "structured_outputs",
            )
        if len(choice) > MAX_CHOICES:
            raise _too_big("choice", len(choice), MAX_CHOICES, "strings")
        if not all(isinstance(c, str) and c for c in choice):
            raise VLLMValidationError(
                "structured_outputs.choice must be a non-empty list of non-empty strings",
                "structured_outputs",
            )
        size = sum(len(c.encode("utf-8", "surrogatepass")) for c in choice)
        if size > MAX_CHOICE_BYTES:
            raise _too_big("choice", size, MAX_CHOICE_BYTES, "bytes")
    elif params.structural_tag is not None:
        structural_tag_lark(params.structural_tag)  # its shape and sizes
    elif params.json is not None:
        if not isinstance(params.json, dict | str):
            raise VLLMValidationError(
                "structured_outputs.json must be a JSON schema (object or string)",
                "structured_outputs",
            )
        size = _schema_bytes(params.json)
        if size > MAX_JSON_SCHEMA_BYTES:
            raise _too_big("json", size, MAX_JSON_SCHEMA_BYTES, "bytes")
    else:
        for what, value, limit in (
            ("regex", params.regex, MAX_REGEX_CHARS),
            ("grammar", params.grammar, MAX_GRAMMAR_CHARS),
        ):
            if value is None:
                continue
            if not isinstance(value, str):
                raise VLLMValidationError(
                    f"structured_outputs.{what} must be a string", "structured_outputs"
                )
            if len(value) > limit:
                raise _too_big(what, len(value), limit, "characters")
    tag = params.after_reasoning
    if tag is not None and (
        not isinstance(tag, str) or not 0 < len(tag) <= MAX_REASONING_TAG_CHARS
    ):
        raise VLLMValidationError(
            f"structured_outputs.after_reasoning must be a tag of 1 to "
            f"{MAX_REASONING_TAG_CHARS} characters",
            "structured_outputs",
        )


MAX_STRUCTURES = 64
"""Most structures one structural tag may hold (a tool per structure, typically)."""


def _tag_value(value: dict[str, Any] | str) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise VLLMValidationError(
                f"structural_tag is not JSON: {e}", "structured_outputs"
            ) from None
    if not isinstance(value, dict):
        raise VLLMValidationError(
            'structural_tag must be an object: {"structures", "triggers"} or {"format"}',
            "structured_outputs",
        )
    return value


def structural_tag_lark(value: dict[str, Any] | str) -> str:
    """The Lark text of a client's structural tag, in either of vLLM's forms: its own
    ``{"structures", "triggers"}`` (``structural_tag_spec``) or xgrammar's ``{"type":
    "structural_tag", "format": {...}}`` (``structural_tag_format``); within the grammar
    size limit. ``VLLMValidationError`` naming ``structured_outputs``."""
    value = _tag_value(value)
    if "format" in value:
        from vllm.v1.structured_output.structural_tag_format import format_grammar

        lark = format_grammar(value)
    else:
        lark = structural_tag_grammar(*structural_tag_spec(value))
    if len(lark) > MAX_GRAMMAR_CHARS:
        raise _too_big("structural_tag", len(lark), MAX_GRAMMAR_CHARS, "characters of grammar")
    return lark


def structural_tag_spec(value: dict[str, Any] | str) -> tuple[list[dict], list[str]]:
    """vLLM's structural tag, checked: (structures, triggers). Each structure is
    ``{"begin": str, "schema": JSON schema object, "end": str}`` whose ``begin`` starts
    with one of the non-empty ``triggers``; the schemas together within the JSON schema
    size limit. ``VLLMValidationError`` naming what is wrong."""

    def bad(why: str) -> VLLMValidationError:
        return VLLMValidationError(f"structural_tag {why}", "structured_outputs")

    value = _tag_value(value)
    if "format" in value:
        raise bad('in the "format" form has no structures (structural_tag_lark reads it)')
    structures, triggers = value.get("structures"), value.get("triggers")
    if not isinstance(triggers, list) or not triggers:
        raise bad("triggers must be a non-empty list of non-empty strings")
    if not all(isinstance(t, str) and t for t in triggers):
        raise bad("triggers must be a non-empty list of non-empty strings")
    if not isinstance(structures, list) or not structures:
        raise bad("structures must be a non-empty list")
    if len(structures) > MAX_STRUCTURES:
        raise _too_big("structural_tag", len(structures), MAX_STRUCTURES, "structures")
    size = 0
    for i, item in enumerate(structures):
        if not isinstance(item, dict) or set(item) - {"begin", "schema", "end"}:
            raise bad(f"structures[{i}] must be an object with begin, schema and end")
        begin, schema, end = item.get("begin"), item.get("schema"), item.get("end")
        if not (isinstance(begin, str) and begin and isinstance(end, str)):
            raise bad(f"structures[{i}].begin and .end must be strings (begin non-empty)")
        if not isinstance(schema, dict):
            raise bad(f"structures[{i}].schema must be a JSON schema object")
        if not any(begin.startswith(t) for t in triggers):
            raise bad(f"structures[{i}].begin {begin!r} starts with none of the triggers")
        size += _schema_bytes(schema)
    if size > MAX_JSON_SCHEMA_BYTES:
        raise _too_big("structural_tag", size, MAX_JSON_SCHEMA_BYTES, "bytes of schemas")
    return structures, triggers


def json_lark(schema: dict) -> str:
    """A Lark expression of JSON valid against ``schema`` made strict, in this engine's
    JSON layout. The options go inside the schema (``x-guidance``): a compiled grammar in
    its place would be read as a schema of unknown keywords, which any JSON meets."""
    return "%json " + json.dumps({**strict_json_schema(schema), "x-guidance": JSON_OPTIONS})


def structural_tag_grammar(
    structures: list[dict],
    triggers: list[str],
    at_most_one: bool = False,
    rules: Sequence[str] = (),
) -> str:
    """The Lark text of a checked structural tag (``structural_tag_spec``): free text in
    which a trigger opens one of its structures (the rest of ``begin``, JSON valid against
    ``schema`` made strict, ``end``), then free text again, any number of times; with
    ``at_most_one``, once, and the output ends after it. A trigger shaped ``<...>`` is a
    special token's name (llguidance's reading of such a literal); any other is text,
    matched lazily: the first time the text reaches it, the structure starts.

    The tool parsers of formats whose arguments are not JSON (Qwen3-Coder's XML) give a
    structure a ``lark`` expression in place of its ``schema``, and the Lark lines that
    expression uses as ``rules`` (names of their own, not ``start``, ``tag_*`` or
    ``TAG_*``); clients cannot (``structural_tag_spec`` refuses both)."""
    names = [f"tag_{i}" for i in range(len(structures))]
    alternatives = " | ".join(names)
    lines = [
        "%llguidance {}",
        f"start: tag_end | {alternatives}" if at_most_one else f"start: ({alternatives})* tag_end",
        "tag_end: TAG_TEXT",
        "TAG_TEXT: /(.|\\n)*/",
        *rules,
    ]
    for name, structure in zip(names, structures, strict=True):
        begin, end = structure["begin"], structure["end"]
        trigger = next(t for t in triggers if begin.startswith(t))
        inner = structure["lark"] if "lark" in structure else json_lark(structure["schema"])
        body = " ".join(
            part
            for part in (
                json.dumps(begin[len(trigger) :]) if len(begin) > len(trigger) else "",
                inner,
                json.dumps(end) if end else "",
            )
            if part
        )
        if trigger.startswith("<") and trigger.endswith(">"):
            lines.append(f"{name}: TAG_TEXT {trigger} {body}")
        else:
            lines.append(f"{name}_trig[lazy]: TAG_TEXT {json.dumps(trigger)}")
            lines.append(f"{name}: {name}_trig {body}")
    return "\n".join(lines) + "\n"


MAX_REASONING_TAG_CHARS = 64
"""Longest ``after_reasoning`` tag (a model's end-of-reasoning tag is a few characters)."""

_REGEX_META = set("\\.+*?()|[]{}^$#&-~/")


def regex_literal(text: str) -> str:
    """``text`` as a regex matching itself inside a Lark ``/.../`` terminal."""
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


def text_ending_with(name: str, tag: str) -> str:
    """The Lark line of terminal ``name``: any text ending with ``tag``, with no ``tag``
    before. One lexeme, so a greedy lexer cannot split it wrongly."""
    end = regex_literal(tag)
    return f"{name}: /(.|\\n)*{end}/ & ~/(.|\\n)*{end}(.|\\n)+/"


def gate_after_reasoning(grammar: str, tag: str) -> str:
    """``grammar`` (a compiled grammar: llguidance's JSON, or Lark text) preceded by free
    text that ends at the first ``tag``, then up to 8 whitespace characters (bounded: a
    weak model must not loop on newlines there). The free text is one
    lexeme matching "anything ending with ``tag``, with no ``tag`` before": a greedy lexer
    cannot split it wrongly, and while it lasts the mask allows almost every token."""
    try:
        spec = json.loads(grammar)
        inner = spec["grammars"]
    except (ValueError, TypeError, KeyError):
        inner = [{"lark_grammar": grammar}]
    if len(inner) != 1:
        raise ValueError("a constraint of several grammars cannot follow reasoning")
    lark = (
        "start: REASONING WS? answer\n"
        f"{text_ending_with('REASONING', tag)}\n"
        "WS: /[ \\t\\r\\n]{1,8}/\n"
        "answer: @answer\n"
    )
    grammars = [{"name": "reasoning", "lark_grammar": lark}, {**inner[0], "name": "answer"}]
    return json.dumps({"grammars": grammars})


def compile_grammar(params: StructuredOutputsParams) -> str:
    """The llguidance grammar text of ``params`` (``ValueError`` if it cannot be built),
    after the reasoning when ``params.after_reasoning`` says so."""
    grammar = _compile_constraint(params)
    if params.after_reasoning is not None:
        return gate_after_reasoning(grammar, params.after_reasoning)
    return grammar


def _compile_constraint(params: StructuredOutputsParams) -> str:
    """The llguidance grammar text of ``params`` (``ValueError`` if it cannot be built).

    A JSON schema is made strict first (``strict_json_schema``: no property the schema
    does not name), as vLLM's default backend compiles schemas. Deterministic: the front
    end and the engine get the same text from the same params."""
    from llguidance import LLMatcher

    if params.json is not None:
        schema = params.json
        if isinstance(schema, str):
            schema = json.loads(schema)
        if not isinstance(schema, dict):
            raise ValueError("a JSON schema must be an object")
        return LLMatcher.grammar_from_json_schema(strict_json_schema(schema), defaults=JSON_OPTIONS)
    if params.json_object:
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if params.regex is not None:
        return LLMatcher.grammar_from_regex(params.regex)
    if params.structural_tag is not None:
        return LLMatcher.grammar_from_lark(structural_tag_lark(params.structural_tag))
    if params.choice is not None:
        # One terminal (one lexeme, a union of literals) rather than one rule with an
        # alternative per choice: llguidance's Earley rows hold at most 2,000 items, and
        # past that the matcher failed mid-generation. Lark literals take JSON's escapes.
        return LLMatcher.grammar_from_lark(
            "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c) for c in params.choice)
        )
    return LLMatcher.grammar_from_lark(params.grammar)


def parser_limits():
    """llguidance's own limits (its defaults bound lexer fuel per step and grammar size);
    its errors without the parser state and grammar, which can be huge."""
    from llguidance import LLParserLimits

    return LLParserLimits(verbose_errors=False)


def new_matcher(ll_tokenizer, grammar: str):
    """A matcher of ``grammar`` that has computed its first mask: llguidance reports
    some grammar errors only then (``is_error()``). Call it in the grammar thread."""
    from llguidance import LLMatcher

    matcher = LLMatcher(ll_tokenizer, grammar, log_level=0, limits=parser_limits())
    if not matcher.is_error():
        matcher.compute_bitmask()
    return matcher


def check_grammar(grammar: str, ll_tokenizer=None) -> str | None:
    """Why ``grammar`` cannot be served (bounded), or None. Without a tokenizer only the
    syntax is checked; with one, a matcher is built and asked for its first mask."""
    if ll_tokenizer is None:
        from llguidance import LLMatcher

        error = LLMatcher.validate_grammar(grammar, limits=parser_limits())
        return excerpt(error) if error and not error.startswith("WARNING") else None
    matcher = new_matcher(ll_tokenizer, grammar)
    if not matcher.is_error():
        return None
    error = matcher.get_error().replace("<non-verbose/>", "").strip()
    if error.startswith("NoExtension"):  # stopped before its first token
        return "the constraint matches no text (a $ref loop, or a schema only referring to itself?)"
    return excerpt(error or str(matcher.stop_reason()))


def validate_structured_outputs(params: StructuredOutputsParams, ll_tokenizer=None) -> str:
    """The compiled grammar, or ``VLLMValidationError`` naming ``structured_outputs``.

    Runs in the front end, so that a bad schema is a 400 and never reaches the engine.
    Pass the llguidance tokenizer (``StructuredOutputValidator``) for the full check;
    without it only the limits and the grammar's syntax are checked."""
    check_limits(params)
    try:
        grammar = compile_grammar(params)
    except (ValueError, TypeError, RuntimeError) as e:  # RecursionError is a RuntimeError
        raise VLLMValidationError(
            f"invalid structured output: {excerpt(str(e))}", "structured_outputs"
        ) from e
    error = check_grammar(grammar, ll_tokenizer)
    if error:
        raise VLLMValidationError(f"invalid structured output: {error}", "structured_outputs")
    return grammar
