"""ModelRunner input packing: the flat batch built from a SchedulerOutput.

``execute_model`` packs token ids, positions, per-request ``(num_computed, num_new,
block_ids)`` for the attention backend's metadata builder, and the indices of the rows to
sample. The model is a recorder (no forward pass): its hidden state of flat row ``i`` is
``i`` and its logits make greedy sampling return ``100 + i``, so a sampled token tells
which row was sampled (the logits indices).

Block arithmetic (block_size 4; slot = block_id * 4 + position % 4, block = block_ids[pos // 4]):

step 1 (all new)
  A  prompt 10 tokens, prefix hit of 8 (2 full blocks), blocks [7, 3, 9], computes 8..9
  B  prompt 12 tokens, chunked: first chunk 0..4, blocks [5, 6]
  C  prompt 3 tokens, whole prefill 0..2, blocks [11]
step 2
  B  continuation: computed 5, new block [12], computes 5..11 and reaches its end
  C  decode: computed 3, position 3 -> block 11 -> slot 47
  A  decode: computed 10, position 10 -> block_ids[2] = 9 -> slot 38
  D  new, prompt 6 tokens, prefix hit of 4 (block 7, shared with A), blocks [7, 13],
     computes 4..5 -> slots 52, 53
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm.config import CacheConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
from vllm.v1.attention.backends.torch_sdpa import TorchSDPABackend
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.worker.model_runner import ModelRunner

BLOCK = 4
VOCAB = 200
PROMPT_A = list(range(1000, 1010))
PROMPT_B = list(range(2000, 2012))
PROMPT_C = [3000, 3001, 3002]
PROMPT_D = [1000, 1001, 1002, 1003, 4004, 4005]  # shares A's first block

# flash-attn's metadata builder is pure torch (the kernel import is lazy), so it runs on
# CPU; with block size 4 it is in "gathered" mode. It takes the batch in scheduler order.
# (The recording model never calls forward, so the layer shapes do not matter.)
FLASH_BUILDER = FlashAttentionBackend(1, 1, 8, torch.float32, "cpu", BLOCK)
TORCH_BACKEND = TorchSDPABackend(1, 1, 8, torch.float32, "cpu", BLOCK)


class RecordingModel:
    """Stands in for LlamaForCausalLM: records its inputs, hidden row i is the value i."""

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self.logits_inputs: list[list[int]] = []

    def __call__(self, ids, positions, meta, kv_caches):
        self.calls.append({"ids": ids.tolist(), "positions": positions.tolist(), "meta": meta})
        return torch.arange(len(ids), dtype=torch.float32)[:, None]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden[:, 0].long()
        self.logits_inputs.append(rows.tolist())
        logits = torch.zeros(len(rows), VOCAB)
        logits[torch.arange(len(rows)), 100 + rows] = 1.0
        return logits


@pytest.fixture
def runner():
    threads = torch.get_num_threads()  # the constructor sets the CPU thread count
    r = ModelRunner(VllmConfig(cache_config=CacheConfig(block_size=BLOCK)), device="cpu")
    r.model = RecordingModel()
    r.arch = SimpleNamespace(vocab_size=VOCAB)  # the penalties' token tables
    yield r
    torch.set_num_threads(threads)


def new_req(req_id, tokens, blocks, computed, num_prompt=None, **params) -> NewRequestData:
    return NewRequestData(
        req_id,
        tokens,
        len(tokens) if num_prompt is None else num_prompt,
        SamplingParams(**{"temperature": 0.0, **params}),
        blocks if isinstance(blocks, tuple) else (blocks,),  # one KV cache group
        computed,
    )


def sched_out(new=(), cached=(), num_scheduled=None, finished=(), preempted=()):
    c = CachedRequestData()
    for req_id, blocks, computed in cached:
        c.req_ids.append(req_id)
        c.new_block_ids.append(blocks if isinstance(blocks, tuple) else (blocks,))
        c.num_computed_tokens.append(computed)
    num_scheduled = num_scheduled or {}
    return SchedulerOutput(
        list(new),
        c,
        num_scheduled,
        sum(num_scheduled.values()),
        finished_req_ids=set(finished),
        preempted_req_ids=set(preempted),
    )


def step1() -> SchedulerOutput:
    return sched_out(
        new=[
            new_req("A", PROMPT_A, [7, 3, 9], 8),
            new_req("B", PROMPT_B, [5, 6], 0),
            new_req("C", PROMPT_C, [11], 0),
        ],
        num_scheduled={"A": 2, "B": 5, "C": 3},
    )


def step2() -> SchedulerOutput:
    # Dict order as the scheduler emits it: running requests, then the new one.
    return sched_out(
        new=[new_req("D", PROMPT_D, [7, 13], 4)],
        cached=[("B", [12], 5), ("C", [], 3), ("A", [], 10)],
        num_scheduled={"B": 7, "C": 1, "A": 1, "D": 2},
    )


def test_first_step_prefix_hit_chunk_and_full_prefill(runner):
    runner.attn_backend = FLASH_BUILDER
    out = runner.execute_model(step1())
    call = runner.model.calls[0]
    # flat rows: A 0..1 (positions 8, 9), B 2..6 (0..4), C 7..9 (0..2)
    assert call["ids"] == PROMPT_A[8:] + PROMPT_B[:5] + PROMPT_C
    assert call["positions"] == [8, 9, 0, 1, 2, 3, 4, 0, 1, 2]
    meta = call["meta"]
    # A: positions 8, 9 -> block_ids[2] = 9 -> 36, 37. B: block 5 -> 20..23, block 6 -> 24.
    # C: block 11 -> 44..46.
    assert meta.slot_mapping.tolist() == [36, 37, 20, 21, 22, 23, 24, 44, 45, 46]
    assert meta.cu_seq_q.tolist() == [0, 2, 7, 10]
    assert meta.seqused_k.tolist() == [10, 5, 3]
    assert meta.block_table.tolist() == [[7, 3, 9], [5, 6, 0], [11, 0, 0]]
    # B's chunk does not reach its prompt's end: only A (row 1) and C (row 9) sample.
    assert runner.model.logits_inputs == [[1, 9]]
    assert out.req_ids == ["A", "B", "C"]
    assert out.sampled_token_ids == {"A": [101], "B": [], "C": [109]}
    assert runner.requests["A"].token_ids == PROMPT_A + [101]
    assert runner.requests["A"].output_token_ids == [101]
    assert runner.requests["B"].token_ids == PROMPT_B


def test_mixed_step_flash_metadata_in_scheduler_order(runner):
    runner.attn_backend = FLASH_BUILDER
    runner.execute_model(step1())
    out = runner.execute_model(step2())
    call = runner.model.calls[1]
    # flat rows: B 0..6 (positions 5..11), C 7 (3), A 8 (10), D 9..10 (4, 5)
    assert call["ids"] == PROMPT_B[5:] + [109, 101] + PROMPT_D[4:]
    assert call["positions"] == [5, 6, 7, 8, 9, 10, 11, 3, 10, 4, 5]
    meta = call["meta"]
    # B: 5..7 -> block 6 -> 25..27; 8..11 -> block 12 -> 48..51. C 47, A 38, D 52, 53.
    assert meta.slot_mapping.tolist() == [25, 26, 27, 48, 49, 50, 51, 47, 38, 52, 53]
    assert meta.cu_seq_q.tolist() == [0, 7, 8, 9, 11]
    assert meta.seqused_k.tolist() == [12, 4, 11, 6]
    assert meta.cu_seq_k.tolist() == [0, 12, 16, 27, 33]
    assert (meta.max_q, meta.max_k) == (7, 12)
    # Each row holds the blocks its context uses, padded with the null block 0.
    assert meta.block_table.tolist() == [[5, 6, 12], [11, 0, 0], [7, 3, 9], [7, 13, 0]]
    assert not meta.paged
    assert meta.gather_slots.tolist() == (
        list(range(20, 28)) + [48, 49, 50, 51]  # B
        + [44, 45, 46, 47]  # C
        + [28, 29, 30, 31, 12, 13, 14, 15, 36, 37, 38]  # A
        + [28, 29, 30, 31, 52, 53]  # D
    )  # fmt: skip
    # Every request reaches its end this step: the last row of each is sampled.
    assert runner.model.logits_inputs[1] == [6, 7, 8, 10]
    assert out.req_ids == ["B", "C", "A", "D"]
    assert out.sampled_token_ids == {"B": [106], "C": [107], "A": [108], "D": [110]}
    assert runner.requests["B"].block_ids == ([5, 6, 12],)
    assert runner.requests["A"].token_ids == PROMPT_A + [101, 108]


def test_mixed_step_torch_backend_puts_decodes_first(runner):
    runner.attn_backend = TORCH_BACKEND
    runner.execute_model(step1())
    out = runner.execute_model(step2())
    call = runner.model.calls[1]
    # The torch builder needs decodes first: C, A (stable order), then B, D.
    assert call["ids"] == [109, 101] + PROMPT_B[5:] + PROMPT_D[4:]
    assert call["positions"] == [3, 10, 5, 6, 7, 8, 9, 10, 11, 4, 5]
    meta = call["meta"]
    assert meta.slot_mapping.tolist() == [47, 38, 25, 26, 27, 48, 49, 50, 51, 52, 53]
    assert meta.num_decodes == 2
    # Decodes attend through their blocks (C: 4 tokens in 1 block, A: 11 in 3), padded
    # with the null block; the fallback's gather indices are derived from them.
    assert meta.decode_block_table.tolist() == [[11, 0, 0], [7, 3, 9]]
    assert meta.decode_seq_lens.tolist() == [4, 11]
    # Decode rows: each request's whole context (C 0..3, A 0..10), padded with slot 0.
    assert meta.decode_slots.tolist() == [
        [44, 45, 46, 47, 0, 0, 0, 0, 0, 0, 0],
        [28, 29, 30, 31, 12, 13, 14, 15, 36, 37, 38],
    ]
    assert meta.decode_mask.view(2, -1).sum(-1).tolist() == [4, 11]
    b, d = meta.prefills
    assert (b.start, b.num_tokens, d.start, d.num_tokens) == (2, 7, 9, 2)
    assert b.context_slots.tolist() == list(range(20, 28)) + [48, 49, 50, 51]
    assert d.context_slots.tolist() == [28, 29, 30, 31, 52, 53]
    # Query j of B (position 5 + j) sees keys 0..5 + j; of D (4 + j) sees 0..4 + j.
    assert b.mask.sum(-1).tolist() == [6, 7, 8, 9, 10, 11, 12]
    assert d.mask.sum(-1).tolist() == [5, 6]
    assert runner.model.logits_inputs[1] == [0, 1, 8, 10]
    assert out.req_ids == ["C", "A", "B", "D"]
    assert out.sampled_token_ids == {"C": [100], "A": [101], "B": [108], "D": [110]}


def test_whole_prompt_without_prefix_has_no_context_gather(runner):
    runner.attn_backend = TORCH_BACKEND
    runner.execute_model(step1())
    meta = runner.model.calls[0]["meta"]
    # A (prefix hit) attends over gathered slots; B and C are whole contexts: own K/V.
    a, b, c = meta.prefills
    assert a.context_slots.tolist() == [28, 29, 30, 31, 12, 13, 14, 15, 36, 37]
    assert b.context_slots is None and c.context_slots is None
    assert meta.num_decodes == 0


def test_resumed_request_recomputes_and_keeps_its_outputs(runner):
    # Preempted after generating 2 tokens: it comes back as new with prompt + outputs and
    # a prefix hit of one block; the runner must sample after the last known token and
    # count the old outputs as outputs (penalties see them).
    runner.attn_backend = FLASH_BUILDER
    tokens = [1, 2, 3, 4, 5, 60, 61]
    so = sched_out(
        new=[new_req("R", tokens, [8, 2], 4, num_prompt=5, frequency_penalty=0.5)],
        num_scheduled={"R": 3},
    )
    out = runner.execute_model(so)
    call = runner.model.calls[0]
    assert call["ids"] == [5, 60, 61]
    assert call["positions"] == [4, 5, 6]
    assert call["meta"].slot_mapping.tolist() == [8, 9, 10]  # block 2 -> 8..10
    assert runner.requests["R"].output_token_ids == [60, 61, 102]
    assert out.sampled_token_ids == {"R": [102]}
    table, slot = runner.penalty_table, runner.requests["R"].penalty_slot
    assert table.counts[slot, [60, 61, 102]].tolist() == [1, 1, 1]
    assert table.in_prompt[slot].nonzero()[:, 0].tolist() == [1, 2, 3, 4, 5]


def test_finished_and_preempted_requests_are_dropped(runner):
    runner.attn_backend = FLASH_BUILDER
    runner.execute_model(step1())
    out = runner.execute_model(
        sched_out(cached=[("B", [12], 5)], num_scheduled={"B": 7}, finished={"A"}, preempted={"C"})
    )
    assert set(runner.requests) == {"B"}
    assert out.req_ids == ["B"]


def test_empty_step_does_not_call_the_model(runner):
    runner.attn_backend = FLASH_BUILDER
    runner.execute_model(step1())
    out = runner.execute_model(sched_out(finished={"A", "B", "C"}))
    assert out.req_ids == [] and out.sampled_token_ids == {}
    assert len(runner.model.calls) == 1
    assert runner.requests == {}


def test_seeded_request_gets_its_own_generator(runner):
    runner.attn_backend = FLASH_BUILDER
    so = sched_out(
        new=[new_req("S", [1, 2], [1], 0, seed=5), new_req("U", [3, 4], [2], 0)],
        num_scheduled={"S": 2, "U": 2},
    )
    runner.execute_model(so)
    gen = runner.requests["S"].generator
    assert gen is not None and gen.initial_seed() == 5
    assert runner.requests["U"].generator is None


class UniformModel(RecordingModel):
    """Same logits for every row (uniform over VOCAB): only the generator picks tokens."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.zeros(len(hidden), VOCAB)


