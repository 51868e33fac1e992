"""What chat and completion serving share: model check, streaming, errors."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse

from vllm import envs
from vllm.entrypoints.launcher import ServerState
from vllm.entrypoints.logger import RequestLogger
from vllm.entrypoints.openai.cli_args import FrontendArgs
from vllm.entrypoints.openai.protocol import UsageInfo, _SamplingFields, random_id
from vllm.entrypoints.openai.serving_models import OpenAIServingModels
from vllm.entrypoints.openai.sse import with_sse_keep_alive
from vllm.exceptions import VLLMValidationError
from vllm.lora.request import LoRARequest
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.transformers_utils.tokenizer import NO_TOKENIZER
from vllm.v1.engine.async_llm import AsyncLLM, RequestStream
from vllm.v1.outputs import TokenLogprobs

# Response headers of non-streaming responses (seconds): time in this server from the
# request's arrival to the response, and the part of it spent in the engine process.
SERVER_LATENCY_HEADER = "x-vllm-server-latency"
ENGINE_LATENCY_HEADER = "x-vllm-engine-latency"


logger = logging.getLogger(__name__)

Receive = Callable[[], Awaitable[dict]]  # the ASGI ``receive`` of the HTTP request

# Prompts (characters) from this size on are tokenized off the event loop (chat templating
# always is: its cost is not the prompt's length); below it the thread hop would cost more
# than the work (~0.1 ms per 16k characters).
OFFLOAD_CHARS = 16_384


class ClientDisconnected(Exception):
    """The HTTP client went away before its response was ready."""


async def _put_on_disconnect(receive: Receive, streams: Sequence[RequestStream]) -> None:
    # Once the body is read, the next ASGI message is http.disconnect (the client left,
    # or the response completed; by then this watcher has been cancelled).
    while (await receive())["type"] != "http.disconnect":
        pass
    for stream in streams:
        stream.put(ClientDisconnected())


async def _last(stream: RequestStream) -> RequestOutput:
    final = None
    async for out in stream:
        final = out
    assert final is not None
    return final


class EngineStreamingResponse(StreamingResponse):
    """SSE over a request stream, aborting the request however the response ends.

    A client that leaves before the first chunk is sent makes starlette cancel the body
    before the generator ever starts, so the generator's own ``finally`` never runs.
    ``keep_alive_s`` (--sse-keep-alive-interval; 0: off): an SSE comment each time that
    many seconds pass without an event (``with_sse_keep_alive``).
    """

    def __init__(
        self, content: AsyncIterator[str], stream: RequestStream, keep_alive_s: float = 0.0
    ) -> None:
        super().__init__(with_sse_keep_alive(content, keep_alive_s), media_type="text/event-stream")
        self.engine_stream = stream

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.engine_stream.aclose()  # no-op if the request finished


class StreamBatch:
    """Several requests' streams read as one (a batched completion's prompts): outputs in
    the order they come, each choice's index offset by its request's position times
    ``n`` (vLLM's numbering: prompt ``i``'s choice ``j`` is ``i * n + j``). Iteration
    ends once every request has finished; an error in one ends it and aborts them all,
    as ``aclose()`` does. ``prompt_token_ids``: every prompt's, one after another (the
    batch's prompt tokens); ``engine_latency_s``: the slowest request's."""

    def __init__(self, streams: Sequence[RequestStream], n: int = 1) -> None:
        self.streams = list(streams)
        self.n = n
        self.prompt_token_ids = [t for s in self.streams for t in s.prompt_token_ids]
        self._queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = (
            asyncio.Queue()
        )
        self._pumps: list[asyncio.Task] = []
        self._running = len(self.streams)

    @property
    def engine_latency_s(self) -> float | None:
        latencies = [s.engine_latency_s for s in self.streams]
        return None if None in latencies else max(latencies)  # type: ignore[type-var]

    async def _pump(self, position: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                self._queue.put_nowait((position, out))
        except Exception as e:  # noqa: BLE001 - handed to the reader, who raises it
            self._queue.put_nowait(e)
        finally:
            self._queue.put_nowait(None)

    def __aiter__(self) -> StreamBatch:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._pumps and self._running:
            self._pumps = [
                asyncio.ensure_future(self._pump(i, s)) for i, s in enumerate(self.streams)
            ]
        while self._running:
            item = await self._queue.get()
            if item is None:
                self._running -= 1
                continue
            if isinstance(item, BaseException):
                await self.aclose()
                raise item
            position, out = item
            offset = position * self.n
            outputs = [dataclasses.replace(c, index=c.index + offset) for c in out.outputs]
            return dataclasses.replace(out, outputs=outputs)
        raise StopAsyncIteration

    async def aclose(self) -> None:
        """Aborts every request that has not finished; safe to call more than once."""
        self._running = 0
        for pump in self._pumps:
            pump.cancel()
        for stream in self.streams:
            await stream.aclose()


def error_event(e: Exception) -> dict:
    """An OpenAI-shaped error for an exception that ends a stream after its first event."""
    code = getattr(e, "status", 400 if isinstance(e, ValueError) else 500)
    err_type = getattr(e, "err_type", type(e).__name__)
    return {"error": {"message": str(e), "type": err_type, "param": None, "code": code}}


def one_event_or_json(body: dict, stream: bool) -> Response:
    """``body`` as JSON, or for a stream as one SSE event and ``[DONE]``: what vLLM sends
    for a result it does not stream (beam search)."""
    if not stream:
        return JSONResponse(body)

    async def events() -> AsyncIterator[str]:
        yield sse(body)
        yield sse("[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream")


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


class OpenAIServing:
    """Shared by the chat and completion endpoints.

    ``stat_logger`` (optional) gets ``observe_overhead(seconds)`` per finished request: the
    server's latency minus the engine's (HTTP, tokenization, ZMQ, detokenization).
    ``args``: the server's limits; ``state``: whether the server still takes requests.
    """

    # One thread for all endpoints, as vLLM does: tokenizers are not meant for concurrent
    # use, and one long prompt should not take both cores from the engine.
    _executor: ThreadPoolExecutor | None = None

    def __init__(
        self,
        engine: AsyncLLM,
        model_name: str,
        stat_logger=None,
        args: FrontendArgs | None = None,
        state: ServerState | None = None,
        models: OpenAIServingModels | None = None,
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        # The names served: the base model and any LoRA adapters.
        self.models = models or OpenAIServingModels(model_name)
        self.stat_logger = stat_logger
        self.args = args or FrontendArgs()
        self.state = state or ServerState()
        a = self.args
        self.request_logger = (
            RequestLogger(a.enable_log_requests, a.enable_log_outputs, a.enable_log_deltas,
                          a.max_log_len)
            if a.enable_log_requests or a.enable_log_outputs
            else None
        )  # fmt: skip

    @property
    def default_sampling_params(self) -> dict[str, Any]:
        """The model's defaults for unset sampling parameters (``AsyncLLM``'s; none from
        an engine that has no model config, e.g. a test's)."""
        return getattr(self.engine, "default_sampling_params", None) or {}

    @property
    def has_tokenizer(self) -> bool:
        """False with --skip-tokenizer-init (an engine that does not say has one)."""
        return getattr(self.engine, "has_tokenizer", True)

    def require_tokenizer(self, what: str, param: str | None) -> None:
        """A 400 naming ``param`` when ``what`` needs the tokenizer the server skipped."""
        if not self.has_tokenizer:
            raise VLLMValidationError(f"{what} cannot be used: {NO_TOKENIZER}", param)

    @classmethod
    def executor(cls) -> ThreadPoolExecutor:
        if cls._executor is None:
            cls._executor = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
        return cls._executor

    async def in_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in the tokenizer thread (the event loop serves others meanwhile)."""
        return await asyncio.get_running_loop().run_in_executor(self.executor(), fn, *args)

    async def add_request(
        self,
        prompt: str | list[int],
        params,
        request_id: str,
        priority: int,
        external_id: str | None = None,
        **kw: Any,
    ) -> RequestStream:
        """The engine's ``add_request``, tokenizing a long prompt off the event loop.
        ``external_id``: the id /abort_requests stops it by (its response's; default
        ``request_id``)."""
        self.state.check_open()
        executor = self.executor() if len(prompt) >= OFFLOAD_CHARS else None
        stream = await self.engine.add_request(
            prompt, params, request_id, priority=priority, executor=executor, **kw
        )
        if external_id is not None:
            stream.external_id = external_id
        if self.state.closing:  # the drain ended while the prompt was being tokenized
            await stream.aclose()
            self.state.check_open()
        self._log_request(stream, prompt, params, kw.get("lora_request"))
        return stream

    def _log_request(self, stream: RequestStream, prompt, params, lora_request) -> None:
        """--enable-log-requests / --enable-log-outputs: the request as the engine took it,
        and an observer that logs its outputs."""
        log = self.request_logger
        if log is None:
            return
        log.log_inputs(stream.request_id, prompt, stream.prompt_token_ids, params, lora_request)
        stream.on_output = log.output_observer(stream.request_id, stream.output_kind)

    def tokens_as_ids(self, request: _SamplingFields) -> bool:
        """Whether ``request``'s logprobs name tokens ``token_id:<id>`` (vLLM's
        ``return_tokens_as_token_ids``: the request's own, else the server's flag)."""
        own = request.return_tokens_as_token_ids
        return self.args.return_tokens_as_token_ids if own is None else own

    def logprob_token(self, token_id: int, as_id: bool, text: str | None = None) -> str:
        """A logprob entry's ``token``: its text (``text``, else decoded here), or
        (``as_id``) ``token_id:<id>``."""
        if as_id:
            return f"token_id:{token_id}"
        return self.engine.decode([token_id]) if text is None else text

    def chat_logprobs(self, c: CompletionOutput, as_ids: bool = False) -> dict | None:
        """OpenAI's chat logprobs object (chat, and /inference/v1/generate's text mode);
        ``as_ids``: tokens named ``token_id:<id>`` (their ``bytes`` are still the
        text's)."""
        if c.logprobs is None:
            return None

        def entry(token_id: int, logprob: float) -> dict:
            text = self.engine.decode([token_id])
            token = self.logprob_token(token_id, as_ids, text)
            return {"token": token, "logprob": logprob, "bytes": list(text.encode())}

        content = [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
            for lp in c.logprobs
        ]
        return {"content": content}

    def checked_inputs(self, prompts: list) -> list:
        """A pooling route's inputs (embeddings, /classify, /pooling): at least one, at
        most --max-n-sequences (a 400 naming ``input``)."""
        if not prompts:
            raise VLLMValidationError("input must not be empty", "input")
        if len(prompts) > self.args.max_n_sequences:
            raise VLLMValidationError(
                f"at most {self.args.max_n_sequences} inputs per request "
                f"(--max-n-sequences), got {len(prompts)}",
                "input",
            )
        return prompts

    @staticmethod
    def request_ids(request: _SamplingFields, prefix: str) -> tuple[str, str]:
        """The response's ``id`` and the engine's request id. A request the client named
        (vLLM's ``request_id`` field, or its ``X-Request-Id`` header) answers as
        ``{prefix}-{name}``, and runs in the engine under that plus a random suffix, as in
        vLLM: two requests of one name never collide. Otherwise one new id for both."""
        if request.request_id is None:
            new = random_id(prefix)
            return new, new
        response_id = f"{prefix}-{request.request_id}"
        return response_id, f"{response_id}-{uuid.uuid4().hex[:8]}"

    def check_request(self, request: _SamplingFields) -> None:
        """The model, and the limits of ``args`` (``VLLMValidationError`` naming the field)."""
        self.check_model(request)
        args = self.args
        if request.n > args.max_n_sequences:
            raise VLLMValidationError(
                f"n must be at most {args.max_n_sequences} (the server's --max-n-sequences), "
                f"got {request.n}",
                "n",
            )
        if request.job_id is not None and len(request.job_id) > args.max_job_id_length:
            raise VLLMValidationError(
                f"job_id must be at most {args.max_job_id_length} characters "
                f"(--max-job-id-length), got {len(request.job_id)}",
                "job_id",
            )
        stops = [request.stop] if isinstance(request.stop, str) else request.stop or []
        if len(stops) > args.max_stop_strings:
            raise VLLMValidationError(
                f"at most {args.max_stop_strings} stop strings (--max-stop-strings), "
                f"got {len(stops)}",
                "stop",
            )
        if any(len(s) > args.max_stop_string_length for s in stops):
            raise VLLMValidationError(
                f"stop strings must be at most {args.max_stop_string_length} characters "
                "(--max-stop-string-length)",
                "stop",
            )

    async def add_requests(
        self,
        prompts: Sequence[str | list[int]],
        params: Callable[[], Any],
        request_id: str,
        priority: int,
        external_id: str | None = None,
        **kw: Any,
    ) -> list[RequestStream]:
        """One engine request per prompt, each with its own ``params()``: ``request_id``
        for a lone prompt, ``{request_id}-{i}`` for prompt ``i`` of several. Every prompt
        is checked and tokenized before any is queued, so a bad one (too long, say; the
        error names its position) fails the batch with nothing run. ``external_id``: the
        id that stops them all (``add_request``'s)."""
        if len(prompts) == 1:
            stream = await self.add_request(
                prompts[0], params(), request_id, priority, external_id, **kw
            )
            return [stream]
        self.state.check_open()
        prepared, used = [], []
        for i, prompt in enumerate(prompts):
            executor = self.executor() if len(prompt) >= OFFLOAD_CHARS else None
            used.append(params())
            try:
                prepared.append(
                    await self.engine.prepare_request(
                        prompt,
                        used[-1],
                        f"{request_id}-{i}",
                        priority=priority,
                        executor=executor,
                        **kw,
                    )
                )
            except VLLMValidationError as e:
                raise VLLMValidationError(f"prompt {i}: {e}", e.param, e.value, e.code) from e
        loras = [kw.get("lora_request")] * len(prompts)
        return await self.submit_all(prepared, prompts, used, loras, external_id or request_id)

    async def submit_all(
        self,
        prepared: Sequence[Any],
        prompts: Sequence[Any],
        params: Sequence[Any],
        loras: Sequence[LoRARequest | None],
        external_id: str,
    ) -> list[RequestStream]:
        """Queue requests all prepared (``AsyncLLM.prepare_request``; their prompts,
        params and adapters, for the request log), all or none: a submit that fails
        aborts those already queued. ``external_id``: the id that stops them all."""
        self.state.check_open()  # the drain began while the prompts were tokenized
        streams: list[RequestStream] = []
        try:
            for request in prepared:
                streams.append(await self.engine.submit_request(request))
        except BaseException:
            for stream in streams:
                await stream.aclose()
            raise
        for prompt, request_params, lora, stream in zip(
            prompts, params, loras, streams, strict=True
        ):
            self._log_request(stream, prompt, request_params, lora)
            stream.external_id = external_id
        return streams

    def timing(self, received: float | None, stream: RequestStream | StreamBatch) -> dict[str, str]:
        """Record the request's overhead; returns the timing headers (empty if unknown)."""
        engine_s = stream.engine_latency_s
        if received is None or engine_s is None:
            return {}
        server_s = time.monotonic() - received
        if self.stat_logger is not None:
            self.stat_logger.observe_overhead(max(server_s - engine_s, 0.0))
        return {SERVER_LATENCY_HEADER: f"{server_s:.6f}", ENGINE_LATENCY_HEADER: f"{engine_s:.6f}"}

    def check_model(self, request: _SamplingFields) -> LoRARequest | None:
        """The LoRA adapter ``request.model`` names (None: the base model); a 404
        ``model_not_found`` for a name this server does not serve."""
        return self.models.lora_request(request.model)

    def response_model(self, model: str | None) -> str:
        """The ``model`` a response names: the adapter's name, else the served model's."""
        return model if self.models.lora_request(model) is not None else self.model_name

    def prompt_logprobs(self, lps: list[TokenLogprobs | None] | None) -> list[dict | None] | None:
        """vLLM's ``prompt_logprobs`` in a response: per prompt token None (the first) or
        ``{token_id: {"logprob", "rank", "decoded_token"}}``, the prompt's own token first,
        then the top-n (one entry when it is among them). -inf is -9999.0, as in vLLM.
        ``decoded_token`` is null without a tokenizer (--skip-tokenizer-init), as vLLM's."""
        if lps is None:
            return None
        decoded: dict[int, str | None] = {}
        has_tokenizer = self.has_tokenizer

        def entry(token_id: int, logprob: float, rank: int) -> dict:
            if token_id not in decoded:
                decoded[token_id] = self.engine.decode([token_id]) if has_tokenizer else None
            value = max(logprob, -9999.0)
            return {"logprob": value, "rank": rank, "decoded_token": decoded[token_id]}

        result: list[dict | None] = []
        for lp in lps:
            if lp is None:
                result.append(None)
                continue
            position = {lp.token_id: entry(lp.token_id, lp.logprob, lp.rank)}
            for rank, (token_id, logprob) in enumerate(lp.top, 1):
                position.setdefault(token_id, entry(token_id, logprob, rank))
            result.append(position)
        return result

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

    async def collect(self, stream: RequestStream, receive: Receive | None = None):
        """The final output, or None if the client disconnected first (``receive``: the
        request's ASGI receive, watched for that). The request is aborted in the engine
        if it did not finish (disconnect, or this task cancelled)."""
        finals = await self.collect_all([stream], receive)
        return None if finals is None else finals[0]

    async def collect_all(
        self, streams: Sequence[RequestStream], receive: Receive | None = None
    ) -> list[RequestOutput] | None:
        """``collect`` for several requests read at once: their final outputs in order,
        or None if the client disconnected first. One failing (an engine error, this
        task cancelled) ends and aborts them all."""
        watcher = asyncio.ensure_future(_put_on_disconnect(receive, streams)) if receive else None
        readers: list[asyncio.Future] = []
        try:
            if len(streams) == 1:  # no task of its own: the common case stays cheap
                return [await _last(streams[0])]
            readers = [asyncio.ensure_future(_last(s)) for s in streams]
            return list(await asyncio.gather(*readers))
        except ClientDisconnected:
            return None
        finally:
            for reader in readers:
                reader.cancel()
            if watcher is not None:
                watcher.cancel()
            for stream in streams:
                await stream.aclose()

    async def respond_json(
        self,
        stream: RequestStream,
        body: Callable[[RequestOutput], dict],
        received: float | None,
        receive: Receive | None,
    ) -> Response:
        """The non-streaming response: ``body(final output)`` with the timing headers, or
        499 (nginx's code: nobody reads it) if the client disconnected first."""
        final = await self.collect(stream, receive)
        if final is None:
            return Response(status_code=499)
        return JSONResponse(body(final), headers=self.timing(received, stream))

    async def stream_events(
        self,
        stream: RequestStream | StreamBatch,
        chunk: Callable[[CompletionOutput], dict],
        first_chunks: list[dict],
        include_usage: bool,
        usage_chunk: Callable[[UsageInfo], dict],
        received: float | None = None,
        observe: Callable[[CompletionOutput], None] | None = None,
        continuous_usage: bool = False,
        every_output: bool = False,
    ) -> AsyncIterator[str]:
        """SSE events; an error mid-stream becomes an error event, then [DONE].
        ``first_chunks`` (chat's role chunks) go out with the first output, as vLLM
        sends them, not before the prefill. ``observe``: called with every output,
        those that make no chunk included.
        ``continuous_usage``: every chunk carries the usage so far (vLLM's
        ``stream_options.continuous_usage_stats``). ``every_output``: a chunk for every
        output with new tokens, text or not (``return_token_ids``)."""
        prompt_tokens, completion = len(stream.prompt_token_ids), 0
        cached: dict[str, int] = {}  # by request (a batch's several)

        def event(payload: dict) -> str:
            if continuous_usage:
                total = prompt_tokens + completion
                payload["usage"] = {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion,
                    "total_tokens": total,
                }
            return sse(payload)

        try:
            async for out in stream:
                if first_chunks:  # with the first output, as vLLM: a client that times
                    # the first event (vllm bench serve does) reads the time to first token
                    for first in first_chunks:
                        yield event(first)
                    first_chunks = []
                cached[out.request_id] = out.num_cached_tokens
                for c in out.outputs:
                    completion += len(c.token_ids)
                    if observe is not None:
                        observe(c)
                    new = c.text or (every_output and c.token_ids)
                    if new or c.finish_reason is not None or c.logprobs:
                        yield event(chunk(c))
            if include_usage:
                yield sse(
                    usage_chunk(
                        UsageInfo(
                            prompt_tokens=prompt_tokens,
                            completion_tokens=completion,
                            total_tokens=prompt_tokens + completion,
                            prompt_tokens_details={"cached_tokens": sum(cached.values())},
                        )
                    )
                )
            self.timing(received, stream)
        except Exception as e:  # the status line is already sent: report in-band
            if self.args.log_error_stack or envs.VLLM_SERVER_DEV_MODE:
                name = getattr(stream, "request_id", "of a batch")
                logger.error("Error in stream %s, sent in-band", name, exc_info=e)
            yield sse(error_event(e))
        finally:
            # A client that went away cancels us here: abort its request in the engine.
            await stream.aclose()
        yield sse("[DONE]")
