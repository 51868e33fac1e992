"""Random arrivals, steps, finishes, aborts, pins and preemptions never leak a block."""

from __future__ import annotations

import os

from hypothesis import given, settings
from hypothesis import strategies as st

from vllm.v1.request import RequestStatus

from ..conftest import make_request
from .helpers import make_scheduler, step
from .test_pinning import PinAll

actions = st.lists(
    st.tuples(st.sampled_from(["add", "step", "step", "abort", "tick"]), st.integers(0, 50)),
    min_size=1,
    max_size=50,
)


@settings(max_examples=int(os.environ.get("HYPOTHESIS_EXAMPLES", 80)), deadline=None)
@given(
    actions,
    st.booleans(),
    st.sampled_from(["fcfs", "priority", "continuum", "context_serve"]),
    st.booleans(),
)
def test_random_workload_conserves_blocks(seq, pin, policy, job_admission):
    clock_policy = PinAll(ttl=1.5) if pin else None
    s = make_scheduler(
        num_blocks=10,
        budget=16,
        max_num_seqs=4,
        max_model_len=40,
        policy=policy,
        policy_obj=clock_policy,
        job_admission=job_admission,
    )
    clock = s.clock
    added = []
    for op, arg in seq:
        if op == "add":
            n = 1 + arg % 20
            req = make_request(
                [arg + i for i in range(n)],
                max_tokens=1 + arg % 9,
                job_id=f"job{arg % 3}",
                is_last_step=arg % 4 == 0,
                priority=arg % 3,
            )
            s.add_request(req)
            added.append(req)
        elif op == "step":
            step(s)
        elif op == "abort" and added:
            s.finish_requests(added[arg % len(added)].request_id, RequestStatus.FINISHED_ABORTED)
        elif op == "tick":
            clock.advance(arg / 10)
        s.check_invariants()
    for _ in range(400):
        if not s.has_unfinished_requests():
            break
        step(s)
        clock.advance(1.0)  # time passes: TTLs and waiting bounds end every hold
    assert not s.has_unfinished_requests()
    clock.advance(10)
    s.schedule()  # all pins expire
    s.check_invariants()
    assert s.kv_cache_manager.usage == 0.0
