"""EngineCore.step over the real scheduler with a fake, deterministic model runner."""

from __future__ import annotations

import pytest

import vllm.v1.engine.core as core_module
import vllm.v1.worker.model_runner as model_runner_module
from vllm.engine.arg_utils import EngineArgs
from vllm.sampling_params import SamplingParams
from vllm.utils.clock import FakeClock
from vllm.v1.engine import EngineCoreRequest, FinishReason
from vllm.v1.engine.core import EngineCore
from vllm.v1.outputs import ModelRunnerOutput
from vllm_continuum.policy.plain import FCFSPolicy

EOS = 2  # SmolLM2's <|im_end|>, from its generation config


class FakeRunner:
    """A 'model' whose next token is the last token + 1; records every call."""

    def __init__(self, vllm_config) -> None:
        from vllm.v1.structured_output import StructuredOutputManager

        self.config = vllm_config
        self.structured_output = StructuredOutputManager(vllm_config)  # never masks here
        self.calls = []
        self.states: dict[str, list] = {}  # req_id -> [token_ids, num_computed_tokens]

    def load_model(self) -> None:
        pass

    kv_cache_windows = (None,)  # one full-attention KV cache group
    encoder_cache = frozenset()  # no image encoded (the scheduler's encoder budget asks)
    bidirectional_images = False  # image tokens attend causally (Gemma 3's would not)
    recurrent_specs = None  # no linear-attention layers
    num_state_checkpoint_slots = 0
    state_checkpoint_bytes = 0

    def determine_num_blocks(self) -> int:
        return self.config.cache_config.num_gpu_blocks_override

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks

    def profile_prefill(self) -> list[tuple[int, float]]:
        return [(16, 0.01), (64, 0.05)]

    def warm_up_kernels(self) -> None:
        pass

    def capture_model(self) -> None:
        # The graphs record the KV cache's address: it must exist first.
        self.captured_over_blocks = self.num_blocks

    def get_kv_cache_bytes_per_block(self) -> int:
        return 1024

    def initialize_kv_offload(self, num_cpu_blocks: int, num_state_slots: int = 0) -> None:
        self.num_cpu_blocks = num_cpu_blocks

    def execute_model(self, so) -> ModelRunnerOutput:
        self.calls.append(so)
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.states.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self.states[new.req_id] = [list(new.token_ids), new.num_computed_tokens]
        cached = so.scheduled_cached_reqs
        for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            self.states[req_id][1] = computed
        sampled = {}
        for req_id, n in so.num_scheduled_tokens.items():
            tokens, computed = self.states[req_id]
            sampled[req_id] = []
            if computed + n >= len(tokens):  # the prefill is complete: sample
                tokens.append(tokens[-1] + 1)
                sampled[req_id] = [tokens[-1]]
        return ModelRunnerOutput(list(so.num_scheduled_tokens), sampled)


@pytest.fixture
def engine(monkeypatch):
    monkeypatch.setattr(model_runner_module, "ModelRunner", FakeRunner)
    # 15 usable blocks of 16 tokens: 240 tokens of KV, less than max_model_len.
    args = EngineArgs(num_gpu_blocks_override=16, max_num_batched_tokens=16, max_model_len=512)
    return EngineCore(args.create_engine_config(), clock=FakeClock())


def request(request_id: str, prompt: list[int], **params) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, prompt, SamplingParams(**params))


