"""EAGLE speculative decoding (vLLM's ``eagle`` and ``eagle3`` methods), in the model runner.

An EAGLE head (``models/llama_eagle.py``) drafts from the target's hidden states. Its
KV at position ``p`` is computed from the token at ``p + 1`` and a hidden state for
``p``, so a pass is one position behind a draft model's:

```
 positions:   ... start ... stop-1 | stop   stop+1 ... stop+k-2
 head input:  (t[p+1], target h[p])  | (d1, g) (d2, g) ...           g: its own output
 proposes:                     d1 ^  |  d2 ^   d3 ^  ...  d_k ^
```

- **Catching up**: each step, for every request the target computed, the head computes
  the positions ``[start, stop)`` of this step's rows whose next token is known
  (``stop = min(len(tokens) - 1, start + scheduled)``): a prefill chunk's rows, a decode
  row, the last token's and the kept drafts' rows of a drafted step (the rejected drafts'
  rows are dropped: their hidden states are not the request's). Its input there is the
  target's hidden state of the row (EAGLE-1: the last one; EAGLE-3: three of the residual
  stream, ``aux_hidden``, through the head's ``fc``) and the token after it. Its last row
  gives d1, the token after the request's last one.
- **Drafting ahead**: d_j is fed at position ``stop + j - 1`` with the head's own output
  hidden state of the row before, k - 1 single-token forwards. Their KV is written ahead
  and overwritten by the next catch-up, which always starts at the step's first row (the
  head's KV never counts as valid past the target's: unlike a draft model's, it was
  computed from the head's own hidden states).
- Everything else is the draft model's (``DraftModelProposer``): KV tensors in the
  target's blocks (so prefix hits, preemption, the CPU tier and freeing need nothing of
  their own; a cached block's last position was computed with the token after the
  block, which a later request may not share: it may draft worse, never wrong), CUDA
  graphs of the single-token forwards (the hidden state an extra input buffer), sampled
  requests' drafts drawn from the head's q, one host read a pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vllm.utils.device import to_device
from vllm.v1.spec_decode.draft_model import DraftModelProposer
from vllm.v1.worker.cuda_graph import DecodeGraphs


@dataclass
class EagleRequest:
    """One request's part in an EAGLE pass (``EagleProposer.plan_step``)."""

    state: Any  # the runner's CachedRequestState
    start: int  # the head catches up positions [start, stop)
    stop: int
    row: int  # the target step's row of position ``start``
    num_drafts: int  # drafts to propose after them (0: catch up only)


class EagleProposer(DraftModelProposer):
    """An EAGLE head, its KV cache tensors and its passes (module docstring)."""

    def plan_step(
        self,
        state: Any,
        start: int,
        scheduled: int,
        row: int,
        sampled: bool,
        may_propose: bool = True,
    ) -> EagleRequest | None:
        """The pass of a request whose step computed positions ``[start, start +
        scheduled)`` from the target's row ``row`` on (``sampled``: it got tokens this
        step, so it may propose unless ``may_propose`` is False); None when the head has
        nothing to compute."""
        end = len(state.token_ids)
        limit = self._limit(state)
        stop = min(end - 1, start + scheduled, limit)
        # d_1 .. d_(n-1) are fed at stop ..: their KV one position lower than a draft
        # model's, within the same limit.
        num_drafts = self._num_drafts(state, end, limit, sampled and may_propose)
        if stop <= start:
            return None
        return EagleRequest(state, start, stop, row, num_drafts if stop == end - 1 else 0)

    def _as_decode_rows(self, r: EagleRequest) -> bool:
        return r.start > 0 and r.stop - r.start <= self.k + 1

    def capture(self, sizes, max_blocks, graph_factory=None) -> None:
        """The head's decode step at each size, its hidden-state input a buffer too."""
        if not self.kv_caches:
            raise RuntimeError("initialize_kv_cache first: the graphs record the cache's address")
        if not self.attn_backend.supports_decode_graphs:
            return
        graphs = DecodeGraphs(
            self.model, self.attn_backend, self.kv_caches, sizes, max_blocks, self.device,
            graph_factory, name="EAGLE head's decode",
            hidden_input=(self.model.arch.hidden_size, self.model.hidden_dtype),
        )  # fmt: skip
        graphs.capture()
        self.graphs = graphs

    @torch.inference_mode()
    def propose_step(
        self, reqs: list[EagleRequest], target_hidden: torch.Tensor
    ) -> dict[str, list[int]]:
        """Run the passes of ``reqs`` over the target step's hidden states
        (``target_hidden``: every row of the step; EAGLE-3's auxiliary ones): one
        catch-up forward for all, then up to k - 1 single-token forwards; req_id -> its
        drafts, for those with ``num_drafts``."""
        ids: list[int] = []
        positions: list[int] = []
        rows: list[int] = []
        seqs: list[tuple[int, int, Any]] = []
        if self.attn_backend.decodes_first:
            reqs = sorted(reqs, key=lambda r: not self._as_decode_rows(r))
        last_rows: list[int] = []
        for r in reqs:
            state, n = r.state, r.stop - r.start
            ids += state.token_ids[r.start + 1 : r.stop + 1]
            positions += range(r.start, r.stop)
            rows += range(r.row, r.row + n)
            if self._as_decode_rows(r):
                seqs += [(r.start + i, 1, state.full_table) for i in range(n)]
            else:
                seqs.append((r.start, n, state.full_table))
            state.draft_probs = None  # a q of drafts verified or dropped by now
            if r.num_drafts:
                last_rows.append(len(ids) - 1)
        index = to_device(rows, torch.long, self.device)
        hidden_in = self.model.combine_hidden_states(target_hidden.index_select(0, index))
        out = self._forward(ids, positions, seqs, hidden_in)
        live = [r for r in reqs if r.num_drafts]
        if not live:
            return {}
        for_logits, ahead = self.model.split(out)
        pick = to_device(last_rows, torch.long, self.device)
        hidden = ahead.index_select(0, pick)  # a copy: the next replay rewrites ``out``
        q_rows: dict[str, list[torch.Tensor]] = {}
        tokens = self._next_tokens(for_logits, last_rows, live, q_rows)
        steps = [(live, tokens)]
        for j in range(1, self.k):
            fed_by = live
            live = [r for r in live if r.num_drafts > j]
            if not live:
                break
            if len(live) < len(fed_by):
                keep = to_device(
                    [i for i, r in enumerate(fed_by) if r.num_drafts > j], torch.long, self.device
                )
                tokens, hidden = tokens.index_select(0, keep), hidden.index_select(0, keep)
            positions = [r.stop + j - 1 for r in live]
            seqs = [(p, 1, r.state.full_table) for p, r in zip(positions, live, strict=True)]
            for_logits, ahead = self.model.split(self._forward(tokens, positions, seqs, hidden))
            hidden = ahead.clone()
            tokens = self._next_tokens(for_logits, None, live, q_rows)
            steps.append((live, tokens))
        return self._read_drafts(steps, q_rows)

    def _profile_inputs(self, num_tokens: int) -> dict[str, torch.Tensor]:
        """A catch-up's hidden-state input (the runner's memory profile)."""
        width, dtype = self.model.target_hidden_width, self.model.hidden_dtype
        target = torch.zeros(num_tokens, width, dtype=dtype, device=self.device)
        return {"hidden_states": self.model.combine_hidden_states(target)}


