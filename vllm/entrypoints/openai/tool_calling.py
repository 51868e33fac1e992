"""OpenAI tool calling for chat requests: ``tools`` / ``tool_choice`` / ``response_format``
in, ``message.tool_calls`` (or streamed tool-call deltas) out; and, with
``--reasoning-parser``, the model's reasoning apart from its content (``message.reasoning``,
vLLM's field), read before the tool parser reads the rest.

``tool_choice``, as vLLM serves it:
- ``"none"``: plain content (the tools still reach the chat template);
- ``"auto"`` (the default when ``tools`` are given): the model decides, the
  ``--tool-call-parser`` reads its calls; needs ``--enable-auto-tool-choice``;
- ``"required"`` / ``{"type": "function", "function": {"name": ...}}``: guided decoding
  makes the output a JSON list of calls (one call of that function), valid against the
  tools' parameter schemas, read back by the JSON parser. The schemas compile strict
  (``strict_json_schema``): an object schema that does not say ``additionalProperties``
  gets no key it does not name, so no key twice either.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from vllm.entrypoints.openai.tool_parsers import (
    ToolParser,
    get_tool_parser,
    tool_parser_class,
    tool_parser_names,
)
from vllm.exceptions import VLLMValidationError
from vllm.reasoning import (
    ReasoningParser,
    count_reasoning_tokens,
    get_reasoning_parser,
    reasoning_parser_names,
)
from vllm.sampling_params import StructuredOutputsParams
from vllm.v1.structured_output.grammar import (
    MAX_STRUCTURES,
    check_limits,
    structural_tag_grammar,
    structural_tag_spec,
)

logger = logging.getLogger(__name__)


# --tool-strict-level (vLLM's): what tool_choice "auto" holds to its form once the model
# opens a call. auto: nothing, unless a tool says "strict": true; then every call's
# envelope (a known name) and the strict tools' arguments. function: every call's envelope.
# parameter: the envelope and every tool's arguments, as if each were strict.
TOOL_STRICT_LEVELS = ("auto", "function", "parameter")


@dataclass(frozen=True)
class ToolCallingConfig:
    """The server's flags for reading a model's output: tool calling
    (``--enable-auto-tool-choice``, ``--tool-call-parser``) and ``--reasoning-parser``."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    exclude_tools_when_tool_choice_none: bool = False  # the template gets no tools then
    response_role: str = "assistant"  # the role of the replies
    tool_strict_level: str = "auto"  # --tool-strict-level (TOOL_STRICT_LEVELS)
    # The tokenizer's special tokens, text -> id (a tool-call marker that is one is
    # matched as the token by a structural tag): set by the server once its tokenizer is
    # loaded.
    special_tokens: Mapping[str, int] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if self.tool_strict_level not in TOOL_STRICT_LEVELS:
            raise ValueError(
                f"tool_strict_level must be one of {TOOL_STRICT_LEVELS}, "
                f"got {self.tool_strict_level!r}"
            )
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
        if self.tool_call_parser is not None and self.tool_call_parser not in tool_parser_names():
            raise ValueError(
                f"tool_call_parser must be one of {tool_parser_names()}, "
                f"got {self.tool_call_parser!r}"
            )
        if (
            self.tool_strict_level != "auto"
            and self.tool_call_parser is not None
            and not tool_parser_class(self.tool_call_parser).has_structural_tag()
        ):
            raise ValueError(
                f"--tool-strict-level {self.tool_strict_level} needs a tool call parser whose "
                f"calls have a structural tag; {self.tool_call_parser!r} has none (see "
                "docs/tool_calling.md)"
            )
        if self.reasoning_parser is not None and (
            self.reasoning_parser not in reasoning_parser_names()
        ):
            raise ValueError(
                f"reasoning_parser must be one of {reasoning_parser_names()}, "
                f"got {self.reasoning_parser!r}"
            )

    @classmethod
    def from_args(cls, args: Any) -> ToolCallingConfig:
        return cls(
            bool(getattr(args, "enable_auto_tool_choice", False)),
            getattr(args, "tool_call_parser", None),
            getattr(args, "reasoning_parser", None),
            bool(getattr(args, "exclude_tools_when_tool_choice_none", False)),
            getattr(args, "response_role", None) or "assistant",
            getattr(args, "tool_strict_level", None) or "auto",
        )


