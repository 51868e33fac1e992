"""The model runner's side of guided decoding: one llguidance matcher per request."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from typing import Protocol

import numpy as np
import torch

from vllm.config import VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.device import upload
from vllm.v1.outputs import RequestFailure
from vllm.v1.structured_output.grammar import compile_grammar, excerpt, new_matcher
from vllm.v1.structured_output.thread import grammar_thread
from vllm.v1.structured_output.validator import build_ll_tokenizer

logger = logging.getLogger(__name__)

COMPILED_CACHE_SIZE = 32
"""Compiled grammars kept (a fresh matcher each, copied per request): the ``n`` children
of a request, and requests that repeat a schema (the same tools), compile once."""
_MAX_LOGGED = 1024  # grammars whose failure was logged (each logged once)


class ConstrainedRow(Protocol):
    """What the manager reads of a request about to sample (the runner's request state)."""

    req_id: str
    sampling_params: SamplingParams
    output_token_ids: list[int]


class StructuredOutputManager:
    """Owns the matchers of the requests that have ``structured_outputs``.

    Contract, per step: ``failures = mask_logits(logits, rows)`` before sampling (row i of
    ``logits`` belongs to ``rows[i]``), then ``accept(rows, tokens)`` with the sampled
    tokens of the rows that did not fail. ``remove(ids)`` for finished and preempted
    requests: a resumed request gets a fresh matcher that replays the tokens it generated
    before, so preemption changes nothing. Requests without a constraint cost one
    attribute check each.
    """

    def __init__(self, vllm_config: VllmConfig) -> None:
        self.model_config = vllm_config.model_config
        self._ll_tokenizer = None  # built on first use: ~0.5 s, useless to most servers
        self._matchers: dict[str, object] = {}
        self._grammars: dict[str, str] = {}  # req_id -> its grammar text
        self._compiled: OrderedDict[str, object] = OrderedDict()  # grammar -> fresh matcher
        self._logged: set[str] = set()
        self._vocab_size: int | None = None

    def _tokenizer(self, vocab_size: int):
        if self._ll_tokenizer is None:
            from vllm.model_executor.model_loader import eos_token_ids
            from vllm.transformers_utils.tokenizer import NO_TOKENIZER, init_tokenizer_from_config

            mc = self.model_config
            tok = init_tokenizer_from_config(mc)
            if tok is None:  # the front end refuses such requests first
                raise ValueError(f"structured outputs need a tokenizer: {NO_TOKENIZER}")
            eos = eos_token_ids(mc, tok)[0]
            self._ll_tokenizer = build_ll_tokenizer(tok, vocab_size, eos)
        return self._ll_tokenizer

    @property
    def vocab_size(self) -> int:
        """Rows of the logits the matchers mask: the model's vocabulary."""
        if self._vocab_size is None:
            from vllm.model_executor.model_loader import hf_config_of

            self._vocab_size = hf_config_of(self.model_config).vocab_size
        return self._vocab_size

    def _build(self, grammar: str) -> tuple[str, object]:
        """In the grammar thread (deep grammars need its stack): ``grammar`` and a fresh
        matcher of it. The llguidance tokenizer is built there too, once, so only that
        thread ever touches it."""
        return grammar, new_matcher(self._tokenizer(self.vocab_size), grammar)

    def prepare(self, params: SamplingParams) -> Future | None:
        """Start compiling ``params``' grammar; None when there is nothing to wait for.

        The future's result goes to ``adopt`` (on this thread) before the request is
        scheduled, so the step that first samples it does not compile."""
        if params.structured_outputs is None:
            return None
        grammar = compile_grammar(params.structured_outputs)
        if grammar in self._compiled:
            return None
        return grammar_thread().submit(self._build, grammar)

    def adopt(self, compiled: tuple[str, object]) -> None:
        """Keep a compiled grammar (``prepare``'s result) for the requests that use it."""
        grammar, template = compiled
        self._compiled[grammar] = template
        self._compiled.move_to_end(grammar)
        if len(self._compiled) > COMPILED_CACHE_SIZE:
            self._compiled.popitem(last=False)

    def _compile(self, grammar: str):
        """A compiled ``grammar``: from the cache, else compiled now (a resumed request
        whose grammar left the cache, or a caller that did not ``prepare``)."""
        template = self._compiled.get(grammar)
        if template is None:
            self.adopt(grammar_thread().run(self._build, grammar))
            return self._compiled[grammar]
        self._compiled.move_to_end(grammar)
        return template

    def _matcher(self, row: ConstrainedRow):
        matcher = self._matchers.get(row.req_id)
        if matcher is None:
            grammar = compile_grammar(row.sampling_params.structured_outputs)
            self._grammars[row.req_id] = grammar
            matcher = self._compile(grammar).deep_copy()
            if row.output_token_ids:  # resumed after preemption: replay its tokens
                matcher.consume_tokens(row.output_token_ids)
            self._matchers[row.req_id] = matcher
        return matcher

    def _row_mask(self, row: ConstrainedRow, vocab: int) -> tuple[torch.Tensor | None, str]:
        """(allowed tokens, "") or (None, why the row's grammar failed)."""
        try:
            matcher = self._matcher(row)
            packed = np.frombuffer(matcher.compute_bitmask(), np.uint8)
        except Exception as e:  # the front end validated it: not expected
            logger.warning("request %s: its matcher failed", row.req_id, exc_info=True)
            return None, f"{type(e).__name__}: {e}"
        if matcher.is_error():
            return None, matcher.get_error() or str(matcher.stop_reason())
        allowed = torch.from_numpy(np.unpackbits(packed, bitorder="little")[:vocab].astype(bool))
        if allowed.numel() != vocab:  # a tokenizer smaller than the model's vocabulary
            return None, f"the grammar's mask covers {allowed.numel()} tokens, not {vocab}"
        if not allowed.any():
            return None, "the grammar allows no token"
        return allowed, ""

    def mask_logits(
        self, logits: torch.Tensor, rows: Sequence[ConstrainedRow]
    ) -> dict[int, RequestFailure]:
        """Set the logits of tokens the grammar forbids to -inf, in place; the rows whose
        matcher is in an error state (a grammar limit hit mid-generation) are all -inf and
        returned (row index -> failure): their requests fail, the others go on. Such a
        row never samples unconstrained text. The masks are built on the host (llguidance)
        and reach ``logits``' device in one copy for the whole batch."""
        vocab = logits.shape[-1]
        failures: dict[int, RequestFailure] = {}
        masked: list[int] = []  # rows of ``logits`` that get a mask
        masks: list[torch.Tensor] = []  # (vocab,) bool each, on the host
        for i, row in enumerate(rows):
            if row.sampling_params.structured_outputs is None:
                continue
            allowed, error = self._row_mask(row, vocab)
            if allowed is None:
                logits[i].fill_(float("-inf"))
                failures[i] = RequestFailure(
                    f"structured_outputs: the grammar failed: {excerpt(error)}", internal=False
                )
                self._log_failure(row.req_id, error)
                continue
            masked.append(i)
            masks.append(allowed)
        if masks:
            forbidden = ~upload(torch.stack(masks), logits.device)  # (len(masked), vocab)
            for j, i in enumerate(masked):
                logits[i].masked_fill_(forbidden[j], float("-inf"))
        return failures

    def _log_failure(self, req_id: str, error: str) -> None:
        # Once per grammar (the n children of a request share theirs), as an excerpt.
        grammar = self._grammars.get(req_id, "")
        if grammar in self._logged:
            return
        if len(self._logged) >= _MAX_LOGGED:
            self._logged.clear()
        self._logged.add(grammar)
        logger.warning(
            "request %s: its grammar failed: %s; grammar: %s",
            req_id,
            excerpt(error),
            excerpt(grammar),
        )

    def accept(self, rows: Sequence[ConstrainedRow], tokens: Sequence[int]) -> None:
        """Advance each constrained request's matcher by its sampled token."""
        for row, token in zip(rows, tokens, strict=True):
            matcher = self._matchers.get(row.req_id)
            if matcher is not None and not matcher.is_stopped():
                matcher.consume_token(token)

    def remove(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self._matchers.pop(req_id, None)
            self._grammars.pop(req_id, None)
