"""Beam search: vLLM's ``use_beam_search`` on chat and completions, over the engine.

As vLLM runs it, in the serving layer: each step sends every live beam (the prompt and
the beam's tokens) to the engine as a one-token request asking for ``2 * width`` top
logprobs, extends each beam by each of those tokens, and keeps the ``width`` best by
score, ``cumulative logprob / length ** length_penalty`` (the length counts the prompt,
and not a final EOS). A beam that ends with EOS (unless ``ignore_eos``) is set aside as
done. After ``max_tokens`` steps, the ``width`` best of the done and the live beams are
the choices, best first. The prefix cache makes each step compute only the new tokens.

Beam search is deterministic: a request that also asks to sample (temperature > 0,
top-p, top-k, min-p, a seed), for penalties, logit biases, stop strings, logprobs or a
grammar is refused (400) rather than served with those ignored.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class Beam:
    tokens: list[int] = field(default_factory=list)  # generated, EOS included if it ended
    logprob: float = 0.0  # cumulative
    ended: bool = False  # by EOS

    def text_tokens(self, include_stop_str_in_output: bool) -> list[int]:
        """The tokens its text shows: without the final EOS unless asked for."""
        drop = self.ended and not include_stop_str_in_output
        return self.tokens[:-1] if drop else self.tokens

    @property
    def finish_reason(self) -> str:
        return "stop" if self.ended else "length"


def score(beam: Beam, prompt_len: int, length_penalty: float) -> float:
    length = prompt_len + len(beam.tokens) - (1 if beam.ended else 0)
    return beam.logprob / (max(length, 1) ** length_penalty)


# Request fields that ask for what beam search does not do, with the value that asks for
# nothing: anything else is a 400 naming the field.
_NOT_WITH_BEAMS: dict[str, Any] = {
    "top_p": (None, 1.0),
    "top_k": (None, 0, -1),
    "min_p": (None, 0.0),
    "seed": (None,),
    "presence_penalty": (0.0,),
    "frequency_penalty": (0.0,),
    "repetition_penalty": (None, 1.0),
    "logit_bias": (None, {}),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "min_tokens": (0,),
    "stop": (None, [], ""),
    "stop_token_ids": (None, []),
    "prompt_logprobs": (None,),
    "structured_outputs": (None,),
    "logprobs": (None, False),
    "top_logprobs": (None,),
    "stream_interval": (None,),
    "truncate_prompt_tokens": (None,),
    "repetition_detection": (None,),
}


def check_request(request: Any, max_logprobs: int) -> None:
    """``VLLMValidationError`` naming the field a beam-search request may not set. A job
    (``job_id``) is refused too: Continuum would take each one-token step for a turn."""
    if request.job_id is not None or request.is_last_step is not None:
        raise VLLMValidationError("use_beam_search does not go with a job (job_id)", "job_id")
    if request.temperature not in (None, 0.0, 0):
        raise VLLMValidationError(
            "use_beam_search is deterministic: temperature must be 0 or unset", "temperature"
        )
    for name, harmless in _NOT_WITH_BEAMS.items():
        if getattr(request, name, None) not in harmless:
            raise VLLMValidationError(f"{name} does not go with use_beam_search", name)
    fmt = getattr(request, "response_format", None)
    if fmt not in (None, {"type": "text"}):
        raise VLLMValidationError(
            "response_format does not go with use_beam_search", "response_format"
        )
    if 2 * request.n > max_logprobs:
        raise VLLMValidationError(
            f"use_beam_search with n={request.n} needs {2 * request.n} logprobs a step, past "
            f"the server's --max-logprobs ({max_logprobs})",
            "n",
        )
    if not math.isfinite(request.length_penalty):
        raise VLLMValidationError("length_penalty must be a finite number", "length_penalty")


class BeamSet:
    """One prompt's search: its live beams and those ended, stepped by ``grow``. Pure
    bookkeeping, shared by the server (``beam_search``) and ``LLM.beam_search``."""

    def __init__(
        self, prompt_ids: list[int], width: int, eos_ids: Sequence[int], ignore_eos: bool,
        length_penalty: float,
    ) -> None:  # fmt: skip
        self.prompt_ids = prompt_ids
        self.width = width
        self.eos_ids = set(eos_ids)
        self.ignore_eos = ignore_eos
        self.length_penalty = length_penalty
        self.beams, self.ended = [Beam()], []

    def params(self) -> SamplingParams:
        """A step's request: one token, greedy, with the ``2 * width`` top logprobs."""
        return SamplingParams(
            max_tokens=1, temperature=0.0, logprobs=2 * self.width, ignore_eos=True,
            detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY,
        )  # fmt: skip

    def prompts(self) -> list[list[int]]:
        """A step's prompts: the prompt and each live beam."""
        return [self.prompt_ids + b.tokens for b in self.beams]

    def _score(self, beam: Beam) -> float:
        return score(beam, len(self.prompt_ids), self.length_penalty)

    def grow(self, tops: Sequence[Sequence[tuple[int, float]]]) -> bool:
        """Each live beam extended by each of its ``(token, logprob)`` top tokens (one list
        per beam, in order); the ``width`` best kept. Whether any beam is still live."""
        grown = []
        for beam, top in zip(self.beams, tops, strict=True):
            for token, logprob in top:
                child = Beam(beam.tokens + [token], beam.logprob + logprob)
                if token in self.eos_ids and not self.ignore_eos:
                    child.ended = True
                    self.ended.append(child)
                else:
                    grown.append(child)
        grown.sort(key=self._score, reverse=True)
        self.beams = grown[: self.width]
        return bool(self.beams)

    def best(self) -> list[Beam]:
        """The ``width`` best of the ended and the live beams, best first."""
        return sorted(self.ended + self.beams, key=self._score, reverse=True)[: self.width]


async def beam_search(
    serving,
    prompt_ids: list[int],
    width: int,
    max_tokens: int,
    eos_ids: Sequence[int],
    ignore_eos: bool,
    length_penalty: float,
    request_id: str,
    priority: int,
    receive=None,
    **kw: Any,
) -> list[Beam] | None:
    """The ``width`` best beams, best first; None if the client disconnected."""
    search = BeamSet(prompt_ids, width, eos_ids, ignore_eos, length_penalty)
    for step in range(max_tokens):
        streams = await serving.add_requests(
            search.prompts(), search.params, f"{request_id}-{step}", priority, **kw
        )
        finals = await serving.collect_all(streams, receive)
        if finals is None:
            return None
        if not search.grow([f.outputs[0].logprobs[0].top for f in finals]):
            break
    return search.best()


async def search_all(
    serving, prompts: list[list[int]], max_tokens: int | None, request_id: str, **kw: Any
) -> list[list[Beam]] | None:
    """``beam_search`` of several prompts side by side (a batched completion), each for
    ``max_tokens`` steps or until its context is full (None: until then)."""
    limit = serving.engine.processor.context_limit
    runs = [
        beam_search(
            serving,
            p,
            max_tokens=max(1, min(max_tokens or limit, limit - len(p))),
            request_id=request_id if len(prompts) == 1 else f"{request_id}-{i}",
            **kw,
        )  # fmt: skip
        for i, p in enumerate(prompts)
    ]
    tasks = [asyncio.ensure_future(run) for run in runs]
    try:
        results = await asyncio.gather(*tasks)
    finally:  # one failed (a prompt too long) or this request was cancelled: stop the rest
        for task in tasks:
            task.cancel()
    return None if any(r is None for r in results) else list(results)
