"""What chat and completion serving share: model check, token limits, streaming, errors."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

from vllm.entrypoints.openai.protocol import RequestError, UsageInfo, _SamplingFields
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.v1.engine.async_llm import AsyncLLM


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.max_model_len = engine.config.scheduler_config.max_model_len

    def check_model(self, request: _SamplingFields) -> None:
        if request.model is not None and request.model != self.model_name:
            raise RequestError(
                f"The model `{request.model}` does not exist.", "model", code="model_not_found"
            )

    def max_tokens_for(self, num_prompt_tokens: int, requested: int | None) -> int:
        room = self.max_model_len - num_prompt_tokens
        if room < 1 or (requested is not None and requested > room):
            want = requested if requested is not None else 1
            raise RequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, you requested {num_prompt_tokens + want} tokens "
                f"({num_prompt_tokens} in the prompt, {want} in the completion). "
                "Please reduce the length of the prompt or completion.",
                "max_tokens",
            )
        return room if requested is None else requested

    def tokenize(self, prompt: str | list[int], add_special_tokens: bool) -> list[int]:
        try:
            return self.engine.processor.tokenize(prompt, add_special_tokens)
        except ValueError as e:
            raise RequestError(str(e), "prompt") from e

    @staticmethod
    def usage(outputs: list[RequestOutput]) -> UsageInfo:
        prompt = sum(len(o.prompt_token_ids) for o in outputs)
        completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        cached = sum(o.num_cached_tokens for o in outputs)
        return UsageInfo(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details={"cached_tokens": cached},
        )

    async def collect(self, stream: AsyncIterator[RequestOutput]) -> RequestOutput:
        final = None
        async for out in stream:
            final = out
        assert final is not None
        return final

    async def stream_events(
        self,
        stream: AsyncIterator[RequestOutput],
        chunk: Callable[[CompletionOutput], dict],
        first_chunks: list[dict],
        include_usage: bool,
        usage_chunk: Callable[[UsageInfo], dict],
    ) -> AsyncIterator[str]:
        """SSE events; an error mid-stream becomes an error event, then [DONE]."""
        prompt_tokens = completion = cached = 0
        try:
            for first in first_chunks:
                yield sse(first)
            async for out in stream:
                prompt_tokens, cached = len(out.prompt_token_ids), out.num_cached_tokens
                for c in out.outputs:
                    completion += len(c.token_ids)
                    if c.text or c.finish_reason is not None or c.logprobs:
                        yield sse(chunk(c))
            if include_usage:
                yield sse(
                    usage_chunk(
                        UsageInfo(
                            prompt_tokens=prompt_tokens,
                            completion_tokens=completion,
                            total_tokens=prompt_tokens + completion,
                            prompt_tokens_details={"cached_tokens": cached},
                        )
                    )
                )
        except Exception as e:  # the status line is already sent: report in-band
            yield sse(
                {"error": {"message": str(e), "type": type(e).__name__, "param": None, "code": 500}}
            )
        finally:
            # A client that went away cancels us here: abort its request in the engine.
            await stream.aclose()
        yield sse("[DONE]")
