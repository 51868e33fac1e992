"""Scheduler scenarios with fake model outputs. Block size 4; block 0 is the null block."""

from __future__ import annotations

import pytest

from vllm.v1.request import RequestStatus

from ..conftest import make_request
from .helpers import make_scheduler, run_until_done, step


def test_budget_and_max_num_seqs():
    s = make_scheduler(budget=20, max_num_seqs=2)
    reqs = [make_request(list(range(i * 10, i * 10 + 8)), max_tokens=3) for i in range(3)]
    for r in reqs:
        s.add_request(r)
    so, _ = step(s)
    # Two 8-token prompts fit (16 <= 20); the third is held back by max_num_seqs.
    assert so.num_scheduled_tokens == {reqs[0].request_id: 8, reqs[1].request_id: 8}
    assert [r.request_id for r in s.waiting] == [reqs[2].request_id]
    so, _ = step(s)
    assert so.num_scheduled_tokens == {reqs[0].request_id: 1, reqs[1].request_id: 1}
    run_until_done(s)
    assert s.kv_cache_manager.usage == 0.0


def test_chunked_prefill_across_steps():
    s = make_scheduler(budget=8)
    r = make_request(list(range(20)), max_tokens=2)
    s.add_request(r)
    so1, out1 = step(s)
    assert so1.num_scheduled_tokens[r.request_id] == 8 and out1.outputs == []
    so2, out2 = step(s)
    assert so2.scheduled_cached_reqs.req_ids == [r.request_id]
    assert so2.scheduled_cached_reqs.num_computed_tokens == [8]
    so3, out3 = step(s)
    assert so3.num_scheduled_tokens[r.request_id] == 4  # 20 = 8 + 8 + 4
    assert out3.outputs[0].new_token_ids == [7]  # the first token comes with the last chunk
    run_until_done(s)


def test_long_prefill_threshold_caps_chunks():
    s = make_scheduler(budget=64, threshold=5)
    r = make_request(list(range(12)), max_tokens=1)
    s.add_request(r)
    so, _ = step(s)
    assert so.num_scheduled_tokens[r.request_id] == 5


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    s = make_scheduler(budget=128, max_model_len=128, chunked=False)
    a = make_request(list(range(100)), max_tokens=2)
    b = make_request(list(range(200, 240)), max_tokens=2)
    s.add_request(a)
    s.add_request(b)
    so, _ = step(s)
    assert so.num_scheduled_tokens == {a.request_id: 100}  # b (40) does not fit the 28 left


def test_prefix_hit_on_shared_prompt():
    s = make_scheduler()
    shared = list(range(100, 112))  # 3 full blocks
    a = make_request(shared + [1, 2], max_tokens=2)
    s.add_request(a)
    run_until_done(s)
    b = make_request(shared + [3], max_tokens=2)
    s.add_request(b)
    so, out = step(s)
    # 12 shared tokens come from the cache; only 1 token is computed.
    assert so.scheduled_new_reqs[0].num_computed_tokens == 12
    assert so.num_scheduled_tokens[b.request_id] == 1
    assert out.outputs[0].num_cached_tokens == 12
    stats = out.scheduler_stats.prefix_cache_stats
    assert stats.hits == 12 and stats.queries == 13
    run_until_done(s)


def test_preemption_and_resumption_with_prefix_recovery():
    # 8 usable blocks. Two requests of 12 prompt tokens (3 blocks each) decode until the
    # pool runs out; FCFS preempts the last admitted, which later resumes with a hit.
    s = make_scheduler(num_blocks=9, budget=64)
    a = make_request(list(range(12)), max_tokens=12)
    b = make_request(list(range(50, 62)), max_tokens=12)
    s.add_request(a)
    s.add_request(b)
    preempted_seen = False
    for _ in range(60):
        so, _ = step(s)
        if b.request_id in so.preempted_req_ids:
            preempted_seen = True
            assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
            assert a.status == RequestStatus.RUNNING  # the last admitted is the victim
        if preempted_seen and any(n.req_id == b.request_id for n in so.scheduled_new_reqs):
            resumed = next(n for n in so.scheduled_new_reqs if n.req_id == b.request_id)
            # Its blocks were freed tail first, so a evicted b's tail while decoding; the
            # head blocks were still cached and b resumes with a prefix hit.
            assert resumed.num_computed_tokens > 0 and resumed.num_computed_tokens % 4 == 0
            # It recomputes everything it knew (prompt + outputs so far) past the hit.
            assert resumed.num_computed_tokens + so.num_scheduled_tokens[b.request_id] == len(
                resumed.token_ids
            )
            assert len(resumed.token_ids) > 12
            break
        if not s.has_unfinished_requests():
            break
    assert preempted_seen
    run_until_done(s)
    assert a.num_output_tokens == 12 and b.num_output_tokens == 12
    assert s.kv_cache_manager.usage == 0.0


def test_priority_policy_preempts_worst_priority():
    s = make_scheduler(num_blocks=9, policy="priority")
    low = make_request(list(range(12)), max_tokens=12, priority=5)
    high = make_request(list(range(50, 62)), max_tokens=12, priority=0)
    s.add_request(low)
    s.add_request(high)
    so, _ = step(s)
    assert [n.req_id for n in so.scheduled_new_reqs] == [high.request_id, low.request_id]
    for _ in range(40):
        so, _ = step(s)
        if so.preempted_req_ids:
            assert so.preempted_req_ids == {low.request_id}
            break
    else:
        pytest.fail("no preemption happened")
    run_until_done(s)


