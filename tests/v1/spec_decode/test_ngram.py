"""N-gram speculative decoding: the proposer, the scheduler's drafts and rollback, the
runner's greedy check, and whole engines whose outputs must equal plain decoding's."""

from __future__ import annotations

import numpy as np
import pytest

from vllm.config import SpeculativeConfig
from vllm.sampling_params import SamplingParams, StructuredOutputsParams
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.spec_decode.ngram_proposer import (
    NgramProposer,
    drafts_allowed,
    find_draft,
    verify_greedy,
)

from ..core.conftest import make_request
from ..core.sched.helpers import make_scheduler
from .chat_engines import CODE, chat, check_limits_hold

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}


@pytest.mark.parametrize(
    ("tokens", "n_min", "n_max", "k", "draft"),
    [
        ([1, 2, 3, 4, 5, 9, 1, 2, 3], 1, 3, 4, [4, 5, 9, 1]),  # "1 2 3" before: "4 5 9 1"
        ([1, 2, 3, 4, 5, 9, 1, 2, 3], 1, 3, 2, [4, 5]),
        ([1, 2, 3, 4, 5, 9, 1, 2, 3], 4, 4, 4, []),  # no 4-gram repeats
        ([5, 1, 7, 5, 1, 8, 5, 1], 2, 2, 1, [8]),  # the most recent occurrence
        ([5, 1, 7, 2, 1, 8, 3, 1], 1, 2, 2, [8, 3]),  # "3 1" never; "1" lastly before 8
        ([4, 4, 4, 4], 1, 3, 3, [4]),  # the continuation stops at the sequence's end
        ([1, 2, 3], 1, 3, 2, []),
        ([7], 1, 3, 2, []),
    ],
)
def test_find_draft(tokens, n_min, n_max, k, draft):
    assert find_draft(np.array(tokens), n_min, n_max, k) == draft


def test_the_proposer_keeps_a_growing_buffer_per_request():
    proposer = NgramProposer(3, 1, 2)
    tokens = [1, 2, 3, 1]
    assert proposer.propose("r", tokens, limit=3) == [2, 3, 1]
    for t in range(100, 300):  # grows past its first buffer
        tokens.append(t)
    tokens += [1, 2]
    assert proposer.propose("r", tokens, limit=2) == [3, 1]
    assert proposer.propose("r", tokens, limit=0) == []
    proposer.forget("r")
    assert proposer.propose("r", [9, 8, 9], limit=3) == [8, 9]  # a fresh buffer


@pytest.mark.parametrize(
    ("argmax", "drafts", "tokens"),
    [
        ([4, 5, 6, 7], [4, 5, 6], [4, 5, 6, 7]),  # all kept, and the next
        ([4, 5, 7, 8], [4, 5, 6], [4, 5, 7]),
        ([3, 5, 6, 7], [4, 5, 6], [3]),  # the first differs: only the model's token
        ([9], [], [9]),
    ],
)
def test_verify_greedy(argmax, drafts, tokens):
    assert verify_greedy(argmax, drafts) == tokens


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        ({"temperature": 0}, True),
        ({"temperature": 0, "stop": ["x"], "ignore_eos": True}, True),
        ({"temperature": 0.7}, True),  # rejection sampling
        ({"temperature": 0.6, "top_p": 0.95, "top_k": 20, "seed": 1}, True),  # Qwen3's
        ({"temperature": 0, "logprobs": 1}, True),  # each kept token's row gives them
        ({"temperature": 0, "repetition_penalty": 1.1}, False),
        ({"temperature": 0, "presence_penalty": 0.5}, False),
        ({"temperature": 0, "logit_bias": {1: 5.0}}, False),
        ({"temperature": 0, "allowed_token_ids": [1, 2]}, False),
        ({"temperature": 0, "min_tokens": 3}, False),
        ({"temperature": 0, "structured_outputs": StructuredOutputsParams(regex="a+")}, False),
    ],
)
def test_requests_whose_token_depends_on_the_logits_alone_get_drafts(params, allowed):
    assert drafts_allowed(SamplingParams(**params)) is allowed


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ({"method": "medusa", "num_speculative_tokens": 3}, "method"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
        ({**NGRAM, "prompt_lookup_max": 0}, "prompt_lookup_max"),
        ({**NGRAM, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({**NGRAM, "model": "some/draft"}, "speculative_config"),
        ({**NGRAM, "disable_by_batch_size": 0}, "disable_by_batch_size"),
    ],
)
def test_bad_configs_name_the_field(spec, needle):
    with pytest.raises(ValueError, match=needle):
        SpeculativeConfig(spec)


def test_config_defaults_as_vllm():
    c = SpeculativeConfig({"method": "ngram", "num_speculative_tokens": 2})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    c = SpeculativeConfig({**NGRAM})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (1, 1)
    assert not SpeculativeConfig().enabled and SpeculativeConfig().num_speculative_tokens == 0


# -- the scheduler ------------------------------------------------------------------------
def _decode_until_drafts(sched, req):
    """Prefill, then one decode step with the model echoing the prompt's pattern."""
    so = sched.schedule()
    sched.update_from_output(so, ModelRunnerOutput([req.request_id], {req.request_id: [1]}))
    return sched.schedule()


def test_drafts_are_scheduled_and_rejected_ones_rolled_back():
    sched = make_scheduler(speculative=NGRAM)
    req = make_request([1, 2, 3, 4, 5, 6, 7, 8, 9], temperature=0)
    sched.add_request(req)
    so = _decode_until_drafts(sched, req)
    # Known: 1..9 then 1: the last "1" occurred at the start, followed by 2 3 4.
    assert so.scheduled_spec_decode_tokens == {req.request_id: [2, 3, 4]}
    assert so.num_scheduled_tokens[req.request_id] == 4
    assert req.num_computed_tokens == 10 + 3  # as scheduled, drafts included
    # The model agreed with "2" only, then chose 8: two tokens, two drafts rejected.
    out = sched.update_from_output(
        so, ModelRunnerOutput([req.request_id], {req.request_id: [2, 8]})
    )
    assert out.outputs[0].new_token_ids == [2, 8]
    assert req.all_token_ids[-3:] == [1, 2, 8] and req.num_computed_tokens == req.num_tokens - 1
    stats = out.scheduler_stats.spec_decoding_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 1)
    sched.check_invariants()
    # Only blocks of known tokens are cached: 12 tokens -> 3 full blocks of 4.
    assert sched.kv_cache_manager._num_cached_blocks[req.request_id] <= req.num_tokens // 4


