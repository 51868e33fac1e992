"""``AsyncLLM``: the asyncio front end of the engine core process (used by the server)."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable, Collection
from concurrent.futures import Executor
from typing import Any

from vllm.config import VllmConfig
from vllm.exceptions import GenerationError, VLLMValidationError
from vllm.lora.request import LoRARequest
from vllm.model_executor.model_loader import default_sampling_params, eos_token_ids
from vllm.outputs import RequestOutput, merge_delta
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.tracing import current_trace_headers, make_tracer, warn_untraced
from vllm.transformers_utils.tokenizer import init_tokenizer_from_config
from vllm.v1.engine import (
    PAUSE_MODES,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreOutputType,
    EngineCoreRequest,
    EngineCoreRequestError,
    EngineCoreRequestType,
    FinishReason,
    StampedOutputs,
    UtilityCall,
)
from vllm.v1.engine.admission_control import AdmissionControl, SharedAdmissionStats
from vllm.v1.engine.core_client import AsyncMPClient, EngineDeadError, EngineLink, last_line
from vllm.v1.engine.core_proc import EngineFactory
from vllm.v1.engine.dp_client import DPAsyncMPClient, DPLink
from vllm.v1.engine.dp_rank import requested_rank
from vllm.v1.engine.output_processor import OutputProcessor
from vllm.v1.engine.processor import Processor

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class PreparedRequest:
    """A request checked, tokenized and fanned out (``AsyncLLM.prepare_request``), not
    yet queued: dropping it leaves nothing behind."""

    request_id: str
    prompt_text: str | None
    core_reqs: list[EngineCoreRequest]  # one per sample (n)
    output_kind: RequestOutputKind


class RequestStream:
    """The outputs of one request, as an async iterator.

    Iteration ends after the finished output. ``aclose()`` before that aborts the request
    in the engine (frees its KV blocks); it is safe to call more than once.
    ``engine_latency_s``: once finished, seconds the request spent in the engine process
    (receipt of its first sample to the message that finished it). ``external_id``: the
    id its client knows it by (its response's id), which ``AsyncLLM.abort_requests``
    takes; the request id unless the server set another.

    A reader that falls behind the engine (a slow client, an event loop busy with many
    streams) gets what arrived meanwhile as one output, as in vLLM: DELTA outputs are
    merged (``merge_delta``), a CUMULATIVE one replaces the one before. So a loaded
    server sends fewer, larger chunks instead of queueing one per token and step.
    """

    def __init__(
        self,
        engine: AsyncLLM,
        request_id: str,
        child_ids: list[str],
        prompt_token_ids: list[int] | None = None,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
    ) -> None:
        self.request_id = request_id
        self.external_id = request_id
        self.child_ids = child_ids
        self.prompt_token_ids = prompt_token_ids or []  # as processed (template, truncation)
        self.engine_arrival: float | None = None  # time.monotonic() in the engine process
        self.engine_latency_s: float | None = None
        self.output_kind = output_kind
        self._engine = engine
        self._pending: collections.deque[RequestOutput | BaseException] = collections.deque()
        self._ready = asyncio.Event()
        self._done = False
        # Called with each output as the reader takes it (--enable-log-outputs).
        self.on_output: Callable[[RequestOutput], None] | None = None

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        while not self._pending:
            self._ready.clear()
            await self._ready.wait()
        item = self._pending.popleft()
        if isinstance(item, BaseException):
            await self.aclose()
            raise item
        if item.finished:
            self._done = True
        if self.on_output is not None:
            self.on_output(item)
        return item

    async def aclose(self) -> None:
        if not self._done:
            self._done = True
            await self._engine.abort(self.request_id)

    def put(self, item: RequestOutput | BaseException) -> None:
        last = self._pending[-1] if self._pending else None
        if isinstance(item, RequestOutput) and isinstance(last, RequestOutput):
            # DELTA: both, merged; otherwise everything so far: the newer says it all.
            delta = self.output_kind == RequestOutputKind.DELTA
            self._pending[-1] = merge_delta(last, item) if delta else item
        else:
            self._pending.append(item)
        self._ready.set()


class AsyncLLM:
    """Tokenizes and validates in this process; the engine core runs in another one."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        stat_loggers: list | None = None,
        engine_factory: EngineFactory | None = None,
        link: EngineLink | DPLink | None = None,
    ) -> None:
        """``link``: attach to an engine another process started (one of several API
        servers, ``AsyncMPClient``; with data parallelism a ``DPLink`` to every rank);
        None: start this front end's own."""
        mc = vllm_config.model_config
        self.config = vllm_config
        # Start the engine process first: its model load overlaps the tokenizer load here.
        if vllm_config.parallel_config.data_parallel_size > 1:
            self.client = DPAsyncMPClient(vllm_config, engine_factory=engine_factory, link=link)
        else:
            self.client = AsyncMPClient(vllm_config, engine_factory=engine_factory, link=link)
        try:
            self.tokenizer = init_tokenizer_from_config(mc)  # None: --skip-tokenizer-init
            eos = eos_token_ids(mc, self.tokenizer)[0]
            # What a request that leaves a sampling parameter unset gets (the model's
            # generation_config.json, as vLLM); the API server applies them.
            self.default_sampling_params = default_sampling_params(mc)
            # Checks what the model folder must hold (a bad --mm-processor-kwargs).
            self.processor = Processor(vllm_config, self.tokenizer, eos)
            self.tracer = make_tracer(vllm_config)  # --otlp-traces-endpoint
        except BaseException:
            self.client.shutdown()
            raise
        self.processor.default_max_tokens = self.default_sampling_params.get("max_tokens")
        self.output_processor = OutputProcessor(
            self.tokenizer, vllm_config.scheduler_config.stream_interval, self.tracer
        )
        self.stat_loggers = stat_loggers or []
        self.admission = self._make_admission(vllm_config, link)
        self._streams: dict[str, RequestStream] = {}
        self._by_child: dict[str, RequestStream] = {}
        self._utility_calls: dict[int, asyncio.Future] = {}  # call id -> its result
        self._next_call_id = 0
        self._asleep = False  # put to sleep by this front end, until it woke the engine
        self._loop_task: asyncio.Task | None = None
        self._shut_down = False  # set by shutdown(): the output loop must not go on
        self._engine_requests = 0  # running + waiting in the engine, by its latest stats
        # time.monotonic() of the last engine message, or of the moment work arrived at an
        # idle engine: what "no progress for N seconds" is measured from.
        self._last_progress = time.monotonic()

    def _make_admission(
        self, config: VllmConfig, link: EngineLink | DPLink | None
    ) -> AdmissionControl:
        sc, op = config.scheduler_config, self.output_processor
        shared = None
        if link is not None and link.admission_counters is not None:
            shared = SharedAdmissionStats(
                link.admission_counters, link.client_count, link.client_index
            )
        return AdmissionControl(
            sc.max_num_queued_reqs,
            sc.max_num_queued_tokens,
            op.get_num_queued_requests,
            op.get_num_queued_tokens,
            shared,
            self._record_admission_rejection,
        )

    def check_admission(self, n: int = 1, request_id: str | None = None) -> None:
        """vLLM's queue limits (``admission_control.py``): ``QueueOverflowError`` /
        ``MaxQueuedTokensError`` (HTTP 503) if a request of ``n`` samples may not be
        admitted now. ``prepare_request`` and ``submit_request`` call it."""
        self.admission.check(n, request_id)

    def _record_admission_rejection(self, reason: str) -> None:
        for stat_logger in self.stat_loggers:
            record = getattr(stat_logger, "record_admission_rejection", None)
            if record is not None:
                record(reason)

    async def start(self) -> dict:
        """Wait until the engine is ready; returns its info (num_gpu_blocks, pid)."""
        ready = await self.client.wait_ready()
        self.processor.set_kv_capacity(ready.num_gpu_blocks)
        self._loop_task = asyncio.create_task(self._output_loop())
        return dataclasses.asdict(ready)

    @property
    def is_alive(self) -> bool:
        return self.client.is_alive

    # -- text, for the serving layer (which never reaches into the tokenizer) --------------
    @property
    def has_tokenizer(self) -> bool:
        """False with --skip-tokenizer-init: prompts are token ids, outputs have no text."""
        return self.tokenizer is not None

    @property
    def image_placeholder(self) -> str | None:
        """The text that stands for one image in a prompt; None: the model takes none."""
        return self.processor.image_placeholder

    @property
    def chat_template(self) -> str | None:
        """The chat template in use (--chat-template, else the tokenizer's); None under a
        chat encoding (``chat_encoding``), which renders chats instead."""
        if self.chat_encoding is not None:
            return None
        return getattr(self.tokenizer, "chat_template", None)

    @property
    def chat_encoding(self) -> str | None:
        """The --tokenizer-mode whose own encoding renders chats (``deepseek_v32``), or
        None: the chat template does."""
        processor = self.processor
        return processor.chat_encoding_mode if processor.chat_encoding is not None else None

    def apply_chat_template(
        self,
        messages: list[dict],
        chat_template: str | None,
        add_generation_prompt: bool,
        tools: list[dict] | None,
        template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> str:
        """The prompt text of a conversation (blocking: callers run it in the tokenizer
        thread, its cost grows with the messages and tools)."""
        return self.processor.apply_chat_template(
            messages,
            chat_template,
            add_generation_prompt,
            tools,
            template_kwargs,
            continue_final_message,
        )

    def tokenize(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``prompt``, checked as for generation (blocking: tokenizer thread)."""
        return self.processor.tokenize(prompt, add_special_tokens)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        """Token ids as text (special tokens kept unless asked); ``VLLMValidationError``
        without a tokenizer."""
        self.processor.require_tokenizer("detokenization", "tokens")
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    @property
    def num_unfinished_requests(self) -> int:
        """This front end's requests not finished yet."""
        return len(self._streams)

    @property
    def engine_load(self) -> int:
        """The requests the engine holds, running or waiting: this front end's own, or,
        when it shares the engine with other API servers, all of them as of the engine's
        latest step."""
        if self.client.proc is not None:
            return len(self._streams)
        return self._engine_requests

    def stalled_for(self) -> float:
        """Seconds the engine has sent nothing while requests are pending (0 if none are).

        Every engine step sends a message, so a long silence with work pending means a hung
        engine process (stopped, deadlocked, or stuck in one step)."""
        if not self._streams or self._asleep:  # asleep: requests wait on purpose
            return 0.0
        return time.monotonic() - self._last_progress

    def fail_all(self, error: BaseException) -> None:
        """End every pending request with ``error`` (each handler aborts its own), and
        every pending utility call."""
        for stream in list(self._streams.values()):
            stream.put(error)
        for future in list(self._utility_calls.values()):
            if not future.done():
                future.set_exception(error)

    async def generate(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams,
        request_id: str,
        add_special_tokens: bool = True,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Yield outputs until the request finishes; cancelling the caller aborts it."""
        stream = await self.add_request(
            prompt,
            sampling_params,
            request_id,
            add_special_tokens=add_special_tokens,
            priority=priority,
        )
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    async def add_request(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams,
        request_id: str,
        **options: Any,
    ) -> RequestStream:
        """Validate and queue now (ValueError / EngineDeadError raise here), stream later:
        ``prepare_request`` (``options``: its keywords), then ``submit_request``."""
        prepared = await self.prepare_request(prompt, sampling_params, request_id, **options)
        return await self.submit_request(prepared)

    async def prepare_request(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams,
        request_id: str,
        add_special_tokens: bool = True,
        priority: int = 0,
        executor: Executor | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        pooling: bool = False,
        multi_modal_data: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> PreparedRequest:
        """``add_request``'s first half: every check, the tokenization and validation,
        nothing queued or held (a batch of prompts is prepared whole, so that one bad
        prompt fails it before any runs); ``submit_request`` queues it. ``executor``:
        tokenize and validate there, off the event loop (a long prompt would hold the
        loop, and every other request and /health, for its whole tokenization)."""
        self._check_can_add(request_id)
        # Before any work, as vLLM's preflight; submit_request checks again.
        self.check_admission(sampling_params.n, request_id)
        # A grammar compiles in its own thread, within a time budget (a 400 past it).
        await self.processor.check_structured_outputs(sampling_params)
        self._check_can_add(request_id)  # again: other requests ran meanwhile
        process = functools.partial(
            self.processor.process,
            prompt,
            sampling_params,
            request_id,
            priority,
            cache_salt=cache_salt,
            add_special_tokens=add_special_tokens,
            structured_outputs_checked=True,
            lora_request=lora_request,
            pooling=pooling,
            multi_modal_data=multi_modal_data,
            mm_processor_kwargs=mm_processor_kwargs,
        )
        if executor is None and not multi_modal_data:
            _, core_reqs = process()
        else:  # a long prompt, or images (resized and normalised off the event loop)
            _, core_reqs = await asyncio.get_running_loop().run_in_executor(executor, process)
        return PreparedRequest(
            request_id,
            prompt if isinstance(prompt, str) else None,
            core_reqs,
            sampling_params.output_kind,
        )

    async def submit_request(self, prepared: PreparedRequest) -> RequestStream:
        """Queue a prepared request in the engine; its outputs come on the stream."""
        request_id, core_reqs = prepared.request_id, prepared.core_reqs
        self._check_can_add(request_id)  # again: other requests ran meanwhile
        # No await from this check to the registration: concurrent submits see each other.
        self.check_admission(len(core_reqs), request_id)
        headers = current_trace_headers()  # the HTTP request's (api_server's middleware)
        if self.tracer is None:
            warn_untraced(headers)
        self.output_processor.add_request(
            request_id, prepared.prompt_text, core_reqs, trace_headers=headers
        )
        self.admission.publish()
        stream = RequestStream(
            self,
            request_id,
            [r.request_id for r in core_reqs],
            list(core_reqs[0].prompt_token_ids) if core_reqs else None,
            prepared.output_kind,
        )
        if not self._streams:  # an idle engine owes no progress until now
            self._last_progress = time.monotonic()
        self._streams[request_id] = stream
        for r in core_reqs:
            self._by_child[r.request_id] = stream
        try:
            choose = getattr(self.client, "choose_rank", None)  # --data-parallel-size
            if choose is not None and core_reqs:
                # One rank for all n samples (they share the prompt's blocks): the
                # header's (X-data-parallel-rank), else the job's or the least loaded.
                rank = choose(core_reqs[0], requested_rank())
                for r in core_reqs:
                    r.data_parallel_rank = rank
            for r in core_reqs:
                r.client_index = self.client.client_index
                await self.client.send(EngineCoreRequestType.ADD, r)
        except BaseException:
            await self.abort(request_id)
            raise
        return stream

    def _check_can_add(self, request_id: str) -> None:
        if not self.client.is_alive:
            raise EngineDeadError(self.client.dead_reason or "the engine core process died")
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")

    async def start_profile(self) -> None:
        """--profiler-config: the engine core starts recording its steps (vLLM's
        ``start_profile``); ``ValueError`` without a profiler."""
        await self._profile(True)

    async def stop_profile(self) -> None:
        """The engine core stops recording and writes the trace into the configured
        folder; returns once it is written."""
        await self._profile(False)

    async def _profile(self, start: bool) -> None:
        if not self.config.profiler_config.enabled:
            raise ValueError("no profiler: start the server with --profiler-config")
        await self.call_utility("profile", start)

    async def reset_prefix_cache(self) -> bool:
        """Empty the engine's prefix cache (vLLM's); False while blocks are in use
        (running requests, pinned jobs): nothing is reset then, and the caller may retry."""
        return bool(await self.call_utility("reset_prefix_cache"))

    async def sleep(self, level: int = 1) -> None:
        """vLLM's sleep ("abort" mode): the engine aborts every unfinished request (their
        streams end with finish_reason abort), empties the prefix cache and frees its KV
        cache (level 1) and weights (level 2). Requests sent while it sleeps wait for
        ``wake_up``. ``ValueError`` without --enable-sleep-mode."""
        await self.call_utility("sleep", level)
        self._asleep = True
        self._record_sleep_state(level)

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        """Bring back ``tags`` ("weights", "kv_cache"; None: all); whether fully awake."""
        awake = bool(await self.call_utility("wake_up", tags))
        if awake:
            self._asleep = False
            self._last_progress = time.monotonic()  # the waiting requests' wait starts now
            self._record_sleep_state()
        return awake

    async def is_sleeping(self) -> bool:
        """Asleep, or paused (as vLLM's, whose sleep is a pause of its scheduler)."""
        return bool(await self.call_utility("is_sleeping")) or await self.is_paused()

    async def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """vLLM's pause of generation (e.g. for a weight update): the engine schedules
        nothing new until ``resume_generation``; requests sent meanwhile wait. ``mode``:
        "abort" ends every unfinished request (finish_reason abort), "wait" returns once
        the running ones have finished, "keep" freezes them (their KV kept) until the
        resume. ``clear_cache`` (not for "keep"): once drained, Continuum's pins are
        released and the prefix cache emptied. ``VLLMValidationError`` for another mode."""
        if mode not in PAUSE_MODES:
            raise VLLMValidationError(
                f"mode must be one of {', '.join(PAUSE_MODES)}; got {mode!r}", "mode", mode
            )
        await self.call_utility("pause", mode, clear_cache)

    async def resume_generation(self) -> None:
        """Schedule again after ``pause_generation`` (a "wait" pause still waiting for
        its running requests then fails with ``ValueError``)."""
        await self.call_utility("resume")

    async def is_paused(self) -> bool:
        return bool(await self.call_utility("is_paused"))

    # -- RL weight sync (vLLM's weight-transfer API; the engine's end: weight_sync.py) ---
    async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Join the trainer's process group (``vllm.distributed.weight_transfer``): returns
        once the trainer has joined too. ``ValueError`` without --weight-transfer-config."""
        await self.call_utility("init_weight_transfer_engine", init_info)

    async def shutdown_weight_transfer_engine(self) -> None:
        await self.call_utility("shutdown_weight_transfer_engine")

    async def start_weight_update(self) -> None:
        await self.call_utility("start_weight_update")

    async def update_weights(self, update_info: dict[str, Any]) -> None:
        """Receive a chunk of the round (``names``, ``dtype_names``, ``shapes``) while the
        trainer broadcasts it."""
        await self.call_utility("update_weights", update_info)

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Swap the round's weights in (and name their version); the prefix cache is
        emptied (see ``EngineCore.finish_weight_update``)."""
        await self.call_utility("finish_weight_update", weight_version)

    async def update_weight_version(self, new_version: str) -> None:
        await self.call_utility("set_weight_version", new_version)

    async def get_weight_version(self) -> str:
        return await self.call_utility("get_weight_version")

    async def compute_weight_checksums(self) -> dict[str, str]:
        return await self.call_utility("compute_weight_checksums")

    async def reset_weights(self) -> None:
        await self.call_utility("reset_weights")

    def _record_sleep_state(self, level: int | None = None) -> None:
        """The sleep-state gauge: ``level`` asleep, None awake."""
        for stat_logger in self.stat_loggers:
            record = getattr(stat_logger, "record_sleep_state", None)
            if record is not None:
                record(level is not None, level or 0)

    async def call_utility(self, method: str, *args: Any) -> Any:
        """Run the engine's ``method`` (one of ``UTILITY_METHODS``) between its steps and
        return its result; ``ValueError`` with its message if it raised,
        ``EngineDeadError`` if the engine dies first."""
        self.client._check_alive()
        self._next_call_id += 1
        call_id = self._next_call_id
        future = asyncio.get_running_loop().create_future()
        self._utility_calls[call_id] = future
        try:
            call = UtilityCall(call_id, self.client.client_index, method, args)
            await self.client.send(EngineCoreRequestType.UTILITY, call)
            return await future
        finally:
            self._utility_calls.pop(call_id, None)

    async def abort(self, request_id: str) -> None:
        """Stop ``request_id`` (no-op if unknown or finished) and free its blocks."""
        child_ids = self.output_processor.abort_request(request_id)
        self._forget(request_id)
        self.admission.publish()
        if child_ids and self.client.is_alive:
            await self.client.send(EngineCoreRequestType.ABORT, child_ids)

    async def abort_requests(self, external_ids: Collection[str] | None = None) -> int:
        """Stop the in-flight requests whose ``external_id`` is in ``external_ids`` (None
        or empty: every one), as vLLM's /abort_requests routes do: each stream's reader
        gets a last output with finish_reason ``abort`` (a non-streaming response still
        answers, with what it had), and the core frees their blocks. Returns how many."""
        wanted = set(external_ids or ())
        streams = [s for s in self._streams.values() if not wanted or s.external_id in wanted]
        children = [c for s in streams for c in self.output_processor.child_ids(s.request_id)]
        ends = [EngineCoreOutput(c, [], finish_reason=FinishReason.ABORT) for c in children]
        results, _ = self.output_processor.process_outputs(ends)
        for out in results:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                if out.finished:
                    self._forget(out.request_id)
                stream.put(out)
        self.admission.publish()
        if children and self.client.is_alive:
            await self.client.send(EngineCoreRequestType.ABORT, children)
        return len(streams)

    def _forget(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            for child in stream.child_ids:
                self._by_child.pop(child, None)

    async def _output_loop(self) -> None:
        try:
            # Python 3.11's wait_for can swallow a cancel that lands as its message
            # arrives; the flag ends the loop then instead of a recv on closed sockets.
            while not self._shut_down:
                msg = await self.client.recv()
                if msg is not None and not self._shut_down:
                    self._last_progress = time.monotonic()
                    await self._handle(*msg)
        except asyncio.CancelledError:
            return
        except Exception as e:
            # A dead engine, or a bug here: fail every pending request instead of hanging.
            if not isinstance(e, EngineDeadError):
                logger.exception("output loop stopped")
            self.client.dead_reason = self.client.dead_reason or f"output loop failed: {e}"
            self.fail_all(e if isinstance(e, EngineDeadError) else EngineDeadError(str(e)))

    async def _handle(self, msg_type: EngineCoreOutputType, payload: Any) -> None:
        """Dispatch one engine message by type; ``EngineDeadError`` ends the output loop."""
        match msg_type:
            case EngineCoreOutputType.OUTPUTS:
                await self._deliver_outputs(payload)
            case EngineCoreOutputType.REQUEST_ERROR:
                self._fail_request(payload)
            case EngineCoreOutputType.FATAL:
                raise self.client.mark_dead(f"the engine core failed: {last_line(payload)}")
            case EngineCoreOutputType.UTILITY_RESULT:
                future = self._utility_calls.get(payload.call_id)
                if future is not None and not future.done():  # else its caller left
                    if payload.error is None:
                        future.set_result(payload.result)
                    else:
                        future.set_exception(ValueError(payload.error))
            case _:  # READY again, or a type added to the enum but not handled here
                raise self.client.mark_dead(
                    f"protocol error from the engine core: unexpected {msg_type.name}"
                )

    def _fail_request(self, error: EngineCoreRequestError) -> None:
        """The engine refused or failed one request (nothing of it is left there): its
        stream raises ``GenerationError`` (500) if the engine failed, else ``ValueError``
        (400); the stream's close forgets it here and aborts its siblings (n > 1)."""
        stream = self._by_child.get(error.request_id)
        if stream is not None:
            cls = GenerationError if error.internal else ValueError
            stream.put(cls(error.message))

    async def _deliver_outputs(self, msg: StampedOutputs) -> None:
        core_outputs, sent_at = msg.outputs, msg.sent_at
        if (stats := core_outputs.scheduler_stats) is not None:
            self._engine_requests = stats.num_running_reqs + stats.num_waiting_reqs
        for core_id, received in msg.arrivals.items():
            stream = self._by_child.get(core_id)
            if stream is not None and (
                stream.engine_arrival is None or received < stream.engine_arrival
            ):
                stream.engine_arrival = received
        results, to_stop = self.output_processor.process_outputs(
            core_outputs.outputs, core_outputs.weight_version
        )
        self.admission.publish()
        if to_stop:
            await self.client.send(EngineCoreRequestType.STOP, to_stop)
        for out in results:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                if stream.engine_arrival is not None:
                    stream.engine_latency_s = sent_at - stream.engine_arrival
                self._forget(out.request_id)
            stream.put(out)
        if self.stat_loggers:
            # After the woken handlers have run: when many requests finish in one step,
            # their responses should not wait for the histograms.
            latencies = self.output_processor.inter_token_latencies
            asyncio.get_running_loop().call_soon(
                self._record_stats, core_outputs, results, latencies
            )

    def _record_stats(
        self,
        core_outputs: EngineCoreOutputs,
        results: list[RequestOutput],
        inter_token_latencies: list[float],
    ) -> None:
        for stat_logger in self.stat_loggers:
            stat_logger.record(core_outputs, results, inter_token_latencies)

    def shutdown(self) -> None:
        self._shut_down = True
        if self._loop_task is not None:
            self._loop_task.cancel()
        self.client.shutdown()
        if self.tracer is not None:
            self.tracer.shutdown()  # the spans still queued are exported