def test_abort_mid_decode_frees_blocks():
    s = make_scheduler()
    r = make_request(list(range(10)), max_tokens=50)
    s.add_request(r)
    step(s)
    step(s)
    assert s.kv_cache_manager.usage > 0
    s.finish_requests(r.request_id, RequestStatus.FINISHED_ABORTED)
    s.check_invariants()
    assert s.kv_cache_manager.usage == 0.0
    so = s.schedule()
    assert r.request_id in so.finished_req_ids and so.total_num_scheduled_tokens == 0
    s.finish_requests("unknown", RequestStatus.FINISHED_ABORTED)  # no-op


def test_abort_waiting_request():
    s = make_scheduler(max_num_seqs=1)
    a, b = make_request([1, 2, 3]), make_request([4, 5, 6])
    s.add_request(a)
    s.add_request(b)
    step(s)
    s.finish_requests(b.request_id, RequestStatus.FINISHED_ABORTED)
    assert len(s.waiting) == 0
    s.check_invariants()


@pytest.mark.parametrize(
    ("kwargs", "tokens", "status", "n_out", "stop_reason"),
    [
        ({"max_tokens": 3}, [5, 5, 5, 5], RequestStatus.FINISHED_LENGTH_CAPPED, 3, None),
        ({"stop_token_ids": [9]}, [5, 9, 5], RequestStatus.FINISHED_STOPPED, 2, 9),
        ({"stop_token_ids": [9], "min_tokens": 2}, [9, 9, 5], RequestStatus.FINISHED_STOPPED, 2, 9),
    ],
)
def test_stop_conditions(kwargs, tokens, status, n_out, stop_reason):
    s = make_scheduler()
    r = make_request([1, 2, 3], **kwargs)
    s.add_request(r)
    for t in tokens:
        step(s, token=t)
        if r.is_finished():
            break
    assert r.status == status and r.num_output_tokens == n_out and r.stop_reason == stop_reason


def test_eos_stops_with_no_stop_reason():
    s = make_scheduler()
    r = make_request([1, 2, 3], max_tokens=10)
    r.eos_token_id = 2
    r.sampling_params.update_from_generation_config(2)
    s.add_request(r)
    step(s, token=4)
    _, out = step(s, token=2)
    assert out.outputs[0].finish_reason is not None and str(out.outputs[0].finish_reason) == "stop"
    assert r.stop_reason is None


def test_max_model_len_caps_generation():
    s = make_scheduler(max_model_len=16)
    r = make_request(list(range(14)), max_tokens=100)
    s.add_request(r)
    run_until_done(s)
    assert r.num_tokens == 16 and r.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_prompt_larger_than_the_pool_rejected():
    # (max_model_len is the processor's check: tests/v1/engine/test_processor.py)
    small_pool = make_scheduler(num_blocks=3, max_model_len=128)  # 2 blocks = 8 tokens
    with pytest.raises(ValueError, match="KV cache"):
        small_pool.add_request(make_request(list(range(10))))
    assert not small_pool.has_unfinished_requests()


def test_duplicate_request_id_rejected():
    s = make_scheduler()
    s.add_request(make_request([1, 2], request_id="x"))
    with pytest.raises(ValueError, match="request_id"):
        s.add_request(make_request([1, 2], request_id="x"))


def test_at_most_max_loras_adapters_run_and_the_skipped_keep_their_places():
    """As vLLM: a waiting request whose adapter would be one too many waits, and requests
    behind it (the base model, an adapter already running) go ahead."""
    from vllm.lora.request import LoRARequest

    s = make_scheduler(max_loras=2)
    lora = {i: LoRARequest(f"a{i}", i, "/adapters") for i in (1, 2, 3)}
    reqs = [
        make_request([1, 2, 3, 4], lora_request=lora[1], max_tokens=3),
        make_request([1, 2, 3, 4], lora_request=lora[2], max_tokens=3),
        make_request([5, 6, 7, 8], lora_request=lora[3], max_tokens=3),  # a third: waits
        make_request([9, 10, 11, 12], max_tokens=3),  # the base model: runs
        make_request([1, 2, 3, 4], lora_request=lora[1], max_tokens=3),  # a1 runs: runs
        make_request([5, 6, 7, 9], lora_request=lora[3], max_tokens=3),  # behind the other a3
    ]
    for r in reqs:
        s.add_request(r)
    so, _ = step(s)
    assert [r.req_id for r in so.scheduled_new_reqs] == [reqs[i].request_id for i in (0, 1, 3, 4)]
    assert [r.request_id for r in s.waiting] == [reqs[2].request_id, reqs[5].request_id]
    stats = s.make_stats()  # vLLM's vllm:lora_requests_info fields
    assert stats.running_lora_adapters == {"a1": 2, "a2": 1}
    assert stats.waiting_lora_adapters == {"a3": 2}
    seen_together = []
    while s.requests:
        so, _ = step(s)
        running = {r.lora_request.lora_int_id for r in s.running if r.lora_request}
        assert len(running) <= 2
        seen_together.append(running)
    assert any(3 in ids for ids in seen_together)  # a3 ran once a slot freed
    # The adapter's name keys the prefix cache: the same tokens under another adapter
    # (or none) share no block.
    assert reqs[0].block_hashes[0] != reqs[1].block_hashes[0]
    base = make_request([1, 2, 3, 4])
    assert base.block_hashes[0] not in (reqs[0].block_hashes[0], reqs[1].block_hashes[0])
    assert make_request([1, 2, 3, 4], lora_request=lora[1]).block_hashes == reqs[0].block_hashes
