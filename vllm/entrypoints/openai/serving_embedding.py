"""POST /v1/embeddings (OpenAI's API) on a model served with ``--runner pooling``.

Every input (a string, token ids, or a list of either) is one engine request; the
response lists their embeddings in input order, as floats or as base64 of little-endian
float32 (``encoding_format``), with the prompt tokens as usage. A request naming a LoRA
adapter embeds with it. A bad input fails the whole request before any is queued; a
client that disconnects aborts them all.
"""

from __future__ import annotations

import base64
import functools
import struct
from collections.abc import Callable
from typing import Any

from fastapi.responses import JSONResponse, Response

from vllm.entrypoints.openai.protocol import EmbeddingRequest, now_s, random_id
from vllm.entrypoints.openai.serving_engine import OpenAIServing, StreamBatch
from vllm.outputs import RequestOutput
from vllm.pooling_params import PoolingParams


def encode(embedding: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return embedding
    return base64.b64encode(struct.pack(f"<{len(embedding)}f", *embedding)).decode()


class OpenAIServingPooling(OpenAIServing):
    """What the pooling routes share (/v1/embeddings, /classify, /pooling): every input
    run as one engine request of the model's task, and the list they answer."""

    async def pool_inputs(
        self,
        request: Any,
        task: str,
        prefix: str,
        params_of: Callable[[], PoolingParams],
        received: float | None,
        receive,
    ) -> tuple[str, list[RequestOutput], dict[str, str]] | Response:
        """Run every input of ``request`` for ``task`` (``params_of()``: their params,
        made once the model is checked): (request id, final outputs, timing headers), or
        the 499 response when the client left."""
        lora = self.check_model(request)
        params = params_of()
        prompts = self.checked_inputs(request.prompts())
        request_id = random_id(prefix)
        streams = await self.add_requests(
            prompts,
            params.to_sampling_params,
            request_id,
            request.priority,
            add_special_tokens=request.add_special_tokens,
            lora_request=lora,
            pooling=task,
        )
        finals = await self.collect_all(streams, receive)
        if finals is None:
            return Response(status_code=499)  # the client left; every request aborted
        return request_id, finals, self.timing(received, StreamBatch(streams))

    def list_response(
        self,
        request_id: str,
        model: str | None,
        data: list,
        finals: list[RequestOutput],
        headers: dict[str, str],
    ) -> JSONResponse:
        """The routes' answer: ``data`` in input order, the prompt tokens as usage."""
        tokens = sum(len(f.prompt_token_ids) for f in finals)
        body = {
            "id": request_id,
            "object": "list",
            "created": now_s(),
            "model": self.response_model(model),
            "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
        return JSONResponse(body, headers=headers)


class OpenAIServingEmbedding(OpenAIServingPooling):
    async def create_embedding(
        self, request: EmbeddingRequest, received: float | None = None, receive=None
    ) -> Response:
        params_of = functools.partial(PoolingParams, dimensions=request.dimensions)
        result = await self.pool_inputs(request, "embed", "embd", params_of, received, receive)
        if isinstance(result, Response):
            return result
        request_id, finals, headers = result
        data = [
            {"object": "embedding", "index": i,
             "embedding": encode(f.pooled, request.encoding_format)}
            for i, f in enumerate(finals)
        ]  # fmt: skip
        return self.list_response(request_id, request.model, data, finals, headers)
