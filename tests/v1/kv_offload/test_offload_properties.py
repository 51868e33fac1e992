"""Random workloads with a CPU KV tier: after every step both tiers conserve their blocks
(``check_invariants``) and every hashed block of either tier holds the tokens its hash
names (``FakeKV``), whatever mix of frees, pins, offloads, aborts and preemptions."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from vllm.v1.request import RequestStatus
from vllm_continuum.policy.base import FREE, Offload, Pin
from vllm_continuum.policy.plain import FCFSPolicy

from ..core.conftest import make_request
from .helpers import FakeKV, make_offload_scheduler, offload_step

actions = st.lists(
    st.tuples(st.sampled_from(["add", "add", "step", "step", "abort", "tick"]), st.integers(0, 50)),
    min_size=20,
    max_size=60,
)


class MixedPolicy(FCFSPolicy):
    """Frees, pins or offloads by request id; may preempt the first running request
    (one scheduled earlier in the same step)."""

    def __init__(self, victim_first: bool) -> None:
        super().__init__()
        self.victim_first = victim_first

    def on_finished(self, request, now):
        return (FREE, Pin(1.5), Offload())[int(request.request_id.split("-")[-1]) % 3]

    def victim_key(self, request):
        # The earliest arrival (most often one scheduled earlier in this step), or the
        # engine's default (the last admitted).
        return -request.arrival_time if self.victim_first else None


@settings(max_examples=80, deadline=None)
@given(actions, st.integers(1, 32), st.booleans(), st.sampled_from([6, 8, 12]))
def test_random_workload_with_tier_conserves_blocks_and_data(seq, cpu, victim_first, gpu):
    s = make_offload_scheduler(
        num_blocks=gpu,
        num_cpu_blocks=cpu,
        budget=16,
        max_num_seqs=4,
        max_model_len=20,
        policy_obj=MixedPolicy(victim_first),
    )
    fkv = FakeKV(s)
    clock = s.clock
    added = []
    for op, arg in seq:
        if op == "add":
            # Few distinct prompts sharing blocks, so they hit both tiers.
            prompt = [arg % 3 * 20 + i for i in range(5 + arg % 11)]
            req = make_request(prompt, max_tokens=1 + arg % 5, job_id=f"job{arg % 3}")
            s.add_request(req)
            added.append(req)
        elif op == "step":
            offload_step(s, fkv)
        elif op == "abort" and added:
            s.finish_requests(added[arg % len(added)].request_id, RequestStatus.FINISHED_ABORTED)
        elif op == "tick":
            clock.advance(arg / 10)
        s.check_invariants()
    for _ in range(400):
        if not s.has_unfinished_requests():
            break
        offload_step(s, fkv)
    assert not s.has_unfinished_requests()
    clock.advance(10)
    offload_step(s, fkv)  # all pins expire (and are offloaded)
    s.check_invariants()
    assert s.kv_cache_manager.usage == 0.0
