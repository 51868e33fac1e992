"""Draft-model speculative decoding (vLLM's ``draft_model`` method), in the model runner.

A small model of the target's vocabulary guesses the next k tokens; the target checks
them in its next step. For a greedy request the draft proposes its argmax and the target
keeps the drafts its own argmax agrees with (``verify_greedy``). For a sampled request
the draft samples each proposal from its own distribution q (the request's temperature,
top-k, top-p and min-p over the draft's logits; a seeded request's generator, so it stays
reproducible) and keeps q on the device, in the request's state, until the target's next
step checks the drafts by speculative sampling (``rejection_sampler.verify_sampled``:
keep d with min(1, p(d) / q(d)), else draw from max(0, p - q)). A draft equal to the
target keeps every draft; the drafts only decide how many tokens a step gives, never
their distribution.

The draft's KV lives in the target's blocks: one extra tensor per draft layer, indexed by
the same block ids and slots (positions are the same in both models), so the scheduler's
block tables, prefix caching, preemption and freeing need nothing of their own. Each
step, after the target's tokens are known, one pass per request:

```
 positions:  ... v-1 | v ... end-1 | end   end+1 ... end+k-2 | end+k-1
 draft KV:   valid   | catch-up    | fed d1, d2 ...  d(k-1)  | (d_k: not fed)
 proposes:                    d1 ^   d2 ^  ...       d_k ^
```

``v`` (``draft_valid``): positions whose draft KV holds the request's own tokens. The
catch-up computes ``[v, end)`` in one forward for every request of the step (a prefill
chunk's tokens, or what the target just accepted plus its new token), its last row gives
d1; then k - 1 single-token forwards feed d1... and give d2... The fed drafts' KV stays:
next step, those the target kept are the request's tokens at those positions, so ``v``
moves past them (``draft_ahead``); the rejected ones' slots are overwritten, in both
models, by the next pass. The draft writes up to position end + k - 2, which the
scheduler's lookahead slots (``SpeculativeConfig.num_lookahead_tokens``) cover; a pass
never writes past the slots its request holds.

Every generating request catches up (also one whose drafts are not allowed), so a block
that prefix caching shares carries the draft's KV of its tokens too.

**CUDA graphs.** A small draft run eagerly is bound by kernel launches, not by its
weights. ``capture`` records the draft's decode step over the target's ladder of batch
sizes (``DecodeGraphs``, the class the target's graphs use, over the draft's model,
backend and KV tensors). The k - 1 single-token forwards always have one new token a
request: they replay (up to the largest captured size). So does the catch-up whenever every
request's rows go as decode rows (``_as_decode_rows``): after a step whose drafts the
target did not all keep, a request has exactly one row (its new token; the kept drafts'
KV is already there), and after one whose drafts it kept entirely, two (the last draft,
never fed, and the bonus token); only a prompt's chunks, or a first pass after a long
gap, make the catch-up run eagerly.

**No host round trips.** Each forward's tokens (argmax, or drawn from q after the
replay) stay on the device and are the next forward's input; the pass reads its drafts
back once, at its end (one ``tolist`` of every step's tokens): one host sync a pass
instead of one per forward. The q rows never leave the device.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from vllm.utils.device import to_device
from vllm.v1.attention.backends.abstract import kv_cache_bytes
from vllm.v1.sample.sampler import SamplingRow, draw_with_probs_on_device
from vllm.v1.worker.cuda_graph import DecodeGraphs, Graph

logger = logging.getLogger(__name__)


class DraftDistribution(NamedTuple):
    """The drafts a pass proposed to a sampled request and the q each was drawn from
    (``probs``: (len(tokens), vocab), on the device). The runner keeps it in the request's
    state until its next step verifies the drafts; dropped with the state (finished,
    preempted) or replaced by the next pass."""

    tokens: list[int]
    probs: torch.Tensor

    def for_drafts(self, drafts: list[int]) -> torch.Tensor | None:
        """q of the scheduled ``drafts``: a prefix of the proposed ones (the scheduler
        cuts, never edits); None for drafts this pass did not propose."""
        if drafts != self.tokens[: len(drafts)]:
            return None
        return self.probs[: len(drafts)]


@dataclass
class DraftRequest:
    """One request's part in a drafting pass (``DraftModelProposer.plan``)."""

    state: Any  # the runner's CachedRequestState (token_ids, full_table, draft_* fields)
    end: int  # after the pass, draft KV holds the request's tokens [0, end)
    num_drafts: int  # drafts to propose after them (0: catch up only)


