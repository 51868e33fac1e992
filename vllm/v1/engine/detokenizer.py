"""Incremental detokenization and stop strings."""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from vllm.sampling_params import SamplingParams


class IncrementalDetokenizer:
    """Turns a request's new tokens into new text; stops at stop strings.

    Built on ``tokenizers``' ``DecodeStream``, which holds back incomplete UTF-8
    sequences, so the concatenated deltas equal a full decode of the tokens.
    """

    def __init__(self, tokenizer, params: SamplingParams) -> None:
        self._backend = tokenizer._tokenizer  # the fast (Rust) tokenizer
        self._stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        self.stop = params.stop or []
        self.include_stop = params.include_stop_str_in_output
        self._max_stop = max((len(s) for s in self.stop), default=0)
        self.output_text = ""
        self.stop_reason: str | None = None

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append tokens; returns the stop string if one completed (text truncated)."""
        for token_id in new_token_ids:
            piece = self._stream.step(self._backend, token_id)
            if not piece:
                continue
            start = max(len(self.output_text) - self._max_stop + 1, 0)
            self.output_text += piece
            if self.stop and self._check_stop(start):
                return self.stop_reason
        return None

    def _check_stop(self, search_from: int) -> bool:
        best = None
        for stop in self.stop:
            i = self.output_text.find(stop, search_from)
            if i != -1 and (best is None or i < best[0]):
                best = (i, stop)
        if best is None:
            return False
        i, stop = best
        self.output_text = self.output_text[: i + len(stop) if self.include_stop else i]
        self.stop_reason = stop
        return True
