"""Background ``/v1/responses`` (``background: true``): the task a response runs as, and
the event log of one created with ``stream: true`` as well.

A background response is answered at once (status ``queued``) and generates in a task of
the API server's event loop, which writes its state to the response store as it goes
(``in_progress``, then ``completed`` / ``incomplete`` / ``failed``), so ``GET
/v1/responses/{id}`` polls it. Streamed, its events go to an ``EventLog`` instead of one
connection: the POST follows the log from its start, ``GET ...?stream=true&
starting_after=N`` from sequence number N + 1, and a client that leaves only stops
following (the generation goes on; ``POST .../cancel`` is what stops it).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import AsyncIterator

MAX_EVENT_LOGS = 100
"""Finished background streams whose events stay replayable, per API server process (the
most recent; a running one's always do)."""
CANCEL_POLL_S = 1.0
"""With a store shared by several API servers: how often a process running a background
response checks whether another process has cancelled it."""


class EventLog:
    """The SSE events of one background streamed response, in order: event ``i`` has
    sequence number ``i`` (``ResponseEvents`` numbers them from 0). Append-only until
    ``close``; any number of readers ``follow`` it."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.closed = False
        self._changed = asyncio.Event()

    def append(self, event: str) -> None:
        self.events.append(event)
        self._wake()

    def close(self) -> None:
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        # A fresh event per change: each reader waits on the one of its own time, so no
        # reader's clear() can hide a change from another.
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def follow(self, start: int = 0) -> AsyncIterator[str]:
        """The events from sequence number ``start`` on: those logged, then the new ones
        as they come; ends once the log is closed and read to its end."""
        i = start
        while True:
            while i < len(self.events):
                yield self.events[i]
                i += 1
            if self.closed:
                return
            await self._changed.wait()


class EventLogs:
    """The event logs of this process's background streams by response id: every running
    one's, and the ``MAX_EVENT_LOGS`` most recently finished ones'."""

    def __init__(self, max_finished: int = MAX_EVENT_LOGS) -> None:
        self.max_finished = max_finished
        self._logs: OrderedDict[str, EventLog] = OrderedDict()

    def new(self, response_id: str) -> EventLog:
        log = self._logs[response_id] = EventLog()
        return log

    def get(self, response_id: str) -> EventLog | None:
        return self._logs.get(response_id)

    def finished(self, response_id: str) -> None:
        """Close the response's log; forget the oldest finished logs past the bound."""
        log = self._logs.get(response_id)
        if log is None:
            return
        log.close()
        self._logs.move_to_end(response_id)
        closed = [k for k, v in self._logs.items() if v.closed]
        for old in closed[: max(len(closed) - self.max_finished, 0)]:
            del self._logs[old]
