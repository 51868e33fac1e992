"""Tokens in, tokens out (vLLM's scale-out routes, ``--enable-scale-out``):
``POST /inference/v1/generate`` runs a prompt given as token ids with vLLM's
``SamplingParams`` as sent and answers token ids (``output_mode: "text"``: the text too);
``POST /inference/v1/abort_requests`` stops requests by the ``request_id`` their responses
named. The ``/render`` routes (``generate_body``) answer the body a chat, completion,
Messages or Responses request would run as here, and the ``/derender`` routes read a
generate response back as the chat or completions route reads its outputs.

A client that leaves aborts its request; a stream ends with ``[DONE]``, an error after
the first chunk comes in-band, as on the OpenAI routes.
"""

from __future__ import annotations

import uuid
from types import SimpleNamespace
from typing import Any

from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from vllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, now_s
from vllm.entrypoints.openai.protocol_generate import (
    DerenderChatRequest,
    DerenderChatStreamRequest,
    DerenderCompletionRequest,
    DerenderCompletionStreamRequest,
    DerenderStreamState,
    GeneratedResponse,
    GenerateRequest,
)
from vllm.entrypoints.openai.serving_engine import EngineStreamingResponse, OpenAIServing, Receive
from vllm.exceptions import VLLMValidationError
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import SamplingParams
from vllm.v1.engine.detokenizer import IncrementalDetokenizer
from vllm.v1.outputs import TokenLogprobs

RESPONSE_PREFIX = "generate-tokens"  # vLLM's: the response's request_id is <this>-<name>
NO_LOGPROB = -9999.0  # OpenAI's floor for -inf, as vLLM's shapes clamp it


def _clamp(logprob: float) -> float:
    return NO_LOGPROB if logprob != logprob else max(logprob, NO_LOGPROB)  # NaN too


