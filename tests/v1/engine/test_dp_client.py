"""Data parallelism's front end (vllm/v1/engine/dp_client.py): which rank a request goes
to, how the ranks' gauges combine, and how a broadcast utility call is answered."""

from __future__ import annotations

import collections
import dataclasses

import pytest

from vllm.sampling_params import SamplingParams
from vllm.v1.engine import EngineCoreOutputType, EngineCoreRequest, UtilityResult
from vllm.v1.engine.dp_client import (
    DPAsyncMPClient,
    JobTable,
    SentSinceStats,
    SharedJobTable,
    combine_checksums,
    combine_stats,
    rank_env,
)
from vllm.v1.metrics.prometheus import SCHEDULER_METRICS
from vllm.v1.metrics.stats import (
    KVTransferStats,
    OffloadStats,
    PinStats,
    SchedulerStats,
    StateCheckpointStats,
)


def client(size: int) -> DPAsyncMPClient:
    """The routing state of a client of ``size`` ranks, no processes."""
    c = object.__new__(DPAsyncMPClient)
    c.engines = [None] * size
    c._stats = [None] * size
    c._sent = SentSinceStats(size)
    c._jobs = JobTable()
    c._owner = {}
    c._pinned_weight = 1.0
    c._calls = {}
    c._ready = collections.deque()
    return c


def request(rid: str, job: str | None = None) -> EngineCoreRequest:
    extra = {"job_id": job} if job else None
    return EngineCoreRequest(rid, [1, 2, 3], SamplingParams(extra_args=extra))


def test_least_loaded_rank_then_the_jobs_rank():
    c = client(2)
    c._stats = [SchedulerStats(num_running_reqs=3), SchedulerStats(num_waiting_reqs=1)]
    # rank 0: 3 running weigh 3; rank 1: 1 waiting weighs 4: rank 0 is lighter
    assert c.choose_rank(request("a", "job-a")) == 0
    c._sent.add(0)
    c._sent.add(0)  # two sent to rank 0 since its stats: now 5 against 4
    assert c.choose_rank(request("b", "job-b")) == 1
    # job-a's next turns stay on rank 0 whatever the load says
    for _ in range(10):
        c._sent.add(0)
    assert c.choose_rank(request("a2", "job-a")) == 0
    assert c.choose_rank(request("x")) == 1  # no job: the least loaded


def test_jobs_between_turns_weigh_on_the_rank_that_pins_them():
    c = client(2)
    # rank 0: three agents in their tools (pinned, nothing running); rank 1: one request
    between_turns = SchedulerStats(pin_stats=PinStats(num_pinned_requests=3))
    c._stats = [between_turns, SchedulerStats(num_running_reqs=1)]
    assert c.choose_rank(request("a", "job-new")) == 1  # their turns will come back to 0
    c._pinned_weight = 0.0  # vLLM's balance sees an idle rank 0
    assert c.choose_rank(request("b", "job-other")) == 0


def test_an_asked_rank_wins_and_the_job_follows_it():
    c = client(2)
    assert c.choose_rank(request("a", "job-a"), asked=1) == 1
    assert c.choose_rank(request("a2", "job-a")) == 1
    with pytest.raises(ValueError, match="data_parallel_rank 2 is not a rank"):
        c.choose_rank(request("b"), asked=2)


def test_the_job_table_forgets_the_least_recently_used_job():
    table = JobTable(capacity=2)
    assert table.rank_of("a", lambda: 0) == 0
    assert table.rank_of("b", lambda: 1) == 1
    assert table.rank_of("a", lambda: 1) == 0  # known: kept, and now the latest used
    table.assign("c", 1)  # past the capacity: b, the least recently used, goes
    assert table.rank_of("b", lambda: 0) == 0  # forgotten: picked anew (a goes now)
    assert table.rank_of("c", lambda: 0) == 1


def test_the_shared_job_table_keeps_a_job_in_a_set_until_eight_newer_ones_came():
    import multiprocessing

    table = SharedJobTable(multiprocessing.get_context("spawn"), slots=8)  # one set
    assert table.rank_of("job-0", lambda: 1) == 1
    assert table.rank_of("job-0", lambda: 0) == 1  # known: the pick is not asked
    table.assign("job-0", 0)  # X-data-parallel-rank moved it
    assert table.rank_of("job-0", lambda: 1) == 0
    for i in range(1, 8):  # the set is full now, job-0 the least recently used
        table.assign(f"job-{i}", i % 2)
    assert table.rank_of("job-1", lambda: 0) == 1  # used again: job-0 is still the oldest
    table.assign("job-8", 1)  # evicts job-0, the least recently used
    assert table.rank_of("job-0", lambda: 1) == 1  # forgotten: picked anew (evicts job-2)
    assert table.rank_of("job-1", lambda: 0) == 1 and table.rank_of("job-8", lambda: 0) == 1
    with pytest.raises(ValueError, match="multiple of 8"):
        SharedJobTable(multiprocessing.get_context("spawn"), slots=12)


def _place_in_another_process(table, counters, job, out):
    """A second API server's routing state over the same shared memory."""
    sent = SentSinceStats(2, counters, index=1, count=2)
    rank = table.rank_of(job, lambda: 0)
    sent.add(rank)
    out.put(rank)