def _seeded_run(runner, preempt_after_first: bool) -> list[int]:
    runner.attn_backend = FLASH_BUILDER
    runner.model = UniformModel()
    prompt = [1, 2]
    first = sched_out(
        new=[new_req("S", prompt, [1], 0, seed=5, temperature=1.0)], num_scheduled={"S": 2}
    )
    tokens = runner.execute_model(first).sampled_token_ids["S"]
    if preempt_after_first:
        # Preempted (recompute), then resumed as new with prompt + its output so far.
        runner.execute_model(sched_out(preempted={"S"}))
        resumed = new_req("S", prompt + tokens, [1], 0, num_prompt=2, seed=5, temperature=1.0)
        so = sched_out(new=[resumed], num_scheduled={"S": 3})
    else:
        so = sched_out(cached=[("S", [], 2)], num_scheduled={"S": 1})
    tokens += runner.execute_model(so).sampled_token_ids["S"]
    so = sched_out(cached=[("S", [], 3)], num_scheduled={"S": 1})
    tokens += runner.execute_model(so).sampled_token_ids["S"]
    return tokens


def test_seeded_tokens_do_not_depend_on_preemption(runner):
    plain = _seeded_run(runner, preempt_after_first=False)
    runner.requests.clear()
    preempted = _seeded_run(runner, preempt_after_first=True)
    assert preempted == plain


