"""Tokens in, tokens out (vLLM's scale-out routes, ``--enable-scale-out``):
``POST /inference/v1/generate`` runs a prompt given as token ids with vLLM's
``SamplingParams`` as sent and answers token ids (``output_mode: "text"``: the text too);
``POST /inference/v1/abort_requests`` stops requests by the ``request_id`` their responses
named. The ``/render`` routes (``generate_body``) answer the body a chat, completion,
Messages or Responses request would run as here.

A client that leaves aborts its request; a stream ends with ``[DONE]``, an error after
the first chunk comes in-band, as on the OpenAI routes.
"""

from __future__ import annotations

import uuid
from types import SimpleNamespace
from typing import Any

from fastapi.responses import JSONResponse, Response

from vllm.entrypoints.openai.protocol import now_s
from vllm.entrypoints.openai.protocol_generate import GenerateRequest
from vllm.entrypoints.openai.serving_engine import EngineStreamingResponse, OpenAIServing, Receive
from vllm.exceptions import VLLMValidationError
from vllm.outputs import CompletionOutput
from vllm.sampling_params import SamplingParams

RESPONSE_PREFIX = "generate-tokens"  # vLLM's: the response's request_id is <this>-<name>
NO_LOGPROB = -9999.0  # OpenAI's floor for -inf, as vLLM's shapes clamp it


def _clamp(logprob: float) -> float:
    return NO_LOGPROB if logprob != logprob else max(logprob, NO_LOGPROB)  # NaN too


class OpenAIServingTokens(OpenAIServing):
    def _check(self, request: GenerateRequest, params: SamplingParams) -> None:
        """The server's limits (as on the OpenAI routes), named as the body names them."""
        shim = SimpleNamespace(
            model=request.model, n=params.n, job_id=request.job_id, stop=params.stop
        )
        try:
            self.check_request(shim)  # type: ignore[arg-type]
        except VLLMValidationError as e:
            if e.param in ("n", "stop"):
                e.param = f"sampling_params.{e.param}"
            raise
        if request.output_mode == "text":
            self.require_tokenizer("output_mode 'text'", "output_mode")
        if request.stream and params.prompt_logprobs is not None:
            raise VLLMValidationError(
                "prompt_logprobs are not available when stream=true",
                "sampling_params.prompt_logprobs",
            )

    async def create_generate(
        self,
        request: GenerateRequest,
        received: float | None = None,
        receive: Receive | None = None,
    ) -> Response:
        """The response (JSON, or SSE if ``request.stream``)."""
        params = request.sampling()
        self._check(request, params)
        name = request.request_id
        response_id = f"{RESPONSE_PREFIX}-{name or uuid.uuid4().hex}"
        # A named request runs under its name and a suffix: two of one name never collide.
        engine_id = response_id if name is None else f"{response_id}-{uuid.uuid4().hex[:8]}"
        stream = await self.add_request(
            list(request.token_ids),
            params,
            engine_id,
            request.priority,
            response_id,
            cache_salt=request.cache_salt,
            lora_request=self.check_model(request),
        )
        model = self.response_model(request.model)
        if request.stream:
            return EngineStreamingResponse(
                self._stream(request, params, stream, response_id, received), stream
            )
        final = await self.collect(stream, receive)
        if final is None:
            return Response(status_code=499)  # the client left; the request is aborted
        body = {
            "request_id": response_id,
            "model": model,
            "created": now_s(),
            "output_mode": request.output_mode,
            "choices": [self._choice(request, params, c, final=True) for c in final.outputs],
            "usage": self.usage([final]).model_dump(),
            "prompt_logprobs": self.prompt_logprobs(final.prompt_logprobs),
            "prompt_token_ids": final.prompt_token_ids if request.return_token_ids else None,
            "kv_transfer_params": None,
        }
        return JSONResponse(body, headers=self.timing(received, stream))

    def _choice(
        self, request: GenerateRequest, params: SamplingParams, c: CompletionOutput, final: bool
    ) -> dict[str, Any]:
        """One choice (``final``: the non-streaming response's, whose finish reason is
        never null, as vLLM's)."""
        text_mode = request.output_mode == "text"
        logprobs = None
        if params.logprobs is not None:
            logprobs = self.chat_logprobs(c) if text_mode else self._token_logprobs(c)
        choice: dict[str, Any] = {
            "index": c.index,
            "finish_reason": c.finish_reason or ("stop" if final else None),
            "stop_reason": c.stop_reason,
            "token_ids": list(c.token_ids),
            "logprobs": logprobs,
        }
        if text_mode:
            choice["text"] = c.text
        return choice

    @staticmethod
    def _token_logprobs(c: CompletionOutput) -> dict[str, Any] | None:
        """vLLM's tokens-mode logprobs: per sampled token its id, logprob and rank, and
        the top-n as ids (best first), no text."""
        if c.logprobs is None:
            return None
        content = [
            {
                "token_id": lp.token_id,
                "logprob": _clamp(lp.logprob),
                "rank": lp.rank,
                "top_logprobs": [
                    {"token_id": t, "logprob": _clamp(v), "rank": rank}
                    for rank, (t, v) in enumerate(lp.top, 1)
                ],
            }
            for lp in c.logprobs
        ]
        return {"content": content}

    def _stream(
        self,
        request: GenerateRequest,
        params: SamplingParams,
        stream,
        response_id: str,
        received: float | None,
    ):
        """One chunk per output with new tokens (or a finish), the prompt's ids in the
        first when asked; a usage chunk last with ``stream_options.include_usage``."""
        mode = request.output_mode
        prompt_ids = list(stream.prompt_token_ids) if request.return_token_ids else None

        def chunk(c: CompletionOutput) -> dict:
            nonlocal prompt_ids
            payload = {
                "request_id": response_id,
                "output_mode": mode,
                "choices": [self._choice(request, params, c, final=False)],
            }
            if prompt_ids is not None:
                payload["prompt_token_ids"], prompt_ids = prompt_ids, None
            return payload

        options = request.stream_options
        include = self.args.enable_force_include_usage or bool(options and options.include_usage)
        continuous = include and bool(options and options.continuous_usage_stats)
        return self.stream_events(
            stream,
            chunk,
            [],
            include,
            lambda u: {"request_id": response_id, "output_mode": mode, "choices": [],
                       "usage": u.model_dump()},
            received,
            continuous_usage=continuous,
            every_output=True,
        )  # fmt: skip

    async def abort(self, request_ids: list[str] | None) -> dict[str, Any]:
        """Stop the requests named (None: every one in flight)."""
        count = await self.engine.abort_requests(request_ids)
        return {"status": "aborted", "aborted": count}
