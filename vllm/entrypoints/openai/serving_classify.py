"""POST /classify and POST /pooling (vLLM's) on a model served by the pooling runner.

/classify needs a classifier (a ``*ForSequenceClassification`` model, or ``--convert
classify``): each input (a string, token ids, or a list of either) is one engine request,
answered in input order with its class probabilities, their count, and the label of the
likeliest class (the config's ``id2label``). /pooling serves the model's own task: an
embedding model's embeddings, a classifier's probabilities, each as ``data`` (floats, or
base64 of little-endian float32). Both report the prompt tokens as usage. A bad input
fails the whole request before any is queued; a client that disconnects aborts them all.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from vllm.entrypoints.openai import openapi
from vllm.entrypoints.openai.protocol import (
    ClassificationRequest,
    PoolingRequest,
)
from vllm.entrypoints.openai.serving_embedding import OpenAIServingPooling, encode
from vllm.exceptions import VLLMValidationError
from vllm.pooling_params import PoolingParams

logger = logging.getLogger(__name__)
CLASSIFY_PATH, POOLING_PATH = "/classify", "/pooling"  # vLLM's routes (no /v1 prefix)
POOLING_PATHS = (CLASSIFY_PATH, POOLING_PATH)  # outside /v1: api_server guards them
_ERRORS = {k: v for k, v in openapi.EMBEDDING_RESPONSES.items() if k != 200}
CLASSIFY_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "Each input's class probabilities, their count and the likeliest "
          "class's label, in input order (a classifier under --runner pooling)."},
    **_ERRORS,
}  # fmt: skip
POOLING_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "Each input pooled by the model's task, in input order: an "
          "embedding model's embedding, a classifier's probabilities."},
    **_ERRORS,
}  # fmt: skip


class OpenAIServingClassification(OpenAIServingPooling):
    @functools.cached_property
    def id2label(self) -> dict[int, str]:
        """The classifier's label names by class index (its HF config's ``id2label``)."""
        from vllm.model_executor.model_loader import hf_config_of

        config = hf_config_of(self.engine.config.model_config)
        return {int(k): v for k, v in (getattr(config, "id2label", None) or {}).items()}

    async def create_classify(
        self, request: ClassificationRequest, received: float | None = None, receive=None
    ) -> Response:
        params_of = functools.partial(PoolingParams, use_activation=request.use_activation)
        result = await self.pool_inputs(
            request, "classify", "classify", params_of, received, receive
        )
        if isinstance(result, Response):
            return result
        request_id, finals, headers = result
        data = []
        for i, f in enumerate(finals):
            probs = f.pooled
            best = max(range(len(probs)), key=probs.__getitem__)
            label = self.id2label.get(best)
            data.append({"index": i, "label": label, "probs": probs, "num_classes": len(probs)})
        return self.list_response(request_id, request.model, data, finals, headers)

    async def create_pooling(
        self, request: PoolingRequest, received: float | None = None, receive=None
    ) -> Response:
        params = PoolingParams(use_activation=request.use_activation, dimensions=request.dimensions)
        task = self.engine.processor.pooling_task
        if task is None:
            raise VLLMValidationError(
                "/pooling needs a pooling model (--runner pooling): this one generates", "model"
            )
        if request.task not in (None, task):
            raise VLLMValidationError(
                f"task {request.task!r} is not this model's: it serves {task!r}", "task"
            )
        result = await self.pool_inputs(request, task, "pool", lambda: params, received, receive)
        if isinstance(result, Response):
            return result
        request_id, finals, headers = result
        data = [
            {"index": i, "object": "pooling", "data": encode(f.pooled, request.encoding_format)}
            for i, f in enumerate(finals)
        ]
        return self.list_response(request_id, request.model, data, finals, headers)


def add_pooling_routes(
    app: FastAPI, serving: OpenAIServingClassification, received_key: str, log_requests: bool
) -> None:
    """Register POST /classify and POST /pooling on ``app`` (``received_key``: the ASGI
    scope key of the request's arrival time, for the timing headers)."""

    @app.post(CLASSIFY_PATH, responses=CLASSIFY_RESPONSES)
    async def classify(request: ClassificationRequest, raw: Request):
        if log_requests:
            logger.info("classify request: inputs=%d", len(request.prompts()))
        return await serving.create_classify(request, raw.scope.get(received_key), raw.receive)

    @app.post(POOLING_PATH, responses=POOLING_RESPONSES)
    async def pooling(request: PoolingRequest, raw: Request):
        if log_requests:
            logger.info("pooling request: inputs=%d", len(request.prompts()))
        return await serving.create_pooling(request, raw.scope.get(received_key), raw.receive)
