"""POST /v1/chat/completions."""

from __future__ import annotations

from vllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    RequestError,
    now_s,
    random_id,
)
from vllm.entrypoints.openai.serving_engine import (
    EngineStreamingResponse,
    OpenAIServing,
    Receive,
)
from vllm.outputs import CompletionOutput, RequestOutput


def _message_text(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    raise RequestError("message content must be a string or a list of text parts", "messages")


class OpenAIServingChat(OpenAIServing):
    def _prompt(self, request: ChatCompletionRequest) -> str:
        if not request.messages:
            raise RequestError("messages must not be empty", "messages")
        messages = []
        for m in request.messages:
            if "role" not in m:
                raise RequestError("every message needs a role", "messages")
            messages.append({**m, "content": _message_text(m.get("content"))})
        try:
            return self.engine.processor.apply_chat_template(
                messages, request.chat_template, request.add_generation_prompt, request.tools
            )
        except Exception as e:  # jinja errors from malformed conversations
            raise RequestError(f"chat template failed: {e}", "messages") from e

    def _logprobs(self, c: CompletionOutput) -> dict | None:
        if c.logprobs is None:
            return None
        tok = self.engine.tokenizer
        content = []
        for lp in c.logprobs:
            text = tok.decode([lp.token_id])
            content.append(
                {
                    "token": text,
                    "logprob": lp.logprob,
                    "bytes": list(text.encode()),
                    "top_logprobs": [
                        {
                            "token": tok.decode([t]),
                            "logprob": v,
                            "bytes": list(tok.decode([t]).encode()),
                        }
                        for t, v in lp.top
                    ],
                }
            )
        return {"content": content}

    async def create_chat_completion(
        self,
        request: ChatCompletionRequest,
        received: float | None = None,
        receive: Receive | None = None,
    ):
        """The response (JSON or SSE); ``received``: monotonic arrival time, for timing;
        ``receive``: the ASGI receive, to abort the request if the client disconnects."""
        self.check_model(request)
        prompt = self._prompt(request)
        ids = self.tokenize(prompt, add_special_tokens=False)
        max_tokens = self.max_tokens_for(
            len(ids), request.max_completion_tokens or request.max_tokens
        )
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        params = request.to_sampling_params(max_tokens, logprobs, request.stream)
        request_id = random_id("chatcmpl")
        created = now_s()
        stream = await self.engine.add_request(ids, params, request_id, priority=request.priority)
        if request.stream:
            return EngineStreamingResponse(
                self._stream(request, stream, request_id, created, received), stream
            )

        def body(final: RequestOutput) -> dict:
            choices = [
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": self._logprobs(c),
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
                for c in final.outputs
            ]
            return {
                "id": request_id,
                "object": "chat.completion",
                "created": created,
                "model": self.model_name,
                "choices": choices,
                "usage": self.usage([final]).model_dump(),
            }

        return await self.respond_json(stream, body, received, receive)

    def _stream(self, request, stream, request_id: str, created: int, received: float | None):
        base = {
            "id": request_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": self.model_name,
        }

        def chunk(c: CompletionOutput) -> dict:
            return {
                **base,
                "choices": [
                    {
                        "index": c.index,
                        "delta": {"content": c.text} if c.text else {},
                        "logprobs": self._logprobs(c),
                        "finish_reason": c.finish_reason,
                    }
                ],
            }

        first = [
            {
                **base,
                "choices": [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            }
            for i in range(request.n)
        ]
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        return self.stream_events(
            stream,
            chunk,
            first,
            include_usage,
            lambda u: {**base, "choices": [], "usage": u.model_dump()},
            received,
        )