class OpenAIServingTokens(OpenAIServing):
    """The tokens routes; ``chat`` and ``completions``: the routes whose requests the
    /derender routes read outputs back for (set by the app)."""

    chat: Any = None
    completions: Any = None

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
        if self.args.tokens_only and params.stop:  # nothing is detokenized to match them
            raise VLLMValidationError(
                "stop strings are not supported on a --tokens-only server (it detokenizes "
                "nothing): check them on the coordinator, or use stop_token_ids",
                "sampling_params.stop",
            )
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
        if self.args.tokens_only:  # vLLM's force_no_detokenize
            params.detokenize = False
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
                self._stream(request, params, stream, response_id, received),
                stream,
                self.args.sse_keep_alive_interval,
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
            "kv_transfer_params": final.kv_transfer_params,
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
            "weight_versions": weight_spans(c),
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

    # -- /derender --------------------------------------------------------------------
    def _check_ids(self, *named: tuple[list[int], str]) -> None:
        """Token ids of this model's vocabulary (a 400 naming where they came from)."""
        self.require_tokenizer("derendering (token ids to text)", named[0][1])
        vocab = self.engine.processor.vocab_size
        for ids, name in named:
            if not all(0 <= t < vocab for t in ids):
                raise VLLMValidationError(
                    f"{name}: token ids must be integers in [0, {vocab})", name
                )

    def _texts(
        self,
        params: SamplingParams,
        chunks: list[list[int]],
        finish: tuple[str | None, int | str | None] = (None, None),
    ) -> list[str]:
        """Each chunk's new text as the engine's detokenizer gave it when the tokens came
        so: stop strings found and cut (their possible beginnings held back until they
        cannot be one), a character split across tokens held back, the stop token's text
        left out. ``finish``: the last chunk's finish reason and stop reason."""
        detok = IncrementalDetokenizer(self.engine.tokenizer, params)
        texts = []
        for j, ids in enumerate(chunks):
            finished = j == len(chunks) - 1 and finish[0] is not None
            # The engine stopped on the last token (EOS, a stop token id): not a stop string.
            on_token = finished and finish[0] == "stop" and not isinstance(finish[1], str)
            stop = detok.update(ids, on_token)
            if stop is None and finished:
                detok.flush()
            texts.append(detok.get_next_output_text(finished or detok.stopped, True))
        return texts

    def _decoded(
        self, response: GeneratedResponse, params: SamplingParams, prompt_ids: list[int]
    ) -> list[CompletionOutput]:
        """Each choice's output as the engine would have given it (``_texts`` of all its
        tokens at once), its logprobs as the engine's."""
        self._check_ids(
            (prompt_ids, "prompt_token_ids"),
            *[(c.token_ids, "generate_response") for c in response.choices],
        )
        outputs = []
        for c in response.choices:
            finish = (c.finish_reason, c.stop_reason)
            [text] = self._texts(params, [list(c.token_ids)], finish)
            outputs.append(
                CompletionOutput(
                    c.index, text, list(c.token_ids), None, _engine_logprobs(c.logprobs),
                    c.finish_reason, c.stop_reason,
                )
            )  # fmt: skip
        return outputs

    async def derender_chat(self, body: DerenderChatRequest) -> dict[str, Any]:
        """The chat.completion the chat route would have answered for these outputs."""
        request = _request_of(body, "chat_request")
        plan, _, params = await self.chat._prepare(request)
        response = body.generate_response
        prompt_ids = body.prompt_token_ids or response.prompt_token_ids or []
        outputs = self._decoded(response, params, prompt_ids)
        final = RequestOutput(
            response.request_id, None, list(prompt_ids), outputs, True, _cached(response)
        )
        reply = self.chat.reply_body(request, plan, final, response.request_id, now_s())
        _count_prompt(reply["usage"], body.prompt_tokens, prompt_ids, response)
        return reply

    async def derender_completion(self, body: DerenderCompletionRequest) -> dict[str, Any]:
        """The text_completion the completions route would have answered for these
        outputs (one generate response per prompt, in order)."""
        request = _request_of(body, "completion_request")
        completions = self.completions
        completions.check_request(request)
        if request.echo and request.logprobs is not None:
            raise VLLMValidationError(
                "echo with logprobs needs the prompt's logprobs, which a generate response "
                "read back does not carry",
                "completion_request.echo",
            )
        params = completions.sampling_params(request, stream=False)
        as_ids = self.tokens_as_ids(request)
        choices, usage = [], {"prompt_tokens": 0, "completion_tokens": 0}
        cached = sum(_cached(r) for r in body.generate_responses)
        for i, response in enumerate(body.generate_responses):
            given = body.prompt_token_ids[i] if body.prompt_token_ids else None
            prompt_ids = given or response.prompt_token_ids or []
            if request.echo and not prompt_ids:
                raise VLLMValidationError(
                    f"echo needs generate response {i}'s prompt: send prompt_token_ids",
                    "prompt_token_ids",
                )
            echo = completions._echo_text(prompt_ids) if request.echo else ""
            for c in self._decoded(response, params, prompt_ids):
                choices.append(
                    {
                        "index": i * request.n + c.index,
                        "text": echo + c.text,
                        "logprobs": completions._logprobs(c, as_ids=as_ids),
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                        "prompt_logprobs": None,  # not in a generate response read back
                        **completions._token_ids(request, prompt_ids, c.token_ids),
                    }
                )
                usage["completion_tokens"] += len(c.token_ids)
            counted = {"prompt_tokens": 0}
            given_count = body.prompt_tokens[i] if body.prompt_tokens else None
            _count_prompt(counted, given_count, prompt_ids, response)
            usage["prompt_tokens"] += counted["prompt_tokens"]
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return {
            "id": body.generate_responses[0].request_id,
            "object": "text_completion",
            "created": now_s(),
            "model": self.response_model(request.model),
            "choices": choices,
            "usage": usage,
        }

    # -- streaming /derender: one generate chunk a call, the state carried by the client --
    def _stream_texts(
        self, body: Any, params: SamplingParams
    ) -> tuple[DerenderStreamState, list[str], Any]:
        """The state before this chunk, each chunk's text (the earlier ones replayed, this
        one last) and this chunk's choice (None for the usage chunk)."""
        state = body.stream_state or DerenderStreamState()
        chunk = body.generate_chunk
        if not chunk.choices:
            return state, [], None
        c = chunk.choices[0]
        prompt_ids = body.prompt_token_ids or chunk.prompt_token_ids or []
        self._check_ids(
            (prompt_ids, "prompt_token_ids"),
            (state.output_token_ids, "stream_state"),
            (c.token_ids, "generate_chunk"),
        )
        chunks = [*state.chunks(), list(c.token_ids)]
        return state, self._texts(params, chunks, (c.finish_reason, c.stop_reason)), c

    def _envelope(self, body: Any, obj: str, request: Any) -> dict[str, Any]:
        """A streamed chunk's fields but its choices: the generate chunk's id."""
        return {"id": body.generate_chunk.request_id, "object": obj, "created": now_s(),
                "model": self.response_model(request.model)}  # fmt: skip

    def _usage_answer(
        self, body: Any, state: DerenderStreamState, base: dict[str, Any]
    ) -> dict[str, Any]:
        """The answer to the generate stream's usage chunk (no choices; the state as is)."""
        chunk = {**base, "choices": [], "usage": self._stream_usage(body, state)}
        return {"chunk": chunk, "stream_state": state}

    @staticmethod
    def _stream_usage(body: Any, state: DerenderStreamState) -> dict[str, Any]:
        """The usage chunk's: the prompt's count (given, else its ids, else the chunk's
        usage) and the output tokens the chunk's usage counts (else the state's)."""
        usage = body.generate_chunk.usage or {}
        prompt = body.prompt_tokens
        if prompt is None:
            ids = body.prompt_token_ids or body.generate_chunk.prompt_token_ids
            prompt = len(ids) if ids else usage.get("prompt_tokens", 0)
        completion = usage.get("completion_tokens", len(state.output_token_ids))
        out = {"prompt_tokens": prompt, "completion_tokens": completion,
               "total_tokens": prompt + completion}  # fmt: skip
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict):
            out["prompt_tokens_details"] = details
        return out

    async def derender_chat_stream(self, body: DerenderChatStreamRequest) -> dict[str, Any]:
        """One chat.completion.chunk: what the chat route's stream would have sent for
        this generate chunk, after the earlier ones (replayed from ``stream_state``)."""
        request = _request_of(body, "chat_request")
        plan, _, params = await self.chat._prepare(request)
        state, texts, c = self._stream_texts(body, params)
        base = self._envelope(body, "chat.completion.chunk", request)
        if c is None:  # the usage chunk
            return self._usage_answer(body, state, base)
        streamer = plan.streamer()
        finished = c.finish_reason is not None
        if streamer is None:
            delta = {"content": texts[-1]} if texts[-1] else {}
            finish_reason = c.finish_reason
        else:
            for text in texts[:-1]:  # the parser's state: the earlier chunks again
                streamer.delta(text, False)
            delta = streamer.delta(texts[-1], finished)
            finish_reason = plan.finish_reason(c.finish_reason, streamer.called)
        if not state.started:  # the role, as the chat stream's first chunk carries it
            delta = {"role": plan.role, "content": "", **delta}
        output = CompletionOutput(
            c.index, texts[-1], list(c.token_ids), None, _engine_logprobs(c.logprobs)
        )
        hide = plan.hides_reasoning
        choice = {
            "index": c.index,
            "delta": delta,
            "logprobs": None if hide else self.chat_logprobs(output, self.tokens_as_ids(request)),
            "finish_reason": finish_reason,
        }
        if request.return_token_ids and not hide:
            choice["token_ids"] = list(c.token_ids)
        chunk = {**base, "choices": [choice]}
        return {"chunk": chunk, "stream_state": state.after(list(c.token_ids))}

    async def derender_completion_stream(
        self, body: DerenderCompletionStreamRequest
    ) -> dict[str, Any]:
        """One text_completion chunk: what the completions route's stream would have sent
        for this generate chunk (``echo``: the prompt leads the first)."""
        request = _request_of(body, "completion_request")
        completions = self.completions
        completions.check_request(request)
        params = completions.sampling_params(request, stream=True)
        state, texts, c = self._stream_texts(body, params)
        base = self._envelope(body, "text_completion", request)
        if c is None:  # the usage chunk
            return self._usage_answer(body, state, base)
        prompt_ids = body.prompt_token_ids or body.generate_chunk.prompt_token_ids or []
        echo = ""
        if request.echo and not state.started:
            if not prompt_ids:
                raise VLLMValidationError(
                    "echo needs the prompt: send prompt_token_ids", "prompt_token_ids"
                )
            echo = completions._echo_text(prompt_ids)
        output = CompletionOutput(
            c.index, texts[-1], list(c.token_ids), None, _engine_logprobs(c.logprobs)
        )
        before = sum(len(t) for t in texts[:-1]) + (
            len(completions._echo_text(prompt_ids)) if request.echo and state.started else 0
        )
        choice = {
            "index": c.index,
            "text": echo + texts[-1],
            "logprobs": completions._logprobs(
                output, offset=before + len(echo), as_ids=self.tokens_as_ids(request)
            ),
            "finish_reason": c.finish_reason,
            **completions._token_ids(
                request, None if state.started else prompt_ids, list(c.token_ids)
            ),
        }
        chunk = {**base, "choices": [choice]}
        return {"chunk": chunk, "stream_state": state.after(list(c.token_ids))}


