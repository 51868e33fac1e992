"""Job-level admission: a new job starts only when memory can hold it next to older jobs.

Ordering the waiting queue by job is not enough under overload: if any request that fits
is admitted, a new job's first turn takes the memory that an older job's context needs
when its tool returns, and the older job re-prefills (or is preempted). ``JobAdmission``
keeps, per active job (seen, not ended, not idle for too long), the size of its context
and whether its KV is held (running or pinned), and reserves for each older job:

- a job whose KV is held (running or pinned): the growth of its next turn;
- a job whose KV is not held but which will need it all back soon (its turn waits, or
  it is in a tool gap that is expected to end within ``reserve_s`` of its departure):
  its whole context plus that growth;
- a job in a tool gap expected to be long (a SLOW tool, or past ``reserve_s``): nothing,
  so its memory serves other jobs meanwhile.

A new job's first turn is admitted when the free memory minus the reserve holds it, or,
while no job runs (the engine would idle), when it fits next to the pinned jobs' growth.
The growth of a turn is learned (mean prompt growth between a job's consecutive turns).
Everything is in tokens; the engine converts its free blocks.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass

DEFAULT_TURN_GROWTH = 256  # tokens, until a job's second turn has been seen


@dataclass
class _ActiveJob:
    context: int  # tokens of its latest turn (prompt at arrival, all tokens at departure)
    last_prompt: int
    last_seen: float
    running: int = 0  # requests of the job admitted and not finished
    waiting: bool = False  # a turn arrived and is not admitted yet
    reserve_until: float = 0.0  # in a tool gap: expected back before this time


class JobAdmission:
    """Per-job memory accounting for job-level admission (plain values; no engine)."""

    def __init__(self, idle_timeout_s: float) -> None:
        self.idle_timeout_s = idle_timeout_s
        self._jobs: dict[str, _ActiveJob] = {}
        self._growth_sum = 0.0
        self._growth_n = 0

    @property
    def turn_growth(self) -> int:
        """Mean tokens a job's prompt grows by from one turn to the next."""
        if not self._growth_n:
            return DEFAULT_TURN_GROWTH
        return int(self._growth_sum / self._growth_n)

    def is_known(self, job: str) -> bool:
        """Whether ``job`` has started (one of its turns was admitted before)."""
        return job in self._jobs

    # -- events ---------------------------------------------------------------------------
    def on_arrival(self, job: str, prompt_tokens: int, now: float) -> None:
        state = self._jobs.get(job)
        if state is None:
            return  # a new job becomes active when its first turn is admitted
        if prompt_tokens > state.last_prompt:
            self._growth_sum += prompt_tokens - state.last_prompt
            self._growth_n += 1
        state.context = max(state.context, prompt_tokens)
        state.last_prompt = prompt_tokens
        state.last_seen = now
        state.waiting = True

    def on_scheduled(self, job: str, prompt_tokens: int, now: float) -> None:
        state = self._jobs.get(job)
        if state is None:
            state = self._jobs[job] = _ActiveJob(prompt_tokens, prompt_tokens, now)
        state.running += 1
        state.waiting = False
        state.last_seen = now

    def on_stopped(
        self, job: str, num_tokens: int, is_last_step: bool, now: float, reserve_s: float
    ) -> None:
        """A turn finished, or was preempted or aborted (its KV is no longer held); the
        job is expected back within ``reserve_s`` (its context is reserved until then)."""
        state = self._jobs.get(job)
        if state is None:
            return
        if is_last_step:
            del self._jobs[job]
            return
        state.running = max(state.running - 1, 0)
        state.context = max(state.context, num_tokens)
        state.last_seen = now
        state.reserve_until = now + reserve_s

    def expect_late(self, job: str, now: float) -> None:
        """The job's tool is predicted slow: reserve nothing for it until it returns."""
        state = self._jobs.get(job)
        if state is not None:
            state.reserve_until = now

    # -- the decision ---------------------------------------------------------------------
    def reserve_tokens(self, pinned_jobs: Container[str], now: float) -> int:
        """Tokens the active jobs will need beyond what they hold now."""
        growth = self.turn_growth
        total = 0
        for job in self._expire_idle(now):
            state = self._jobs[job]
            if state.running > 0 or job in pinned_jobs:
                total += growth
            elif state.waiting or now <= state.reserve_until:
                total += state.context + growth
        return total

    def admits(
        self, new_tokens: int, free_tokens: int, pinned_jobs: Container[str], now: float
    ) -> bool:
        """Whether a new job whose first turn needs ``new_tokens`` fits next to the
        active jobs, given ``free_tokens`` of free (or evictable) KV memory. An engine
        that holds no job's KV (nothing running, nothing pinned) never waits for jobs
        that may come back: the new job runs now, which costs less than idling (the soak
        found agents that never return holding reservations on an idle server).

        Work-conserving: while no job runs (the older jobs are all in tool gaps), the
        engine would idle, so the new job is admitted if it fits next to the pinned jobs'
        growth alone; the contexts of jobs whose KV is gone are not waited for (they
        re-prefill either way, and the new job is the first victim if memory runs out)."""
        held = [job for job, s in self._jobs.items() if s.running or job in pinned_jobs]
        if not held:
            return True
        if not any(self._jobs[job].running for job in held):
            return new_tokens + len(held) * self.turn_growth <= free_tokens
        return new_tokens + self.reserve_tokens(pinned_jobs, now) <= free_tokens

    def _expire_idle(self, now: float) -> list[str]:
        """Active jobs, after forgetting those silent for ``idle_timeout_s`` (an agent
        that gave up or crashed must not hold a reservation forever)."""
        idle = [
            job
            for job, s in self._jobs.items()
            if s.running == 0 and now - s.last_seen > self.idle_timeout_s
        ]
        for job in idle:
            del self._jobs[job]
        return list(self._jobs)
