"""POST /v1/embeddings (OpenAI's API) on a model served with ``--runner pooling``.

Every input (a string, token ids, or a list of either) is one engine request; the
response lists their embeddings in input order, as floats or as base64 of little-endian
float32 (``encoding_format``), with the prompt tokens as usage. A request naming a LoRA
adapter embeds with it. A bad input fails the whole request before any is queued; a
client that disconnects aborts them all.
"""

from __future__ import annotations

import base64
import struct

from fastapi.responses import JSONResponse, Response

from vllm.entrypoints.openai.protocol import EmbeddingRequest, now_s, random_id
from vllm.entrypoints.openai.serving_engine import OpenAIServing, StreamBatch
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import SamplingParams


def encode(embedding: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return embedding
    return base64.b64encode(struct.pack(f"<{len(embedding)}f", *embedding)).decode()


class OpenAIServingEmbedding(OpenAIServing):
    async def create_embedding(
        self, request: EmbeddingRequest, received: float | None = None, receive=None
    ) -> Response:
        lora = self.check_model(request)
        if request.dimensions is not None:
            raise VLLMValidationError(
                "dimensions is not supported: the embeddings are the model's whole hidden "
                "state (no matryoshka truncation)",
                "dimensions",
            )
        prompts = self.checked_inputs(request.prompts())
        request_id = random_id("embd")
        streams = await self.add_requests(
            prompts,
            lambda: SamplingParams(max_tokens=1, temperature=0.0, detokenize=False),
            request_id,
            request.priority,
            add_special_tokens=request.add_special_tokens,
            lora_request=lora,
            pooling=True,
        )
        finals = await self.collect_all(streams, receive)
        if finals is None:
            return Response(status_code=499)  # the client left; every request aborted
        tokens = sum(len(f.prompt_token_ids) for f in finals)
        data = [
            {"object": "embedding", "index": i,
             "embedding": encode(f.pooled, request.encoding_format)}
            for i, f in enumerate(finals)
        ]  # fmt: skip
        body = {
            "id": request_id,
            "object": "list",
            "created": now_s(),
            "model": self.response_model(request.model),
            "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
        return JSONResponse(body, headers=self.timing(received, StreamBatch(streams)))
