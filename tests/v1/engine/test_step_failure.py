"""A request that fails inside a step fails alone; the engine goes on (issue 16).

EngineCore over the real scheduler and the fake runner of ``test_engine_core`` (next
token = last + 1), with faults injected by monkeypatching the runner's ``execute_model``.
Budget: 16 tokens per step; 15 usable blocks of 16 tokens.
"""

from __future__ import annotations

import pytest

import vllm.v1.worker.model_runner as model_runner_module
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.clock import FakeClock
from vllm.v1.engine.core import EngineCore
from vllm.v1.outputs import ModelRunnerOutput, RequestFailure

from .test_engine_core import FakeRunner, assert_idle, request, run_to_completion

NUM_USABLE_BLOCKS = 15


@pytest.fixture
def engine(monkeypatch):
    monkeypatch.setattr(model_runner_module, "ModelRunner", FakeRunner)
    args = EngineArgs(num_gpu_blocks_override=16, max_num_batched_tokens=16, max_model_len=512)
    return EngineCore(args.create_engine_config(), clock=FakeClock())


def inject_fault(monkeypatch, engine: EngineCore, poison: str = "bad", always: bool = False):
    """The runner raises in every step that schedules ``poison`` (or in every step)."""
    runner = engine.model_runner
    execute = runner.execute_model

    def faulty(so):
        if always or poison in so.num_scheduled_tokens:
            runner.calls.append(so)
            raise RuntimeError("injected fault")
        return execute(so)

    monkeypatch.setattr(runner, "execute_model", faulty)


def assert_pool_whole(engine: EngineCore) -> None:
    assert_idle(engine)
    assert engine.scheduler.kv_cache_manager.num_free_blocks == NUM_USABLE_BLOCKS


def test_a_step_that_raises_fails_its_requests_and_the_engine_goes_on(monkeypatch, engine):
    inject_fault(monkeypatch, engine)
    # Step 1: bad (3 tokens) + the first 13 of a; b (20 tokens) waits for the budget.
    engine.add_request(request("bad", [9, 9, 9], max_tokens=4))
    engine.add_request(request("a", list(range(100, 140)), max_tokens=4))
    engine.add_request(request("b", list(range(200, 220)), max_tokens=3))
    out = engine.step()
    assert {e.request_id for e in out.errors} == {"bad", "a"}  # the culprit is unknown
    assert all(e.internal and "RuntimeError: injected fault" in e.message for e in out.errors)
    assert out.outputs == []
    engine.scheduler.check_invariants()
    # b was not in the failed step: it runs to its correct tokens; the engine serves new work.
    engine.add_request(request("c", [5, 6], max_tokens=2))
    results = run_to_completion(engine)
    assert results["b"][0] == [220, 221, 222] and results["c"][0] == [7, 8]
    assert "bad" not in results and "a" not in results
    runner = engine.model_runner
    assert {"bad", "a"} <= runner.calls[1].finished_req_ids  # the runner drops their state
    assert not {"bad", "a"} & set(runner.states)
    assert_pool_whole(engine)


def test_the_kv_of_a_failed_step_is_never_served_from_the_prefix_cache(monkeypatch, engine):
    inject_fault(monkeypatch, engine)
    prompt = list(range(300, 320))  # one full block (hashed when allocated) + 4 tokens
    engine.add_request(request("bad", prompt, max_tokens=2))
    assert [e.request_id for e in engine.step().errors] == ["bad"]
    assert engine.scheduler.kv_cache_manager.block_pool.num_cached_blocks == 0
    engine.add_request(request("again", prompt, max_tokens=2))
    tokens, last = run_to_completion(engine)["again"]
    assert tokens == [320, 321] and last.num_cached_tokens == 0  # no hit on unwritten KV
    assert_pool_whole(engine)


def test_a_request_the_runner_fails_alone_leaves_its_batch_running(monkeypatch, engine):
    runner = engine.model_runner
    execute = runner.execute_model

    def nan_for_bad(so):
        out = execute(so)
        if out.sampled_token_ids.get("bad"):  # its row "could not be sampled"
            out.sampled_token_ids["bad"] = []
            out.errors["bad"] = RequestFailure("NaN probabilities", internal=False)
        return out

    monkeypatch.setattr(runner, "execute_model", nan_for_bad)
    engine.add_request(request("bad", [9, 9, 9], max_tokens=4))
    engine.add_request(request("good", [5, 6], max_tokens=3))
    out = engine.step()  # both sampled in this step; only bad fails
    assert [(e.request_id, e.internal) for e in out.errors] == [("bad", False)]
    assert [(o.request_id, o.new_token_ids) for o in out.outputs] == [("good", [7])]
    results = run_to_completion(engine)
    assert results["good"][0] == [8, 9] and "bad" not in results
    assert_pool_whole(engine)


def test_steps_failing_in_a_row_end_the_engine(monkeypatch, engine):
    inject_fault(monkeypatch, engine, always=True)
    for i in range(EngineCore.MAX_FAILED_STEPS - 1):
        engine.add_request(request(f"r{i}", [1, 2], max_tokens=2))
        assert [e.request_id for e in engine.step().errors] == [f"r{i}"]
    engine.add_request(request("last", [1, 2], max_tokens=2))
    with pytest.raises(RuntimeError, match="injected fault"):
        engine.step()  # a broken model: the engine process reports FATAL


def test_a_step_that_succeeds_resets_the_count(monkeypatch, engine):
    inject_fault(monkeypatch, engine, poison="bad")
    for i in range(2 * EngineCore.MAX_FAILED_STEPS):
        engine.add_request(request(f"bad{i}", [1, 2], max_tokens=1))
        engine.add_request(request("bad", [9], max_tokens=1))
        assert {e.request_id for e in engine.step().errors} == {f"bad{i}", "bad"}
        engine.add_request(request(f"ok{i}", [5, 6], max_tokens=1))
        assert run_to_completion(engine)[f"ok{i}"][0] == [7]
    assert_pool_whole(engine)


def test_ids_a_failed_step_carried_reach_the_runner_with_the_next_step(monkeypatch, engine):
    engine.add_request(request("x", list(range(100, 120)), max_tokens=50))
    engine.step()
    engine.abort_requests(["x"])  # delivered to the runner with the next step...
    inject_fault(monkeypatch, engine)
    engine.add_request(request("bad", [9], max_tokens=2))
    engine.step()  # ...which fails before the runner looked at it
    engine.add_request(request("c", [5, 6], max_tokens=1))
    run_to_completion(engine)
    runner = engine.model_runner
    assert {"x", "bad"} <= runner.calls[-1].finished_req_ids
    assert not {"x", "bad"} & set(runner.states)
    assert_pool_whole(engine)


def test_an_empty_runner_output_with_errors_only(engine):
    # A runner that failed every request of the step before its forward pass.
    engine.add_request(request("a", [1, 2], max_tokens=2))
    so = engine.scheduler.schedule()
    out = engine.scheduler.update_from_output(
        so, ModelRunnerOutput([], {}, errors={"a": RequestFailure("no state")})
    )
    assert [e.request_id for e in out.errors] == ["a"] and out.outputs == []
    assert not engine.has_unfinished_requests()
    assert_pool_whole(engine)
