"""The server-sent events of a streamed ``/v1/responses`` response.

One response streams as::

    response.created, response.in_progress
    per output item (reasoning, a message, or a function call), in output order:
        response.output_item.added
        reasoning:     response.content_part.added, response.reasoning_text.delta ...,
                       response.reasoning_text.done, response.content_part.done
        message:       response.content_part.added, response.output_text.delta ...,
                       response.output_text.done, response.content_part.done
        function call: response.function_call_arguments.delta ...,
                       response.function_call_arguments.done
        MCP listing:   response.mcp_list_tools.in_progress, .completed
        MCP call:      response.mcp_call_arguments.delta ..., .done, then once the call
                       has run on its server: response.mcp_call.in_progress,
                       response.mcp_call.completed (or .failed)
        response.output_item.done
    response.completed (response.incomplete when cut by max_output_tokens)

An item is closed (its ``done`` events sent) when the next one starts or the output
ends. Every event has a ``sequence_number``, 0 first; the items' ids are those of the
final response.
"""

from __future__ import annotations

import json
from typing import Any

from vllm.entrypoints.openai.protocol_responses import call_item, message_item, reasoning_item
from vllm.entrypoints.openai.responses_mcp import approval_item
from vllm.entrypoints.openai.responses_mcp import call_item as mcp_call_item


def sse_event(payload: dict[str, Any]) -> str:
    return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


