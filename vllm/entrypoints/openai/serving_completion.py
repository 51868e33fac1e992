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
        return self.engine.tokenizer.decode(prompt, skip_special_tokens=False)

    def _logprobs(self, c: CompletionOutput) -> dict | None:
        if c.logprobs is None:
            return None
        tok = self.engine.tokenizer
        return {
            "tokens": [tok.decode([lp.token_id]) for lp in c.logprobs],
            "token_logprobs": [lp.logprob for lp in c.logprobs],
            "top_logprobs": [{tok.decode([t]): v for t, v in lp.top} for lp in c.logprobs],
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
        if request.echo and request.logprobs is not None:
            raise VLLMValidationError(
                "echo with logprobs is not supported yet (it needs prompt logprobs)", "echo"
            )
        # OpenAI's default for completions; 0 is refused as on chat, not replaced.
        max_tokens = 16 if request.max_tokens is None else request.max_tokens
        params = request.to_sampling_params(max_tokens, request.logprobs, request.stream)
        request_id = random_id("cmpl")
        created = now_s()
        stream = await self.add_request(prompt, params, request_id, request.priority)
        echo = self._echo_text(prompt) if request.echo else ""
        base = {
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": self.model_name,
        }
        if request.stream:
            events = self._stream(request, stream, base, echo, received)
            return EngineStreamingResponse(events, stream)

        def body(final: RequestOutput) -> dict:
            choices = [
                {
                    "index": c.index,
                    "text": echo + c.text,
                    "logprobs": self._logprobs(c),
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
                for c in final.outputs
            ]
            return {**base, "choices": choices, "usage": self.usage([final]).model_dump()}

        return await self.respond_json(stream, body, received, receive)

    def _stream(self, request, stream, base: dict, echo: str, received: float | None):
        echoed: set[int] = set()

        def chunk(c: CompletionOutput) -> dict:
            text = c.text
            if echo and c.index not in echoed:  # the prompt leads each choice's text
                echoed.add(c.index)
                text = echo + text
            choice = {
                "index": c.index,
                "text": text,
                "logprobs": self._logprobs(c),
                "finish_reason": c.finish_reason,
            }
            return {**base, "choices": [choice]}

        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        return self.stream_events(
            stream,
            chunk,
            [],
            include_usage,
            lambda u: {**base, "choices": [], "usage": u.model_dump()},
            received,
        )
