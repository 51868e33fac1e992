"""The garbage collector in a serving process: freeze the start-up heap, log collections.

A process that has imported torch and transformers and built a model holds 330-480k
objects that the cyclic collector tracks. Each full (generation 2) collection walks all
of them: 160-210 ms on the CPU machines here, a pause in the middle of an engine step
(every request waits) or of the API server's event loop (every stream waits). 256
requests decoding trigger one such pause every few seconds. vLLM freezes the heap once
start-up is done (``gc.freeze``: what exists then moves to a permanent generation that
collections skip); so do we: the engine core's process once its engine is built (the
model, the KV cache, the warm-up, the CUDA graphs), before it reports ready; the API
server once its app is built; and ``LLM``, whose ``generate`` steps the engine in the
caller's process. Objects made later are collected as before.

Frozen objects that become unreachable are still freed by reference counting; only
reference cycles among them wait. An ``LLM`` shut down or dropped leaves such cycles (its
engine's, the CUDA graphs'), so a freeze is a hold: ``freeze_gc_heap`` returns one and
``release`` gives it back (``LLM.shutdown``, or a finalizer when the ``LLM`` is dropped),
and the last hold given back unfreezes the heap (``gc.unfreeze``), so the next collection
can free them; so does the interpreter's exit (else the collection at exit would skip
them, and libraries that count their objects at exit, Triton's bindings, complain).

``VLLM_GC_DEBUG`` (vLLM's variable): ``1`` logs each collection of this process with its
generation, duration and what it freed; a JSON object ``{"top_objects": N}`` adds the N
most common types among the objects the collection examined.
"""

from __future__ import annotations

import atexit
import gc
import json
import logging
import threading
import time
from collections import Counter
from typing import Any

from vllm import envs

logger = logging.getLogger(__name__)

# Reentrant: the collection ``freeze_gc_heap`` runs under it may finalize a dropped
# ``LLM`` (a cycle), whose finalizer releases its hold in this very thread; a plain lock
# deadlocked there (a failed ``LLM(...)`` then froze the next one's constructor).
_lock = threading.RLock()
_holds = 0  # freezes not yet released; the heap is frozen while > 0
_thaw_at_exit = False  # the atexit hook is registered


class GCFreeze:
    """One hold on the frozen heap (``freeze_gc_heap``); ``release`` gives it back, once."""

    def __init__(self, num_frozen: int) -> None:
        self.num_frozen = num_frozen  # objects moved to the permanent generation
        self._held = True

    def release(self) -> None:
        """Give the hold back; the last one unfreezes the heap. Idempotent."""
        global _holds
        with _lock:
            if not self._held:
                return
            self._held = False
            _holds -= 1
            if _holds == 0:
                gc.unfreeze()


def freeze_gc_heap(context: str) -> GCFreeze:
    """Collect every generation, then freeze what is left (``gc.freeze``): later
    collections skip it. Collecting first keeps today's garbage out of the permanent
    generation. ``context`` names the process part in the log line."""
    global _holds, _thaw_at_exit
    start = time.perf_counter()
    with _lock:
        gc.collect()
        gc.freeze()
        _holds += 1
        if not _thaw_at_exit:  # an engine never shut down: exit still collects its cycles
            atexit.register(gc.unfreeze)
            _thaw_at_exit = True
        frozen = gc.get_freeze_count()
    logger.info(
        "Froze %d objects of the %s's start-up heap (%.0f ms): collections skip them",
        frozen,
        context,
        (time.perf_counter() - start) * 1e3,
    )
    return GCFreeze(frozen)


def gc_debug_config() -> dict[str, int] | None:
    """``VLLM_GC_DEBUG`` read: None (off), ``{"top_objects": 0}`` for "1"/"true", or the
    JSON object's settings; anything else is a ValueError naming the variable."""
    value = envs.VLLM_GC_DEBUG
    if value is None or value.lower() in ("0", "false"):
        return None
    if value.lower() in ("1", "true"):
        return {"top_objects": 0}
    try:
        parsed = json.loads(value)
        top = parsed.get("top_objects", 0) if isinstance(parsed, dict) else None
        if isinstance(top, bool) or not isinstance(top, int) or top < 0:
            raise ValueError
    except ValueError:
        raise ValueError(
            f'VLLM_GC_DEBUG={value!r}: expected 1, 0 or a JSON object like {{"top_objects": 5}}'
        ) from None
    return {"top_objects": top}


class GCDebugger:
    """A ``gc.callbacks`` entry that logs each collection: its generation, duration and
    the objects it freed, and with ``top_objects`` > 0 the commonest types it examined."""

    def __init__(self, top_objects: int = 0) -> None:
        self.top_objects = top_objects
        self._start = 0.0
        self._examined = ""

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        generation = info["generation"]
        if phase == "start":
            if self.top_objects:
                types = Counter(type(o).__name__ for o in gc.get_objects(generation))
                self._examined = ", ".join(
                    f"{name}: {n}" for name, n in types.most_common(self.top_objects)
                )
            self._start = time.perf_counter()
            return
        logger.info(
            "GC generation %d: %.2f ms, %d collected, %d uncollectable%s",
            generation,
            (time.perf_counter() - self._start) * 1e3,
            info["collected"],
            info["uncollectable"],
            f"; examined most: {self._examined}" if self._examined else "",
        )


def maybe_attach_gc_debug_callback() -> GCDebugger | None:
    """Log this process's collections when ``VLLM_GC_DEBUG`` asks (once per process)."""
    config = gc_debug_config()
    if config is None:
        return None
    for callback in gc.callbacks:
        if isinstance(callback, GCDebugger):
            return callback
    debugger = GCDebugger(**config)
    gc.callbacks.append(debugger)
    return debugger
