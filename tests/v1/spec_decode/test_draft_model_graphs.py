"""The draft model's steps replay CUDA graphs (``DraftModelProposer.capture``, over
``DecodeGraphs``), its drafts stay on the device between forwards, and a step whose
drafts the scheduler would drop proposes nothing.

On the CPU the graphs are ``ReplayingGraph`` stand-ins (tests/v1/worker/test_cuda_graph.py):
what is checked is the plumbing (which forwards replay, the buffers, the device-side
feeding), on tiny random Llamas of SmolLM2's vocabulary whose layers attend with
TORCH_FLASH_ATTN's decode path (the Triton kernel emulated in float64). Host syncs are
counted on ``FakeDevice``'s pretend ``cuda:0``. Real graphs on a GPU:
tests/cuda/test_draft_model_cuda.py.
"""

from __future__ import annotations

import contextlib
import logging
from types import SimpleNamespace

import pytest
import torch

from tests.utils import save_smollm_vocab_llama
from tests.v1.attention.test_torch_flash import install, ref_varlen_attn
from tests.v1.attention.test_triton_decode import emulated_kernel
from tests.v1.sample.fake_device import FakeDevice
from tests.v1.worker.test_cuda_graph import ReplayingGraph
from vllm.sampling_params import SamplingParams
from vllm.v1.attention.backends import triton_decode
from vllm.v1.attention.backends.torch_flash import TorchFlashAttentionBackend
from vllm.v1.spec_decode.draft_model import DraftModelProposer

# -- host syncs of a pass ---------------------------------------------------------------------
VOCAB = 512
BLOCK = 4


class _ChainModel:
    """A stand-in draft on the device: the token after ``t`` at position ``p`` is
    ``(3 t + p) % VOCAB``, so a wrong feed (a stale id, a row out of place) shows."""

    arch = SimpleNamespace(num_layers=1)

    def __call__(self, ids, positions, meta, kv_caches):
        return ((ids * 3 + positions) % VOCAB).float()[:, None]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(len(hidden), VOCAB, device=hidden.device)
        return logits.scatter(1, hidden[:, 0].long()[:, None], 5.0)