def _engine_logprobs(logprobs: dict[str, Any] | None) -> list[TokenLogprobs] | None:
    """A tokens-mode response's logprobs as the engine's (``TokenLogprobs``)."""
    if not logprobs or logprobs.get("content") is None:
        return None
    try:
        return [
            TokenLogprobs(
                int(e["token_id"]), float(e["logprob"]), int(e.get("rank") or 0),
                [(int(t["token_id"]), float(t["logprob"])) for t in e.get("top_logprobs", [])],
            )
            for e in logprobs["content"]
        ]  # fmt: skip
    except (KeyError, TypeError, ValueError) as e:
        raise VLLMValidationError(
            f"generate_response logprobs are malformed: {e!r}", "generate_response"
        ) from None


def _cached(response: GeneratedResponse) -> int:
    """The prompt tokens the generate response's usage says the prefix cache served."""
    details = (response.usage or {}).get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens", 0) if isinstance(details, dict) else 0
    return cached if isinstance(cached, int) else 0


_DEFAULT_REQUESTS: dict[str, tuple[type, dict[str, Any]]] = {
    # With none given, the route's reading of an output under the server's defaults.
    "chat_request": (ChatCompletionRequest, {"messages": [{"role": "user", "content": ""}]}),
    "completion_request": (CompletionRequest, {"prompt": ""}),
}