def eagle_head_class(
    method: str | None, target: torch.nn.Module, draft_hf_config: Any = None
) -> type | None:
    """The head class of an EAGLE method or of ``mtp`` (a multi-token-prediction layer of
    the draft's HF config, ``draft_hf_config``, which drafts as an EAGLE-1 head does); None
    for other methods. ValueError naming ``speculative_config.method`` for a target it
    cannot read hidden states of."""
    if method == "mtp":
        from vllm.model_executor.models.mtp import mtp_head_class

        head = mtp_head_class(draft_hf_config)
    elif method in ("eagle", "eagle3"):
        from vllm.model_executor.models.llama_eagle import (
            Eagle3LlamaForCausalLM,
            EagleLlamaForCausalLM,
        )

        if method == "eagle3" and not hasattr(target, "aux_hidden_layers"):
            raise ValueError(
                f"speculative_config.method: eagle3 reads auxiliary hidden states that "
                f"{type(target).__name__} does not expose (the Llama family's models do)"
            )
        head = Eagle3LlamaForCausalLM if method == "eagle3" else EagleLlamaForCausalLM
    else:
        return None
    if not (hasattr(target, "embed_tokens") and hasattr(target, "lm_head")):
        raise ValueError(
            f"speculative_config.method: {method} needs the target's embeddings and "
            f"output head, which {type(target).__name__} does not have as such"
        )
    return head


def check_eagle_head(head: torch.nn.Module, hf_config: Any, target: torch.nn.Module) -> None:
    """Fit a loaded head to its target: the hidden sizes must agree (ValueError naming
    ``speculative_config.model``); an EAGLE-3 target records the residual-stream states
    the head reads; the head takes the target's embeddings (and EAGLE-1 its output head)
    where its checkpoint has none."""
    from vllm.model_executor.models.llama_eagle import eagle3_aux_layers

    want = head.arch.target_hidden_size if head.eagle3 else head.arch.hidden_size
    if want != target.arch.hidden_size:
        raise ValueError(
            f"speculative_config.model: the head reads hidden states of size {want}, the "
            f"target's are {target.arch.hidden_size}"
        )
    if head.eagle3:
        layers = eagle3_aux_layers(hf_config, target.arch.num_layers)
        if len(layers) != head.arch.num_aux:
            raise ValueError(
                f"speculative_config.model: the head's fc reads {head.arch.num_aux} hidden "
                f"states, its layer ids name {len(layers)} distinct ones ({list(layers)})"
            )
        target.aux_hidden_layers = frozenset(layers)
    head.share_target_weights(target)