@dataclass
class ToolPlan:
    """How one request handles tools: what the template gets, how its output is read."""

    template_tools: list[dict] | None = None
    parser: ToolParser | None = None  # None: the output is plain content
    structured_outputs: StructuredOutputsParams | None = None
    forced_name: str | None = None  # a named tool_choice (OpenAI then finishes "stop")
    guided: bool = False  # required / named: the output's form is guaranteed
    reasoning: ReasoningParser | None = None  # None: no reasoning is split off
    include_reasoning: bool = True  # False: the reasoning is dropped from the response
    stream_reasoning: bool = True  # False: streamed in one piece once it is over
    # The configured parser's call ids, and whether its markers are special tokens the
    # output's text must keep (Mistral's [TOOL_CALLS]).
    call_id: Callable[[], str] = ToolParser.new_call_id
    keep_special_tokens: bool = False
    role: str = "assistant"  # the reply's (--response-role)

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The non-streaming ``message`` and its ``finish_reason``."""
        if self.reasoning is None:
            return self._content_message(text, finish_reason)
        extracted = self.reasoning.extract(text, final=True)
        message, finish_reason = self._content_message(extracted.content, finish_reason)
        if message["content"] == "":
            message["content"] = None  # all reasoning (vLLM's null content)
        if extracted.reasoning is not None and self.include_reasoning:
            message["reasoning"] = extracted.reasoning
        return message, finish_reason

    @property
    def hides_reasoning(self) -> bool:
        """``include_reasoning: false`` on a split output: the reasoning's logprobs and
        token ids are withheld too (they would spell it out), as in vLLM."""
        return self.reasoning is not None and not self.include_reasoning

    def reasoning_tokens(
        self, token_ids: Sequence[int], decode: Callable[[Sequence[int]], str]
    ) -> int:
        """How many of the output's tokens are its reasoning (0 when none is split off)."""
        if self.reasoning is None:
            return 0
        return count_reasoning_tokens(self.reasoning, token_ids, decode)

    def _content_message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        if self.parser is None:
            return {"role": self.role, "content": text}, finish_reason
        extracted = self.parser.extract(text, final=True)
        found, content = extracted.calls, extracted.content
        if not found and self.guided:
            # Cut off by max_tokens (a small model may repeat calls until then): the
            # complete calls before the cut are valid by construction.
            found = [c for c in self.parser.extract(text, False).calls if c.complete and c.name]
            content = None
        if not found:
            return {"role": self.role, "content": self.parser.plain_content(text)}, finish_reason
        calls = [_call_dict(c.name, c.arguments, c.id or self.call_id()) for c in found]
        message = {"role": self.role, "content": content, "tool_calls": calls}
        return message, self.finish_reason(finish_reason, True)

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        if reason is None or not called or reason == "abort":
            return reason
        return "stop" if self.forced_name else "tool_calls"

    def streamer(self) -> OutputStreamer | None:
        """A choice's stream reader; None when the text is all plain content."""
        if self.parser is None and self.reasoning is None:
            return None
        tools = ToolCallStreamer(self.parser, self.call_id) if self.parser is not None else None
        return OutputStreamer(self, tools)


def _call_dict(name: str, arguments: str, call_id: str) -> dict:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