def test_one_token_prefix_hit_is_batched_as_a_decode_by_the_torch_backend(runner):
    # P: prompt 5, prefix hit of 4 (block 7), blocks [7, 13], computes position 4 only:
    # one query over a cached context, which is what a decode row is, so it goes first.
    runner.attn_backend = TORCH_BACKEND
    so = sched_out(
        new=[new_req("C", PROMPT_C, [11], 0), new_req("P", PROMPT_D[:5], [7, 13], 4)],
        num_scheduled={"C": 3, "P": 1},
    )
    out = runner.execute_model(so)
    call = runner.model.calls[0]
    assert call["ids"] == [4004] + PROMPT_C
    assert call["positions"] == [4, 0, 1, 2]
    meta = call["meta"]
    assert meta.num_decodes == 1
    assert meta.decode_slots.tolist() == [[28, 29, 30, 31, 52]]
    assert meta.slot_mapping.tolist() == [52, 44, 45, 46]
    assert out.sampled_token_ids == {"P": [100], "C": [103]}


class RowLogitsModel(RecordingModel):
    """Row i of the flat batch has logits ``i * 0.01 * arange(VOCAB)``: distinct per row."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden * 0.01 * torch.arange(VOCAB, dtype=torch.float32)


def test_prompt_logprobs_of_each_chunk_come_from_its_rows(runner):
    # 12-token prompt in two chunks: positions 0-4, then 5-11 (the last row samples).
    runner.attn_backend = FLASH_BUILDER
    runner.model = RowLogitsModel()
    prompt = list(range(10, 22))
    first = runner.execute_model(
        sched_out(
            new=[new_req("P", prompt, [1, 2, 3, 4], 0, prompt_logprobs=2)], num_scheduled={"P": 5}
        )
    )
    chunk = first.prompt_logprobs["P"]
    assert chunk.start == 1 and [e.token_id for e in chunk.entries] == prompt[1:6]
    assert first.sampled_token_ids["P"] == []
    second = runner.execute_model(sched_out(cached=[("P", [], 5)], num_scheduled={"P": 7}))
    chunk = second.prompt_logprobs["P"]
    assert chunk.start == 6 and [e.token_id for e in chunk.entries] == prompt[6:]
    # Flat row 3 of the second step is position 8, predicting prompt token 9 (= 19).
    expected = (3 * 0.01 * torch.arange(VOCAB, dtype=torch.float32)).log_softmax(-1)
    entry = chunk.entries[3]
    assert entry.token_id == 19 and entry.logprob == pytest.approx(float(expected[19]))
    assert entry.rank == VOCAB - 19 and [t for t, _ in entry.top] == [VOCAB - 1, VOCAB - 2]
    assert len(second.sampled_token_ids["P"]) == 1
    # Decode steps have no prompt logprobs.
    third = runner.execute_model(sched_out(cached=[("P", [], 12)], num_scheduled={"P": 1}))
    assert third.prompt_logprobs == {}


def test_prompt_logprobs_after_requests_that_asked_for_them_come_and_go(runner):
    # The runner skips the prompt-logprob pass while no request it holds asks for them:
    # its count follows the requests through preemption and finishing, and a later one
    # still gets them.
    runner.attn_backend = FLASH_BUILDER
    runner.model = RowLogitsModel()
    prompt = list(range(10, 16))
    asks = lambda rid: new_req(rid, prompt, [1, 2], 0, prompt_logprobs=1)  # noqa: E731
    out = runner.execute_model(sched_out(new=[asks("P"), new_req("Q", prompt, [3, 4], 0)],
                                         num_scheduled={"P": 6, "Q": 6}))  # fmt: skip
    assert set(out.prompt_logprobs) == {"P"} and runner._num_prompt_logprobs == 1
    runner.execute_model(sched_out(cached=[("Q", [], 6)], num_scheduled={"Q": 1}, preempted={"P"}))
    assert runner._num_prompt_logprobs == 0
    out = runner.execute_model(sched_out(new=[asks("P")], num_scheduled={"P": 6}, finished={"Q"}))
    assert set(out.prompt_logprobs) == {"P"} and runner._num_prompt_logprobs == 1
    runner.execute_model(sched_out(new=[asks("R")], num_scheduled={"R": 6}, finished={"P"}))
    assert runner._num_prompt_logprobs == 1  # R's
    runner.execute_model(sched_out(finished={"R"}))
    assert runner._num_prompt_logprobs == 0


def test_a_request_whose_state_cannot_be_built_fails_alone(runner):
    runner.attn_backend = FLASH_BUILDER
    bad = new_req("bad", [1, 2], [1], 0, temperature=1.0)
    bad.sampling_params.seed = 2**70  # past the front end's check: torch refuses it
    so = sched_out(new=[bad, new_req("ok", [3, 4], [2], 0)], num_scheduled={"bad": 2, "ok": 2})
    out = runner.execute_model(so)
    assert set(out.errors) == {"bad"} and "Error" in out.errors["bad"].message
    assert out.req_ids == ["ok"] and len(out.sampled_token_ids["ok"]) == 1
    assert set(runner.requests) == {"ok"}


class NaNRowModel(RecordingModel):
    """Row logits as RecordingModel's, the second sampled row all NaN."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        if len(logits) > 1:
            logits[1] = float("nan")
        return logits


