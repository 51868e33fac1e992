"""Per-job event log written to ``$RUN_OUTPUT_DIR/scheduler_timestamps.json``."""

from __future__ import annotations

import json
import os
import tempfile
from collections import defaultdict
from typing import Any

from vllm_continuum.clock import Clock

FILE_NAME = "scheduler_timestamps.json"


class JobRecorder:
    """Collects events per job; flushes atomically at most every ``flush_every_s``."""

    def __init__(self, directory: str, clock: Clock, flush_every_s: float = 5.0) -> None:
        self.path = os.path.join(directory, FILE_NAME)
        os.makedirs(directory, exist_ok=True)
        self.clock = clock
        self.flush_every_s = flush_every_s
        self.events: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self._last_flush = clock()

    def record(self, job: str, event: str, **fields: Any) -> None:
        self.events[job].append({"event": event, "time": self.clock(), **fields})
        if self.clock() - self._last_flush >= self.flush_every_s:
            self.flush()

    def flush(self) -> None:
        self._last_flush = self.clock()
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(self.path), suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(self.events, f, indent=1)
        os.replace(tmp, self.path)