@dataclass
class ToolCallStreamer:
    """One choice's stream: turns text deltas into OpenAI deltas (content and tool-call
    pieces). A call's first delta has its id, type and name; later ones append to its
    ``arguments``, whose pieces concatenate to the non-streaming response's string."""

    parser: ToolParser
    call_id: Callable[[], str] = ToolParser.new_call_id
    text: str = ""
    sent_content: str = ""
    sent_calls: list[int] = field(default_factory=list)  # per call: argument chars sent

    def delta(self, new_text: str, final: bool) -> dict:
        self.text += new_text
        extracted = self.parser.extract(self.text, final)
        delta: dict[str, Any] = {}
        content = extracted.content or ""
        if content.startswith(self.sent_content) and len(content) > len(self.sent_content):
            delta["content"] = content[len(self.sent_content) :]
            self.sent_content = content
        pieces = []
        for i, call in enumerate(extracted.calls):
            if i == len(self.sent_calls):
                if call.name is None:
                    break  # its header needs the name; later calls wait behind it
                call_id = call.id or self.call_id()
                pieces.append({"index": i, **_call_dict(call.name, call.arguments, call_id)})
                self.sent_calls.append(len(call.arguments))
            elif len(call.arguments) > self.sent_calls[i]:
                piece = call.arguments[self.sent_calls[i] :]
                pieces.append({"index": i, "function": {"arguments": piece}})
                self.sent_calls[i] = len(call.arguments)
        if pieces:
            delta["tool_calls"] = pieces
        return delta

    @property
    def called(self) -> bool:
        return bool(self.sent_calls)


@dataclass
class OutputStreamer:
    """One choice's stream: the reasoning (``{"reasoning": ...}`` deltas) split from the
    rest, which goes to the tool-call streamer, else out as ``content``. The pieces of
    each kind concatenate to the non-streaming message's field."""

    plan: ToolPlan
    tools: ToolCallStreamer | None
    text: str = ""
    sent_reasoning: int = 0  # characters of the reasoning sent
    passed_content: int = 0  # characters of the content passed on

    def delta(self, new_text: str, final: bool) -> dict:
        reasoning = self.plan.reasoning
        if reasoning is None:
            assert self.tools is not None
            return self.tools.delta(new_text, final)
        self.text += new_text
        extracted = reasoning.extract(self.text, final)
        delta: dict[str, Any] = {}
        thought = extracted.reasoning or ""
        ready = self.plan.stream_reasoning or extracted.ended or final
        if self.plan.include_reasoning and ready and len(thought) > self.sent_reasoning:
            delta["reasoning"] = thought[self.sent_reasoning :]
            self.sent_reasoning = len(thought)
        piece = extracted.content[self.passed_content :]
        self.passed_content = len(extracted.content)
        if self.tools is not None:
            if piece or final:
                delta.update(self.tools.delta(piece, final))
        elif piece:
            delta["content"] = piece
        return delta

    @property
    def called(self) -> bool:
        return self.tools is not None and self.tools.called


