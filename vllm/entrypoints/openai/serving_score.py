"""vLLM's scoring routes on a pooling model (``--runner pooling``): ``/score``
(``/v1/score``) and the Jina / Cohere rerank API (``/rerank``, ``/v1/rerank``,
``/v2/rerank``).

How a pair is scored follows the model, as in vLLM (``score_utils.ScoringModel``): an
embedding model is a bi-encoder (every text embedded on its own, one engine request
each, a pair's score the cosine similarity of its two embeddings); a classifier with one
label (a reranker) is a cross-encoder (each pair one prompt, one classify request, its
score the classifier's output: the sigmoid of the logit, or the logit with
``use_activation`` false). ``/score`` pairs its first texts with its second ones 1:1,
1:N (one first text against each second) or N:N (in order); ``/rerank`` scores its
query against each document and returns them best first. Any other model is a 400.
"""

from __future__ import annotations

import functools
from typing import Any, Literal

from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictStr, model_validator

from vllm.entrypoints.openai.protocol import MAX_REQUEST_ID, now_s
from vllm.entrypoints.openai.serving_engine import OpenAIServing, StreamBatch
from vllm.entrypoints.score_utils import (
    ScoringModel,
    check_pairing,
    pair_scores,
    pair_token_ids,
    pairs,
    template_kwargs,
)
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import SamplingParams

SCORE_PATHS = ("/score", "/v1/score")
RERANK_PATHS = ("/rerank", "/v1/rerank", "/v2/rerank")
Texts = StrictStr | list[StrictStr]
# /score's names for its two sides, in vLLM's order of preference.
SCORE_PAIRS = (("text_1", "text_2"), ("data_1", "data_2"), ("queries", "documents"),
               ("queries", "items"))  # fmt: skip


def _as_list(texts: Texts | None) -> list[str]:
    return [texts] if isinstance(texts, str) else list(texts or [])


class _ScoringFields(BaseModel):
    """What /score and /rerank share (vLLM's scoring fields, text inputs only). The
    cross-encoder's fields (its template's variables, its activation) are a 400 naming
    them on a bi-encoder; ``padding`` and an unknown field are a 400 on any model."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str | None = None
    user: str | None = None
    priority: int = 0
    request_id: StrictStr | None = Field(default=None, min_length=1, max_length=MAX_REQUEST_ID)
    # Each text's token budget (before the whole prompt's): the first tokens kept.
    max_tokens_per_query: int = Field(default=0, ge=0)
    max_tokens_per_doc: int = Field(default=0, ge=0)
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None
    # A cross-encoder's: its score template and activation.
    instruction: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    use_activation: bool | None = None
    padding: Literal["max_length", "do_not_pad"] | None = None

    @model_validator(mode="after")
    def _no_padding(self) -> _ScoringFields:
        if self.padding is not None:
            raise VLLMValidationError(
                "padding is not supported: every prompt runs at its own length", "padding"
            )
        return self

    def check_bi_encoder(self) -> None:
        """A 400 naming the first cross-encoder field set: a bi-encoder (the cosine
        similarity of two embeddings) has no template or activation."""
        for name in ("instruction", "chat_template_kwargs", "use_activation"):
            if getattr(self, name) is not None:
                raise VLLMValidationError(
                    f"{name} is not supported: the served embedding model scores as a "
                    "bi-encoder (cosine similarity of two embeddings), which has no "
                    "template or activation",
                    name,
                )

    def params(self) -> SamplingParams:
        """One prompt's engine parameters; a cross-encoder's ``use_activation`` rides in
        ``extra_args`` (as ``PoolingParams`` puts it)."""
        extra = None if self.use_activation is None else {"use_activation": self.use_activation}
        return SamplingParams(
            max_tokens=1, temperature=0.0, detokenize=False,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            truncation_side=self.truncation_side or "left", extra_args=extra,
        )  # fmt: skip


class ScoreRequest(_ScoringFields):
    """vLLM's ``/score`` body: one pair of sides, each a text or a list of texts."""

    text_1: Texts | None = None
    text_2: Texts | None = None
    data_1: Texts | None = None
    data_2: Texts | None = None
    queries: Texts | None = None
    documents: Texts | None = None
    items: Texts | None = None

    def sides(self) -> tuple[list[str], list[str], tuple[str, str]]:
        """The first texts, the second ones and their fields' names."""
        for first, second in SCORE_PAIRS:
            a, b = getattr(self, first), getattr(self, second)
            if a is not None and b is not None:
                return _as_list(a), _as_list(b), (first, second)
        raise VLLMValidationError(
            "a score request needs text_1 and text_2 (or data_1 and data_2, queries and "
            "documents, queries and items)",
            "text_1",
        )


class RerankRequest(_ScoringFields):
    """The Jina / Cohere rerank body, as vLLM serves it."""

    query: StrictStr
    documents: Texts
    top_n: int = Field(default=0, ge=0)  # 0: every document
    return_documents: bool = True  # Cohere's: false leaves each result's text out


