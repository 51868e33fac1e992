"""DeepSeek-V3.2's chat encoding (``--tokenizer-mode deepseek_v32``, vLLM's name).

The model ships no Jinja chat template: its Hub repo renders a conversation in Python
(``encoding/encoding_dsv32.py``). This module writes the same prompt text from the chat
messages the server validated (``ChatMessage.for_template``), the request's tools and
its ``chat_template_kwargs``::

    <｜begin▁of▁sentence｜>{system}<｜User｜>{user}<｜Assistant｜></think>{answer}<｜end▁of▁sentence｜>

- A user turn (or a ``developer`` one, written as a user turn that quotes it) ends by
  opening the assistant's: ``<｜Assistant｜>`` then ``</think>`` (no thinking), or
  ``<think>`` after the last user turn in thinking mode (``{"thinking": true}`` or
  ``{"enable_thinking": true}`` in ``chat_template_kwargs``).
- Tools: a system text first (``## Tools`` with their JSON schemas); an assistant's calls
  in DSML markup after its content (what ``--tool-call-parser deepseek_v32`` reads);
  the tool results following them as one ``<function_results>`` block, which also
  reopens the assistant's turn (``</think>``, or ``<think>`` in thinking mode).
- An assistant turn's ``reasoning`` is written (``{reasoning}</think>``) only in
  thinking mode and only for the turns after the last user message (the current tool
  loop); earlier turns' reasoning is dropped, as DeepSeek's encoder drops it.

What this encoding has no place for is refused (``VLLMValidationError``, a 400): image
parts, ``documents``, a request's own ``chat_template``, unknown roles, tool results
without calls. ``add_generation_prompt`` false leaves the assistant's turn unopened after
a last user or tool message; ``continue_final_message`` leaves the last assistant
message open (no ``<｜end▁of▁sentence｜>``), its reasoning and text as written.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from vllm.exceptions import VLLMValidationError
from vllm.transformers_utils.chat_encodings import images_refused

# The model's own special tokens and prompt text (facts of the format it was trained on).
BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
DEVELOPER_QUOTE = "\n\n# The user's message is: "
TOOLS_TEXT = (
    "## Tools\n"
    "You have access to a set of tools you can use to answer the user's question.\n"
    'You can invoke functions by writing a "<{d}function_calls>" block like the following '
    "as part of your reply to the user:\n"
    "<{d}function_calls>\n"
    '<{d}invoke name="$FUNCTION_NAME">\n'
    '<{d}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{d}parameter>\n'
    "...\n"
    "</{d}invoke>\n"
    '<{d}invoke name="$FUNCTION_NAME2">\n'
    "...\n"
    "</{d}invoke>\n"
    "</{d}function_calls>\n"
    "String and scalar parameters should be specified as is without any escaping or quotes, "
    'while lists and objects should use JSON format. The "string" attribute should be set '
    'to "true" for string type parameters and "false" for other types (numbers, booleans, '
    "arrays, objects).\n"
    "If the thinking_mode is enabled, then after function results you should strongly "
    "consider outputting a thinking block. Here is an example:\n"
    "<{d}function_calls>\n"
    "...\n"
    "</{d}function_calls>\n"
    "<function_results>\n"
    "...\n"
    "</function_results>\n"
    "{think_start}...thinking about results{think_end}\n"
    "Here are the functions available in JSONSchema format:\n"
    "<functions>\n"
    "{schemas}\n"
    "</functions>\n"
)

NAME = "deepseek_v32"
IMAGES_REFUSED = images_refused(NAME)
THINKING_KWARGS = ("thinking", "enable_thinking")


def _json(value: Any) -> str:
    """JSON as the encoder writes it: non-ASCII kept, Python's default separators."""
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return json.dumps(value, ensure_ascii=True, default=str)


def tools_text(tools: Sequence[Mapping[str, Any]]) -> str:
    """The ``## Tools`` system text for OpenAI-format tools (each one's ``function``
    object as a line of JSON)."""
    schemas = "\n".join(_json(_function_of(t)) for t in tools)
    return TOOLS_TEXT.format(d=DSML, think_start=THINK_START, think_end=THINK_END, schemas=schemas)


def _function_of(tool: Any) -> Any:
    if isinstance(tool, Mapping) and isinstance(tool.get("function"), Mapping):
        return tool["function"]
    return tool  # already a bare function schema


def _arguments(raw: Any) -> dict[str, Any]:
    """A call's arguments as a dict (the server hands them over parsed; a JSON string is
    read here; anything that is no JSON object is no arguments)."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw) if raw.strip() else {}
        except (ValueError, RecursionError):
            raw = {}
    return dict(raw) if isinstance(raw, Mapping) else {}


def dsml_call(name: str, arguments: Any) -> str:
    """One call as a DSML ``invoke``: strings verbatim (``string="true"``), any other value
    as JSON (``string="false"``)."""
    params = []
    for key, value in _arguments(arguments).items():
        is_str = isinstance(value, str)
        text = value if is_str else _json(value)
        flag = "true" if is_str else "false"
        params.append(f'<{DSML}parameter name="{key}" string="{flag}">{text}</{DSML}parameter>')
    body = "\n".join(params)
    return f'<{DSML}invoke name="{name}">\n{body}\n</{DSML}invoke>'


def dsml_calls(tool_calls: Sequence[Any]) -> str:
    """An assistant's calls (OpenAI's ``{"function": {"name", "arguments"}}``) as one
    ``function_calls`` block."""
    invokes = []
    for call in tool_calls:
        fn = call.get("function", call) if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise VLLMValidationError(
                "an assistant message's tool_calls must each have a function name",
                "messages",
            )
        invokes.append(dsml_call(fn["name"], fn.get("arguments")))
    calls = "\n".join(invokes)
    return f"<{DSML}function_calls>\n{calls}\n</{DSML}function_calls>"


def _text(message: Mapping[str, Any]) -> str:
    """A message's content as text: typed text parts joined, anything else refused."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, Mapping) and part.get("type") == "text"):
                raise VLLMValidationError(IMAGES_REFUSED, "messages")
            texts.append(str(part.get("text") or ""))
        return "".join(texts)
    raise VLLMValidationError("a message's content must be text", "messages")


