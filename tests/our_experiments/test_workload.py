"""The agentic workload generator: arrivals, jobs, context growth, trace replay, summary."""

from __future__ import annotations

import asyncio
import json
import random
import statistics
from types import SimpleNamespace

import pytest

from our_experiments.scripts import ab_benchmark, plot_jps_sweep, workload
from our_experiments.scripts.workload import (
    HINTS,
    SIZE_CHARS,
    TOOL_TABLE,
    JobResult,
    TurnResult,
    identity_fields,
    load_corpus,
    load_trace,
    make_job,
    poisson_arrivals,
    routing_summary,
    run_job,
    shell_tool_call,
    summarize,
    synthetic_jobs,
    turn_moves,
)
from vllm.entrypoints.utils import INSTANCE_HEADER


@pytest.fixture(scope="module")
def corpus():
    return load_corpus()


def test_poisson_arrivals_have_the_rate_and_exponential_gaps():
    # 2 jobs/s over 2,000 s: ~4,000 arrivals (sd ~63); gaps ~Exp(2): mean 0.5, CV 1.
    arrivals = poisson_arrivals(2.0, 2000.0, random.Random(1))
    assert abs(len(arrivals) - 4000) < 4 * 63
    assert arrivals == sorted(arrivals) and 0 <= arrivals[0] and arrivals[-1] < 2000
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    mean = statistics.mean(gaps)
    assert abs(mean - 0.5) < 0.03
    assert abs(statistics.stdev(gaps) / mean - 1.0) < 0.08


def test_poisson_arrivals_are_seeded_and_reject_bad_values():
    assert poisson_arrivals(0.5, 100, random.Random(3)) == poisson_arrivals(
        0.5, 100, random.Random(3)
    )
    with pytest.raises(ValueError, match="jps"):
        poisson_arrivals(0, 10, random.Random(0))
    with pytest.raises(ValueError, match="duration"):
        poisson_arrivals(1, -1, random.Random(0))


def test_job_turns_follow_the_tool_table_with_real_outputs(corpus):
    job = make_job("job_x", 1.5, 8, 32, corpus, random.Random(0))
    assert len(job.turns) == 8 and job.arrival_s == 1.5
    assert job.turns[0].user_content.startswith("Task: ")
    assert job.turns[-1].tool_kind is None  # nothing runs after the last turn
    for i, turn in enumerate(job.turns[:-1]):
        kind, lo, hi = TOOL_TABLE[i]
        assert turn.tool_kind == kind and lo <= turn.tool_s <= hi
        nxt = job.turns[i + 1].user_content
        header, body = nxt.split("\n", 1)
        assert header.startswith("Output of `")
        assert len(body) <= SIZE_CHARS[kind][1]
        assert len(body) >= SIZE_CHARS[kind][0] // 2  # cut at a line end at most
        first_line = body.splitlines()[0]
        assert any(first_line in entry for entry in corpus[kind])  # text from the corpus
    assert 2.0 <= job.turns[4].tool_s <= 5.0  # the slow pytest turn
    with pytest.raises(ValueError, match="turns"):
        make_job("j", 0, 0, 32, corpus, random.Random(0))


def test_synthetic_jobs_are_bounded_and_reproducible(corpus):
    a = synthetic_jobs(1.0, 50, 3, 16, corpus, seed=7, max_jobs=10)
    b = synthetic_jobs(1.0, 50, 3, 16, corpus, seed=7, max_jobs=10)
    assert len(a) == 10  # ~50 arrivals, bounded by max_jobs
    assert [j.turns[1].user_content for j in a] == [j.turns[1].user_content for j in b]
    assert len({j.job_id for j in a}) == 10