def _request_of(body: Any, name: str) -> Any:
    """The /derender body's ``name`` (chat_request / completion_request) validated as the
    route's request (a 400 naming ``name.<field>``), its ``model`` the body's if set."""
    model, default = _DEFAULT_REQUESTS[name]
    request = _validated(model, getattr(body, name) or default, name)
    if body.model is not None:
        request.model = body.model
    return request


def _validated(model: type, raw: dict[str, Any], name: str) -> Any:
    """``model`` validated from ``raw``, its errors a 400 naming ``name.<field>``."""
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ()))
        raise VLLMValidationError(
            f"{name}: {where}: {first['msg']}", f"{name}.{where}" if where else name
        ) from None


def _count_prompt(
    usage: dict[str, Any], given: int | None, prompt_ids: list[int], response: GeneratedResponse
) -> None:
    """The usage's prompt tokens: the count given, else the prompt's ids, else the
    generate response's own usage."""
    if given is None:
        given = len(prompt_ids) if prompt_ids else (response.usage or {}).get("prompt_tokens", 0)
    usage["prompt_tokens"] = given
    usage["total_tokens"] = given + usage.get("completion_tokens", 0)


def weight_spans(c: CompletionOutput) -> list[dict[str, Any]] | None:
    """vLLM's ``weight_versions`` of a finished choice: which weights (RL weight sync's
    versions) sampled which output tokens, as ``{"version", "start", "end"}`` spans."""
    if c.weight_versions is None:
        return None
    return [{"version": s.version, "start": s.start, "end": s.end} for s in c.weight_versions]
