"""How long each tool takes between an agent's turns, learned from arrivals/departures.

``ToolCallEstimator`` records per job when a turn left and when the next one arrived:
the gap is the tool's duration, kept per tool for the TTL rule and the predictors. It is
also the one owner of a job's first arrival (the job-level order's key).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field


@dataclass
class _Job:
    first_arrival: float
    turns: int = 0
    last_departure: float | None = None
    last_tool: str | None = None


@dataclass
class ToolCallEstimator:
    """Per-job arrival/departure bookkeeping and per-tool duration histories.

    Safe with concurrent requests of one job and with job-less requests: a duration is
    recorded only when a departure is waiting to be matched by the next arrival.
    """

    max_samples: int = 1000
    """Durations kept per tool (the oldest are dropped)."""
    max_jobs: int = 100_000
    """Jobs tracked at once (the oldest is dropped)."""
    max_tools: int = 1024
    """Tool names with a history: tool names come from the model's output, so without a
    bound a client could grow the dict without end. Past it, the tool recorded least
    recently loses its history (its durations then fall back to all tools')."""
    _jobs: dict[str, _Job] = field(default_factory=dict)
    _durations: OrderedDict[str, deque] = field(default_factory=OrderedDict)  # LRU order
    _all: deque = field(default_factory=lambda: deque(maxlen=5000))
    _turn_pairs: deque = field(default_factory=lambda: deque(maxlen=5000))

    def __post_init__(self) -> None:
        for name in ("max_samples", "max_jobs", "max_tools"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def on_arrival(self, job: str, now: float) -> str | None:
        """A turn of ``job`` arrived; returns the tool that ran before it (if known)."""
        state = self._jobs.get(job)
        if state is None:
            if len(self._jobs) >= self.max_jobs:
                self._jobs.pop(next(iter(self._jobs)))
            self._jobs[job] = _Job(first_arrival=now)
            return None
        tool = state.last_tool
        if state.last_departure is not None and tool is not None:
            self.record(tool, max(now - state.last_departure, 0.0))
        state.last_departure = None
        return tool

    def on_departure(self, job: str, now: float, tool: str | None) -> None:
        state = self._jobs.setdefault(job, _Job(first_arrival=now))
        state.turns += 1
        state.last_departure = now
        state.last_tool = tool

    def on_job_end(self, job: str) -> None:
        """The job's last step finished: its turn count feeds the eta statistic."""
        state = self._jobs.pop(job, None)
        if state is not None and state.turns > 1:
            n = state.turns
            self._turn_pairs.extend((k, n - k) for k in range(1, n + 1))

    def record(self, tool: str, seconds: float) -> None:
        """Add a duration of ``tool``; it becomes the most recently seen tool."""
        history = self._durations.get(tool)
        if history is None:
            if len(self._durations) >= self.max_tools:
                self._durations.popitem(last=False)  # the least recently seen tool
            history = self._durations[tool] = deque(maxlen=self.max_samples)
        else:
            self._durations.move_to_end(tool)
        history.append(seconds)
        self._all.append(seconds)

    def job_first_arrival(self, job: str, default: float) -> float:
        state = self._jobs.get(job)
        return state.first_arrival if state else default

    def durations(self, tool: str | None) -> list[float]:
        return list(self._durations.get(tool, ())) if tool else []

    def all_durations(self) -> list[float]:
        return list(self._all)

    def mean(self, tool: str | None) -> float | None:
        d = self._durations.get(tool) if tool else None
        return sum(d) / len(d) if d else None

    @property
    def num_records(self) -> int:
        return len(self._all)

    def turn_pairs(self) -> list[tuple[int, int]]:
        return list(self._turn_pairs)