def test_a_stop_inside_the_kept_drafts_ends_the_request_there():
    sched = make_scheduler(speculative=NGRAM)
    req = make_request([1, 2, 3, 4, 5, 6, 7, 8, 9], temperature=0, stop_token_ids=[3])
    sched.add_request(req)
    so = _decode_until_drafts(sched, req)
    assert so.scheduled_spec_decode_tokens[req.request_id] == [2, 3, 4]
    out = sched.update_from_output(
        so, ModelRunnerOutput([req.request_id], {req.request_id: [2, 3, 4, 5]})
    )
    assert out.outputs[0].new_token_ids == [2, 3] and req.is_finished()
    assert req.num_computed_tokens == req.num_tokens - 1  # not the tokens after the stop
    sched.check_invariants()


def test_drafts_stop_at_max_tokens_and_the_budget():
    sched = make_scheduler(speculative={**NGRAM, "num_speculative_tokens": 8})
    req = make_request([1, 2, 3, 4, 5, 6, 7, 8, 9], temperature=0, max_tokens=3)
    sched.add_request(req)
    so = _decode_until_drafts(sched, req)
    # One output so far, max_tokens 3: one more token is the step's, one draft fits.
    assert so.scheduled_spec_decode_tokens[req.request_id] == [2]
    tight = make_scheduler(speculative={**NGRAM, "num_speculative_tokens": 8}, budget=12)
    other = make_request([1, 2, 3, 4, 5, 6, 7, 8, 9], temperature=0)
    tight.add_request(other)
    so = tight.schedule()  # the prefill (9 tokens)
    tight.update_from_output(so, ModelRunnerOutput([other.request_id], {other.request_id: [1]}))
    so = tight.schedule()
    assert so.num_scheduled_tokens[other.request_id] <= 12


def test_no_drafts_above_the_batch_size_limit():
    sched = make_scheduler(speculative={**NGRAM, "disable_by_batch_size": 1})
    reqs = [make_request([1, 2, 3, 1], temperature=0) for _ in range(2)]
    sched.add_request(reqs[0])
    assert _decode_until_drafts(sched, reqs[0]).scheduled_spec_decode_tokens
    sched.add_request(reqs[1])
    so = sched.schedule()  # two running: plain steps
    assert so.scheduled_spec_decode_tokens == {}


def test_penalised_requests_get_no_drafts_and_no_stats_without_the_config():
    sched = make_scheduler(speculative=NGRAM)
    req = make_request([1, 2, 3, 1], temperature=0.8, presence_penalty=0.5)
    sched.add_request(req)
    so = _decode_until_drafts(sched, req)
    assert so.scheduled_spec_decode_tokens == {} and so.num_scheduled_tokens[req.request_id] == 1
    plain = make_scheduler()
    assert plain.make_stats().spec_decoding_stats is None


# -- whole engines ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engines():
    from vllm import LLM

    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    spec["prompt_lookup_min"] = 1
    plain = LLM(max_num_seqs=4)
    fast = LLM(max_num_seqs=4, speculative_config=spec)
    yield plain, fast
    plain.shutdown()
    fast.shutdown()


def test_greedy_outputs_equal_plain_decoding(engines):
    plain, fast = engines
    params = SamplingParams(temperature=0, max_tokens=80)
    texts = (
        "Repeat this code exactly:\n" + CODE,
        "Copy this list: red, green, blue, red, green, blue, cyan",
        "What is the capital of France?",
    )
    base = chat(plain, params, *texts)
    steps = []
    step = fast.engine_core.step

    def counting():
        out = step()
        spec = out.scheduler_stats.spec_decoding_stats if out.scheduler_stats else None
        steps.append(spec)
        return out

    fast.engine_core.step = counting
    try:
        assert chat(fast, params, *texts) == base
    finally:
        fast.engine_core.step = step
    accepted = sum(s.num_accepted_tokens for s in steps if s is not None)
    assert accepted > 20  # the copying turns did take drafts
    assert len(steps) < max(len(ids) for ids, _, _ in base)  # fewer steps than tokens


