"""Incremental detokenization and stop strings (front end, per sequence)."""

from __future__ import annotations

from collections.abc import Callable

from vllm.sampling_params import SamplingParams

# What a tokenizer decodes an incomplete UTF-8 sequence to.
_REPLACEMENT_CHAR = "\ufffd"


def fast_decoder(tokenizer, spaces: bool = True) -> Callable[[list[int], bool], str]:
    """``decode(token_ids, skip_special_tokens)`` with the same result as
    ``tokenizer.decode``, calling the Rust backend directly when that is equivalent.
    ``spaces``: a slow tokenizer's ``spaces_between_special_tokens`` (a fast one has no
    such spaces to put).

    transformers' ``decode`` wrapper costs ~30 us a call against ~1 us for the backend;
    incremental detokenization calls it twice per read of a sequence's text (per token
    with stop strings) on the server's event loop. The wrapper only adds
    ``clean_up_tokenization_spaces``, so the backend is used when that is off.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)
    if backend is None and not spaces:
        return lambda ids, skip: tokenizer.decode(
            ids, skip_special_tokens=skip, spaces_between_special_tokens=False
        )
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)


class IncrementalDetokenizer:
    """Turns one sequence's new tokens into new text and finds stop strings.

    Decoding uses a prefix offset and a read offset, as vLLM does: each decode takes
    the few tokens from ``prefix_offset`` twice, without and with the new tokens, and
    the difference is the new text. Text ending in an incomplete UTF-8 sequence (a
    character split across byte-level tokens) is held back until it completes, so
    for text without stop strings ``output_text == tokenizer.decode(token_ids)`` once
    ``flush()`` ran at the end.

    Stop strings: the text is cut at the earliest stop string (kept with
    ``include_stop_str_in_output``) and ``stop_reason`` names it. A text suffix that
    could still grow into a stop string is held back from ``get_next_output_text``, so
    streamed text never has to be retracted.

    Without stop strings (``deferred``) nothing needs the text before it is read: the
    tokens are decoded when ``get_next_output_text`` or ``flush`` asks, all those since
    the last read at once. The same text (the incremental decode adds up to the full
    one), with fewer decodes: a ``FINAL_ONLY`` sequence (``LLM.generate``, a
    non-streaming request) is decoded once, at the end; a stream with
    ``stream_interval`` N once an output, not twice a token.
    """

    def __init__(self, tokenizer, params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self._decode_fn = fast_decoder(tokenizer, params.spaces_between_special_tokens)
        self.skip_special_tokens = params.skip_special_tokens
        self.stop: list[str] = list(params.stop or [])
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        # False: token ids only, no text (vLLM's); always so without a tokenizer.
        self.detokenize = params.detokenize and tokenizer is not None
        self.deferred = not self.stop  # no stop string to look for: decode when read
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        self.stop_buffer_length = (
            self._max_stop_len - 1 if self.stop and not self.include_stop_str_in_output else 0
        )
        self.token_ids: list[int] = []  # tokens whose text is (or will be) in output_text
        self.num_output_tokens = 0  # every token seen, the skipped stop token included
        self.num_unused_tokens = 0  # the last update's tokens after its stop string
        self._text = ""  # ``output_text``, up to the last token decoded
        self.stop_reason: str | None = None
        self._prefix_offset = 0
        self._read_offset = 0
        self._last_output_offset = 0  # DELTA: characters already handed out

    @property
    def output_text(self) -> str:
        """The text so far: the tokens since the last read decoded first (``deferred``)."""
        if self.deferred and self._read_offset < len(self.token_ids):
            self._text += self._decode_next()
        return self._text

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> str | None:
        """Add tokens; returns the stop string if one completed (then the text is cut).

        ``stop_terminated``: the engine stopped on the last token (EOS or a stop token
        id); like vLLM, that token's text is left out unless include_stop_str_in_output.
        """
        self.num_unused_tokens = 0
        if self.stopped:
            return self.stop_reason
        if not self.detokenize:
            self.num_output_tokens += len(new_token_ids)
            return None
        last = len(new_token_ids)
        if stop_terminated and new_token_ids and not self.include_stop_str_in_output:
            last -= 1
            self.num_output_tokens += 1  # the stop token counts, its text does not
        if self.deferred:
            self.token_ids += new_token_ids[:last]
            self.num_output_tokens += last
            return None
        for i in range(last):
            # Token by token (several arrive at once with speculative decoding): a stop
            # string ends the text at the token that completed it, as when they come
            # one at a time; the tokens after it are ``num_unused_tokens``.
            old_len = len(self._text)
            self.token_ids.append(new_token_ids[i])
            self.num_output_tokens += 1
            self._text += self._decode_next()
            stop = self._check_stop(old_len)
            if stop is not None:
                self.num_unused_tokens = len(new_token_ids) - i - 1
                return stop
        return None

    def flush(self) -> str | None:
        """At the end of the sequence: emit text held back for an incomplete character."""
        if self.stopped or self._read_offset == len(self.token_ids) or not self.detokenize:
            return self.stop_reason
        prefix_text = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self.token_ids[self._prefix_offset :])
        old_len = len(self._text)
        self._text += full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset = len(self.token_ids)
        return self._check_stop(old_len)

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The whole text so far, or (``delta``) what was not handed out yet."""
        text = self.output_text  # every token since the last read decoded (deferred)
        end = len(text) - (0 if finished else self._num_held_back())
        if not delta:
            return text[:end]
        if end <= self._last_output_offset:
            return ""
        start, self._last_output_offset = self._last_output_offset, end
        return text[start:end]

    def _num_held_back(self) -> int:
        """Length of the longest text suffix that may still grow into a stop string."""
        text = self._text
        for k in range(min(self.stop_buffer_length, len(text)), 0, -1):
            suffix = text[-k:]
            if any(stop.startswith(suffix) for stop in self.stop):
                return k
        return 0

    def _decode(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        return self._decode_fn(token_ids, self.skip_special_tokens)

    def _decode_next(self) -> str:
        """New text for the tokens after ``read_offset`` ("" while a character is split)."""
        prefix_text = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self.token_ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT_CHAR):
            return ""
        # Decoding from a few tokens back (not from read_offset) keeps the word-boundary
        # spaces that some decoders strip from the first token of a slice.
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        return full_text[len(prefix_text) :]

    def _check_stop(self, old_len: int) -> str | None:
        """Cut the text at the earliest stop string that ends in the new text."""
        if not self.stop or self.num_output_tokens <= self.min_tokens:
            return None
        if len(self._text) == old_len:
            return None
        # A stop string ending in the new text starts at most len(stop) - 1 chars earlier.
        search_from = max(old_len - self._max_stop_len + 1, 0)
        best: tuple[int, str] | None = None
        for stop in self.stop:
            i = self._text.find(stop, search_from)
            if i != -1 and (best is None or i < best[0]):
                best = (i, stop)
        if best is None:
            return None
        i, stop = best
        end = i + len(stop) if self.include_stop_str_in_output else i
        self._text = self._text[:end]
        self.stop_reason = stop
        return stop
