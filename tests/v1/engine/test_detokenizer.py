"""Incremental detokenization and stop strings with the real SmolLM2 tokenizer."""

from __future__ import annotations

import random

import pytest

from vllm.sampling_params import SamplingParams
from vllm.v1.engine.detokenizer import IncrementalDetokenizer, fast_decoder

TRICKY = [
    "Héllo wörld! 你好，世界 🎉👩‍👩‍👧 naïve café — “quotes” 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "def f(x):\n    return x ** 2  # ∑ over ∀ x ∈ ℝ\n\n\tdone",
    "🇫🇷🇯🇵 e\u0301 a\u0308 ﷺ ｆｕｌｌｗｉｄｔｈ 😀😃😄 ñ",
]


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def stream(tokenizer, token_ids, params, chunks=1, finish=True) -> tuple[list[str], object]:
    """Feed ``token_ids`` ``chunks`` at a time; returns the DELTA texts and the detokenizer."""
    detok = IncrementalDetokenizer(tokenizer, params)
    deltas = []
    for i in range(0, len(token_ids), chunks):
        stopped = detok.update(token_ids[i : i + chunks]) is not None
        last = stopped or i + chunks >= len(token_ids)
        if last and finish:
            detok.flush()
        deltas.append(detok.get_next_output_text(last and finish, delta=True))
        if stopped:
            break
    return deltas, detok


@pytest.mark.parametrize("text", TRICKY)
@pytest.mark.parametrize("chunks", [1, 3])
def test_deltas_concatenate_to_the_full_decode(tokenizer, text, chunks):
    token_ids = ids_of(tokenizer, text)
    deltas, detok = stream(tokenizer, token_ids, SamplingParams(), chunks)
    assert "".join(deltas) == tokenizer.decode(token_ids) == text
    assert detok.output_text == text
    # A split multi-byte character is held back, never streamed as U+FFFD.
    assert all("\ufffd" not in d for d in deltas)


def test_random_token_ids_match_decode_after_flush(tokenizer):
    # Arbitrary ids produce broken UTF-8 in the middle and at the end: the held-back
    # bytes come out at the end, so the text still equals a full decode.
    rng = random.Random(0)
    for _ in range(20):
        token_ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 40))]
        deltas, detok = stream(tokenizer, token_ids, SamplingParams(), rng.choice([1, 2, 5]))
        assert "".join(deltas) == tokenizer.decode(token_ids, skip_special_tokens=True)


def test_special_tokens_skipped_or_kept(tokenizer):
    token_ids = ids_of(tokenizer, "Paris is nice.") + [tokenizer.eos_token_id]
    _, skipped = stream(tokenizer, token_ids, SamplingParams())
    assert skipped.output_text == "Paris is nice."
    _, kept = stream(tokenizer, token_ids, SamplingParams(skip_special_tokens=False))
    assert kept.output_text == "Paris is nice.<|im_end|>"


def test_stop_string_across_token_boundaries(tokenizer):
    # " this is" spans three tokens: ",", " this", " is".
    token_ids = ids_of(tokenizer, "Hello world, this is a test.")
    deltas, detok = stream(tokenizer, token_ids, SamplingParams(stop=[", this is"]))
    assert detok.stop_reason == ", this is"
    assert detok.output_text == "Hello world"
    assert "".join(deltas) == "Hello world"  # nothing of the stop string was streamed
    # Tokens after the stop are never looked at.
    assert len(detok.token_ids) == 5


def test_stop_string_kept_with_include_stop_str_in_output(tokenizer):
    token_ids = ids_of(tokenizer, "1, 2, 3, 4, 5, 6, 7, 8")
    params = SamplingParams(stop=[" 5", ", 4"], include_stop_str_in_output=True)
    deltas, detok = stream(tokenizer, token_ids, params)
    assert detok.stop_reason == ", 4"  # the earliest stop string wins, not the first listed
    assert "".join(deltas) == detok.output_text == "1, 2, 3, 4"


def test_stop_string_inside_a_single_token(tokenizer):
    token_ids = ids_of(tokenizer, "The answer is 42. Done!")
    _, detok = stream(tokenizer, token_ids, SamplingParams(stop=["Don"]))
    assert detok.output_text == "The answer is 42. "


def test_stream_holds_back_a_possible_stop_prefix(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["world peace"]))
    detok.update(ids_of(tokenizer, "Hello world"))
    # "world" could still become "world peace": only what cannot is handed out.
    assert detok.get_next_output_text(finished=False, delta=True) == "Hello "
    assert detok.get_next_output_text(finished=False, delta=False) == "Hello "
    detok.update(ids_of(tokenizer, " war"))
    assert detok.get_next_output_text(finished=False, delta=True) == "world war"
    assert detok.get_next_output_text(finished=True, delta=True) == ""


def test_min_tokens_delays_stop_strings(tokenizer):
    token_ids = ids_of(tokenizer, "1, 2, 3, 4, 5")  # "1" "," " " "2" ...
    params = SamplingParams(stop=[","], min_tokens=3)
    _, detok = stream(tokenizer, token_ids, params)
    assert detok.output_text == "1, 2"  # the first "," came before min_tokens outputs