def _last_user(messages: Sequence[Mapping[str, Any]]) -> int:
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") in ("user", "developer"):
            return i
    return -1


def thinking_requested(kwargs: Mapping[str, Any] | None) -> bool:
    """Thinking mode: ``chat_template_kwargs`` ``thinking`` or ``enable_thinking`` true
    (what the ``deepseek_v3`` reasoning parser reads too)."""
    return any(bool((kwargs or {}).get(k)) for k in THINKING_KWARGS)


def encode_messages(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    thinking: bool = False,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> str:
    """The prompt text of a conversation; ``messages`` as chat templates get them (role,
    content, an assistant's ``tool_calls`` and ``reasoning``)."""
    msgs: list[Mapping[str, Any]] = list(messages)
    if tools:
        # The tools ride in a system message of their own, first (as vLLM places them).
        msgs.insert(0, {"role": "system", "content": "", "tools": list(tools)})
    last_user = _last_user(msgs)
    final = len(msgs) - 1
    if continue_final_message and (not msgs or msgs[final].get("role") != "assistant"):
        raise VLLMValidationError(
            "continue_final_message needs the last message to be an assistant's",
            "continue_final_message",
        )
    out = [BOS]
    results_open = 0  # tool results written in the current <function_results> block
    for i, msg in enumerate(msgs):
        role = msg.get("role")
        is_final = i == final
        # The text that opens the model's reply after a user turn or tool results.
        think = THINK_START if thinking and i >= last_user else THINK_END
        if role == "system":
            out.append(_text(msg))
            if msg.get("tools"):
                out.append("\n\n" + tools_text(msg["tools"]))
        elif role in ("user", "developer"):
            content = _text(msg)
            if role == "developer":
                if not content:
                    raise VLLMValidationError("a developer message must have content", "messages")
                content = DEVELOPER_QUOTE + content
            out.append(USER + content)
            if add_generation_prompt or not is_final:
                out.append(ASSISTANT + (THINK_START if thinking and i == last_user else THINK_END))
        elif role == "tool":
            calls = _calls_answered(msgs, i)
            if results_open == 0:
                out.append("\n\n<function_results>")
            results_open += 1
            if results_open > calls:
                raise VLLMValidationError(
                    f"message {i - bool(tools)} is a tool result beyond the {calls} tool "
                    "calls of the assistant message before it",
                    "messages",
                )
            out.append(f"\n<result>{_text(msg)}</result>")
            if is_final or msgs[i + 1].get("role") != "tool":
                out.append("\n</function_results>")
                results_open = 0
                if add_generation_prompt or not is_final:
                    out.append("\n\n" + think)
        elif role == "assistant":
            out.append(
                _assistant(msg, thinking and i > last_user, continue_final_message and is_final)
            )
        else:
            raise VLLMValidationError(
                f"--tokenizer-mode {NAME} renders the roles system, user, developer, "
                f"assistant and tool, not {role!r}",
                "messages",
            )
    return "".join(out)


def _calls_answered(msgs: Sequence[Mapping[str, Any]], i: int) -> int:
    """How many calls the assistant message before tool message ``i``'s run made."""
    j = i - 1
    while j >= 0 and msgs[j].get("role") == "tool":
        j -= 1
    calls = msgs[j].get("tool_calls") if j >= 0 and msgs[j].get("role") == "assistant" else None
    if not calls:
        raise VLLMValidationError(
            "a tool message must follow an assistant message with tool_calls "
            f"(--tokenizer-mode {NAME} writes the results after the calls)",
            "messages",
        )
    return len(calls)


def _assistant(msg: Mapping[str, Any], with_reasoning: bool, open_end: bool) -> str:
    content = _text(msg)
    reasoning = msg.get("reasoning")
    if reasoning is None:
        reasoning = msg.get("reasoning_content")
    reasoning = reasoning if isinstance(reasoning, str) else ""
    calls = msg.get("tool_calls") or []
    if open_end:  # continue_final_message: the turn stays open where the client left it
        if calls:
            raise VLLMValidationError(
                "continue_final_message cannot continue an assistant message with tool_calls",
                "continue_final_message",
            )
        if not with_reasoning:
            return content
        return reasoning + (THINK_END + content if content else "")
    head = reasoning + THINK_END if with_reasoning else ""
    tail = "\n\n" + dsml_calls(calls) if calls else ""
    return head + content + tail + EOS


def render(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    add_generation_prompt: bool,
    continue_final_message: bool,
    template_kwargs: Mapping[str, Any] | None,
) -> str:
    """The chat-encoding seam's entry (``Processor.apply_chat_template``)."""
    if (template_kwargs or {}).get("documents") is not None:
        raise VLLMValidationError(
            f"documents cannot be used with --tokenizer-mode {NAME}: DeepSeek-V3.2's chat "
            "encoding has no place for them",
            "documents",
        )
    return encode_messages(
        messages,
        tools,
        thinking=thinking_requested(template_kwargs),
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
    )