# -- request -> plan ----------------------------------------------------------------------
def plan_tool_calls(request: Any, config: ToolCallingConfig) -> ToolPlan:
    """The plan of a ``ChatCompletionRequest``; ``VLLMValidationError`` (a 400) naming
    ``tools``, ``tool_choice`` or ``response_format`` for what cannot be served."""
    functions = _validate_tools(request.tools)
    choice = request.tool_choice
    if choice is None:
        choice = "auto" if functions else "none"
    response_format = guided_params(request)
    if isinstance(choice, str) and choice in ("none", "auto", "required"):
        if choice != "none" and not functions:
            raise VLLMValidationError(
                f'tool_choice "{choice}" needs tools', "tool_choice", code="invalid_tool_choice"
            )
        hidden = choice == "none" and config.exclude_tools_when_tool_choice_none
        plan = ToolPlan(template_tools=None if hidden else request.tools or None)
        if config.tool_call_parser is not None:
            plan.call_id = tool_parser_class(config.tool_call_parser).new_call_id
        if choice == "auto":
            if not config.enable_auto_tool_choice:
                raise VLLMValidationError(
                    '"auto" tool choice requires --enable-auto-tool-choice and '
                    "--tool-call-parser to be set",
                    "tool_choice",
                )
            plan.parser = get_tool_parser(config.tool_call_parser, functions)
            plan.keep_special_tokens = plan.parser.keeps_special_tokens
            if response_format is None:  # with one, its grammar holds the whole output
                single = request.parallel_tool_calls is False
                plan.structured_outputs = _strict_calls(plan.parser, functions, config, single)
        elif choice == "required":
            plan.parser, plan.guided = get_tool_parser("json"), True
            schema = _required_schema(functions, request.parallel_tool_calls is not False)
            plan.structured_outputs = StructuredOutputsParams(json=schema)
    else:
        name = _named_choice(choice, functions)
        plan = ToolPlan(request.tools, get_tool_parser("json"), forced_name=name, guided=True)
        if config.tool_call_parser is not None:
            plan.call_id = tool_parser_class(config.tool_call_parser).new_call_id
        plan.structured_outputs = StructuredOutputsParams(json=_call_schema(name, functions[name]))
    plan.role = config.response_role
    if response_format is not None:
        if plan.structured_outputs is not None:
            raise VLLMValidationError(
                "response_format cannot be combined with a required or named tool_choice",
                "response_format",
            )
        plan.structured_outputs = response_format
    if config.reasoning_parser is not None and request.separate_reasoning is not False:
        plan.reasoning = get_reasoning_parser(config.reasoning_parser, request.chat_template_kwargs)
        plan.keep_special_tokens |= plan.reasoning.keeps_special_tokens
        plan.include_reasoning = request.include_reasoning is not False
        plan.stream_reasoning = request.stream_reasoning is not False
        end = plan.reasoning.end_of_reasoning
        if plan.structured_outputs is not None and end is not None:
            # As vLLM: the model reasons freely, the grammar holds once that is over.
            plan.structured_outputs = dataclasses.replace(
                plan.structured_outputs, after_reasoning=end
            )
    return plan


def _validate_tools(tools: Any) -> dict[str, dict]:
    """Function name -> its definition (``{"name", "description", "parameters"}``)."""
    if tools is None:
        return {}
    functions: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise VLLMValidationError(
                f'tools[{i}] must be {{"type": "function", "function": {{...}}}}', "tools"
            )
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise VLLMValidationError(f"tools[{i}].function.name must be a string", "tools")
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise VLLMValidationError(
                f"tools[{i}].function.parameters must be a JSON schema object", "tools"
            )
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise VLLMValidationError(f"tools[{i}].function.strict must be a boolean", "tools")
        functions[name] = {**fn, "parameters": params}
    return functions


def _strict_calls(
    parser: ToolParser, functions: dict[str, dict], config: ToolCallingConfig, single: bool
) -> StructuredOutputsParams | None:
    """tool_choice "auto": the structural tag that holds the model's calls to their form
    once one opens (``TOOL_STRICT_LEVELS``), or None (free, as without strict tools).
    ``single`` (``parallel_tool_calls: false``): at most one call, the output ending with
    it; as in vLLM, that needs the envelope, so it raises the level to ``function``."""
    level = config.tool_strict_level
    if single and level == "auto":
        level = "function"
    strict = {name: fn.get("strict") is True for name, fn in functions.items()}
    if level == "auto" and not any(strict.values()):
        return None
    schemas = {
        name: fn["parameters"] if strict[name] or level == "parameter" else None
        for name, fn in functions.items()
    }
    try:
        if len(schemas) > MAX_STRUCTURES:  # one structural tag's limit, every format's
            raise VLLMValidationError(
                f"{len(schemas)} tools are more than a structural tag holds ({MAX_STRUCTURES})",
                "tools",
            )
        tag = parser.structural_tag(schemas, config.special_tokens, single)
        if tag is None:
            _warn_once(
                f"{type(parser).__name__} has no structural tag with this tokenizer: strict "
                "tools and parallel_tool_calls false are not enforced under tool_choice auto"
            )
            return None
        if "rules" in tag or any("lark" in s for s in tag["structures"]):
            # A format whose calls are not begin + JSON + end (Qwen3-Coder's XML, special
            # tokens inside a call): its own Lark, which only a grammar carries, bounded
            # by the grammar's size.
            structures, triggers, rules = tag["structures"], tag["triggers"], tag.get("rules", ())
        else:
            structures, triggers = structural_tag_spec(tag)  # past one tag's limits: a 400
            if not single:
                return StructuredOutputsParams(structural_tag=tag)
            rules = ()
        params = StructuredOutputsParams(
            grammar=structural_tag_grammar(structures, triggers, at_most_one=single, rules=rules)
        )
        check_limits(params)
        return params
    except VLLMValidationError as e:
        logger.warning("Tool calls under tool_choice auto are not constrained: %s", e)
        return None


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)


