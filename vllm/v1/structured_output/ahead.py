"""Requests whose grammar is still compiling wait outside the scheduler.

Compiling a grammar with the model's tokenizer takes 20-250 ms at the front end's limits,
and the first constrained request of a process also builds llguidance's tokenizer table
(~2.4 s with the tokenizer load). Done inside a step, that time stalls every request in
the batch. As in vLLM (a request waits for its grammar before it is scheduled), the
engine starts the compile when the request arrives, in the grammar thread, and hands the
request to the scheduler once its grammar is ready; the other requests step meanwhile.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterable
from concurrent.futures import Future

from vllm.v1.engine import EngineCoreRequestError
from vllm.v1.request import Request
from vllm.v1.structured_output.grammar import excerpt
from vllm.v1.structured_output.manager import StructuredOutputManager


class PendingGrammars:
    """Requests held while their grammar compiles, in arrival order.

    ``hold(request)`` starts the compile and keeps the request (False: nothing to wait
    for, schedule it now); ``take_ready`` returns the requests whose grammar is ready (the
    compiled matcher is adopted by the manager, so the step that samples them finds it)
    and an error for each whose compile failed; ``discard`` forgets aborted ones.
    """

    def __init__(self, manager: StructuredOutputManager) -> None:
        self.manager = manager
        self._held: dict[str, tuple[Request, Future]] = {}

    def hold(self, request: Request) -> bool:
        future = self.manager.prepare(request.sampling_params)
        if future is None:
            return False
        self._held[request.request_id] = (request, future)
        return True

    def take_ready(self, wait_s: float = 0.0) -> tuple[list[Request], list[EngineCoreRequestError]]:
        """The held requests now ready (waiting up to ``wait_s`` for the first one)."""
        if not self._held:
            return [], []
        if wait_s > 0:
            futures = [future for _, future in self._held.values()]
            concurrent.futures.wait(futures, wait_s, concurrent.futures.FIRST_COMPLETED)
        ready, errors = [], []
        for req_id, (request, future) in list(self._held.items()):
            if not future.done():
                continue
            del self._held[req_id]
            try:
                self.manager.adopt(future.result())
            except Exception as e:  # validated in the front end: not expected
                message = f"structured_outputs: the grammar failed: {excerpt(str(e))}"
                errors.append(EngineCoreRequestError(req_id, message))
                continue
            ready.append(request)
        return ready, errors

    def discard(self, request_ids: Iterable[str]) -> None:
        for req_id in request_ids:
            held = self._held.pop(req_id, None)
            if held is not None:
                held[1].cancel()  # skipped if it has not started

    def __len__(self) -> int:
        return len(self._held)
