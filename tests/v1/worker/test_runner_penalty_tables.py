"""The runner's penalties from device token tables (``ModelRunner.use_penalty_tables``, on
by default) against the sparse way: the same tokens through decoding, a
preemption and resumption, a finished request's row reused by a new one, with and without
--async-scheduling; and with the tables a deferred step of penalised rows does not wait
for the step before it (the sparse way must: it reads the rows' output on the host).

The stand-in model's logits are one fixed vector (a little of each row's input token
added), so greedy rows repeat a token until their penalties move them off it: the tokens
tell whether every earlier token was counted."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.v1.worker.test_model_runner_inputs import FLASH_BUILDER, new_req, sched_out
from vllm.config import CacheConfig, VllmConfig
from vllm.v1.worker.model_runner import DeferredOutput, ModelRunner

VOCAB = 64
BLOCK = 4

SPECS = {
    "rep": dict(repetition_penalty=1.8),
    "freq": dict(frequency_penalty=0.6, presence_penalty=0.3, temperature=1.0, seed=1),
    "plain": dict(),  # greedy, no penalty: no row in the table
    "top_p": dict(repetition_penalty=1.3, temperature=0.8, top_p=0.9, seed=2),
    "late": dict(presence_penalty=2.0, frequency_penalty=0.5),  # arrives after "plain" ends
}
PROMPTS = {"rep": [5, 9], "freq": [3, 3, 4], "plain": [7], "top_p": [1, 2, 3, 4, 5], "late": [8, 8]}


class FixedLogitsModel:
    """Hidden row i is its input token; logits: a fixed vector plus 0.01 x that token."""

    def __init__(self) -> None:
        self.base = torch.linspace(3.0, -3.0, VOCAB)

    def __call__(self, ids, positions, meta, kv_caches):
        return ids.float()[:, None]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.base[None] + 0.01 * hidden


@pytest.fixture
def make_runner():
    threads = torch.get_num_threads()

    def make(tables: bool) -> ModelRunner:
        r = ModelRunner(VllmConfig(cache_config=CacheConfig(block_size=BLOCK)), device="cpu")
        r.model = FixedLogitsModel()
        r.arch = SimpleNamespace(vocab_size=VOCAB)
        r.attn_backend = FLASH_BUILDER
        assert r.use_penalty_tables  # the default
        r.use_penalty_tables = tables
        return r

    yield make
    torch.set_num_threads(threads)


def _run(runner: ModelRunner, defer: bool) -> tuple[dict[str, list[int]], list[bool]]:
    """Every request's tokens, and for each deferred step after the first whether the
    step before it had already landed on the host when it returned."""
    tokens = {k: [] for k in SPECS}
    computed = {}
    waited: list[bool] = []
    pending: list[DeferredOutput] = []

    def take(out) -> None:
        result = out.result() if isinstance(out, DeferredOutput) else out
        assert not result.errors
        for k, t in result.sampled_token_ids.items():
            tokens[k] += t

    def land() -> None:
        while pending:
            take(pending.pop(0))

    def step(so) -> None:
        out = runner.execute_model(so, defer=defer)
        if defer:
            assert isinstance(out, DeferredOutput)
            if pending:
                waited.append(pending[-1].done)
            pending.append(out)
            while len(pending) > 1:  # the engine takes a step's output after the next's launch
                take(pending.pop(0))
        else:
            take(out)
        for k in so.num_scheduled_tokens:
            computed[k] += so.num_scheduled_tokens[k]

    def decode(names) -> None:
        step(sched_out(cached=[(k, [], computed[k]) for k in names],
                       num_scheduled=dict.fromkeys(names, 1)))  # fmt: skip

    def blocks(k: str) -> list[int]:  # 8 blocks of 4 tokens a request, its own
        return list(range(1 + 8 * list(SPECS).index(k), 9 + 8 * list(SPECS).index(k)))

    first = ["rep", "freq", "plain", "top_p"]
    computed.update(dict.fromkeys(first, 0))
    new = [new_req(k, PROMPTS[k], blocks(k), 0, **SPECS[k]) for k in first]
    step(sched_out(new=new, num_scheduled={k: len(PROMPTS[k]) for k in first}))
    for _ in range(4):
        decode(first)
    land()  # the scheduler knows every token before it preempts or finishes a request
    runner.execute_model(sched_out(finished={"plain"}, preempted={"rep"}))  # runs nothing
    resumed = new_req(
        "rep", PROMPTS["rep"] + tokens["rep"], blocks("rep"), 0, num_prompt=2, **SPECS["rep"]
    )
    computed["rep"], computed["late"] = 0, 0
    late = new_req("late", PROMPTS["late"], blocks("late"), 0, **SPECS["late"])
    step(sched_out(new=[resumed, late],
                   cached=[("freq", [], computed["freq"]), ("top_p", [], computed["top_p"])],
                   num_scheduled={"rep": len(resumed.token_ids), "late": 2, "freq": 1,
                                  "top_p": 1}))  # fmt: skip
    for _ in range(5):
        decode(["freq", "top_p", "rep", "late"])
    land()
    return tokens, waited


def test_tables_give_the_sparse_tokens(make_runner):
    sparse, _ = _run(make_runner(tables=False), defer=False)
    runner = make_runner(tables=True)
    tabled, _ = _run(runner, defer=False)
    assert tabled == sparse
    # The penalties moved the greedy rows (one fixed vector: without them, one token).
    assert len(set(sparse["rep"])) > 3 and len(set(sparse["late"])) > 3
    assert len(set(sparse["plain"])) == 1
    table = runner.penalty_table
    assert table.num_used == 4  # rep (resumed), freq, top_p, late; plain never had a row
    slots = {k: runner.requests[k].penalty_slot for k in ("rep", "freq", "top_p", "late")}
    assert sorted(slots.values()) == [0, 1, 2, 3]  # the preempted row reused, no growth
    late = slots["late"]
    assert table.counts[late].sum() == len(tabled["late"])  # each token counted once
    assert table.counts[slots["rep"]].sum() == len(tabled["rep"])  # resumed with its output


def test_deferred_penalised_steps_wait_for_nothing_with_tables(make_runner):
    reference, _ = _run(make_runner(tables=False), defer=False)
    tabled, waited = _run(make_runner(tables=True), defer=True)
    assert tabled == reference
    assert waited and not any(waited)  # no step landed the one before it
    sparse, waited = _run(make_runner(tables=False), defer=True)
    assert sparse == reference
    assert all(waited)  # the sparse way landed the step before each (its output on the host)
