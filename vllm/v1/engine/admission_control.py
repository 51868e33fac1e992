"""Front-end queue limits (vLLM's ``--max-num-queued-reqs`` / ``--max-num-queued-tokens``).

The API server refuses a request with HTTP 503 (``QueueOverflowError`` /
``MaxQueuedTokensError``) when admitting it would pass a limit. The check runs before the
request is registered anywhere, so a refused request leaves nothing behind: no state in
this process, nothing sent to the engine, no KV blocks.

What is counted (vLLM's semantics; ``OutputProcessor`` keeps both counts, O(1)):

- queued requests: engine-core requests not finished, waiting or running alike; a user
  request with ``n`` samples counts ``n``, and each sample stops counting when it finishes
  or its request is aborted or fails. Refused when ``current + n > max_num_queued_reqs``.
- queued tokens: the whole prompt of every sample that has had no output from the engine
  yet (still prefilling, or waiting to). Chunked-prefill progress and prefix-cache hits
  are not subtracted (the front end learns of them with the first output): conservative.
  Refused when ``current >= max_num_queued_tokens``; the new request's own prompt is not
  part of the comparison.

With several API servers on one engine (``--api-server-count N``) each counts its own
requests; ``SharedAdmissionStats`` publishes each server's queued-request count in shared
memory so the request limit is global, as vLLM does. The token limit stays per server.

Not to be confused with job admission (``vllm_continuum/admission.py``): that is the
engine scheduler's decision of *when* a waiting job's first turn may start; it never
refuses. A turn it holds back is waiting, so it counts here as queued.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from vllm.exceptions import MaxQueuedTokensError, QueueOverflowError

logger = logging.getLogger(__name__)

# The ``reason`` label of ``vllm:admission_rejections`` (vLLM's ``ADMISSION_REASONS``).
ADMISSION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")


class SharedAdmissionStats:
    """Per-API-server queued-request counts in one shared int64 array (a multiprocessing
    ``RawArray``, created by the supervisor). Each server writes only its own slot, one
    cache line apart so writers do not contend; a reader sums the slots, without a lock
    (a slightly stale sum is fine for a capacity valve)."""

    SLOT = 8  # int64 counters per slot: 64 bytes

    def __init__(self, counters: Any, client_count: int, client_index: int) -> None:
        if not 0 <= client_index < client_count:
            raise ValueError(f"client_index {client_index} outside 0..{client_count - 1}")
        self._counters = counters
        self._count = client_count
        self._offset = client_index * self.SLOT

    @classmethod
    def num_counters(cls, client_count: int) -> int:
        return client_count * cls.SLOT

    def set_num_requests(self, count: int) -> None:
        self._counters[self._offset] = count

    def get_num_requests(self) -> int:
        return sum(self._counters[i * self.SLOT] for i in range(self._count))


class AdmissionControl:
    """The two limits of a ``SchedulerConfig`` over the counts of one front end.

    ``num_requests`` / ``num_tokens``: this front end's queued requests and tokens
    (``OutputProcessor``'s); ``shared``: all servers' request count, when there are
    several; ``on_reject(reason)``: called once per refusal (the metric)."""

    def __init__(
        self,
        max_num_queued_reqs: int | None,
        max_num_queued_tokens: int | None,
        num_requests: Callable[[], int],
        num_tokens: Callable[[], int],
        shared: SharedAdmissionStats | None = None,
        on_reject: Callable[[str], None] | None = None,
    ) -> None:
        self.max_num_queued_reqs = max_num_queued_reqs
        self.max_num_queued_tokens = max_num_queued_tokens
        self._num_requests = num_requests
        self._num_tokens = num_tokens
        self.shared = shared
        self._on_reject = on_reject

    @property
    def enabled(self) -> bool:
        return self.max_num_queued_reqs is not None or self.max_num_queued_tokens is not None

    def num_queued_requests(self) -> int:
        """Queued requests: every API server's when shared, else this one's."""
        if self.shared is not None:
            return self.shared.get_num_requests()
        return self._num_requests()

    def publish(self) -> None:
        """Write this server's count into the shared slot (after it changed)."""
        if self.shared is not None:
            self.shared.set_num_requests(self._num_requests())

    def check(self, n: int = 1, request_id: str | None = None) -> None:
        """Raise ``QueueOverflowError`` / ``MaxQueuedTokensError`` (503) if a request of
        ``n`` samples may not be admitted now; mutates nothing but the rejection count."""
        limit = self.max_num_queued_reqs
        if limit is not None:
            current = self.num_queued_requests()
            if current + n > limit:
                logger.debug(
                    "Request queue full, rejecting %s (current=%d, n=%d, max=%d)",
                    request_id,
                    current,
                    n,
                    limit,
                )
                self._reject("max_num_queued_reqs")
                raise QueueOverflowError()
        limit = self.max_num_queued_tokens
        if limit is not None:
            current = self._num_tokens()
            if current >= limit:
                logger.debug(
                    "Queued prompt tokens at the limit, rejecting %s (current=%d, max=%d)",
                    request_id,
                    current,
                    limit,
                )
                self._reject("max_num_queued_tokens")
                raise MaxQueuedTokensError()

    def _reject(self, reason: str) -> None:
        if self._on_reject is not None:
            self._on_reject(reason)
