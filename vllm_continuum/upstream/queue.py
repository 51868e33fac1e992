"""The job-ordered waiting queue (``vllm_continuum.queue.JobOrderQueue``) as an upstream
``RequestQueue``.

Upstream's own part: its scheduler pops the request it just peeked, and admitting that
request may end its job's pin (a hit) in between, which re-ranks the queue; so
``pop_request`` returns the peeked request while it is still queued. Upstream also puts
back requests it skipped this step (``prepend_requests``): adding them again.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.request_queue import RequestQueue
from vllm_continuum.queue import JobOrderQueue


class JobOrderRequestQueue(JobOrderQueue, RequestQueue):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """``JobOrderQueue``'s arguments."""
        super().__init__(*args, **kwargs)
        self._peeked: Any = None

    def peek_request(self) -> Any:
        self._peeked = super().peek_request()
        return self._peeked

    def pop_request(self) -> Any:
        request = self._peeked if self._peeked in self else self.peek_request()
        self.remove_request(request)
        return request

    def remove_request(self, request: Any) -> None:
        super().remove_request(request)
        if request is self._peeked:
            self._peeked = None