class OpenAIServingScore(OpenAIServing):
    async def create_score(
        self, request: ScoreRequest, received: float | None = None, receive=None
    ) -> Response:
        first, second, names = request.sides()
        check_pairing(first, second, names)
        scored = await self._scores(request, first, second, received, receive, "score")
        if isinstance(scored, Response):
            return scored
        request_id, scores, tokens, streams = scored
        body = {
            "id": request_id,
            "object": "list",
            "created": now_s(),
            "model": self.response_model(request.model),
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
        return JSONResponse(body, headers=self.timing(received, StreamBatch(streams)))

    async def create_rerank(
        self, request: RerankRequest, received: float | None = None, receive=None
    ) -> Response:
        documents = _as_list(request.documents)
        check_pairing([request.query], documents, ("query", "documents"))
        scored = await self._scores(
            request, [request.query], documents, received, receive, "rerank"
        )
        if isinstance(scored, Response):
            return scored
        request_id, scores, tokens, streams = scored
        order = sorted(range(len(documents)), key=lambda i: scores[i], reverse=True)
        results = [
            {"index": i, "document": {"text": documents[i]} if request.return_documents else None,
             "relevance_score": scores[i]}
            for i in order[: request.top_n or len(order)]
        ]  # fmt: skip
        body = {
            "id": request_id,
            "model": self.response_model(request.model),
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            "results": results,
        }
        return JSONResponse(body, headers=self.timing(received, StreamBatch(streams)))

    @functools.cached_property
    def scoring(self) -> ScoringModel:
        """How the served model scores (read from its config once)."""
        return ScoringModel.of(self.engine.config.model_config)

    async def _scores(self, request, first, second, received, receive, prefix: str):
        """Score each pair, as a bi-encoder or a cross-encoder by the served model: (id,
        scores, prompt tokens, streams), or the 499 of a client that left (every engine
        request of the batch aborted)."""
        lora = self.check_model(request)
        cross = self.scoring.require() == "cross-encoder"
        prompts = await self._prompts(request, first, second, cross, prefix)
        request_id, engine_id = self.request_ids(request, prefix)
        streams = await self.add_requests(
            prompts, request.params, engine_id, request.priority,
            lora_request=lora, pooling="classify" if cross else "embed",
        )  # fmt: skip
        finals = await self.collect_all(streams, receive)
        if finals is None:
            return Response(status_code=499)  # the client left; every request aborted
        if cross:
            scores = [f.pooled[0] for f in finals]
        else:
            vectors = [f.pooled for f in finals]
            scores = pair_scores(vectors[: len(first)], vectors[len(first) :])
        tokens = sum(len(f.prompt_token_ids) for f in finals)
        return request_id, scores, tokens, streams

    async def _prompts(self, request, first, second, cross: bool, prefix: str) -> list:
        """The engine's prompts: a cross-encoder's one per pair (token ids), a
        bi-encoder's ``first`` then ``second``; each text cut to its token budget."""
        if not cross:
            request.check_bi_encoder()
        n = len(second) if cross else len(first) + len(second)
        if n > self.args.max_n_sequences:
            raise VLLMValidationError(
                f"at most {self.args.max_n_sequences} {'pairs' if cross else 'texts'} per "
                f"request (--max-n-sequences), got {n}",
                "documents" if prefix == "rerank" else "text_2",
            )
        if cross:  # before any tokenization: a bad field costs nothing
            kwargs = template_kwargs(
                request.instruction, request.chat_template_kwargs, self.scoring.template
            )
        first = await self._cut(first, request.max_tokens_per_query, "max_tokens_per_query")
        second = await self._cut(second, request.max_tokens_per_doc, "max_tokens_per_doc")
        if not cross:
            return first + second
        return await self.in_thread(self._pair_prompts, first, second, kwargs)

    def _pair_prompts(
        self, first: list[str], second: list[str], kwargs: dict[str, Any]
    ) -> list[list[int]]:
        """Each pair's cross-encoder prompt (blocking: the tokenizer thread)."""
        self.require_tokenizer("scoring with a cross-encoder", "model")
        model, tokenizer = self.scoring, self.engine.tokenizer
        return [
            pair_token_ids(tokenizer, a, b, model.template, kwargs, model.sep_token)
            for a, b in pairs(first, second)
        ]

    async def _cut(self, texts: list[str], limit: int, name: str) -> list[str]:
        """Each text at most ``limit`` tokens (its first ones; 0: no limit), as vLLM's
        ``max_tokens_per_query`` / ``max_tokens_per_doc`` cut them."""
        if limit == 0:
            return texts
        max_len = self.engine.processor.max_model_len
        if limit >= max_len:
            raise VLLMValidationError(
                f"{name} ({limit}) must be less than max_model_len ({max_len})", name
            )
        out = []
        for text in texts:
            ids = await self.in_thread(self.engine.tokenize, text, False)
            out.append(text if len(ids) <= limit else self.engine.decode(ids[:limit]))
        return out
