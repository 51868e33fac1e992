"""The model runner's side of guided decoding: one llguidance matcher per request."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from typing import Protocol

import numpy as np
import torch

from vllm.config import VllmConfig
from vllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class ConstrainedRow(Protocol):
    """What the manager reads of a request about to sample (the runner's request state)."""

    req_id: str
    sampling_params: SamplingParams
    output_token_ids: list[int]


class StructuredOutputManager:
    """Owns the matchers of the requests that have ``structured_outputs``.

    Contract, per step: ``mask_logits(logits, rows)`` before sampling (row i of ``logits``
    belongs to ``rows[i]``), then ``accept(rows, tokens)`` with the sampled tokens.
    ``remove(ids)`` for finished and preempted requests: a resumed request gets a fresh
    matcher that replays the tokens it generated before, so preemption changes nothing.
    Requests without a constraint cost one attribute check each.
    """

    def __init__(self, vllm_config: VllmConfig) -> None:
        self.model_config = vllm_config.model_config
        self._ll_tokenizer = None  # built on first use: ~1.5 s, useless to most servers
        self._matchers: dict[str, object] = {}

    def _tokenizer(self, vocab_size: int):
        if self._ll_tokenizer is None:
            import llguidance.hf

            from vllm.model_executor.model_loader import get_eos_token_id
            from vllm.transformers_utils.tokenizer import get_tokenizer

            start = time.monotonic()
            mc = self.model_config
            tok = get_tokenizer(mc.model, mc.tokenizer, mc.chat_template)
            eos = get_eos_token_id(mc.model)
            eos = eos if eos is not None else tok.eos_token_id
            self._ll_tokenizer = llguidance.hf.from_tokenizer(
                tok, n_vocab=vocab_size, eos_token=eos
            )
            logger.info("Guided decoding tokenizer built in %.2f s", time.monotonic() - start)
        return self._ll_tokenizer

    def _matcher(self, row: ConstrainedRow, vocab_size: int):
        matcher = self._matchers.get(row.req_id)
        if matcher is None:
            from llguidance import LLMatcher

            from vllm.v1.structured_output.grammar import compile_grammar

            so = row.sampling_params.structured_outputs
            matcher = LLMatcher(self._tokenizer(vocab_size), compile_grammar(so))
            if row.output_token_ids:  # resumed after preemption: replay its tokens
                matcher.consume_tokens(row.output_token_ids)
            self._matchers[row.req_id] = matcher
        return matcher

    def mask_logits(self, logits: torch.Tensor, rows: Sequence[ConstrainedRow]) -> None:
        """Set the logits of tokens the grammar forbids to -inf, in place.

        ``logits``: (len(rows), vocab). A matcher in an error state (it should not happen:
        every sampled token was allowed) leaves only EOS, so its request ends."""
        vocab = logits.shape[-1]
        for i, row in enumerate(rows):
            if row.sampling_params.structured_outputs is None:
                continue
            matcher = self._matcher(row, vocab)
            if matcher.is_error():
                logger.warning("Grammar of %s failed: %s", row.req_id, matcher.get_error())
            packed = np.frombuffer(matcher.compute_bitmask(), np.uint8)
            bits = np.unpackbits(packed, bitorder="little")
            allowed = torch.from_numpy(bits[:vocab].astype(bool))
            if not allowed.any():  # error state: end the request rather than sample garbage
                allowed[self._ll_tokenizer.eos_token] = True
            logits[i].masked_fill_(~allowed, float("-inf"))

    def accept(self, rows: Sequence[ConstrainedRow], tokens: Sequence[int]) -> None:
        """Advance each constrained request's matcher by its sampled token."""
        for row, token in zip(rows, tokens, strict=True):
            matcher = self._matchers.get(row.req_id)
            if matcher is not None and not matcher.is_stopped():
                matcher.consume_token(token)

    def remove(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self._matchers.pop(req_id, None)