def test_bare_greedy_rows_take_the_argmax_and_a_nan_row_fails_alone(runner, monkeypatch):
    """A step of bare greedy requests (nothing but the argmax) skips ``sample``; it gives
    the general path's tokens, and a row with non-finite logits fails its request alone.
    A request with anything more (here logprobs) takes the general path."""
    import vllm.v1.worker.model_runner as model_runner

    runner.attn_backend = FLASH_BUILDER
    runner.model = NaNRowModel()
    calls = []
    real = model_runner.sample
    monkeypatch.setattr(model_runner, "sample", lambda *a: calls.append(1) or real(*a))
    so = sched_out(
        new=[new_req("A", [1, 2], [1], 0), new_req("B", [3], [2], 0), new_req("C", [4], [3], 0)],
        num_scheduled={"A": 2, "B": 1, "C": 1},
    )
    out = runner.execute_model(so)
    assert calls == [] and all(s.bare_greedy for s in runner.requests.values())
    # The sampled rows: A's last (flat row 1), B's (row 2: NaN), C's (row 3).
    assert set(out.errors) == {"B"} and out.errors["B"].internal
    assert out.sampled_token_ids == {"A": [101], "B": [], "C": [103]}
    assert runner.requests["C"].output_token_ids == [103]
    so = sched_out(new=[new_req("D", [5], [4], 0, logprobs=1)], num_scheduled={"D": 1})
    out = runner.execute_model(so)
    assert calls == [1] and not runner.requests["D"].bare_greedy