def test_engine_stop_token_text_is_left_out(tokenizer):
    token_ids = ids_of(tokenizer, "Hello world.")
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop_token_ids=[token_ids[-1]]))
    detok.update(token_ids, stop_terminated=True)
    assert detok.output_text == "Hello world"
    kept = IncrementalDetokenizer(
        tokenizer, SamplingParams(stop_token_ids=[token_ids[-1]], include_stop_str_in_output=True)
    )
    kept.update(token_ids, stop_terminated=True)
    assert kept.output_text == "Hello world."


def test_streamed_text_is_never_retracted_with_random_stops(tokenizer):
    rng = random.Random(1)
    text = " ".join(TRICKY)
    token_ids = ids_of(tokenizer, text)
    for _ in range(30):
        start = rng.randrange(len(text) - 8)
        stops = [text[start : start + rng.randrange(1, 8)], "never appears"]
        params = SamplingParams(stop=stops)
        deltas, detok = stream(tokenizer, token_ids, params, rng.choice([1, 2, 4]))
        assert "".join(deltas) == detok.output_text
        assert text.startswith(detok.output_text)
        assert not any(s in detok.output_text for s in stops)
        assert detok.stop_reason is not None
        assert text[len(detok.output_text) :].startswith(detok.stop_reason)


def test_fast_decoder_matches_the_tokenizers_decode(tokenizer):
    ids = ids_of(tokenizer, "<|im_start|>user\n" + TRICKY[0] + "<|im_end|>")
    decode = fast_decoder(tokenizer)
    for skip in (True, False):
        for cut in (ids, ids[1:4], ids[-3:]):
            assert decode(cut, skip) == tokenizer.decode(cut, skip_special_tokens=skip)


def test_fast_decoder_keeps_the_wrapper_when_it_cleans_up_spaces():
    class CleaningTokenizer:
        clean_up_tokenization_spaces = True
        backend_tokenizer = object()  # would decode without the clean-up: must not be used

        def decode(self, ids, skip_special_tokens=False):
            return f"cleaned {ids} {skip_special_tokens}"

    assert fast_decoder(CleaningTokenizer())([1, 2], True) == "cleaned [1, 2] True"


def counting(decode, calls: list[int]):
    """``decode``, recording each call's number of token ids in ``calls``."""

    def counted(ids, skip):
        calls.append(len(ids))
        return decode(ids, skip)

    return counted


@pytest.mark.parametrize("skip", [True, False])
def test_final_only_without_stop_strings_decodes_once_to_the_same_text(tokenizer, skip):
    # LLM.generate and non-streaming requests read the text only at the end: it is decoded
    # once then, and equals the token-by-token decode's (EOS's text left out).
    from vllm.sampling_params import RequestOutputKind

    rng = random.Random(1)
    eos = tokenizer.eos_token_id
    for _ in range(20):
        token_ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 40))] + [eos]
        kw = {"skip_special_tokens": skip}
        final = IncrementalDetokenizer(
            tokenizer, SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY, **kw)
        )
        eager = IncrementalDetokenizer(tokenizer, SamplingParams(**kw))
        eager.deferred = False  # every token decoded as it comes, as with stop strings
        calls: list[int] = []
        final._decode_fn = counting(final._decode_fn, calls)
        for i in range(0, len(token_ids), 3):
            chunk = token_ids[i : i + 3]
            end = i + 3 >= len(token_ids)
            for d in (final, eager):
                assert d.update(chunk, stop_terminated=end) is None
        assert calls == []
        for d in (final, eager):
            d.flush()
        assert calls == [len(token_ids) - 1]  # one decode, without the EOS
        assert final.output_text == eager.output_text
        assert final.get_next_output_text(True, delta=False) == eager.output_text
        assert final.num_output_tokens == eager.num_output_tokens == len(token_ids)


@pytest.mark.parametrize("text", TRICKY)
def test_a_stream_read_every_few_tokens_decodes_once_a_read(tokenizer, text):
    # A stream_interval's reads: the tokens since the last read are decoded together (two
    # decodes a read, not two a token), the deltas never carry a split character, and they
    # add up to the full text.
    token_ids = ids_of(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, SamplingParams())
    assert detok.deferred
    calls: list[int] = []
    detok._decode_fn = counting(detok._decode_fn, calls)
    deltas = []
    for i, token in enumerate(token_ids):
        detok.update([token])
        if i % 4 == 3:
            deltas.append(detok.get_next_output_text(False, delta=True))
    detok.flush()
    deltas.append(detok.get_next_output_text(True, delta=True))
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert len(calls) <= 2 * (len(token_ids) // 4 + 1)


def test_stop_strings_decode_token_by_token(tokenizer):
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY, stop=[" nice"])
    detok = IncrementalDetokenizer(tokenizer, params)
    assert not detok.deferred
    assert detok.update(ids_of(tokenizer, "Paris is nice.")) == " nice"
    assert detok.output_text == "Paris is"
