"""A constrained request waits outside the scheduler while its grammar compiles, so the
compile (and the first request's tokenizer table, seconds) never stalls a step."""

from __future__ import annotations

from concurrent.futures import Future

from vllm.sampling_params import SamplingParams, StructuredOutputsParams
from vllm.v1.structured_output.ahead import PendingGrammars

from ..engine.test_engine_core import engine, request, run_to_completion  # noqa: F401

CHOICE = StructuredOutputsParams(choice=["yes", "no"])


class ControlledCompiles:
    """``prepare`` hands out futures the test completes; ``adopt`` records results."""

    def __init__(self) -> None:
        self.futures: list[Future] = []
        self.adopted: list = []

    def prepare(self, params: SamplingParams) -> Future | None:
        if params.structured_outputs is None:
            return None
        self.futures.append(Future())
        return self.futures[-1]

    def adopt(self, compiled) -> None:
        self.adopted.append(compiled)


def constrained(request_id: str, **params):
    return request(request_id, [10, 11, 12], structured_outputs=CHOICE, max_tokens=3, **params)


def test_pending_grammars_release_requests_as_their_compile_ends(engine):  # noqa: F811
    compiles = ControlledCompiles()
    pending = PendingGrammars(compiles)
    engine.add_request(request("plain", [1, 2, 3], max_tokens=1))  # a Request to reuse
    plain = engine.scheduler.requests["plain"]
    assert not pending.hold(plain)  # nothing to compile: schedule it now
    a, b, c = (SamplingParams(structured_outputs=CHOICE) for _ in range(3))
    held = [type(plain)(rid, [1], p) for rid, p in zip("abc", (a, b, c), strict=True)]
    assert all(pending.hold(r) for r in held) and len(pending) == 3
    assert pending.take_ready() == ([], [])
    compiles.futures[1].set_result(("g", "matcher"))
    compiles.futures[2].set_exception(RuntimeError("bad grammar"))
    ready, errors = pending.take_ready()
    assert [r.request_id for r in ready] == ["b"] and compiles.adopted == [("g", "matcher")]
    assert [e.request_id for e in errors] == ["c"] and "bad grammar" in errors[0].message
    pending.discard(["a"])
    assert len(pending) == 0 and compiles.futures[0].cancelled()


def test_the_engine_steps_other_requests_while_a_grammar_compiles(engine):  # noqa: F811
    compiles = ControlledCompiles()
    engine.grammars = PendingGrammars(compiles)
    engine.add_request(constrained("json"))
    engine.add_request(request("plain", [1, 2, 3], max_tokens=2))
    assert "json" not in engine.scheduler.requests and engine.has_unfinished_requests()
    out = engine.step()
    assert [o.request_id for o in out.outputs] == ["plain"]
    compiles.futures[0].set_result(("grammar", "matcher"))
    results = run_to_completion(engine)
    assert set(results) == {"plain", "json"} and results["json"][1].finished


def test_a_request_aborted_while_its_grammar_compiles_is_gone(engine):  # noqa: F811
    compiles = ControlledCompiles()
    engine.grammars = PendingGrammars(compiles)
    engine.add_request(constrained("json"))
    engine.abort_requests(["json"])
    assert not engine.has_unfinished_requests() and compiles.futures[0].cancelled()
    assert engine.step().outputs == []


def test_a_failed_compile_fails_its_request_alone(engine):  # noqa: F811
    compiles = ControlledCompiles()
    engine.grammars = PendingGrammars(compiles)
    engine.add_request(constrained("json"))
    engine.add_request(request("plain", [1, 2, 3], max_tokens=1))
    compiles.futures[0].set_exception(ValueError("no"))
    out = engine.step()
    assert [e.request_id for e in out.errors] == ["json"]
    assert [o.request_id for o in out.outputs] == ["plain"]