@contextlib.contextmanager
def _no_streams(monkeypatch):
    """A CPU build has no CUDA streams; the fake device runs everything in order."""
    stream = SimpleNamespace(wait_stream=lambda other: None)
    monkeypatch.setattr(torch.cuda, "Stream", lambda: stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    yield


def _state(i: int, max_tokens: int | None) -> SimpleNamespace:
    tokens = list(range(10 + i, 20 + i))  # 10 tokens; the last one new this step
    return SimpleNamespace(
        req_id=f"r{i}", token_ids=tokens, output_token_ids=tokens[-1:],
        full_table=[1 + 4 * i, 2 + 4 * i, 3 + 4 * i, 4 + 4 * i], num_computed_tokens=9,
        sampling_params=SamplingParams(temperature=0, max_tokens=max_tokens),
        draft_valid=9, draft_ahead=[], draft_allowed=True,
    )  # fmt: skip


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_a_draft_pass_reads_the_device_once(monkeypatch, k, graphs):
    # Three decoding requests, one of which may take a single draft (max_tokens): the
    # batch shrinks after the catch-up. Before the drafts stayed on the device, a pass
    # read each forward's argmax back: k reads (k = 2: 2, k = 4: 4); now one.
    dev = FakeDevice()
    with dev, _no_streams(monkeypatch):
        backend = TorchFlashAttentionBackend(1, 1, 8, torch.bfloat16, torch.device("cuda"), BLOCK)
        backend.decode_kernel = "triton"  # the backend that captures decode steps
        cuda = torch.device("cuda")
        p = DraftModelProposer(_ChainModel(), backend, k, BLOCK, 64, 64, torch.bfloat16, cuda)
        p.initialize_kv_cache(16)
        if graphs:
            p.capture([1, 2, 4], 16, ReplayingGraph)
        states = [_state(0, None), _state(1, 3), _state(2, None)]  # r1: 1 output of 3
        reqs = [p.plan(s, 10, sampled=True) for s in states]
        dev.device_reads.clear()
        dev.blocking_uploads.clear()
        drafts = p.propose(reqs)
    assert [r.split(" at")[0] for r in dev.device_reads] == ["tolist"]
    assert dev.blocking_uploads == []
    expected = {}
    for s, r in zip(states, reqs, strict=True):
        token, chain = s.token_ids[-1], []
        for j in range(r.num_drafts):  # d_(j+1) follows the token at position 9 + j
            token = (3 * token + 9 + j) % VOCAB
            chain.append(token)
        expected[s.req_id] = chain
        assert s.draft_ahead == chain[:-1]  # fed: their KV is written
    assert drafts == expected and len(drafts["r1"]) == 1 and len(drafts["r0"]) == k
    if graphs:  # the catch-up (one row each) and the k - 1 single-token forwards
        assert p.graphs.num_replays == k


# -- whole engines on tiny models ---------------------------------------------------------------
@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A two-layer target and a one-layer draft (other random weights), both of SmolLM2's
    vocabulary."""
    target, draft = tmp_path_factory.mktemp("target"), tmp_path_factory.mktemp("draft")
    save_smollm_vocab_llama(target)
    save_smollm_vocab_llama(draft, num_hidden_layers=1, hidden_size=32, intermediate_size=48)
    return str(target), str(draft)


def _engine(monkeypatch, target, draft=None, graphs=False, k=3, method=None, **kwargs):
    """An engine whose target (and draft) attend with TORCH_FLASH_ATTN and the emulated
    Triton decode kernel; ``graphs``: capture with stand-in graphs. ``method``: the
    draft's (None: a draft model)."""
    from vllm import LLM

    install(monkeypatch, ref_varlen_attn)
    monkeypatch.setattr(triton_decode, "paged_decode_attention", emulated_kernel([]))
    spec = None if draft is None else {"model": draft, "num_speculative_tokens": k, **kwargs}
    if spec is not None and method is not None:
        spec["method"] = method
    llm = LLM(model=target, kv_cache_memory="16MiB", max_num_seqs=4, max_model_len=256,
              enforce_eager=not graphs, speculative_config=spec,
              skip_tokenizer_init=True)  # fmt: skip
    runner = llm.engine_core.model_runner
    parts = [(runner, runner.model)]
    if runner.drafter is not None:
        parts.append((runner.drafter, runner.drafter.model))
    for owner, model in parts:
        a = model.arch
        backend = TorchFlashAttentionBackend(
            a.num_heads, a.num_kv_heads, a.head_dim, torch.float32, "cpu", 16
        )
        backend.decode_kernel = "triton"
        owner.attn_backend = backend
        model.set_attention_backend(backend)
    runner.capture_model(graph_factory=ReplayingGraph)
    return llm


PROMPTS = [[300 + t for t in range(12)] * 2, [7, 8, 9] * 5, list(range(1000, 1040))]


def _generate(llm, max_tokens=(20, 24, 28)):
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    llm.engine_core.scheduler.check_invariants()
    return [list(o.outputs[0].token_ids) for o in outs]


@contextlib.contextmanager
def _recording(llm):
    """Each step's (requests held by the runner, proposals), and every draft forward's
    shape (all rows single-token, rows)."""
    runner = llm.engine_core.model_runner
    steps, forwards = [], []
    execute, forward = runner.execute_model, runner.drafter._forward

    def recorded_execute(so, *args, **kwargs):
        out = execute(so, *args, **kwargs)
        steps.append((len(runner.requests), out.draft_token_ids))
        return out

    def recorded_forward(ids, positions, seqs):
        forwards.append((all(n == 1 for _, n, _ in seqs), len(seqs)))
        return forward(ids, positions, seqs)

    runner.execute_model, runner.drafter._forward = recorded_execute, recorded_forward
    try:
        yield steps, forwards
    finally:
        runner.execute_model, runner.drafter._forward = execute, forward


def test_replayed_draft_steps_propose_as_eager_ones(monkeypatch, models, caplog):
    target, draft = models
    plain = _engine(monkeypatch, target)
    base = _generate(plain)
    plain.shutdown()
    proposals, replays = {}, {}
    for graphs in (False, True):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="vllm"):
            llm = _engine(monkeypatch, target, draft, graphs=graphs)
        drafter = llm.engine_core.model_runner.drafter
        logged = "Captured 3 draft model's decode CUDA graphs (batch sizes 1-4)" in caplog.text
        assert logged == graphs
        try:
            with _recording(llm) as (steps, forwards):
                assert _generate(llm) == base
            replays[graphs] = drafter.graphs and (drafter.graphs.sizes, drafter.graphs.num_replays)
        finally:
            llm.shutdown()
        assert drafter.graphs is None  # freed with the KV cache they recorded
        proposals[graphs] = [drafts for _, drafts in steps]
    assert replays[False] is None  # --enforce-eager: nothing captured, nothing replayed
    # Every draft forward of one row a request, at most 4 rows, replayed: the k - 1
    # single-token ones and the catch-ups after decode steps; only the prompts' catch-ups
    # (one forward each step a prompt is in) ran eagerly.
    replayable = sum(single and n <= 4 for single, n in forwards)
    assert replays[True] == ([1, 2, 4], replayable)
    assert replayable >= len(forwards) - 3 and replayable > 20
    assert proposals[True] == proposals[False]
    assert sum(len(d) for step in proposals[True] for d in step.values()) > 30