class DraftModelProposer:
    """The draft model, its KV cache tensors and the drafting passes."""

    def __init__(
        self,
        model: torch.nn.Module,
        attn_backend: Any,
        num_speculative_tokens: int,
        block_size: int,
        max_model_len: int,
        target_max_model_len: int,
        kv_cache_dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """``max_model_len``: the draft's (``speculative_config.max_model_len``): a
        request drafts nothing once it is longer; ``target_max_model_len``: no draft is
        proposed at a position the target can never reach."""
        self.model = model
        self.arch = model.arch
        self.attn_backend = attn_backend
        self.k = num_speculative_tokens
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.target_max_model_len = target_max_model_len
        self.kv_cache_dtype = kv_cache_dtype
        self.device = device
        self.kv_caches: list[torch.Tensor] = []
        self.graphs: DecodeGraphs | None = None  # capture (CUDA, or stand-ins in tests)

    # -- the KV cache -----------------------------------------------------------------
    def layer_shape(self, num_blocks: int) -> tuple[int, ...]:
        """One draft layer's cache, as its backend reads it (K and V halves, or MLA's
        latent alone)."""
        return self.attn_backend.kv_cache_shape(num_blocks)

    def kv_cache_bytes_per_block(self) -> int:
        """The draft layers' share of a KV block (the runner adds it to the target's)."""
        return kv_cache_bytes(self.layer_shape(1), self.kv_cache_dtype, self.arch.num_layers)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.graphs = None  # they recorded the old tensors' addresses
        shape = self.layer_shape(num_blocks)
        self.kv_caches = [
            torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)
            for _ in range(self.arch.num_layers)
        ]

    # -- planning a step's pass --------------------------------------------------------
    def plan(
        self, state: Any, end: int, sampled: bool, may_propose: bool = True
    ) -> DraftRequest | None:
        """The pass of a request whose tokens ``[0, end)`` have target KV or a token from
        this step (``sampled``: it got tokens, so ``end`` is its length and it may
        propose, unless ``may_propose`` is False: the scheduler would drop the drafts);
        None when there is nothing to compute. Mutates ``state``'s draft bookkeeping:
        the drafts fed last step that the target kept become valid."""
        if state.draft_valid is None:
            # A new (or resumed) request starts after its prefix hit: those blocks' draft
            # KV was written with their target KV (see the module docstring).
            state.draft_valid = state.num_computed_tokens
        tokens, ahead = state.token_ids, state.draft_ahead
        kept = 0
        while (
            kept < len(ahead)
            and state.draft_valid + kept < len(tokens)
            and tokens[state.draft_valid + kept] == ahead[kept]
        ):
            kept += 1
        state.draft_valid += kept
        state.draft_ahead = []
        limit = self._limit(state)
        num_drafts = self._num_drafts(state, end, limit, sampled and may_propose)
        if num_drafts:
            # The last token's row gives d1: compute it even when its KV is already right
            # (a fed draft that the target's next token happened to equal).
            state.draft_valid = min(state.draft_valid, end - 1)
        end = min(end, limit)
        if end <= state.draft_valid:
            return None
        return DraftRequest(state, end, num_drafts)

    def _limit(self, state: Any) -> int:
        """Positions the pass may write for ``state``: the slots its request holds, and
        the draft's own length limit."""
        return min(len(state.full_table) * self.block_size, self.max_model_len)

    def _num_drafts(self, state: Any, end: int, limit: int, may_propose: bool) -> int:
        """How many drafts a request of length ``end`` may get: none unless it may
        propose and is allowed drafts; at most k, none past ``limit`` (d_i sits at
        position end + i - 1, d_1 .. d_(n-1) are fed, their KV written) or the target's
        max_model_len, and none its max_tokens could not keep."""
        if not (may_propose and end <= limit and state.draft_allowed):
            return 0
        num_drafts = min(self.k, limit - end + 1, self.target_max_model_len - end)
        max_tokens = state.sampling_params.max_tokens
        if max_tokens is not None:
            num_drafts = min(num_drafts, max_tokens - len(state.output_token_ids) - 1)
        return max(num_drafts, 0)

    # -- CUDA graphs -------------------------------------------------------------------
    def capture(
        self, sizes: list[int], max_blocks: int, graph_factory: Callable[[], Graph] | None = None
    ) -> None:
        """Capture the draft's decode step at each batch size of ``sizes`` over its KV
        tensors (``ModelRunner.capture_model``, after the target's); the passes then
        replay them. Nothing when the draft's backend cannot replay a decode step."""
        if not self.kv_caches:
            raise RuntimeError("initialize_kv_cache first: the graphs record the cache's address")
        if not self.attn_backend.supports_decode_graphs:
            logger.info(
                "No CUDA graphs of the draft model: the %s backend cannot replay decode steps",
                self.attn_backend.name,
            )
            return
        graphs = DecodeGraphs(
            self.model, self.attn_backend, self.kv_caches, sizes, max_blocks, self.device,
            graph_factory, name="draft model's decode",
        )  # fmt: skip
        graphs.capture()
        self.graphs = graphs

    # -- a step's pass ------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, reqs: list[DraftRequest]) -> dict[str, list[int]]:
        """Run the passes of ``reqs`` (one catch-up forward for all, then up to k - 1
        single-token forwards); req_id -> its drafts, for those with ``num_drafts``.
        Each forward's drafts feed the next on the device; one read at the end. A sampled
        request's drafts are drawn from q, which lands in its state's ``draft_probs``
        (a ``DraftDistribution``; None for the others of the pass)."""
        if self.attn_backend.decodes_first:
            reqs = sorted(reqs, key=lambda r: not self._as_decode_rows(r))
        ids: list[int] = []
        positions: list[int] = []
        seqs: list[tuple[int, int, Any]] = []
        last_rows: list[int] = []
        for r in reqs:
            state, start = r.state, r.state.draft_valid
            ids += state.token_ids[start : r.end]
            positions += range(start, r.end)
            if self._as_decode_rows(r):
                # One decode row per token, as the target's drafted steps: row i attends
                # to the context through position start + i (written before attending).
                seqs += [(start + i, 1, state.full_table) for i in range(r.end - start)]
            else:
                seqs.append((start, r.end - start, state.full_table))
            state.draft_valid = r.end
            if r.num_drafts:
                last_rows.append(len(ids) - 1)
        hidden = self._forward(ids, positions, seqs)
        for r in reqs:
            r.state.draft_probs = None  # a q of drafts verified or dropped by now
        live = [r for r in reqs if r.num_drafts]
        if not live:
            return {}
        q_rows: dict[str, list[torch.Tensor]] = {}  # sampled requests: q of each draft
        tokens = self._next_tokens(hidden, last_rows, live, q_rows)  # d1 each, on device
        steps = [(live, tokens)]
        for j in range(1, self.k):
            fed_by = live
            live = [r for r in live if r.num_drafts > j]
            if not live:
                break
            if len(live) < len(fed_by):  # the requests still drafting keep their rows
                keep = [i for i, r in enumerate(fed_by) if r.num_drafts > j]
                tokens = tokens.index_select(0, to_device(keep, torch.long, self.device))
            # d_j of each request at position end + j - 1: its KV, and d_(j+1).
            positions = [r.end + j - 1 for r in live]
            seqs = [(p, 1, r.state.full_table) for p, r in zip(positions, live, strict=True)]
            tokens = self._next_tokens(self._forward(tokens, positions, seqs), None, live, q_rows)
            steps.append((live, tokens))
        drafts = self._read_drafts(steps, q_rows)
        for r in steps[0][0]:  # d_1 .. d_(n-1) were fed: their KV is written ahead
            r.state.draft_ahead = drafts[r.state.req_id][: r.num_drafts - 1]
        return drafts

    @staticmethod
    def _read_drafts(
        steps: list[tuple[list, torch.Tensor]], q_rows: dict[str, list[torch.Tensor]]
    ) -> dict[str, list[int]]:
        """req_id -> its drafts, from each forward's (requests, tokens on the device) in
        one host read; a sampled request's q rows go to its state's ``draft_probs``."""
        flat = iter(torch.cat([t for _, t in steps]).tolist())  # the pass's one host read
        drafts: dict[str, list[int]] = {r.state.req_id: [] for r in steps[0][0]}
        for step_reqs, _ in steps:
            for r in step_reqs:
                drafts[r.state.req_id].append(next(flat))
        for r in steps[0][0]:
            if r.state.req_id in q_rows:
                probs = torch.stack(q_rows[r.state.req_id])
                r.state.draft_probs = DraftDistribution(drafts[r.state.req_id], probs)
        return drafts

    def _as_decode_rows(self, r: DraftRequest) -> bool:
        """Whether a pass's tokens go as decode rows (a few tokens after a context) rather
        than as a chunk (a prompt's chunk, or a context's first tokens)."""
        start = r.state.draft_valid
        return start > 0 and r.end - start <= self.k + 1

    def _forward(
        self,
        ids: list[int] | torch.Tensor,
        positions: list[int],
        seqs: list,
        hidden_in: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The draft over ``seqs``; ``ids`` on the host or already on the device;
        ``hidden_in``: the rows' hidden-state input (an EAGLE head's). A decode-only
        batch of a captured size replays its graph (the hidden states are then a view of
        the graphs' output, valid until the next replay)."""
        kwargs = {} if hidden_in is None else {"hidden_states": hidden_in}
        if self.graphs is not None:
            hidden = self.graphs.run(ids, positions, seqs, hidden_in=hidden_in)
            if hidden is not None:
                return hidden
        meta = self.attn_backend.build_metadata(seqs)
        if not isinstance(ids, torch.Tensor):
            ids = to_device(ids, torch.long, self.device)
        pos = to_device(positions, torch.long, self.device)
        return self.model(ids, pos, meta, self.kv_caches, **kwargs)

    def _next_tokens(
        self,
        hidden: torch.Tensor,
        rows: list[int] | None,
        reqs: list[DraftRequest],
        q_rows: dict[str, list[torch.Tensor]],
    ) -> torch.Tensor:
        """The next draft of each request of ``reqs`` from ``hidden``'s ``rows`` (None:
        every row), on the device: a greedy request's argmax; a sampled one's drawn from
        q, whose row is appended to ``q_rows[req_id]``. A sampled row whose filtered
        logits are not finite gets a point mass on the token it got instead (the
        verifier's point-mass rule is exact for any draft it did not choose)."""
        if rows is not None and len(rows) != hidden.shape[0]:
            hidden = hidden.index_select(0, to_device(rows, torch.long, self.device))
        logits = self.model.compute_logits(hidden)
        tokens = logits.argmax(dim=-1)
        sampled = [
            i for i, r in enumerate(reqs) if not r.state.sampling_params.sampling_type_greedy
        ]
        if not sampled:
            return tokens
        index = to_device(sampled, torch.long, self.device)
        if len(sampled) < len(reqs):
            logits = logits.index_select(0, index)
        sampling_rows = [
            SamplingRow(reqs[i].state.sampling_params, reqs[i].state.generator, (), [])
            for i in sampled
        ]
        drawn, probs, finite = draw_with_probs_on_device(logits, sampling_rows)
        point = torch.nn.functional.one_hot(drawn, probs.shape[-1]).to(probs.dtype)
        probs = torch.where(finite[:, None], probs, point)
        for j, i in enumerate(sampled):
            q_rows.setdefault(reqs[i].state.req_id, []).append(probs[j])
        return tokens.index_copy_(0, index, drawn)

    @torch.inference_mode()
    def profile_run(self, seqs: list, num_tokens: int) -> None:
        """One catch-up forward of ``num_tokens`` tokens laid out as ``seqs`` on a scratch
        cache of two blocks (the runner's memory profile of its largest step)."""
        scratch = torch.zeros(self.layer_shape(2), dtype=self.kv_cache_dtype, device=self.device)
        meta = self.attn_backend.build_metadata(seqs)
        positions = torch.cat([torch.arange(s, s + n) for s, n, _ in seqs]).to(self.device)
        assert positions.numel() == num_tokens
        ids = torch.zeros_like(positions)
        self.model(
            ids,
            positions,
            meta,
            [scratch] * self.arch.num_layers,
            **self._profile_inputs(num_tokens),
        )

    def _profile_inputs(self, num_tokens: int) -> dict[str, torch.Tensor]:
        """The model's inputs besides ids, positions and caches in a profile run."""
        return {}
