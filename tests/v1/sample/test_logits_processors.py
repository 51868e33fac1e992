"""vLLM's custom logits processors (--logits-processors): the persistent batch they see,
processors written against vLLM's interface running here unchanged, per-request
arguments (extra_args / vllm_xargs), validate_params as a 400, raw logprobs."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm.sampling_params import SamplingParams
from vllm.v1.sample.logits_processor import (
    AdapterLogitsProcessor,
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
    process_dict_updates,
)
from vllm.v1.sample.logits_processor.state import PersistentBatch

HERE = "tests.v1.sample.test_logits_processors"


class TargetTokenProcessor(LogitsProcessor):
    """vLLM's documentation example, as a user writes it: a request whose
    ``extra_args["target_token"]`` is set gets that token, greedy or not."""

    @classmethod
    def validate_params(cls, params: SamplingParams):
        target = (params.extra_args or {}).get("target_token")
        if target is not None and not isinstance(target, int):
            raise ValueError(f"target_token must be an integer, got {target!r}")

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        self.req_info: dict[int, int] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None):
        process_dict_updates(
            self.req_info,
            batch_update,
            lambda params, _, __: (params.extra_args or {}).get("target_token"),
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.req_info:
            return logits
        rows = torch.tensor(list(self.req_info), dtype=torch.long, device=logits.device)
        targets = torch.tensor(list(self.req_info.values()), device=logits.device)
        kept = logits[rows, targets].clone()
        logits[rows] = float("-inf")
        logits[rows, targets] = kept
        return logits


class NoRepeatProcessor(AdapterLogitsProcessor):
    """A per-request processor through vLLM's adapter: with ``extra_args["no_repeat"]``,
    a token already generated is never generated again."""

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: SamplingParams):
        if not (params.extra_args or {}).get("no_repeat"):
            return None

        def ban_seen(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            if output_ids:
                logits[torch.tensor(output_ids, device=logits.device)] = float("-inf")
            return logits

        return ban_seen


def _state(req_id: str, n: int = 3):
    return SimpleNamespace(
        req_id=req_id,
        sampling_params=SamplingParams(extra_args={"name": req_id}),
        token_ids=list(range(n)),
        num_prompt_tokens=n,
        output_token_ids=[],
    )


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sets(st.integers(0, 7)), min_size=1, max_size=25))
def test_batch_updates_replayed_give_the_batch(steps):
    """A processor that applies every update (vLLM's process_dict_updates) knows, after
    each step, exactly which request sits in each row; rows stay [0, batch_size)."""
    batch = PersistentBatch()
    known: dict[int, str] = {}
    states = {i: _state(f"r{i}") for i in range(8)}
    for scheduled in steps:
        update = batch.update([states[i] for i in sorted(scheduled)])
        if update is not None:
            assert not set(update.removed) & {row for row, *_ in update.added}
            assert all(d == MoveDirectionality.UNIDIRECTIONAL for *_, d in update.moved)
            process_dict_updates(known, update, lambda p, _, __: p.extra_args["name"])
            assert update.batch_size == len(scheduled)
        assert batch.rows == [known[i] for i in range(len(batch.rows))]
        assert set(batch.rows) == {f"r{i}" for i in scheduled}


def test_an_added_request_takes_the_lowest_free_row_and_holes_are_filled_from_the_end():
    batch = PersistentBatch()
    a, b, c, d = (_state(x) for x in "abcd")
    first = batch.update([a, b, c])
    assert [row for row, *_ in first.added] == [0, 1, 2]
    assert first.added[0][2] == [0, 1, 2] and first.added[0][3] is a.output_token_ids
    assert batch.update([a, b, c]) is None  # no change: update_state(None)
    second = batch.update([c, d])  # a, b leave; d takes row 0, c moves down to 1
    assert second.removed == [1] and [row for row, *_ in second.added] == [0]
    assert second.moved == [(2, 1, MoveDirectionality.UNIDIRECTIONAL)]
    assert batch.rows == ["d", "c"] and second.batch_size == 2


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tests.entrypoints.test_generation_config import tiny_model

    return tiny_model(tmp_path_factory.mktemp("tiny"))


def _generate(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_processors_act_on_the_requests_that_ask_and_leave_the_others(model, async_scheduling):
    from vllm import LLM

    # Prompts of several lengths under a small step budget: chunked prefills share steps
    # with decodes (rows that sample nothing), and requests end at different steps.
    prompts = [[5 + i] * (3 + 17 * i) for i in range(5)]
    plain = LLM(model=model, kv_cache_memory="16MiB", max_num_batched_tokens=32)
    try:
        expected = _generate(plain, prompts, SamplingParams(max_tokens=6, temperature=0))
    finally:
        plain.shutdown()
    llm = LLM(
        model=model,
        kv_cache_memory="16MiB",
        max_num_batched_tokens=32,
        async_scheduling=async_scheduling,  # processors read output ids a step behind
        logits_processors=[f"{HERE}:TargetTokenProcessor", NoRepeatProcessor],
    )
    try:
        params = [
            SamplingParams(max_tokens=6, temperature=0, extra_args={"target_token": 42}),
            SamplingParams(max_tokens=6, temperature=0),
            SamplingParams(max_tokens=4, temperature=0, extra_args={"target_token": 7}),
            SamplingParams(max_tokens=6, temperature=0, extra_args={"no_repeat": True}),
            SamplingParams(max_tokens=6, temperature=0.8, seed=1, extra_args={"target_token": 9}),
        ]
        got = _generate(llm, prompts, params)
        assert got[0] == [42] * 6 and got[2] == [7] * 4 and got[4] == [9] * 6
        assert got[1] == expected[1]  # untouched
        assert len(set(got[3])) == 6  # never a token twice
        # Logprobs stay the model's (raw): the forced token's is not 0.
        out = llm.generate(
            [{"prompt_token_ids": prompts[1]}],
            SamplingParams(
                max_tokens=2, temperature=0, logprobs=0, extra_args={"target_token": 42}
            ),  # fmt: skip
        )[0].outputs[0]
        assert out.token_ids == [42, 42]
        assert all(math.isfinite(lp.logprob) and lp.logprob < -1e-3 for lp in out.logprobs)
        with pytest.raises(ValueError, match="target_token must be an integer"):
            llm.generate(
                [{"prompt_token_ids": [1, 2]}],
                SamplingParams(max_tokens=1, extra_args={"target_token": "x"}),
            )
    finally:
        llm.shutdown()


def test_bad_processor_configs_are_refused():
    from vllm.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match="logits_processors: cannot load 'no.such:X'"):
        EngineArgs(logits_processors=["no.such:X"]).create_engine_config()
    with pytest.raises(ValueError, match="is not a LogitsProcessor subclass"):
        EngineArgs(logits_processors=["json:dumps"]).create_engine_config()
    spec = '{"method": "ngram", "num_speculative_tokens": 2}'
    with pytest.raises(ValueError, match="--logits-processors cannot be combined"):
        EngineArgs(
            logits_processors=[f"{HERE}:TargetTokenProcessor"], speculative_config=spec
        ).create_engine_config()


@pytest.mark.slow
def test_the_server_takes_processors_by_name_and_arguments_in_vllm_xargs(model, tmp_path):
    import requests

    from tests.utils import RemoteServer

    server = RemoteServer("--model", model, "--logits-processors", f"{HERE}:TargetTokenProcessor",
                          log_path=str(tmp_path / "server.log"))  # fmt: skip
    try:
        body = {"model": model, "prompt": "One, two,", "max_tokens": 3, "temperature": 0,
                "return_token_ids": True, "vllm_xargs": {"target_token": 42}}  # fmt: skip
        reply = requests.post(server.base + "/v1/completions", json=body)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["token_ids"] == [42, 42, 42]
        body["vllm_xargs"] = {"target_token": "x"}
        refused = requests.post(server.base + "/v1/completions", json=body)
        assert refused.status_code == 400
        assert "target_token must be an integer" in refused.json()["error"]["message"]
    finally:
        server.stop()
