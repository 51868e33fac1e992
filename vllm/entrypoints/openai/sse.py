"""SSE keep-alive (``--sse-keep-alive-interval``, vLLM's): a comment line on a stream that
has sent nothing for a while, so a proxy with a read timeout (nginx's
``proxy_read_timeout``, a cloud load balancer's idle timeout) does not cut a request that
waits in the queue or in a long prefill. SSE clients ignore comment lines."""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator
from typing import TypeVar

# What vLLM sends: an SSE comment (a line starting with ':'), then the blank line ending it.
SSE_KEEP_ALIVE_COMMENT = ": keep-alive\n\n"
T = TypeVar("T")
F = TypeVar("F")


def with_sse_keep_alive(events: AsyncIterator[str], interval_s: float) -> AsyncIterator[str]:
    """``events`` as they come, and ``SSE_KEEP_ALIVE_COMMENT`` each time ``interval_s``
    seconds pass with none; ``events`` itself when ``interval_s`` is 0 (off).

    An event is passed on as soon as it exists (no delay, no reordering); the stream ends
    when ``events`` ends. Closed or cancelled (the client left), it cancels the pending
    read of ``events`` and closes it, so ``events``' own cleanup (the engine abort) runs."""
    if not (interval_s > 0 and math.isfinite(interval_s)):
        return events
    return idle_filled(events, interval_s, SSE_KEEP_ALIVE_COMMENT)


async def idle_filled(events: AsyncIterator[T], interval_s: float, idle: F) -> AsyncIterator[T | F]:
    """``events`` as they come, and ``idle`` each time ``interval_s`` seconds pass with
    none (an SSE keep-alive comment; the Messages route's ping). Closed or cancelled, it
    cancels the pending read of ``events`` and closes it."""
    # One read of ``events`` at a time, in a task of its own: a timeout must not cancel a
    # read half done (``asyncio.wait_for`` would), and an async generator takes no second
    # ``__anext__`` while one runs.
    pending: asyncio.Task[T] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(events))
            done, _ = await asyncio.wait({pending}, timeout=interval_s)
            if not done:
                yield idle
                continue
            read, pending = pending, None
            try:
                event = read.result()
            except StopAsyncIteration:
                return
            yield event
    finally:
        if pending is not None and not pending.done():
            # ``events`` runs in that read: cancelled there, its own cleanup runs there.
            pending.cancel()
            with contextlib.suppress(BaseException):  # its outcome no longer matters
                await pending
        elif (close := getattr(events, "aclose", None)) is not None:
            await close()  # ``events`` waits at a yield: its cleanup runs now
