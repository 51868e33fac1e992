"""POST /v1/chat/completions."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from fastapi.responses import Response
from pydantic import ValidationError

from vllm.entrypoints.openai import beam_search as beams
from vllm.entrypoints.openai.harmony_plan import plan_harmony, uses_harmony
from vllm.entrypoints.openai.protocol import NO_IMAGES, ChatCompletionRequest, now_s
from vllm.entrypoints.openai.protocol_generate import generate_body
from vllm.entrypoints.openai.serving_engine import (
    EngineStreamingResponse,
    OpenAIServing,
    Receive,
    one_event_or_json,
)
from vllm.entrypoints.openai.tool_calling import (
    ToolCallingConfig,
    ToolPlan,
    plan_tool_calls,
    warn_if_template_ignores_tools,
)
from vllm.exceptions import VLLMValidationError
from vllm.multimodal.media import load_image, template_reads_parts
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.transformers_utils.chat_encodings import images_refused
from vllm.v1.engine.async_llm import RequestStream

if TYPE_CHECKING:
    from PIL import Image

# The engine's names for what a chat request's messages become: its prompt, its images.
ENGINE_PROMPT_PARAMS = ("prompt", "multi_modal_data")
# Threads that load requests' images (fetch, read, decode), apart from the tokenizer
# thread: a slow image URL (up to VLLM_IMAGE_FETCH_TIMEOUT) then holds up no other
# request's tokenization, and a request's images load side by side.
MEDIA_THREADS = 4


class OpenAIServingChat(OpenAIServing):
    tool_config = ToolCallingConfig()  # the server's tool flags (build_app sets them)
    _media_executor: ThreadPoolExecutor | None = None

    @functools.cached_property
    def cache_block(self) -> int:
        """The prompt's full blocks are written to the prefix cache (0: caching is off).
        Read on first use: the app is built (and its schema served) before any engine."""
        cache = self.engine.config.cache_config
        return cache.block_size if cache.enable_prefix_caching else 0

    @functools.cached_property
    def harmony(self) -> bool:
        """The model answers in OpenAI's harmony format (gpt-oss): its replies are read by
        the harmony plan (harmony_plan.py). Read by the first request, as ``cache_block``."""
        model_config = getattr(getattr(self.engine, "config", None), "model_config", None)
        return uses_harmony(model_config, self.tool_config)

    def cache_writes(self, prompt: int, cached: int) -> int:
        """The prompt tokens a request wrote to the prefix cache: those of its full KV
        blocks (every full block of every prompt is kept) that it did not read from it."""
        full = prompt // self.cache_block * self.cache_block if self.cache_block else 0
        return max(full - cached, 0)

    async def _prompt(self, request: ChatCompletionRequest, plan: ToolPlan) -> str:
        """The prompt text: the chat template over the messages, their image parts as the
        model's placeholder text (``_check_images``) or as typed parts (``_typed_parts``)."""
        if request.chat_template is not None and not self.args.trust_request_chat_template:
            raise VLLMValidationError(
                "chat_template in a request is refused: the server was not started with "
                "--trust-request-chat-template",
                "chat_template",
            )
        encoding = getattr(self.engine, "chat_encoding", None)
        if encoding is not None and request.has_images:
            raise VLLMValidationError(images_refused(encoding), "messages")
        if plan.template_tools and encoding is None:
            template = request.chat_template or self.engine.chat_template
            warn_if_template_ignores_tools(template)
        image_placeholder = self._check_images(request)
        engine = self.engine
        typed = self._typed_parts(request)

        def render() -> str:
            messages = [m.for_template(image_placeholder, typed) for m in request.messages]
            return engine.apply_chat_template(
                messages,
                request.chat_template,
                request.add_generation_prompt,
                plan.template_tools,
                request.chat_template_kwargs,
                request.continue_final_message,
            )

        try:
            # Always in the tokenizer thread: its cost grows with the messages and the tools
            # a template renders, not with the text alone; the event loop must not wait.
            return await self.in_thread(render)
        except VLLMValidationError:
            raise
        except Exception as e:  # jinja errors from malformed conversations
            raise VLLMValidationError(f"chat template failed: {e}", "messages") from e

    async def _prepare(self, request: ChatCompletionRequest):
        """The checked request's tool plan, prompt text and sampling params."""
        # Every chat-shaped route (chat, render, /tokenize's messages, responses, Anthropic
        # messages) comes here: its template needs the tokenizer.
        self.require_tokenizer("chat messages (the chat template)", "messages")
        self.check_request(request)
        defaults = self.args.default_chat_template_kwargs  # the request's own win
        kwargs = {**(defaults or {}), **(request.chat_template_kwargs or {})}
        if request.documents is not None:
            kwargs["documents"] = request.documents
        if request.reasoning_effort is not None:  # as vLLM: the field wins, not the flag
            kwargs["reasoning_effort"] = request.reasoning_effort
            if "enable_thinking" not in (request.chat_template_kwargs or {}):
                kwargs["enable_thinking"] = request.reasoning_effort != "none"
        request.chat_template_kwargs = kwargs or None
        if "harmony" not in self.__dict__:  # read the HF config once, off the event loop
            await self.in_thread(lambda: self.harmony)
        plan = (plan_harmony if self.harmony else plan_tool_calls)(request, self.tool_config)
        prompt = await self._prompt(request, plan)
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        # max_completion_tokens (OpenAI's newer name) wins; None: until max_model_len.
        max_tokens = request.max_completion_tokens
        if max_tokens is None:
            max_tokens = request.max_tokens
        params = request.to_sampling_params(
            max_tokens, logprobs, request.stream, self.default_sampling_params
        )
        params.structured_outputs = plan.structured_outputs
        if plan.keep_special_tokens:  # the parser's markers are special tokens
            params.skip_special_tokens = False
        budget = request.thinking_token_budget
        if budget is not None and budget != -1:
            await self._budget_thinking(params, plan, budget)
        return plan, prompt, params

    def _typed_parts(self, request: ChatCompletionRequest) -> bool:
        """Whether the template gets each message's content as typed parts (vLLM's "openai"
        content format) rather than text: --chat-template-content-format, or with "auto"
        for a request with images, whether the template reads a message's parts (as
        llava-hf's do: a text content renders as nothing there). A text-only request
        renders as it always has unless the flag says "openai"."""
        chosen = self.args.chat_template_content_format
        if chosen != "auto":
            return chosen == "openai"
        if not request.has_images:
            return False
        template = request.chat_template or self.engine.chat_template
        return isinstance(template, str) and template_reads_parts(template)

    def _check_images(self, request: ChatCompletionRequest) -> str | None:
        """The model's image placeholder (LLaVA's ``<image>``) when ``request`` holds
        images, None when it holds none. Checked before any image is loaded: the model
        takes images, and at most --limit-mm-per-prompt of them (the engine checks again)."""
        count = sum(len(m.image_urls) for m in request.messages)
        if not count:
            return None
        placeholder = getattr(self.engine, "image_placeholder", None)
        if placeholder is None:
            raise VLLMValidationError(NO_IMAGES, "messages")
        from vllm.multimodal.processing import DEFAULT_LIMIT_PER_PROMPT

        model_config = getattr(getattr(self.engine, "config", None), "model_config", None)
        limits = getattr(model_config, "limit_mm_per_prompt", None) or {}
        limit = limits.get("image", DEFAULT_LIMIT_PER_PROMPT)
        if count > limit:
            raise VLLMValidationError(
                f"at most {limit} images a prompt (--limit-mm-per-prompt), got {count}",
                "messages",
            )
        return placeholder

    @classmethod
    def media_executor(cls) -> ThreadPoolExecutor:
        if cls._media_executor is None:
            cls._media_executor = ThreadPoolExecutor(MEDIA_THREADS, thread_name_prefix="media")
        return cls._media_executor

    async def _load_images(self, request: ChatCompletionRequest) -> list[Image.Image]:
        """The request's images, every message's in order, loaded off the event loop; a
        URL that fails to load is a 400 naming ``messages``."""
        urls = [url for m in request.messages for url in m.image_urls]
        root = self.args.allowed_local_media_path
        domains = self.args.allowed_media_domains

        def load(i: int, url: str) -> Image.Image:
            try:
                return load_image(url, allowed_local_media_path=root, allowed_media_domains=domains)
            except ValueError as e:
                raise VLLMValidationError(
                    f"image {i} of the messages could not be loaded: {e}", "messages"
                ) from e

        loop, pool = asyncio.get_running_loop(), self.media_executor()
        loads = [loop.run_in_executor(pool, load, i, url) for i, url in enumerate(urls)]
        return list(await asyncio.gather(*loads))

    async def _budget_thinking(self, params, plan: ToolPlan, budget: int) -> None:
        """``params`` end the reasoning after ``budget`` tokens: its end tag (or a tag that
        ends it, such as Qwen3's ``<tool_call>``) as token ids for the sampler."""
        reasoning = plan.reasoning
        if reasoning is None:
            raise VLLMValidationError(
                "thinking_token_budget needs a reasoning parser: start the server with "
                "--reasoning-parser (and leave separate_reasoning true)",
                "thinking_token_budget",
            )
        end = reasoning.end_of_reasoning
        if end is None:
            return  # this request does not reason (e.g. enable_thinking: false)
        tags = [end, *getattr(reasoning, "content_starts", ())]
        params.thinking_token_budget = budget
        ends = [await self._tag_ids(tag) for tag in tags]
        params.thinking_end_token_ids = [ids for ids in ends if ids]

    @functools.cached_property
    def _tag_id_cache(self) -> dict[str, list[int]]:
        return {}

    async def _tag_ids(self, tag: str) -> list[int]:
        """The token ids of a reasoning parser's tag, tokenized once per server."""
        cache = self._tag_id_cache
        if tag not in cache:
            cache[tag] = await self.in_thread(self.engine.tokenize, tag, False)
        return cache[tag]

    async def start_generation(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        external_id: str | None = None,
        prepared: tuple[ToolPlan, list[int], Any] | None = None,
    ) -> tuple[ToolPlan, RequestStream]:
        """Check ``request``, render its prompt and add it to the engine as ``request_id``:
        its tool plan (how to read the output) and its output stream. Shared by
        /v1/responses, which converts its input into a chat request. A rejected request
        raises ``VLLMValidationError`` naming the chat field (the prompt is ``messages``).
        ``prepared``: ``prepare_tokens(request)``'s result (rendered already)."""
        plan, prompt, params = prepared or await self._prepare(request)
        options = await self.engine_options(request)
        try:
            stream = await self.add_request(
                prompt, params, request_id, request.priority, external_id, **options
            )
        except VLLMValidationError as e:
            if e.param in ENGINE_PROMPT_PARAMS:  # this endpoint's prompt is its messages
                e.param = "messages"
            raise
        return plan, stream

    async def engine_options(self, request: ChatCompletionRequest) -> dict[str, Any]:
        """The engine's keywords for ``request``'s prompt (``AsyncLLM.prepare_request``'s,
        but its priority): its images, loaded here, once every other check passed (a
        refused request fetches nothing), and their processor's kwargs; no special token
        added by the tokenizer (the template wrote BOS and the like) unless the request's
        add_special_tokens (vLLM's) asks; its cache salt and LoRA adapter."""
        images = await self._load_images(request) if request.has_images else []
        options: dict[str, Any] = {"multi_modal_data": {"image": images}} if images else {}
        if request.mm_processor_kwargs:
            options["mm_processor_kwargs"] = request.mm_processor_kwargs
        return {
            "add_special_tokens": bool(request.add_special_tokens),
            "cache_salt": request.cache_salt,
            "lora_request": self.check_model(request),
            **options,
        }

    async def render_chat(self, request: ChatCompletionRequest) -> dict:
        """POST /v1/chat/completions/render (vLLM's route): the /inference/v1/generate body
        the request would run as (its prompt's token ids and its sampling parameters,
        tool and response-format grammars included), nothing generated; checked as for
        generation. vllm-router's cache_aware asks every replica for it and routes a chat
        by its longest token prefix (docs/router.md). Images are not loaded: each is its
        one placeholder token here, which the engine expands to the image's tokens when it
        takes the request (the tokens route takes no images yet)."""
        _, prompt, params = await self._prepare(request)
        token_ids = await self._tokenize_prompt(prompt, bool(request.add_special_tokens))
        return generate_body(token_ids, params, self.response_model(request.model), request)

    async def prompt_token_ids(
        self, request: ChatCompletionRequest, add_special_tokens: bool = False
    ) -> list[int]:
        """The token ids ``request`` would run with, checked as for generation. By default
        the tokenizer adds no special token: the template wrote them (BOS etc.)."""
        _, prompt, _ = await self._prepare(request)
        return await self._tokenize_prompt(prompt, add_special_tokens)

    async def prepare_tokens(
        self, request: ChatCompletionRequest
    ) -> tuple[ToolPlan, list[int], Any]:
        """``start_generation``'s rendering, nothing run: the checked request's tool plan,
        prompt token ids (as the engine would tokenize its text) and sampling params, for
        a caller that counts the prompt first (/v1/responses' ``truncation: "auto"``)."""
        plan, prompt, params = await self._prepare(request)
        return plan, await self._tokenize_prompt(prompt, bool(request.add_special_tokens)), params

    @property
    def context_limit(self) -> int:
        """The most tokens a request (prompt and output) may have: max_model_len, or the
        KV pool's when it holds less (the engine refuses a longer prompt)."""
        return self.engine.processor.context_limit

    async def _tokenize_prompt(self, prompt: str, add_special_tokens: bool) -> list[int]:
        try:
            return await self.in_thread(self.engine.tokenize, prompt, add_special_tokens)
        except VLLMValidationError as e:
            if e.param in ENGINE_PROMPT_PARAMS:  # this endpoint's prompt is its messages
                e.param = "messages"
            raise

    async def create_chat_completion(
        self,
        request: ChatCompletionRequest,
        received: float | None = None,
        receive: Receive | None = None,
    ):
        """The response (JSON or SSE); ``received``: monotonic arrival time, for timing;
        ``receive``: the ASGI receive, to abort the request if the client disconnects."""
        request_id, engine_id = self.request_ids(request, "chatcmpl")
        created = now_s()
        if request.use_beam_search:
            return await self._beam_search(request, request_id, engine_id, created, receive)
        plan, stream = await self.start_generation(request, engine_id, request_id)
        if request.stream:
            return EngineStreamingResponse(
                self._stream(request, plan, stream, request_id, created, received),
                stream,
                self.args.sse_keep_alive_interval,
            )

        def body(final: RequestOutput) -> dict:
            return self.reply_body(request, plan, final, request_id, created)

        return await self.respond_json(stream, body, received, receive)

    def reply_body(
        self,
        request: ChatCompletionRequest,
        plan: ToolPlan,
        final: RequestOutput,
        request_id: str,
        created: int,
    ) -> dict:
        """The chat.completion object of ``final`` (the reply read as ``plan`` says: tool
        calls, reasoning): the non-streaming response, and /v1/chat/completions/derender's."""
        hide, as_ids = plan.hides_reasoning, self.tokens_as_ids(request)
        echo = request.echoed_text(plan.role)

        def choice(c: CompletionOutput) -> dict:
            message, finish_reason = plan.message(c.text, c.finish_reason)
            if echo:  # as vLLM: a tool-call reply's null content becomes the echo
                message["content"] = echo + (message.get("content") or "")
            out = {
                "index": c.index,
                "message": message,
                "logprobs": None if hide else self.chat_logprobs(c, as_ids),
                "finish_reason": finish_reason,
                "stop_reason": c.stop_reason,
            }
            if request.return_token_ids:  # vLLM's
                out["token_ids"] = None if hide else c.token_ids
            return out

        choices = [choice(c) for c in final.outputs]
        usage = self.usage([final]).model_dump()
        self._count_reasoning(usage, request, plan, [c.token_ids for c in final.outputs])
        out = {
            "id": request_id,
            "object": "chat.completion",
            "created": created,
            "model": self.response_model(request.model),
            "choices": choices,
            "usage": usage,
            "prompt_logprobs": self.prompt_logprobs(final.prompt_logprobs),  # vLLM's
        }
        if request.return_token_ids:
            out["prompt_token_ids"] = final.prompt_token_ids
        if final.kv_transfer_params is not None:  # a disaggregated prefill's (vLLM's)
            out["kv_transfer_params"] = final.kv_transfer_params
        return out

    async def _beam_search(
        self, request: ChatCompletionRequest, request_id, engine_id, created, receive
    ):
        """vLLM's beam search (beam_search.py): ``n`` replies, best first, each read as a
        reply is (tool calls, reasoning); a stream gets it all as one chunk, as vLLM."""
        beams.check_request(request, self.engine.processor.max_logprobs)
        plan, prompt, _ = await self._prepare(request)
        if request.has_images:  # beams are searched on the prompt's token ids alone
            raise VLLMValidationError(
                "use_beam_search does not take images: send the request without it",
                "use_beam_search",
            )
        if plan.structured_outputs is not None:  # a required or named tool_choice
            raise VLLMValidationError(
                "a guided reply does not go with use_beam_search", "tool_choice"
            )
        ids = await self.in_thread(self.engine.tokenize, prompt, bool(request.add_special_tokens))
        max_tokens = request.max_completion_tokens
        if max_tokens is None:
            max_tokens = request.max_tokens
        results = await beams.search_all(
            self, [ids], max_tokens, engine_id, width=request.n,
            eos_ids=[self.engine.processor.eos_token_id], ignore_eos=request.ignore_eos,
            length_penalty=request.length_penalty, priority=request.priority,
            receive=receive, cache_salt=request.cache_salt,
            lora_request=self.check_model(request),
        )  # fmt: skip
        if results is None:
            return Response(status_code=499)  # the client left; every step aborted
        echo = request.echoed_text(plan.role)
        skip_special = request.skip_special_tokens and not plan.keep_special_tokens
        choices, generated = [], 0
        for j, beam in enumerate(results[0]):
            keep = beam.text_tokens(request.include_stop_str_in_output)
            message, finish = plan.message(
                self.engine.decode(keep, skip_special), beam.finish_reason
            )
            if echo:
                message["content"] = echo + (message.get("content") or "")
            if request.stream:  # one chunk: the message as its delta
                if message.get("tool_calls"):  # a delta's calls carry their index
                    calls = message["tool_calls"]
                    message["tool_calls"] = [{**c, "index": k} for k, c in enumerate(calls)]
                choices.append({"index": j, "delta": message, "finish_reason": finish})
            else:
                choices.append({"index": j, "message": message, "logprobs": None,
                                "finish_reason": finish, "stop_reason": None})  # fmt: skip
            generated += len(beam.tokens)
        body = {
            "id": request_id,
            "object": "chat.completion.chunk" if request.stream else "chat.completion",
            "created": created,
            "model": self.response_model(request.model),
            "choices": choices,
            "usage": {
                "prompt_tokens": len(ids),
                "completion_tokens": generated,
                "total_tokens": len(ids) + generated,
            },  # fmt: skip
        }
        return one_event_or_json(body, request.stream)

    def reasoning_tokens(
        self, request: ChatCompletionRequest, plan: ToolPlan, outputs: list[list[int]]
    ) -> int | None:
        """With --reasoning-parser (or a harmony model), the reasoning's tokens in every
        choice's output ids (0 when the request split none off); None without one."""
        if not self.counts_reasoning:
            return None
        skip = request.skip_special_tokens and not plan.keep_special_tokens

        def decode(ids) -> str:
            return self.engine.decode(list(ids), skip)

        return sum(plan.reasoning_tokens(ids, decode) for ids in outputs)

    @property
    def counts_reasoning(self) -> bool:
        """Usage reports reasoning tokens: with --reasoning-parser, as vLLM; a harmony
        model always has one (vLLM gives gpt-oss ``openai_gptoss`` by default)."""
        return self.tool_config.reasoning_parser is not None or self.harmony

    def _count_reasoning(
        self,
        usage: dict,
        request: ChatCompletionRequest,
        plan: ToolPlan,
        outputs: list[list[int]],
    ) -> None:
        """vLLM's ``completion_tokens_details.reasoning_tokens`` in ``usage``, with
        --reasoning-parser."""
        count = self.reasoning_tokens(request, plan, outputs)
        if count is not None:
            usage["completion_tokens_details"] = {"reasoning_tokens": count}

    def _stream(self, request, plan: ToolPlan, stream, request_id: str, created: int, received):
        base = {
            "id": request_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": self.response_model(request.model),
        }

        streamers = [plan.streamer() for _ in range(request.n)]  # None: plain content
        # Each choice's output ids, for the usage's reasoning tokens.
        counted = self.counts_reasoning and plan.reasoning is not None
        output_ids: list[list[int]] = [[] for _ in range(request.n)]

        def observe(c: CompletionOutput) -> None:
            output_ids[c.index] += c.token_ids

        hide, as_ids = plan.hides_reasoning, self.tokens_as_ids(request)
        token_ids = request.return_token_ids and not hide

        def chunk(c: CompletionOutput) -> dict:
            delta, finish_reason = {"content": c.text} if c.text else {}, c.finish_reason
            streamer = streamers[c.index]
            if streamer is not None:
                delta = streamer.delta(c.text, c.finish_reason is not None)
                finish_reason = plan.finish_reason(c.finish_reason, streamer.called)
            out = {
                "index": c.index,
                "delta": delta,
                "logprobs": None if hide else self.chat_logprobs(c, as_ids),
                "finish_reason": finish_reason,
            }
            if token_ids:
                out["token_ids"] = c.token_ids  # this chunk's (vLLM's return_token_ids)
            return {**base, "choices": [out]}

        first = [
            {
                **base,
                "choices": [
                    {
                        "index": i,
                        "delta": {"role": plan.role, "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            }
            for i in range(request.n)
        ]
        if request.return_token_ids:
            first[0]["prompt_token_ids"] = stream.prompt_token_ids  # in the first chunk only
        echo = request.echoed_text(plan.role)
        if echo:  # vLLM's: a chunk of it for each choice, after the role chunks
            first += [
                {
                    **base,
                    "choices": [
                        {"index": i, "delta": {"content": echo}, "logprobs": None,
                         "finish_reason": None}
                    ],
                }
                for i in range(request.n)
            ]  # fmt: skip
        include_usage, continuous_usage = request.stream_usage(self.args.enable_force_include_usage)

        def usage(u) -> dict:
            out = u.model_dump()
            self._count_reasoning(out, request, plan, output_ids)
            return out

        return self.stream_events(
            stream,
            chunk,
            first,
            include_usage,
            lambda u: {**base, "choices": [], "usage": usage(u)},
            received,
            observe if counted and include_usage else None,
            continuous_usage,
            every_output=token_ids,
        )


# -- endpoints that convert their request into a chat request ----------------------------
def renamed(e: VLLMValidationError, names: Mapping[str, str]) -> VLLMValidationError:
    """``e`` naming the field of the request the chat request was converted from
    (``names``: chat field -> that request's)."""
    e.param = names.get(e.param, e.param)
    return e


def converted_request_error(e: ValidationError, names: Mapping[str, str]) -> VLLMValidationError:
    """A converted chat request's validation error, naming the original request's field."""
    first = e.errors()[0]
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, VLLMValidationError):
        return renamed(cause, names)
    loc = [str(p) for p in first.get("loc", ())]
    param = names.get(loc[0], loc[0]) if loc else None
    return VLLMValidationError(f"{param}: {first['msg']}", param)