class ResponseEvents:
    """The events of one response, built from text and tool-call deltas. ``items``: the
    output items so far (the final response's ``output`` once ``finish`` has run)."""

    def __init__(self) -> None:
        self.seq = 0
        self.items: list[dict[str, Any]] = []
        self._open: int | None = None  # output index of the item still streaming
        self._calls: dict[int, int] = {}  # tool call index -> output index
        # MCP tools: their names -> their server labels (a call to one is an mcp_call
        # item, done once it has run: ``mcp_call_ran``), and the calls still to run.
        self.mcp_labels: dict[str, str] = {}
        self.mcp_asks: set[str] = set()  # the MCP tools whose calls wait for approval
        self.pending_mcp: list[int] = []

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse_event(payload)

    def lifecycle(self, kind: str, response: dict[str, Any]) -> str:
        """``response.created``, ``.in_progress``, ``.completed``, ``.incomplete``, ..."""
        return self.event(kind, response=response)

    def text(self, delta: str) -> list[str]:
        """Events for ``delta`` of the assistant's text (a new message item if needed)."""
        events = self._open_text_item("message")
        self.items[self._open]["content"][0]["text"] += delta
        events.append(
            self._item_event(
                "response.output_text.delta", content_index=0, delta=delta, logprobs=[]
            )
        )
        return events

    def reasoning(self, delta: str) -> list[str]:
        """Events for ``delta`` of the model's reasoning (a new reasoning item if needed)."""
        events = self._open_text_item("reasoning")
        self.items[self._open]["content"][0]["text"] += delta
        events.append(
            self._item_event("response.reasoning_text.delta", content_index=0, delta=delta)
        )
        return events

    def _open_text_item(self, kind: str) -> list[str]:
        """Open a message or reasoning item with one empty text part, unless it is open."""
        if self._open is not None and self.items[self._open]["type"] == kind:
            return []
        events = self._close()
        if kind == "message":
            item = message_item("", "in_progress")
            part = {"type": "output_text", "text": "", "annotations": []}
        else:
            item = reasoning_item("", "in_progress")
            part = {"type": "reasoning_text", "text": ""}
        item["content"] = []
        events += self._add(item)
        item["content"].append(part)
        events.append(self._item_event("response.content_part.added", content_index=0, part=part))
        return events

    def tool_call(self, piece: dict[str, Any]) -> list[str]:
        """Events for one chat tool-call delta (``ToolCallStreamer``): the first piece of
        a call (with its id and name) adds a function_call item, later ones extend its
        arguments."""
        events = []
        index, args = piece["index"], piece["function"].get("arguments") or ""
        if index not in self._calls:
            events += self._close()
            name = piece["function"]["name"]
            if name in self.mcp_asks:
                item = approval_item(self.mcp_labels[name], name, "")
            elif name in self.mcp_labels:
                item = mcp_call_item(self.mcp_labels[name], name, "")
            else:
                item = call_item(piece["id"], name, "")
                item["status"] = "in_progress"
            events += self._add(item)
            self._calls[index] = self._open
        output_index = self._calls[index]
        item = self.items[output_index]
        if args:
            item["arguments"] += args
            if item["type"] == "mcp_approval_request":  # sent whole, with its item's done
                return events
            kind = "mcp_call" if item["type"] == "mcp_call" else "function_call"
            events.append(
                self.event(
                    f"response.{kind}_arguments.delta",
                    item_id=item["id"],
                    output_index=output_index,
                    delta=args,
                )
            )
        return events

    def mcp_listing(self, item: dict[str, Any]) -> list[str]:
        """The events of an ``mcp_list_tools`` item (listed before the stream began)."""
        events = self._close()
        events += self._add(item)
        events.append(self._item_event("response.mcp_list_tools.in_progress"))
        events.append(self._item_event("response.mcp_list_tools.completed"))
        events.append(self._item_event("response.output_item.done", item=item))
        self._open = None
        return events

    def mcp_call_done(self, item: dict[str, Any]) -> list[str]:
        """The events of an mcp_call item that ran before the stream began (approved)."""
        events = self._close()
        events += self._add(item)
        index, self._open = self._open, None
        return [self.mcp_call_running(index), *self.mcp_call_ran(index)]

    def mcp_call_running(self, output_index: int) -> str:
        item = self.items[output_index]
        return self.event("response.mcp_call.in_progress", item_id=item["id"],
                          output_index=output_index)  # fmt: skip

    def mcp_call_ran(self, output_index: int) -> list[str]:
        """The call has run (its item holds its output or error): its last events."""
        item = self.items[output_index]
        kind = "failed" if item["status"] == "failed" else "completed"
        ids = {"item_id": item["id"], "output_index": output_index}
        return [
            self.event(f"response.mcp_call.{kind}", **ids),
            self.event("response.output_item.done", output_index=output_index, item=item),
        ]

    def new_round(self) -> None:
        """The next generation of an MCP loop: its tool calls are numbered from 0 again."""
        self._calls = {}

    def finish(self, status: str) -> list[str]:
        """Close the open item; ``status``: the items' final status."""
        return self._close(status)

    def _add(self, item: dict[str, Any]) -> list[str]:
        self.items.append(item)
        self._open = len(self.items) - 1
        return [self._item_event("response.output_item.added", item=item)]  # sent as it is now

    def _close(self, status: str = "completed") -> list[str]:
        if self._open is None:
            return []
        item = self.items[self._open]
        item["status"] = status
        if item["type"] in ("message", "reasoning"):
            part = item["content"][0]
            done = (
                self._item_event(
                    "response.output_text.done", content_index=0, text=part["text"], logprobs=[]
                )
                if item["type"] == "message"
                else self._item_event(
                    "response.reasoning_text.done", content_index=0, text=part["text"]
                )
            )
            events = [
                done,
                self._item_event("response.content_part.done", content_index=0, part=part),
            ]
        elif item["type"] == "mcp_approval_request":
            del item["status"]  # (OpenAI's item has none)
            events = []
        elif item["type"] == "mcp_call":  # done once it has run (mcp_call_ran)
            item["status"] = "in_progress"
            events = [
                self._item_event("response.mcp_call_arguments.done", arguments=item["arguments"])
            ]
            self.pending_mcp.append(self._open)
            self._open = None
            return events
        else:
            events = [
                self._item_event(
                    "response.function_call_arguments.done",
                    name=item["name"],
                    arguments=item["arguments"],
                )
            ]
        events.append(self._item_event("response.output_item.done", item=item))
        self._open = None
        return events

    def _item_event(self, kind: str, **fields: Any) -> str:
        """An event of the open item (its ``output_index``, and ``item_id`` unless the
        event carries the item itself)."""
        item = self.items[self._open]
        ids = {} if "item" in fields else {"item_id": item["id"]}
        return self.event(kind, output_index=self._open, **ids, **fields)


def delta_events(events: ResponseEvents, delta: dict[str, Any]) -> list[str]:
    """The events of one chat delta (``ToolCallStreamer``'s, or plain text)."""
    out = events.reasoning(delta["reasoning"]) if delta.get("reasoning") else []
    if delta.get("content"):
        out += events.text(delta["content"])
    for piece in delta.get("tool_calls") or []:
        out += events.tool_call(piece)
    return out