def run_to_completion(engine: EngineCore, max_steps: int = 100) -> dict:
    """Step until idle; returns req_id -> (token ids, last EngineCoreOutput)."""
    results: dict[str, tuple[list[int], object]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return results
        for out in engine.step().outputs:
            tokens = results.get(out.request_id, ([], None))[0] + out.new_token_ids
            results[out.request_id] = (tokens, out)
    raise AssertionError("engine did not finish")


def assert_idle(engine: EngineCore) -> None:
    engine.scheduler.check_invariants()
    assert engine.scheduler.kv_cache_manager.usage == 0.0


def test_requests_run_to_length_and_eos(engine):
    engine.add_request(request("a", list(range(100, 140)), max_tokens=4))  # chunked: 16/step
    engine.add_request(request("b", [7, 8, 0], max_tokens=10))  # 0 -> 1 -> 2 = EOS
    engine.add_request(request("c", [7, 8, 0], max_tokens=3, ignore_eos=True))
    results = run_to_completion(engine)
    assert results["a"][0] == [140, 141, 142, 143]
    assert results["a"][1].finish_reason == FinishReason.LENGTH
    assert results["b"][0] == [1, EOS] and results["b"][1].finish_reason == FinishReason.STOP
    assert results["b"][1].stop_reason is None  # EOS, not a stop token id
    assert results["c"][0] == [1, 2, 3]
    assert_idle(engine)


def test_first_output_carries_queue_time_and_prompt_length(engine):
    engine.add_request(request("a", [5, 6], max_tokens=2))
    engine.clock.advance(1.5)  # waited 1.5 s before the first schedule
    first = engine.step().outputs[0]
    assert first.queue_time_s == pytest.approx(1.5) and first.num_prompt_tokens == 2
    second = engine.step().outputs[0]
    assert second.queue_time_s is None and second.num_prompt_tokens is None


def test_stop_token_ids_give_stop_reason(engine):
    engine.add_request(request("a", [5, 6], max_tokens=10, stop_token_ids=[9]))
    tokens, last = run_to_completion(engine)["a"]
    assert tokens == [7, 8, 9] and last.stop_reason == 9


def test_abort_frees_blocks_and_empty_steps_skip_the_runner(engine):
    engine.add_request(request("a", list(range(100, 120)), max_tokens=50))
    engine.step()
    engine.step()
    runner = engine.model_runner
    assert len(runner.calls) == 2 and engine.scheduler.kv_cache_manager.usage > 0
    engine.abort_requests(["a", "unknown"])
    assert_idle(engine)
    assert not engine.has_unfinished_requests() and engine.step().outputs == []
    assert len(runner.calls) == 2  # nothing scheduled: the runner was not called
    # The runner still learns that "a" finished, with the next real step.
    engine.add_request(request("b", [1, 2], max_tokens=1))
    run_to_completion(engine)
    assert "a" in runner.calls[2].finished_req_ids and "a" not in runner.states


def test_bad_requests_raise_value_error(engine):
    engine.add_request(request("a", [1, 2], max_tokens=1))
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request(request("a", [1, 2]))
    # (a prompt past max_model_len is refused earlier, by the processor)
    with pytest.raises(ValueError, match="KV cache"):
        engine.add_request(request("huge", [1] * 300))
    run_to_completion(engine)
    assert_idle(engine)


def test_policy_gets_decode_and_prefill_profile(monkeypatch):
    seen = {}

    class ProfiledPolicy(FCFSPolicy):
        def prepare(self, measure_prefill):
            seen["profile"] = measure_prefill()

    def fake_create_policy(vllm_config, decode=None, clock=None, has_kv_tier=False):
        seen["decode"] = decode
        return ProfiledPolicy(decode=decode, clock=clock)

    monkeypatch.setattr(model_runner_module, "ModelRunner", FakeRunner)
    monkeypatch.setattr(core_module, "create_policy", fake_create_policy)
    args = EngineArgs(num_gpu_blocks_override=8, max_model_len=64)
    engine = EngineCore(args.create_engine_config(), clock=FakeClock())
    assert seen["profile"] == [(16, 0.01), (64, 0.05)]
    assert engine.model_runner.captured_over_blocks == 8  # graphs after the KV cache
    ids = engine.tokenizer("Hello world").input_ids + [EOS]
    assert seen["decode"](ids) == "Hello world"  # special tokens skipped
    assert engine.scheduler.policy.name == "fcfs"


@pytest.mark.parametrize("offloading_size", [None, 0.001])
def test_the_engine_derives_its_kv_tier_once_and_passes_it_down(monkeypatch, offloading_size):
    """The tier's block count decides ``has_kv_tier``: the policy and the KV cache manager
    are built from that one fact."""
    monkeypatch.setattr(model_runner_module, "ModelRunner", FakeRunner)
    args = EngineArgs(
        num_gpu_blocks_override=8, max_model_len=64, kv_offloading_size=offloading_size
    )
    engine = EngineCore(args.create_engine_config(), clock=FakeClock())
    tier = offloading_size is not None
    assert engine.num_cpu_blocks == (2**30 * offloading_size // 1024 if tier else 0)
    assert engine.scheduler.policy.has_tier is tier
    assert (engine.scheduler.kv_cache_manager.offload is not None) is tier


@pytest.mark.parametrize(
    ("policy", "size", "prefix_caching", "tier_blocks"),
    [
        ("continuum", None, True, 16 * 8),  # unset: 16x the pool (8 blocks of 1024 bytes)
        ("context_serve", None, True, 16 * 8),
        ("continuum", 0, True, 0),  # 0: off
        ("continuum", None, False, 0),  # no prefix caching: the tier could find nothing
        ("fcfs", None, True, 0),  # a policy that keeps no context gets none
    ],
)
def test_an_unset_tier_is_sized_for_policies_that_keep_contexts(
    monkeypatch, policy, size, prefix_caching, tier_blocks
):
    monkeypatch.setattr(model_runner_module, "ModelRunner", FakeRunner)
    args = EngineArgs(
        num_gpu_blocks_override=8,
        max_model_len=64,
        scheduling_policy=policy,
        kv_offloading_size=size,
        enable_prefix_caching=prefix_caching,
    )
    engine = EngineCore(args.create_engine_config(), clock=FakeClock())
    assert engine.num_cpu_blocks == tier_blocks
    assert engine.scheduler.policy.has_tier is (tier_blocks > 0)


def test_the_automatic_tier_leaves_half_the_host_memory(monkeypatch):
    from vllm import config as config_module

    monkeypatch.setattr(model_runner_module, "ModelRunner", FakeRunner)
    monkeypatch.setattr(config_module, "available_host_memory", lambda: 20 * 1024)
    args = EngineArgs(num_gpu_blocks_override=8, max_model_len=64, scheduling_policy="continuum")
    engine = EngineCore(args.create_engine_config(), clock=FakeClock())
    assert engine.num_cpu_blocks == 10  # 10 KiB of 20 free, blocks of 1024 bytes
