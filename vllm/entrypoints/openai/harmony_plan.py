"""gpt-oss chat replies: the harmony output (``harmony.py``) as OpenAI's message.

Used for a model whose ``hf_config.model_type`` is ``gpt_oss``, as vLLM does, and whenever
the server names ``--reasoning-parser openai_gptoss`` or ``--tool-call-parser openai``:
the ``analysis`` channel is ``reasoning``, ``final`` (and a preamble) is ``content``,
messages to ``functions.NAME`` are ``tool_calls`` (``finish_reason: "tool_calls"``). The
markers are special tokens, so these requests keep them in their text whatever their
``skip_special_tokens``; the client never sees them. Every endpoint that reads a chat plan
(chat completions, /v1/responses, /v1/messages) reads it this way.

The prompt is the checkpoint's own chat template (gpt-oss's renders harmony), not
``openai_harmony``'s renderer as in vLLM.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

# Importing them registers "openai" and "openai_gptoss" (their registries' __init__ list
# them too once that line is added there).
from vllm.entrypoints.openai.harmony import CONTENT, REASONING, HarmonyReading, read_harmony
from vllm.entrypoints.openai.tool_calling import ToolCallingConfig, ToolPlan, plan_tool_calls
from vllm.entrypoints.openai.tool_parsers.openai_tool_parser import call_arguments
from vllm.reasoning.gptoss_reasoning_parser import GptOssReasoningParser

logger = logging.getLogger(__name__)

HARMONY_MODEL_TYPES = frozenset(("gpt_oss",))


def uses_harmony(model_config: Any, config: ToolCallingConfig) -> bool:
    """Whether the server's model answers in harmony: its HF config's ``model_type``, or a
    harmony parser named on the command line."""
    if config.reasoning_parser == "openai_gptoss" or config.tool_call_parser == "openai":
        return True
    if model_config is None:
        return False
    try:
        from vllm.model_executor.model_loader import hf_config_of

        model_type = getattr(hf_config_of(model_config), "model_type", None)
    except Exception as e:  # no readable HF config (a GGUF file alone): not gpt-oss
        logger.debug("no HF config to tell the output format: %s", e)
        return False
    return model_type in HARMONY_MODEL_TYPES


def plan_harmony(request: Any, config: ToolCallingConfig) -> ToolPlan:
    """The plan of a chat request to a harmony model. ``tool_choice`` "auto" needs no flag
    (as in vLLM); "none" drops any call the model writes. A required or named
    ``tool_choice`` is the generic guided plan: its grammar holds from the first token, so
    that output is the plain JSON of the calls, not harmony."""
    choice = request.tool_choice
    guided = choice == "required" or isinstance(choice, dict)
    if guided:
        return plan_tool_calls(request, dataclasses.replace(config, reasoning_parser=None))
    harmony = dataclasses.replace(
        config, enable_auto_tool_choice=True, tool_call_parser="openai", reasoning_parser=None
    )
    base = plan_tool_calls(request, harmony)  # the checks and 400s of every chat request
    plan = HarmonyPlan(**{f.name: getattr(base, f.name) for f in dataclasses.fields(ToolPlan)})
    plan.surface_calls = base.parser is not None  # "auto" (tools given)
    plan.parser, plan.keep_special_tokens = None, True
    if request.separate_reasoning is not False:
        plan.reasoning = GptOssReasoningParser(request.chat_template_kwargs or {})
        plan.include_reasoning = request.include_reasoning is not False
        plan.stream_reasoning = request.stream_reasoning is not False
    return plan


@dataclass
class HarmonyPlan(ToolPlan):
    """A ``ToolPlan`` whose output is harmony. ``reasoning`` (an ``openai_gptoss`` parser)
    is None when the request asked ``separate_reasoning: false``: the analysis is then
    content, in order with the rest."""

    surface_calls: bool = False  # False: tool_choice "none", or no tools

    def content_kinds(self) -> tuple[str, ...]:
        return (CONTENT,) if self.reasoning is not None else (REASONING, CONTENT)

    def calls(self, reading: HarmonyReading, final: bool) -> list[tuple[str, str]]:
        if not self.surface_calls:
            return []
        return [(m.function_name, call_arguments(m.text, final)) for m in reading.calls]

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        reading = read_harmony(text, final=True)
        message: dict[str, Any] = {
            "role": self.role,
            "content": reading.text_of(*self.content_kinds()),
        }
        if self.reasoning is not None and self.include_reasoning and reading.reasoning:
            message["reasoning"] = reading.reasoning
        calls = self.calls(reading, final=True)
        if calls:
            message["tool_calls"] = [_call(name, args, self.call_id()) for name, args in calls]
        return message, self.finish_reason(finish_reason, bool(calls))

    def streamer(self) -> HarmonyStreamer:
        return HarmonyStreamer(self)


def _call(name: str, arguments: str, call_id: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


@dataclass
class HarmonyStreamer:
    """One choice's stream: each delta re-reads the whole output and sends what grew
    (``reasoning``, ``content``, tool-call pieces: a call's first piece has its index, id,
    type and name, later ones append to its arguments). The pieces of each field add up
    to the non-streaming message's."""

    plan: HarmonyPlan
    text: str = ""
    sent_reasoning: str = ""
    sent_content: str = ""
    sent_calls: list[int] = dataclasses.field(default_factory=list)  # argument chars sent

    def delta(self, new_text: str, final: bool) -> dict:
        self.text += new_text
        reading = read_harmony(self.text, final)
        delta: dict[str, Any] = {}
        plan = self.plan
        if plan.reasoning is not None and plan.include_reasoning:
            if plan.stream_reasoning or reading.reasoning_ended or final:
                piece = _grown(self.sent_reasoning, reading.reasoning)
                if piece:
                    delta["reasoning"], self.sent_reasoning = piece, self.sent_reasoning + piece
        piece = _grown(self.sent_content, reading.text_of(*plan.content_kinds()))
        if piece:
            delta["content"], self.sent_content = piece, self.sent_content + piece
        pieces = []
        for i, (name, args) in enumerate(plan.calls(reading, final)):
            if i == len(self.sent_calls):
                pieces.append({"index": i, **_call(name, args, plan.call_id())})
                self.sent_calls.append(len(args))
            elif len(args) > self.sent_calls[i]:
                pieces.append({"index": i, "function": {"arguments": args[self.sent_calls[i] :]}})
                self.sent_calls[i] = len(args)
        if pieces:
            delta["tool_calls"] = pieces
        return delta

    @property
    def called(self) -> bool:
        return bool(self.sent_calls)


def _grown(sent: str, now: str | None) -> str:
    """What ``now`` adds to ``sent`` (nothing if it does not extend it)."""
    now = now or ""
    return now[len(sent) :] if now.startswith(sent) else ""