def test_api_servers_share_the_job_table_and_the_sent_counts():
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    table, counters = SharedJobTable(ctx), ctx.RawArray("q", 2 * 2)
    mine = SentSinceStats(2, counters, index=0, count=2)
    assert table.rank_of("job-a", lambda: 1) == 1  # placed here, on rank 1
    mine.add(1)
    fork = multiprocessing.get_context("fork")  # quicker than spawning; the same memory
    out = fork.Queue()
    other = fork.Process(target=_place_in_another_process, args=(table, counters, "job-a", out))
    other.start()
    assert out.get(timeout=60) == 1  # the other server sends the job's turn to rank 1 too
    other.join(60)
    assert mine.total(1) == 2 and mine.total(0) == 0  # both servers' sends count
    mine.reset(1)  # this server read rank 1's stats: its own count restarts
    assert mine.total(1) == 1


def _filled(cls, value):
    """A stats object with every numeric field ``value``."""
    obj = cls()
    for f in dataclasses.fields(obj):
        if isinstance(getattr(obj, f.name), int | float) and not isinstance(
            getattr(obj, f.name), bool
        ):
            setattr(obj, f.name, value)
    return obj


def _stats(value):
    stats = _filled(SchedulerStats, value)
    stats.pin_stats = _filled(PinStats, value)
    stats.offload_stats = _filled(OffloadStats, value)
    stats.kv_transfer_stats = _filled(KVTransferStats, value)
    stats.state_checkpoint_stats = _filled(StateCheckpointStats, value)
    return stats


def test_every_gauge_on_metrics_combines_over_the_ranks():
    a, b = _stats(1.0), _stats(3.0)
    combined = combine_stats([a, b], b)
    gauges = [s for s in SCHEDULER_METRICS if s.kind == "gauge"]
    assert gauges
    for spec in gauges:
        ((_, value),) = spec.read(combined)
        # the sum (4) or the mean (2) of the ranks: never one rank's own (1 or 3)
        assert value in (2.0, 4.0), f"{spec.name} reads one rank's value: add it to DP_GAUGES"
    # the counters are the reporting rank's deltas; the rank's own stats are unchanged
    assert combined.num_preemptions == 3.0 and combined.pin_stats.pins == 3.0
    assert b.num_running_reqs == 3.0 and b.pin_stats.num_pinned_requests == 3.0


def test_a_broadcast_call_is_answered_once_every_rank_did():
    c = client(2)
    c._calls[7] = [2, None, {}, "is_paused"]
    c._take(1, EngineCoreOutputType.UTILITY_RESULT, UtilityResult(7, True))
    assert not c._ready
    c._take(0, EngineCoreOutputType.UTILITY_RESULT, UtilityResult(7, False))
    ((msg_type, answer),) = c._ready
    assert msg_type is EngineCoreOutputType.UTILITY_RESULT and answer.result is False
    c._ready.clear()
    c._calls[8] = [2, None, {}, "pause"]
    c._take(0, EngineCoreOutputType.UTILITY_RESULT, UtilityResult(8, error="ValueError: x"))
    c._take(1, EngineCoreOutputType.UTILITY_RESULT, UtilityResult(8, None))
    assert c._ready[0][1].error == "ValueError: x"


def test_weight_checksums_show_where_the_ranks_differ():
    c = client(2)
    c._calls[9] = [2, None, {}, "compute_weight_checksums"]
    c._take(0, EngineCoreOutputType.UTILITY_RESULT, UtilityResult(9, {"a": "1", "b": "2"}))
    c._take(1, EngineCoreOutputType.UTILITY_RESULT, UtilityResult(9, {"a": "1", "b": "3"}))
    ((_, answer),) = c._ready
    assert answer.result == {"a": "1", "b": "differ by rank: 2, 3"}
    assert combine_checksums([{"a": "1"}, {}]) == {"a": "differ by rank: 1, missing"}


def test_each_rank_gets_its_share_of_the_cpu(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_THREADS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert rank_env(1, 2, cuda=False) == {"VLLM_CPU_THREADS": "4", "VLLM_DP_RANK": "1"}
    monkeypatch.setenv("VLLM_CPU_THREADS", "3")  # the user's: each engine's own
    assert rank_env(0, 2, cuda=False) == {"VLLM_DP_RANK": "0"}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    assert rank_env(1, 2, cuda=True) == {"CUDA_VISIBLE_DEVICES": "5", "VLLM_DP_RANK": "1"}


def test_the_offline_llm_refuses_several_engines():
    from vllm import LLM

    with pytest.raises(ValueError, match="vllm serve -dp N"):
        LLM(data_parallel_size=2)


def test_aborted_and_stopped_requests_are_forgotten():
    import asyncio

    from vllm.v1.engine import EngineCoreRequestType

    class Engine:
        def __init__(self):
            self.sent = []

        is_alive = True
        dead_reason = None

        async def send(self, msg_type, payload):
            self.sent.append((msg_type, payload))

    c = client(2)
    c._dead_reason = None
    c.engines = [Engine(), Engine()]
    c._owner = {"a": 1, "b": 0}
    asyncio.run(c.send(EngineCoreRequestType.ABORT, ["a", "x"]))
    assert c.engines[1].sent == [(EngineCoreRequestType.ABORT, ["a", "x"])]
    assert c.engines[0].sent == [(EngineCoreRequestType.ABORT, ["x"])]  # unknown: to all
    asyncio.run(c.send(EngineCoreRequestType.STOP, ["b"]))
    assert c._owner == {} and c.engines[0].sent[-1] == (EngineCoreRequestType.STOP, ["b"])
