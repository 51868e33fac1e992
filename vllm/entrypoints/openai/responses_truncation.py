"""``truncation: "auto"`` on ``/v1/responses`` (OpenAI's): when a turn's context does not
fit the model's window, its oldest items are dropped, whole (a call with its output, a
model turn with its reasoning), until it fits; the instructions and the new input stay."""

from __future__ import annotations

import logging
from collections.abc import Callable
from itertools import pairwise
from typing import TYPE_CHECKING, Any

from vllm.entrypoints.openai.protocol_responses import ResponsesRequest
from vllm.entrypoints.openai.serving_chat import renamed
from vllm.exceptions import VLLMValidationError

if TYPE_CHECKING:
    from vllm.entrypoints.openai.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.serving_chat import OpenAIServingChat
    from vllm.entrypoints.openai.tool_calling import ToolPlan

logger = logging.getLogger(__name__)

# A chat request's prompt rendered and tokenized: (tool plan, token ids, sampling params).
Prepared = tuple["ToolPlan", list[int], Any]
# Items a model's turn is made of (with the answers to its calls: ``_ANSWERS``).
_MODEL_ITEMS = ("reasoning", "function_call", "mcp_call", "mcp_list_tools", "mcp_approval_request")
_ANSWERS = {"function_call_output": "call_id", "mcp_approval_response": "approval_request_id"}


def _is_message(item: dict[str, Any], *roles: str) -> bool:
    return item["type"] == "message" and item["role"] in roles


def droppable_units(items: list[dict[str, Any]], first_new: int) -> list[list[int]]:
    """What truncation "auto" may drop from ``items`` (the context: the stored chain's or
    conversation's items, then the request's new input from ``first_new``), oldest first:
    each unit a run of item indices that goes (or stays) whole. A user message is a unit;
    a model turn (its reasoning, assistant text, function / MCP calls) is one together
    with the outputs of its calls (an output and its call, an approval and its request,
    are never apart, whatever lies between). System / developer messages (instructions)
    are never dropped, nor the newest input: from the request's last user message (else
    its first item), with the unit it belongs to, on."""
    starts = []
    previous = None  # the previous item's kind: "model", "answer", "message"
    calls: dict[str, int] = {}  # call_id / approval request id -> its item's index
    for i, item in enumerate(items):
        kind = item["type"]
        if kind in _ANSWERS:
            role = "answer"
        elif kind in _MODEL_ITEMS or _is_message(item, "assistant"):
            role = "model"
        else:
            role = "message"
        if role == "message" or (role != previous and previous != "model") or i == 0:
            starts.append(i)
        if kind == "function_call":
            calls[item["call_id"]] = i
        elif kind == "mcp_approval_request":
            calls[item["id"]] = i
        elif kind in _ANSWERS:
            call = calls.get(item[_ANSWERS[kind]])
            if call is not None:  # the units from its call's to its own are one
                starts = [s for s in starts if not call < s <= i]
        previous = role
    users = [i for i in range(first_new, len(items)) if _is_message(items[i], "user")]
    keep_from = users[-1] if users else first_new
    bounds = [*starts, len(items)]
    units = [list(range(a, b)) for a, b in pairwise(bounds) if b <= keep_from]
    return [u for u in units if not any(_is_message(items[i], "system", "developer") for i in u)]


def drop_oldest(items: list[dict[str, Any]], first_new: int, count: int) -> list[dict[str, Any]]:
    """``items`` without their ``count`` oldest ``droppable_units``."""
    return _without(items, droppable_units(items, first_new)[:count])


def _without(items: list, units: list[list[int]]) -> list:
    dropped = {i for u in units for i in u}
    return [item for i, item in enumerate(items) if i not in dropped]


async def fit(
    chat: OpenAIServingChat,
    request: ResponsesRequest,
    context: list,
    first_new: int,
    build: Callable[[list[dict]], ChatCompletionRequest],
    messages_of: Callable[[ResponsesRequest, list], list[dict]],
) -> tuple[ChatCompletionRequest, Prepared | None]:
    """The chat request of ``context`` (``build`` makes it from the messages) and, with
    truncation "auto", its prompt rendered (``start_generation``'s ``prepared``).

    "auto" (OpenAI's): when the prompt and the output budget (``max_output_tokens``,
    else the one token the chat path reserves) exceed the context window, the fewest
    oldest items are dropped (``drop_oldest``: whole units, instructions and the new
    input kept) that make it fit, found by binary search, each try rendered and
    tokenized as the turn runs. If nothing droppable is left and it still does not
    fit, it runs with all of them dropped: the engine caps the output, or refuses a
    prompt with no room left (the usual 400). Only this turn's prompt changes: the
    stored chain stays whole. A turn that fits is rendered once, as without."""
    chat_request = build(messages_of(request, context))
    if request.truncation != "auto":
        return chat_request, None
    budget = request.max_output_tokens or 1
    limit = chat.context_limit
    prepared = await _prepare_tokens(chat, chat_request)
    units = droppable_units(context, first_new)
    if len(prepared[1]) + budget <= limit or not units:
        return chat_request, prepared
    tried: dict[int, tuple[ChatCompletionRequest, Prepared]] = {}

    async def attempt(count: int) -> bool:
        kept = _without(context, units[:count])
        candidate = build(messages_of(request, kept))
        tried[count] = (candidate, await _prepare_tokens(chat, candidate))
        return len(tried[count][1][1]) + budget <= limit

    low, high, best = 1, len(units), len(units)
    while low <= high:
        mid = (low + high) // 2
        if await attempt(mid):
            best, high = mid, mid - 1
        else:
            low = mid + 1
    if best not in tried:
        await attempt(best)
    logger.info(
        "responses request: truncation dropped %d of %d items (%d units) to fit %d tokens",
        sum(len(u) for u in units[:best]),
        len(context),
        best,
        limit,
    )
    return tried[best]


async def _prepare_tokens(chat: OpenAIServingChat, chat_request: ChatCompletionRequest) -> Prepared:
    try:
        return await chat.prepare_tokens(chat_request)
    except VLLMValidationError as e:
        raise renamed(e, ResponsesRequest.FIELD_NAMES) from e
