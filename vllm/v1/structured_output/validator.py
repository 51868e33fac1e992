"""The front end's full check of a request's ``structured_outputs``, with the tokenizer."""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time

from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import StructuredOutputsParams
from vllm.v1.structured_output.grammar import check_limits, validate_structured_outputs
from vllm.v1.structured_output.thread import grammar_thread

logger = logging.getLogger(__name__)

COMPILE_TIMEOUT_S = 5.0
"""Seconds a grammar may take to compile and compute its first mask in the front end; past
it the request is a 400. Within the limits of ``grammar.py`` a compile takes < 0.3 s on
one core; the tokenizer table built by the first constrained request does not count."""


@functools.lru_cache(maxsize=4)
def build_ll_tokenizer(tokenizer, vocab_size: int, eos_token_id: int):
    """llguidance's tokenizer for a Hugging Face one (~0.5 s for SmolLM2's 49k tokens).

    Cached per tokenizer object (``get_tokenizer`` returns one per model): in one process,
    the front end's validator and the engine's matchers (the offline ``LLM``) share it."""
    import llguidance.hf

    start = time.monotonic()
    ll = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos_token_id)
    logger.info("Guided decoding tokenizer built in %.2f s", time.monotonic() - start)
    return ll


class StructuredOutputValidator:
    """Checks ``StructuredOutputsParams`` as the engine will run them: limits first, then
    a matcher built with the real tokenizer must compute its first mask without error.

    Every compile runs in the grammar thread (``thread.py``); ``validate_async`` awaits it
    with a time budget, so the event loop serves other requests meanwhile. The llguidance
    tokenizer is built once, on first use."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._ll_tokenizer = None
        self._lock = threading.Lock()

    def ll_tokenizer(self):
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = build_ll_tokenizer(
                    self.tokenizer, self.vocab_size, self.eos_token_id
                )
            return self._ll_tokenizer

    def _validate(self, params: StructuredOutputsParams) -> str:
        return validate_structured_outputs(params, self.ll_tokenizer())

    def validate(self, params: StructuredOutputsParams) -> str:
        """The grammar text, or ``VLLMValidationError`` naming ``structured_outputs``
        (synchronous: the offline ``LLM``; no time budget)."""
        check_limits(params)
        return grammar_thread().run(self._validate, params)

    async def validate_async(
        self, params: StructuredOutputsParams, timeout_s: float = COMPILE_TIMEOUT_S
    ) -> str:
        """``validate`` off the event loop; a compile past ``timeout_s`` is a 400."""
        check_limits(params)  # cheap, and before anything is queued
        thread = grammar_thread()
        if self._ll_tokenizer is None:
            await asyncio.wrap_future(thread.submit(self.ll_tokenizer))
        try:
            return await asyncio.wait_for(
                asyncio.wrap_future(thread.submit(self._validate, params)), timeout_s
            )
        except TimeoutError as e:
            raise VLLMValidationError(
                f"structured_outputs took longer than {timeout_s} s to compile (the limit)",
                "structured_outputs",
            ) from e
