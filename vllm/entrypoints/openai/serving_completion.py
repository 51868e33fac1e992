"""POST /v1/completions."""

from __future__ import annotations

from vllm.entrypoints.openai.protocol import CompletionRequest, now_s, random_id
from vllm.entrypoints.openai.serving_engine import (
    EngineStreamingResponse,
    OpenAIServing,
    Receive,
)
from vllm.exceptions import VLLMValidationError
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.v1.outputs import TokenLogprobs


class OpenAIServingCompletion(OpenAIServing):
    def _prompt(self, request: CompletionRequest) -> str | list[int]:
        p = request.prompt
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str | list):
            p = p[0]  # a batch of one
        if isinstance(p, list) and p and not isinstance(p[0], int):
            raise VLLMValidationError(
                "batched prompts are not supported; send one per request", "prompt"
            )
        return p

    def _echo_text(self, prompt: str | list[int]) -> str:
        """``echo``: the prompt as text (token ids decoded) that leads each choice."""
        if isinstance(prompt, str):
            return prompt
        return self.engine.decode(prompt)

    def _logprobs(self, c: CompletionOutput, echoed: RequestOutput | None = None) -> dict | None:
        """OpenAI's legacy logprobs object. ``echoed`` (echo): the request whose prompt
        tokens and prompt logprobs lead it, the first token with null ones (as in vLLM)."""
        if c.logprobs is None:
            return None
        decode = self.engine.decode
        ids = [lp.token_id for lp in c.logprobs]
        lps: list[TokenLogprobs | None] = list(c.logprobs)
        if echoed is not None and echoed.prompt_logprobs is not None:
            ids = echoed.prompt_token_ids + ids
            lps = echoed.prompt_logprobs + lps
        return {
            "tokens": [decode([t]) for t in ids],
            "token_logprobs": [None if lp is None else lp.logprob for lp in lps],
            "top_logprobs": [
                None if lp is None else {decode([t]): v for t, v in lp.top} for lp in lps
            ],
            "text_offset": [],
        }

    async def create_completion(
        self,
        request: CompletionRequest,
        received: float | None = None,
        receive: Receive | None = None,
    ):
        """The response (JSON or SSE); ``received``: monotonic arrival time, for timing;
        ``receive``: the ASGI receive, to abort the request if the client disconnects."""
        self.check_request(request)
        prompt = self._prompt(request)
        echo_logprobs = request.echo and request.logprobs is not None
        if echo_logprobs and request.stream:
            raise VLLMValidationError(
                "echo with logprobs is not available when stream=True", "echo"
            )
        # OpenAI's default for completions; 0 is refused as on chat, not replaced.
        max_tokens = 16 if request.max_tokens is None else request.max_tokens
        params = request.to_sampling_params(
            max_tokens, request.logprobs, request.stream, self.default_sampling_params
        )
        if echo_logprobs and params.prompt_logprobs is None:
            params.prompt_logprobs = request.logprobs  # as vLLM: the echoed prompt's logprobs
        request_id = random_id("cmpl")
        created = now_s()
        stream = await self.add_request(
            prompt,
            params,
            request_id,
            request.priority,
            cache_salt=request.cache_salt,
            lora_request=self.check_model(request),
        )
        echo = self._echo_text(prompt) if request.echo else ""
        base = {
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": self.response_model(request.model),
        }
        if request.stream:
            events = self._stream(request, stream, base, echo, received)
            return EngineStreamingResponse(events, stream)

        def body(final: RequestOutput) -> dict:
            prompt_logprobs = self.prompt_logprobs(final.prompt_logprobs)
            choices = [
                {
                    "index": c.index,
                    "text": echo + c.text,
                    "logprobs": self._logprobs(c, final if echo_logprobs else None),
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                    "prompt_logprobs": prompt_logprobs,  # vLLM's: in every choice
                    **self._token_ids(request, final.prompt_token_ids, c.token_ids),
                }
                for c in final.outputs
            ]
            return {**base, "choices": choices, "usage": self.usage([final]).model_dump()}

        return await self.respond_json(stream, body, received, receive)

    @staticmethod
    def _token_ids(request, prompt_ids: list[int] | None, ids: list[int]) -> dict:
        """vLLM's ``return_token_ids`` fields of a choice (the prompt's: None after a
        choice's first chunk)."""
        if not request.return_token_ids:
            return {}
        return {"prompt_token_ids": prompt_ids, "token_ids": ids}

    def _stream(self, request, stream, base: dict, echo: str, received: float | None):
        echoed: set[int] = set()
        started: set[int] = set()

        def chunk(c: CompletionOutput) -> dict:
            text = c.text
            if echo and c.index not in echoed:  # the prompt leads each choice's text
                echoed.add(c.index)
                text = echo + text
            prompt_ids = None if c.index in started else stream.prompt_token_ids
            started.add(c.index)
            choice = {
                "index": c.index,
                "text": text,
                "logprobs": self._logprobs(c),
                "finish_reason": c.finish_reason,
                **self._token_ids(request, prompt_ids, c.token_ids),
            }
            return {**base, "choices": [choice]}

        include_usage, continuous_usage = request.stream_usage()
        return self.stream_events(
            stream,
            chunk,
            [],
            include_usage,
            lambda u: {**base, "choices": [], "usage": u.model_dump()},
            received,
            continuous_usage=continuous_usage,
            every_output=request.return_token_ids,
        )
