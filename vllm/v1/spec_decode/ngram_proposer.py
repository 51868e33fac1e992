"""N-gram (prompt lookup) draft tokens for speculative decoding (vLLM's ``ngram`` method).

An agent's turn copies a lot: file contents it read, the command it ran, its own earlier
plan. Where the sequence's last n tokens occurred before, the tokens that followed them
then are a good guess for what follows now. One forward computes the request's last
token and those k drafts together; the runner keeps the drafts its own greedy choice
agrees with, plus its next token (``verify_greedy``), so the output is the one decoding
token by token gives, in fewer steps; a sampled request's drafts are kept by rejection
sampling (``vllm/v1/sample/rejection_sampler.py``), with plain sampling's distribution.

Drafts are proposed in the scheduler, on the host, from each request's tokens kept in a
growing numpy buffer (one append a step, not a copy of the sequence).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from vllm.sampling_params import SamplingParams
from vllm.v1.sample.penalty_table import has_penalty


def drafts_allowed(params: SamplingParams) -> bool:
    """Whether a request's next token depends on its logits alone: greedy, or sampled with
    a temperature and top-k / top-p / min-p; no penalty, no logit control (bias, allowed
    ids, bad words, min_tokens, a thinking budget), no grammar (logprobs are fine: each
    kept token's row gives them). Only such a request gets drafts:
    checking one then needs each position's logits alone (the argmax, or
    ``rejection_sampler.verify_sampled``). Every other request decodes as without
    speculation."""
    return (
        not has_penalty(params)
        and not params.logit_bias
        and params.allowed_token_ids is None
        and not params.bad_words
        and params.min_tokens == 0
        and params.thinking_token_budget is None
        and params.structured_outputs is None
    )


def find_draft(tokens: np.ndarray, n_min: int, n_max: int, k: int) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest
    suffix n-gram of ``tokens`` (n from ``n_max`` down to ``n_min``); [] when none
    occurred before."""
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = tokens[length - n :]
        # Occurrences starting at i <= length - n - 1: the suffix itself is not one.
        starts = np.flatnonzero(tokens[: length - n] == suffix[0])
        for j in range(1, n):
            if starts.size == 0:
                break
            starts = starts[tokens[starts + j] == suffix[j]]
        if starts.size:
            begin = int(starts[-1]) + n
            return tokens[begin : begin + k].tolist()
    return []


class NgramProposer:
    """Per-request token buffers and the drafts proposed from them."""

    def __init__(self, num_speculative_tokens: int, n_min: int, n_max: int) -> None:
        self.k = num_speculative_tokens
        self.n_min, self.n_max = n_min, n_max
        self._buffers: dict[str, tuple[np.ndarray, int]] = {}

    def propose(
        self, req_id: str, token_ids: Sequence[int], limit: int, num_prompt_tokens: int = 0
    ) -> list[int]:
        """At most ``min(k, limit)`` drafts for the request whose known tokens are
        ``token_ids`` (prompt and outputs; it grows by appends between calls).
        ``num_prompt_tokens`` is unused: the lookup reads prompt and outputs alike."""
        k = min(self.k, limit)
        if k < 1:
            return []
        buffer, length = self._buffers.get(req_id, (None, 0))
        total = len(token_ids)
        if buffer is None or total < length:
            buffer, length = np.empty(max(2 * total, 64), dtype=np.int64), 0
        if total > len(buffer):
            grown = np.empty(2 * total, dtype=np.int64)
            grown[:length] = buffer[:length]
            buffer = grown
        if total > length:
            buffer[length:total] = token_ids[length:total]
        self._buffers[req_id] = (buffer, total)
        return find_draft(buffer[:total], self.n_min, self.n_max, k)

    def forget(self, req_id: str) -> None:
        self._buffers.pop(req_id, None)


def verify_greedy(argmax: Sequence[int], drafts: Sequence[int]) -> list[int]:
    """The tokens a request gets from one step over its last token and ``drafts``:
    ``argmax[i]`` is the greedy choice after the last token and the first i drafts.
    Each draft that equals the choice before it is kept; then the first choice that
    differs (or the one after all drafts) is the next token."""
    accepted = 0
    while accepted < len(drafts) and argmax[accepted] == drafts[accepted]:
        accepted += 1
    return [*drafts[:accepted], argmax[accepted]]
