"""The one thread where grammars compile: off the event loop, with a large stack.

llguidance compiles a chain of Lark rules recursively: ~3,000 nested rules overflow an
8 MiB stack and kill the process (SIGSEGV, not an exception). A 128 KiB grammar holds at
most ~11,000; 12,000 compile in a 256 MiB stack (virtual memory, committed as used).
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")
STACK_BYTES = 256 * 1024 * 1024
_stack_lock = threading.Lock()
_instance_lock = threading.Lock()
_instance: GrammarThread | None = None


class GrammarThread:
    """A daemon thread that runs submitted calls one at a time, in order.

    ``submit`` returns a ``concurrent.futures.Future``; a future cancelled before its call
    starts is skipped (an ``asyncio.wait_for`` that timed out cancels it). A call that
    already started runs to its end: llguidance's own limits bound it."""

    def __init__(self, name: str = "grammar") -> None:
        self.pid = os.getpid()
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        with _stack_lock:  # stack_size is process-wide: set it for this thread only
            previous = threading.stack_size(STACK_BYTES)
            try:
                self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
                self._thread.start()
            finally:
                threading.stack_size(previous)

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        future: Future[T] = Future()
        self._calls.put((future, fn, args))
        return future

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in the thread, waiting for it (the synchronous callers)."""
        if threading.current_thread() is self._thread:
            return fn(*args)
        return self.submit(fn, *args).result()

    def _loop(self) -> None:
        while True:
            future, fn, args = self._calls.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # handed to the waiter, which raises it
                future.set_exception(e)


def grammar_thread() -> GrammarThread:
    """The process's grammar thread, started on first use."""
    global _instance
    with _instance_lock:
        # A forked child (an engine process) has the object but not the thread.
        if _instance is None or _instance.pid != os.getpid():
            _instance = GrammarThread()
        return _instance