class FakeCompletions:
    """Records what an agent sends; answers with a numbered bash command, from the server
    ``replicas[i]`` for call ``i`` (``INSTANCE_HEADER``; none if not given)."""

    def __init__(self, fail_on: int | None = None, replicas: list[str] | None = None) -> None:
        self.calls: list[dict] = []
        self.fail_on = fail_on
        self.replicas = replicas
        self.with_raw_response = SimpleNamespace(create=self._raw)

    async def _raw(self, **kw):
        resp = await self.create(**kw)
        headers = {INSTANCE_HEADER: self.replicas[len(self.calls) - 1]} if self.replicas else {}
        return SimpleNamespace(parse=lambda: resp, headers=headers)

    async def create(self, **kw):
        self.calls.append(kw)
        if self.fail_on is not None and len(self.calls) == self.fail_on:
            raise RuntimeError("server went away")
        n = len(self.calls)
        prompt = sum(len(m["content"]) for m in kw["messages"]) // 4
        return SimpleNamespace(
            usage=SimpleNamespace(
                prompt_tokens=prompt,
                completion_tokens=5,
                prompt_tokens_details=SimpleNamespace(cached_tokens=prompt // 2),
            ),
            choices=[SimpleNamespace(message=SimpleNamespace(content=f"```bash\nls {n}\n```"))],
        )


def _fast(job):
    for t in job.turns:
        t.tool_s = 0.0
    return job


def test_run_job_grows_the_context_and_marks_only_the_last_step(corpus):
    completions = FakeCompletions()
    client = SimpleNamespace(chat=SimpleNamespace(completions=completions))
    job = _fast(make_job("job_7", 0, 4, 24, corpus, random.Random(2)))
    result = asyncio.run(run_job(client, "m", job, request_timeout_s=5))
    assert result.error is None and len(result.turns) == 4
    calls = completions.calls
    assert [c["extra_body"] for c in calls] == [
        {"job_id": "job_7", "is_last_step": last} for last in (False, False, False, True)
    ]
    for i in range(1, 4):  # each turn resends the whole history plus answer and tool output
        prev, cur = calls[i - 1]["messages"], calls[i]["messages"]
        assert cur[: len(prev)] == prev
        assert cur[len(prev)] == {"role": "assistant", "content": f"```bash\nls {i}\n```"}
        assert cur[len(prev) + 1] == {"role": "user", "content": job.turns[i].user_content}
    assert calls[0]["messages"][0]["role"] == "system" and calls[0]["max_tokens"] == 24
    assert [t.prompt_tokens for t in result.turns] == sorted(t.prompt_tokens for t in result.turns)


def test_run_job_records_the_replica_of_each_turn_and_the_program_steps(corpus):
    completions = FakeCompletions(replicas=["127.0.0.1:1", "127.0.0.1:1", "127.0.0.1:2"])
    client = SimpleNamespace(chat=SimpleNamespace(completions=completions))
    job = _fast(make_job("job_p", 0, 3, 8, corpus, random.Random(0)))
    result = asyncio.run(run_job(client, "m", job, request_timeout_s=5, identity="program_id"))
    assert [t.replica for t in result.turns] == ["127.0.0.1:1", "127.0.0.1:1", "127.0.0.1:2"]
    contexts = [c["extra_body"]["vllm_xargs"]["agentic_context"] for c in completions.calls]
    assert [(c["step_id"], c["expected_resume"]) for c in contexts] == [
        (0, True),
        (1, True),
        (2, False),
    ]
    assert routing_summary([result])["turn_moves"] == 1


def test_the_program_identity_is_what_the_router_s_program_layer_reads():
    # vllm-router's --enable-program-scheduling admits, pauses and binds a Program per
    # vllm_xargs.agentic_context.program_id; expected_resume false: its last request.
    assert identity_fields("program_id", "job-7", last=False, step=2) == {
        "extra_headers": {"X-Session-ID": "job-7"},
        "extra_body": {
            "vllm_xargs": {
                "agentic_context": {
                    "program_id": "job-7",
                    "session_id": "job-7",
                    "step_id": 2,
                    "expected_resume": True,
                }
            },
            "is_last_step": False,
        },
    }
    last = identity_fields("program_id", "job-7", last=True, step=7)["extra_body"]
    assert last["vllm_xargs"]["agentic_context"]["expected_resume"] is False
    assert last["is_last_step"] is True


@pytest.mark.parametrize(
    "replicas, moves",
    [
        ([], 0),
        (["a"], 0),
        (["a", "a", "a"], 0),
        (["a", "b", "b", "a"], 2),  # each change of replica is one move
        (["a", None, "b"], 0),  # an unknown turn is compared with neither neighbour
        (["a", "b", None, "b"], 1),
    ],
)
def test_turn_moves_count_the_turns_served_elsewhere_than_the_previous(replicas, moves):
    assert turn_moves(replicas) == moves


def _routed(job_id: str, replicas: list[str | None], error: str | None = None) -> JobResult:
    turns = [TurnResult(1.0, 10, 0, 1, replica) for replica in replicas]
    return JobResult(job_id, 1.0, turns, error)


def test_the_summary_reports_turn_moves_and_turns_per_replica():
    results = [
        _routed("j1", ["r0", "r0", "r0"]),
        _routed("j2", ["r1", "r0", "r1"]),  # two moves
        _routed("j3", ["r1", "r0"], error="timeout: x"),  # a failed job's turns count too
    ]
    s = summarize("fcfs", 0.1, results)
    assert s["turns_per_replica"] == {"r0": 5, "r1": 3}
    assert s["turn_moves"] == 3 and s["jobs_with_turn_moves"] == 2
    assert s["job_turn_moves"] == {"j2": 2, "j3": 1}
    # One server that does not name itself: no routing fields at all.
    assert "turn_moves" not in summarize("fcfs", 0.1, [_routed("j", [None, None])])


def test_run_job_reports_a_failure_instead_of_raising(corpus):
    completions = FakeCompletions(fail_on=2)
    client = SimpleNamespace(chat=SimpleNamespace(completions=completions))
    job = _fast(make_job("job_f", 0, 3, 8, corpus, random.Random(0)))
    result = asyncio.run(run_job(client, "m", job, request_timeout_s=5))
    assert result.error == "RuntimeError: server went away" and len(result.turns) == 1


def test_trace_replay_keeps_order_sizes_and_times(tmp_path, corpus):
    lines = [
        {"job_id": "b", "turn": 1, "max_tokens": 9},
        {"job_id": "a", "turn": 0, "arrival_s": 3.0, "tool_duration_s": 0.25,
         "tool_output_tokens": 100, "tool_kind": "grep", "prompt_tokens": 50},
        {"job_id": "b", "turn": 0, "arrival_s": 1.0, "tool_duration_s": 4.0,
         "tool_output_tokens": 400, "tool_kind": "test_log"},
        {"job_id": "a", "turn": 1, "tool_duration_s": 99.0},
    ]  # fmt: skip
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    jobs = load_trace(path, jps=1.0, corpus=corpus, seed=0, max_tokens=32, max_jobs=10)
    assert [j.job_id for j in jobs] == ["b", "a"]  # by arrival
    b, a = jobs
    assert b.arrival_s == 1.0 and a.arrival_s == 3.0
    assert [t.tool_s for t in b.turns] == [4.0, 0.0] and b.turns[-1].tool_kind is None
    assert b.turns[0].tool_kind == "test_log" and b.turns[1].max_tokens == 9
    assert b.turns[0].max_tokens == 32
    # 400 tokens at 3.5 chars per token, cut at a line end
    body = b.turns[1].user_content.split("\n", 1)[1]
    assert 700 <= len(body) <= 1400
    assert a.turns[0].tool_kind == "grep" and a.turns[0].tool_s == 0.25
    first = a.turns[0].user_content  # a task plus quoted code: 50 tokens ~ 175 chars
    assert first.startswith("Task: ") and 100 <= len(first) <= 180
    assert len(a.turns[1].user_content.split("\n", 1)[1]) <= 350


def test_trace_errors_name_the_line(tmp_path, corpus):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"job_id": "a"}\n{oops\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not JSON"):
        load_trace(path, 1.0, corpus, 0, 32, 10)
    path.write_text('{"turn": 0}\n')
    with pytest.raises(ValueError, match=r":1: each line needs a job_id"):
        load_trace(path, 1.0, corpus, 0, 32, 10)
    path.write_text('{"job_id": "a", "tool_kind": "ssh"}\n')
    with pytest.raises(ValueError, match="tool_kind 'ssh'"):
        load_trace(path, 1.0, corpus, 0, 32, 10)


def _job(job_id: str, seconds: float, latencies: list[float]) -> JobResult:
    turns = [TurnResult(ms, 100 * (i + 1), 50 * i, 8) for i, ms in enumerate(latencies)]
    return JobResult(job_id, seconds, turns)


def test_summary_has_the_fork_schema_and_excludes_failures():
    results = [_job(f"j{i}", float(i), [100.0, 300.0]) for i in range(1, 11)]
    results.append(JobResult("bad", 0.5, [], error="timeout: x"))
    s = summarize("continuum", 0.5, results)
    assert s["num_jobs"] == 11 and s["num_completed"] == 10 and s["num_failed"] == 1
    assert s["avg_duration_s"] == 5.5 and s["p50_duration_s"] == 5.5
    assert s["p90_duration_s"] == pytest.approx(9.1) and s["p95_duration_s"] == pytest.approx(9.55)
    assert s["per_turn_avg_latency_ms"] == {"1": 100.0, "2": 300.0}
    assert s["per_turn_avg_prompt_tokens"] == {"1": 100, "2": 200}
    assert s["client_cached_token_ratio"] == pytest.approx(50 / 300, abs=1e-4)
    assert s["job_durations"] == [float(i) for i in range(1, 11)]
    assert s["errors"] == ["timeout: x"]


def test_plot_and_table_from_result_files(tmp_path):
    for policy, scale in (("fcfs", 1.0), ("continuum", 0.8)):
        for jps in (0.1, 0.2):
            r = summarize(policy, jps, [_job(f"j{i}", 10 * scale * i, [1e3]) for i in (1, 2)])
            r.update(prefix_hit_rate=0.5, kv_usage_max=0.95, kv_usage_frac_above_90=0.2,
                     metrics={"preemptions": 3, "pins": 4, "pin_hits": 2})  # fmt: skip
            (tmp_path / f"{policy}_jps{jps:g}.json").write_text(json.dumps(r))
    results = plot_jps_sweep.load_results(tmp_path)
    text = plot_jps_sweep.table(results)
    # continuum jobs 8 and 16 s (avg 12, P90 15.2) vs fcfs 10 and 20 s: 20% less time
    assert "| continuum | 0.1 | 2 (2) | 12.0 | 15.2 | 15.6 | 20.0% | 20.0% |" in text
    assert text.index("| fcfs | 0.1") < text.index("| continuum | 0.1")
    for path in plot_jps_sweep.plot(results, tmp_path, "test"):
        assert path.stat().st_size > 10_000 and path.read_bytes()[:4] == b"\x89PNG"


def test_benchmark_targets_loopback_only():
    ab_benchmark.check_loopback("http://127.0.0.1:8000")
    ab_benchmark.check_loopback("http://localhost:8000")
    with pytest.raises(SystemExit, match="not a loopback address"):
        ab_benchmark.check_loopback("http://10.1.2.3:8000")


def test_shipped_corpus_has_every_kind(corpus):
    for kind in SIZE_CHARS:
        assert len(corpus[kind]) >= 3, kind
    assert any("FAILED" in log for log in corpus["test_log"])
    assert workload.CORPUS_PATH.exists()


def test_shipped_example_trace_replays(corpus):
    path = workload.CORPUS_PATH.parent.parent / "traces" / "example_trace.jsonl"
    jobs = load_trace(path, jps=1.0, corpus=corpus, seed=0, max_tokens=64, max_jobs=100)
    assert [(j.job_id, len(j.turns), j.arrival_s) for j in jobs] == [
        ("swe_0001", 8, 0.0),
        ("swe_0002", 6, 4.0),
        ("swe_0003", 5, 9.5),
    ]
    assert max(t.tool_s for t in jobs[1].turns) == 14.0
    assert all(t.max_tokens == 32 for j in jobs for t in j.turns)


def test_benchmark_refuses_a_window_without_arrivals():
    # seed 0 at 0.01 jobs/s: the first arrival is long after a 1 s window; no server needed
    with pytest.raises(SystemExit, match="no job arrives in 1 s"):
        ab_benchmark.main(["--jps", "0.01", "--duration", "1", "--base-url", "http://127.0.0.1:9"])


def test_overload_view_counts_unfinished_jobs_until_the_window_end(tmp_path):
    results = [_job("a", 10.0, [1e3]), _job("b", 30.0, [1e3])]
    results.append(JobResult("late", 50.0, [], error="timeout: not finished"))
    s = summarize("continuum", 0.2, results, window_s=120.0)
    assert s["num_completed"] == 2 and s["goodput_jobs_per_min"] == 1.0
    assert s["avg_duration_s"] == 20.0 and s["avg_duration_all_s"] == 30.0  # (10+30+50)/3
    assert s["p95_duration_all_s"] == pytest.approx(48.0)
    s.update(metrics={"preemptions": 2, "pins": 5, "pin_hits": 3, "pin_forced_releases": 1},
             prompt_tokens_computed=12_000)  # fmt: skip
    (tmp_path / "continuum_jps0.2.json").write_text(json.dumps(s))
    text = plot_jps_sweep.overload_table(plot_jps_sweep.load_results(tmp_path))
    assert "| continuum | 0.2 | 2 / 3 | 1.00 | 30.0 | 48.0 | 20.0 | 12k | 2 | 5 / 3 / 1 |" in text
    written = plot_jps_sweep.plot(plot_jps_sweep.load_results(tmp_path), tmp_path, "test")
    assert tmp_path / "overload.png" in written
    assert (tmp_path / "overload.png").read_bytes()[:4] == b"\x89PNG"


def test_slow_mix_hints_each_command_and_makes_a_share_of_tools_slow(corpus):
    jobs = [make_job(f"j{i}", 0, 8, 16, corpus, random.Random(i), mix="slow") for i in range(40)]
    tools = [t for j in jobs for t in j.turns if t.tool_kind is not None]
    slow = [t for t in tools if t.tool_kind in ("build", "install", "test_suite")]
    assert 0.2 < len(slow) / len(tools) < 0.4  # SLOW_SHARE = 0.3 of 280 tools
    assert all(10.0 <= t.tool_s <= 60.0 for t in slow)
    assert all(t.command == HINTS[t.tool_kind] for t in tools)
    assert all(t.user_content.endswith(f"Next, run: {t.command}") for t in tools)
    request = shell_tool_call("make -j2")  # the call is guided to carry exactly that command
    assert request["tool_choice"] == {"type": "function", "function": {"name": "bash"}}
    params = request["tools"][0]["function"]["parameters"]
    assert params["properties"]["command"]["enum"] == ["make -j2"]
    assert shell_tool_call(None) == {}
    fork = make_job("f", 0, 8, 16, corpus, random.Random(0))
    assert all("Next, run" not in t.user_content for t in fork.turns)  # fork mix: unchanged
    with pytest.raises(ValueError, match="mix"):
        make_job("x", 0, 2, 16, corpus, random.Random(0), mix="fast")


def test_guided_mix_is_the_fork_mix_with_each_command_hinted_and_called(corpus):
    # For a random-weight model: the fork mix's tools, times and outputs, and the command
    # each turn runs written through a guided tool call, so that ContextServe judges it.
    for i in range(10):
        fork = make_job(f"j{i}", 0, 8, 16, corpus, random.Random(i))
        guided = make_job(f"j{i}", 0, 8, 16, corpus, random.Random(i), mix="guided")
        for f, g in zip(fork.turns, guided.turns, strict=True):
            assert (g.tool_kind, g.tool_s) == (f.tool_kind, f.tool_s)
            if f.tool_kind is None:  # the last turn runs no tool
                assert g.command is None and g.user_content == f.user_content
                continue
            assert f.command is None and g.command == HINTS[f.tool_kind]
            assert g.user_content == f"{f.user_content}\nNext, run: {g.command}"
            assert shell_tool_call(g.command)["tool_choice"]["function"]["name"] == "bash"


def test_labelled_delta_keeps_what_moved_including_series_born_mid_run():
    before = {"a{speed=fast}": 2.0, "a{speed=slow}": 1.0}
    after = {"a{speed=fast}": 5.0, "a{speed=slow}": 1.0, "a{speed=uncertain}": 3.0}
    assert ab_benchmark.labelled_delta(before, after) == {
        "a{speed=fast}": 3.0,
        "a{speed=uncertain}": 3.0,
    }


def test_the_session_identity_is_the_header_the_router_routes_by():
    from our_experiments.scripts.workload import identity_fields

    fields = identity_fields("x-session-id", "job-7", last=True)
    assert fields == {
        "extra_headers": {"X-Session-ID": "job-7"},
        "extra_body": {"is_last_step": True},
    }


def test_routing_table_shows_turns_pins_and_hits_per_replica():
    def point(moves: int, rows: list[tuple[int, int, int]]) -> dict:
        replicas = [
            {"replica": i, "turns": t, "pins": p, "pin_hits": h, "preemptions": 0}
            for i, (t, p, h) in enumerate(rows)
        ]
        return {"turn_moves": moves, "jobs_with_turn_moves": min(moves, 1), "replicas": replicas}

    results = {
        "continuum+router2-program": {0.08: point(0, [(48, 42, 36), (32, 28, 24)])},
        "fcfs+router2-round_robin": {0.08: point(35, [(40, 0, 0), (40, 0, 0)])},
        "continuum": {0.08: {"policy": "continuum"}},  # one server: not in this table
    }
    text = plot_jps_sweep.routing_table(results)
    program = "| continuum+router2-program | 0.08 | 48 / 32 | 0 (0) | 42 / 28 | 36 / 24 | 0 / 0 |"
    assert program in text
    assert "| fcfs+router2-round_robin | 0.08 | 40 / 40 | 35 (1) |" in text
    assert "| continuum | " not in text
    assert plot_jps_sweep.routing_table({"continuum": {0.08: {}}}) == ""
