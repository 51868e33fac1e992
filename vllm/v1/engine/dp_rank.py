"""The data-parallel rank an HTTP request asks for (vLLM's ``X-data-parallel-rank``
header), handed from the API server's middleware to ``AsyncLLM`` through a context
variable, as the trace context is (vllm/tracing.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

HEADER = b"x-data-parallel-rank"

_rank: ContextVar[int | None] = ContextVar("vllm_dp_rank", default=None)


def parse_rank(value: bytes) -> int:
    """The header's value; ValueError naming it when it is not a rank."""
    text = value.decode("latin-1").strip()
    if not text.isdigit():
        raise ValueError(f"X-data-parallel-rank must be a rank (0, 1, ...), got {text!r}")
    return int(text)


@contextmanager
def rank_scope(rank: int | None) -> Iterator[None]:
    token = _rank.set(rank)
    try:
        yield
    finally:
        _rank.reset(token)


def requested_rank() -> int | None:
    return _rank.get()