def test_a_step_with_drafts_is_decode_rows_only(engines):
    # Each draft position is a decode row of its own (so the decode kernels, and CUDA
    # graphs of decode steps, serve it), not a prefill chunk.
    _, fast = engines
    backend = fast.engine_core.model_runner.attn_backend
    build, layouts = backend.build_metadata, []

    def recording(seqs):
        layouts.append([(computed, n) for computed, n, _ in seqs])
        return build(seqs)

    backend.build_metadata = recording
    try:
        chat(fast, SamplingParams(temperature=0, max_tokens=40), "Repeat exactly:\n" + CODE)
    finally:
        backend.build_metadata = build
    drafted = [rows for rows in layouts if len(rows) > 1]  # one request: >1 row = drafts
    assert drafted and all(n == 1 for rows in drafted for _, n in rows)
    for rows in drafted:  # consecutive positions of one request
        starts = [computed for computed, _ in rows]
        assert starts == list(range(starts[0], starts[0] + len(rows)))


def test_logprobs_with_drafts_equal_plain_decodings(engines):
    plain, fast = engines
    text = "Repeat this code exactly:\n" + CODE
    params = SamplingParams(temperature=0, max_tokens=40, logprobs=2)
    want = plain.chat([[{"role": "user", "content": text}]], params)[0].outputs[0]
    got = fast.chat([[{"role": "user", "content": text}]], params)[0].outputs[0]
    assert got.token_ids == want.token_ids and len(got.logprobs) == len(got.token_ids)
    for a, b in zip(got.logprobs, want.logprobs, strict=True):
        assert a.token_id == b.token_id and a.rank == b.rank
        assert a.logprob == pytest.approx(b.logprob, abs=1e-3)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob, abs=1e-2)


def test_limits_hold_with_drafts(engines):
    check_limits_hold(*engines)


def test_sampled_requests_take_drafts_by_rejection_sampling(engines):
    # A temperature just above greedy's threshold: the distribution is (all but) the
    # argmax, so both engines give plain greedy decoding's tokens, one of them through
    # rejection sampling of its drafts.
    plain, fast = engines
    text = "Repeat this code exactly:\n" + CODE
    greedy = chat(plain, SamplingParams(temperature=0, max_tokens=60), text)
    nearly = SamplingParams(temperature=2e-5, max_tokens=60, seed=0)
    step, accepted = fast.engine_core.step, []

    def counting():
        out = step()
        spec = out.scheduler_stats.spec_decoding_stats if out.scheduler_stats else None
        accepted.append(spec.num_accepted_tokens if spec else 0)
        return out

    fast.engine_core.step = counting
    try:
        assert chat(fast, nearly, text) == greedy
    finally:
        fast.engine_core.step = step
    assert sum(accepted) > 10


def test_requests_without_drafts_share_the_batch(engines):
    _, fast = engines
    seeded = SamplingParams(temperature=0.8, seed=3, max_tokens=30, repetition_penalty=1.1)
    logprobs = SamplingParams(temperature=0, max_tokens=20, logprobs=2, presence_penalty=0.2)
    out = fast.chat(
        [[{"role": "user", "content": "Repeat: a b c a b c a b"}]] * 2, [seeded, logprobs]
    )
    assert len(out[0].outputs[0].token_ids) > 0
    assert len(out[1].outputs[0].logprobs) == len(out[1].outputs[0].token_ids)


@pytest.mark.slow
def test_server_with_speculative_decoding(tmp_path):
    import json

    from tests.utils import RemoteServer

    spec = json.dumps({**NGRAM, "prompt_lookup_max": 3})
    server = RemoteServer("--speculative-config", spec, log_path=str(tmp_path / "log"))
    try:
        reply = server.client().chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": "Repeat this code exactly:\n" + CODE}],
            max_tokens=60,
            temperature=0,
        )
        assert "def area" in reply.choices[0].message.content
        metrics = server.metrics()
        assert metrics["vllm:spec_decode_num_drafts_total"] > 0
        proposed = metrics["vllm:spec_decode_num_draft_tokens_total"]
        accepted = metrics["vllm:spec_decode_num_accepted_tokens_total"]
        assert 0 < accepted <= proposed
        # Per position (vLLM's series): a draft is kept only after every one before it.
        from vllm.benchmarks.metrics_reader import scrape_labelled

        name = "vllm:spec_decode_num_accepted_tokens_per_pos"
        per_pos = scrape_labelled(server.base, name)
        counts = [per_pos.get(f"{name}_total{{position={i}}}", 0) for i in range(3)]
        assert sum(counts) == accepted and counts == sorted(counts, reverse=True), per_pos
    finally:
        server.stop()