def test_no_proposals_in_steps_the_scheduler_would_drop_them(monkeypatch, models):
    # disable_by_batch_size 2: with 3 requests running the scheduler takes no drafts, so
    # the runner proposes none (only the catch-up runs); once the shortest request ends,
    # two remain and drafts come back. The tokens are plain decoding's either way.
    target, draft = models
    plain = _engine(monkeypatch, target)
    base = _generate(plain, max_tokens=(6, 24, 28))
    plain.shutdown()
    llm = _engine(monkeypatch, target, draft, disable_by_batch_size=2)
    try:
        with _recording(llm) as (steps, forwards):
            assert _generate(llm, max_tokens=(6, 24, 28)) == base
    finally:
        llm.shutdown()
    crowded = [drafts for held, drafts in steps if held > 2]
    assert len(crowded) >= 5 and all(drafts == {} for drafts in crowded)
    assert any(drafts for held, drafts in steps if held <= 2)
    # A crowded step's pass is its catch-up forward alone.
    assert len(forwards) < len(steps) + 2 * sum(1 for _, d in steps if d)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_sampled_drafts_are_drawn_on_the_device_and_keep_their_q(monkeypatch, graphs):
    # r0 sampled (temperature 2: the chain's token has e^2.5 / (e^2.5 + 511) of q, so
    # most drafts are other tokens), r1 greedy: still one read a pass, r0's q of each
    # draft kept on the device in its state, r1 without one.
    k = 3
    dev = FakeDevice()
    with dev, _no_streams(monkeypatch):
        backend = TorchFlashAttentionBackend(1, 1, 8, torch.bfloat16, torch.device("cuda"), BLOCK)
        backend.decode_kernel = "triton"
        cuda = torch.device("cuda")
        p = DraftModelProposer(_ChainModel(), backend, k, BLOCK, 64, 64, torch.bfloat16, cuda)
        p.initialize_kv_cache(16)
        if graphs:
            p.capture([1, 2, 4], 16, ReplayingGraph)
        states = [_state(0, None), _state(1, None)]
        states[0].sampling_params = SamplingParams(temperature=2.0)
        for s in states:
            s.generator, s.draft_probs = None, "stale"
        reqs = [p.plan(s, 10, sampled=True) for s in states]
        dev.device_reads.clear()
        torch.manual_seed(0)
        drafts = p.propose(reqs)
    assert [r.split(" at")[0] for r in dev.device_reads] == ["tolist"]
    sampled, greedy = states
    assert greedy.draft_probs is None and len(drafts["r1"]) == k
    q = sampled.draft_probs
    assert q.tokens == drafts["r0"] and q.probs.shape == (k, VOCAB)
    assert torch.allclose(q.probs.sum(-1).float().cpu(), torch.ones(k))
    # Each q is the chain's row at temperature 2 after the draft before it (fed on).
    token = sampled.token_ids[-1]
    for j, d in enumerate(drafts["r0"]):
        top = (3 * token + 9 + j) % VOCAB
        assert q.probs[j].argmax().item() == top
        token = d
    assert drafts["r0"] != [] and q.for_drafts(drafts["r0"][:1]) is not None
    assert q.for_drafts([VOCAB - 1 - drafts["r0"][0]]) is None  # drafts it did not propose
