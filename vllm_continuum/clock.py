"""Injected clocks: core code never calls ``time.time()``.

A clock is any zero-argument callable returning monotonic seconds as a float.
Production code uses :func:`monotonic_clock`; tests drive TTLs and waiting times
with :class:`FakeClock` instead of sleeping.
"""

from __future__ import annotations

import time
from collections.abc import Callable

Clock = Callable[[], float]


def monotonic_clock() -> float:
    """Monotonic seconds (``time.monotonic``)."""
    return time.monotonic()


class FakeClock:
    """A manually advanced clock for tests."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = float(start)

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        if seconds < 0:
            raise ValueError(f"seconds must be >= 0, got {seconds}")
        self.now += seconds
        return self.now