def _named_choice(choice: Any, functions: dict[str, dict]) -> str:
    is_function = isinstance(choice, dict) and choice.get("type") == "function"
    fn = choice.get("function") if is_function else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise VLLMValidationError(
            'tool_choice must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    if name not in functions:
        raise VLLMValidationError(
            f"tool_choice names {name!r}, which is not in tools", "tool_choice"
        )
    return name


def _call_schema(name: str, fn: dict) -> dict:
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": fn["parameters"]},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _required_schema(functions: dict[str, dict], parallel: bool) -> dict:
    calls = [_call_schema(name, fn) for name, fn in functions.items()]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    return schema if parallel else {**schema, "maxItems": 1}


def response_format_params(fmt: Any) -> StructuredOutputsParams | None:
    """OpenAI's ``response_format`` as the grammar it asks for (None: plain text)."""
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema", {}) if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise VLLMValidationError(
                "response_format.json_schema.schema must be a JSON schema object",
                "response_format",
            )
        if not schema:  # any object (a strict empty object schema would allow only {})
            return StructuredOutputsParams(json_object=True)
        return StructuredOutputsParams(json=schema)
    if kind == "structural_tag":  # vLLM's: {"type", "structures", "triggers"}
        tag = {k: v for k, v in fmt.items() if k != "type"}
        return StructuredOutputsParams(structural_tag=tag)
    raise VLLMValidationError(
        'response_format.type must be "text", "json_object", "json_schema" or "structural_tag"',
        "response_format",
    )


def guided_params(request: Any) -> StructuredOutputsParams | None:
    """What a request's ``response_format`` or, without one, vLLM's ``structured_outputs``
    field asks the output to follow (chat and completions)."""
    return response_format_params(request.response_format) or structured_outputs_from(
        request.structured_outputs
    )


def structured_outputs_from(value: Any) -> StructuredOutputsParams | None:
    """vLLM's ``structured_outputs`` request field (``{"json": ...}``, ``{"regex": ...}``,
    ``{"choice": [...]}``, ``{"grammar": ...}``, ``{"json_object": true}``,
    ``{"structural_tag": ...}``)."""
    if value is None:
        return None
    kinds = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
    if not isinstance(value, dict) or set(value) - set(kinds):
        raise VLLMValidationError(
            f"structured_outputs must be an object with one of {kinds}", "structured_outputs"
        )
    return StructuredOutputsParams(**value)


_warned_templates: set[int] = set()


def special_tokens_of(tokenizer: Any) -> Mapping[str, int]:
    """The added tokens a tokenizer marks special (what llguidance matches as tokens, not
    text), text -> id; none without a tokenizer."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return MappingProxyType(
        {t.content: i for i, t in decoder.items() if getattr(t, "special", False)}
    )


def warn_if_template_ignores_tools(template: str | None) -> None:
    """Log once per template that never reads ``tools`` (SmolLM2's own does not): the
    model is then never told about them. ``--chat-template`` can give one that does."""
    if template is None or "tools" in template or hash(template) in _warned_templates:
        return
    _warned_templates.add(hash(template))
    logger.warning(
        "The chat template does not use `tools`: the model will not see them. Start the "
        "server with a tool-aware --chat-template (examples/tool_chat_template_*.jinja)."
    )
