"""POST /v1/completions.

``prompt`` is a string, token ids, or a batch of either (OpenAI's and vLLM's API): each
prompt of a batch is one engine request, and its choices are numbered ``i * n + j``
(prompt ``i``, choice ``j``), as vLLM numbers them; the usage counts them all. A batch
streams its prompts' chunks as they come. ``prompt_embeds`` (vLLM's, with
--enable-prompt-embeds) adds prompts given as embeddings, before those of ``prompt``. A
prompt the engine refuses fails the whole request (those already queued are aborted),
and a client that leaves aborts them all.
"""

from __future__ import annotations

import base64
import binascii
import io

import torch
from fastapi.responses import JSONResponse, Response

from vllm.entrypoints.openai import beam_search as beams
from vllm.entrypoints.openai.protocol import CompletionRequest, now_s
from vllm.entrypoints.openai.protocol_generate import generate_body
from vllm.entrypoints.openai.serving_engine import (
    OFFLOAD_CHARS,
    EngineStreamingResponse,
    OpenAIServing,
    Receive,
    StreamBatch,
    one_event_or_json,
)
from vllm.entrypoints.openai.tool_calling import guided_params
from vllm.exceptions import VLLMValidationError
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import SamplingParams, StructuredOutputsParams
from vllm.v1.outputs import TokenLogprobs


class OpenAIServingCompletion(OpenAIServing):
    def _prompts(self, request: CompletionRequest) -> list[str | list[int]]:
        """The text and token-id prompts; ``prompt_embeds`` (``_embeds``) come first."""
        p, embeds = request.prompt, request.prompt_embeds
        if embeds is not None and p in (None, ""):
            prompts = []  # embeddings only (the openai client sends prompt="" with them)
        elif isinstance(p, str) or not p or isinstance(p[0], int):
            prompts = [p]  # one prompt: text, or token ids
        else:
            prompts = list(p)
        count = len(prompts) + len(_embeds_items(embeds))
        total = count * request.n
        if count > 1 and total > self.args.max_n_sequences:
            raise VLLMValidationError(
                f"a batch of {count} prompts with n={request.n} asks for {total} "
                f"sequences; at most {self.args.max_n_sequences} (--max-n-sequences)",
                "prompt" if embeds is None else "prompt_embeds",
            )
        return prompts

    async def _embeds(self, request: CompletionRequest) -> list:
        """``prompt_embeds`` decoded and checked (``load_prompt_embeds``), in order; those
        that cannot be combined with the request's other fields are a 400 first."""
        items = _embeds_items(request.prompt_embeds)
        if not items:
            return []
        for name, asked in (("echo", request.echo), ("use_beam_search", request.use_beam_search)):
            if asked:
                raise VLLMValidationError(f"{name} cannot be used with prompt_embeds", name)
        processor = self.engine.processor
        out = []
        for item in items:
            if len(item) < OFFLOAD_CHARS:
                out.append(load_prompt_embeds(item, processor))
            else:  # decoding a large tensor would hold the event loop
                out.append(await self.in_thread(load_prompt_embeds, item, processor))
        return out

    def _echo_text(self, prompt: str | list[int]) -> str:
        """``echo``: the prompt as text (token ids decoded) that leads each choice."""
        if isinstance(prompt, str):
            return prompt
        return self.engine.decode(prompt)

    def _logprobs(
        self,
        c: CompletionOutput,
        echoed: RequestOutput | None = None,
        offset: int = 0,
        as_ids: bool = False,
    ) -> dict | None:
        """OpenAI's legacy logprobs object. ``echoed`` (echo): the request whose prompt
        tokens and prompt logprobs lead it, the first token with null ones (as in vLLM).
        ``text_offset``: each token's position in the choice's text, as vLLM counts it
        (its decoded tokens' lengths added up from ``offset``, the text before them).
        ``as_ids``: tokens named ``token_id:<id>`` (the offsets still count the text)."""
        if c.logprobs is None:
            return None
        ids = [lp.token_id for lp in c.logprobs]
        lps: list[TokenLogprobs | None] = list(c.logprobs)
        if echoed is not None and echoed.prompt_logprobs is not None:
            ids = echoed.prompt_token_ids + ids
            lps = echoed.prompt_logprobs + lps
        # Without a tokenizer the choice's text is empty: every token starts at its end.
        decode = self.engine.decode if self.has_tokenizer else lambda _: ""
        texts = [decode([t]) for t in ids]
        offsets = []
        for text in texts:
            offsets.append(offset)
            offset += len(text)
        name = self.logprob_token
        return {
            "tokens": [name(t, as_ids, text) for t, text in zip(ids, texts, strict=True)],
            "token_logprobs": [None if lp is None else lp.logprob for lp in lps],
            "top_logprobs": [
                None if lp is None else {name(t, as_ids): v for t, v in lp.top} for lp in lps
            ],
            "text_offset": offsets,
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
        self._check_without_tokenizer(request)
        prompts = self._prompts(request)
        prompts = await self._embeds(request) + prompts
        if request.use_beam_search:
            return await self._beam_search(request, prompts, receive)
        echo_logprobs = request.echo and request.logprobs is not None
        if echo_logprobs and request.stream:
            raise VLLMValidationError(
                "echo with logprobs is not available when stream=True", "echo"
            )
        guided = guided_params(request)

        def params():  # one each: the engine caps a prompt's max_tokens to its context
            return self.sampling_params(request, guided=guided)

        request_id, engine_id = self.request_ids(request, "cmpl")
        created = now_s()
        streams = await self.add_requests(
            prompts,
            params,
            engine_id,
            request.priority,
            request_id,
            add_special_tokens=request.add_special_tokens is not False,  # vLLM's default: true
            cache_salt=request.cache_salt,
            lora_request=self.check_model(request),
        )
        echoes = [self._echo_text(p) if request.echo else "" for p in prompts]
        base = {
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": self.response_model(request.model),
        }
        if request.stream:
            stream = streams[0] if len(streams) == 1 else StreamBatch(streams, request.n)
            events = self._stream(request, stream, streams, base, echoes, received)
            return EngineStreamingResponse(events, stream, self.args.sse_keep_alive_interval)
        finals = await self.collect_all(streams, receive)
        if finals is None:
            return Response(status_code=499)  # the client left; every request aborted
        choices, as_ids = [], self.tokens_as_ids(request)
        for i, final in enumerate(finals):
            prompt_logprobs = self.prompt_logprobs(final.prompt_logprobs)
            for c in final.outputs:
                choices.append(
                    {
                        "index": i * request.n + c.index,
                        "text": echoes[i] + c.text,
                        "logprobs": self._logprobs(
                            c, final if echo_logprobs else None, as_ids=as_ids
                        ),
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                        "prompt_logprobs": prompt_logprobs,  # vLLM's: in every choice
                        **self._token_ids(request, final.prompt_token_ids, c.token_ids),
                    }
                )
        body = {**base, "choices": choices, "usage": self.usage(finals).model_dump()}
        if finals and finals[0].kv_transfer_params is not None:  # a disaggregated prefill's
            body["kv_transfer_params"] = finals[0].kv_transfer_params
        return JSONResponse(body, headers=self.timing(received, StreamBatch(streams)))

    def sampling_params(
        self,
        request: CompletionRequest,
        stream: bool | None = None,
        guided: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        """What ``request`` runs with (the completions route, its /render and /derender):
        OpenAI's ``max_tokens`` default for completions (16; 0 is refused as on chat, not
        replaced), with ``echo`` and ``logprobs`` the prompt's logprobs too (as vLLM), the
        request's grammar (``guided``: already made, else made here). ``stream``: the
        request's unless given."""
        max_tokens = 16 if request.max_tokens is None else request.max_tokens
        stream = request.stream if stream is None else stream
        params = request.to_sampling_params(
            max_tokens, request.logprobs, stream, self.default_sampling_params
        )
        if request.echo and request.logprobs is not None and params.prompt_logprobs is None:
            params.prompt_logprobs = request.logprobs
        params.structured_outputs = guided or guided_params(request)
        return params

    async def render_completion(self, request: CompletionRequest) -> list[dict]:
        """POST /v1/completions/render (vLLM's): per prompt of the request, the
        /inference/v1/generate body it would run as (its token ids and sampling
        parameters), nothing generated; checked as for generation. ``echo`` shapes the
        response, not what runs: its prompt logprobs are in the parameters, its text is
        the client's to add. Beam search is several engine requests a step: its body keeps
        ``use_beam_search``, which the tokens route refuses."""
        self.check_request(request)
        self._check_without_tokenizer(request)
        if request.prompt_embeds is not None:  # a generate body holds token ids
            raise VLLMValidationError(
                "/v1/completions/render cannot render prompt_embeds", "prompt_embeds"
            )
        prompts = self._prompts(request)
        special = request.add_special_tokens is not False  # vLLM's default: true
        params = self.sampling_params(request)
        model, bodies = self.response_model(request.model), []
        for prompt in prompts:
            ids = prompt if isinstance(prompt, list) else await self._tokenize(prompt, special)
            bodies.append(generate_body(list(ids), params, model, request))
        return bodies

    async def _tokenize(self, prompt: str, add_special_tokens: bool) -> list[int]:
        if len(prompt) < OFFLOAD_CHARS:
            return self.engine.tokenize(prompt, add_special_tokens)
        return await self.in_thread(self.engine.tokenize, prompt, add_special_tokens)

    def _check_without_tokenizer(self, request: CompletionRequest) -> None:
        """--skip-tokenizer-init: what would need text is a 400 before anything runs (a
        text prompt is refused when it is tokenized)."""
        if self.has_tokenizer:
            return
        if request.echo:
            self.require_tokenizer("echo (the prompt as text)", "echo")
        if request.logprobs is not None and not self.tokens_as_ids(request):
            self.require_tokenizer(
                "logprobs' tokens as text (return_tokens_as_token_ids=true names them by id)",
                "logprobs",
            )

    async def _beam_search(self, request: CompletionRequest, prompts, receive):
        """vLLM's beam search (beam_search.py): the choices, best first per prompt; a
        stream gets the whole response as one event, as vLLM sends it."""
        beams.check_request(request, self.engine.processor.max_logprobs)
        special = request.add_special_tokens is not False  # vLLM's default: true
        ids = [
            list(p)
            if isinstance(p, list)
            else await self.in_thread(self.engine.tokenize, p, special)
            for p in prompts
        ]
        request_id, engine_id = self.request_ids(request, "cmpl")
        results = await beams.search_all(
            self, ids, 16 if request.max_tokens is None else request.max_tokens, engine_id,
            width=request.n, eos_ids=[self.engine.processor.eos_token_id],
            ignore_eos=request.ignore_eos, length_penalty=request.length_penalty,
            priority=request.priority, receive=receive, cache_salt=request.cache_salt,
            lora_request=self.check_model(request),
        )  # fmt: skip
        if results is None:
            return Response(status_code=499)  # the client left; every step aborted
        choices, generated = [], 0
        for i, found in enumerate(results):
            echo = self._echo_text(prompts[i]) if request.echo else ""
            for j, beam in enumerate(found):
                keep = beam.text_tokens(request.include_stop_str_in_output)
                choices.append(
                    {
                        "index": i * request.n + j,
                        "text": echo + self._text(keep, request.skip_special_tokens),
                        "logprobs": None,
                        "finish_reason": beam.finish_reason,
                        "stop_reason": None,
                        **self._token_ids(request, ids[i], beam.tokens),
                    }
                )
                generated += len(beam.tokens)
        prompt_tokens = sum(len(p) for p in ids)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": generated,
                 "total_tokens": prompt_tokens + generated}  # fmt: skip
        body = {
            "id": request_id,
            "object": "text_completion",
            "created": now_s(),
            "model": self.response_model(request.model),
            "choices": choices,
            "usage": usage,
        }
        return one_event_or_json(body, request.stream)

    def _text(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        """A choice's text: "" without a tokenizer (--skip-tokenizer-init)."""
        if not self.has_tokenizer:
            return ""
        return self.engine.decode(token_ids, skip_special_tokens)

    def _returns_token_ids(self, request: CompletionRequest) -> bool:
        """vLLM's ``return_token_ids``; always on without a tokenizer, where the token
        ids are the whole output (the text is empty)."""
        return request.return_token_ids or not self.has_tokenizer

    def _token_ids(self, request, prompt_ids: list[int] | None, ids: list[int]) -> dict:
        """vLLM's ``return_token_ids`` fields of a choice (the prompt's: None after a
        choice's first chunk)."""
        if not self._returns_token_ids(request):
            return {}
        return {"prompt_token_ids": prompt_ids, "token_ids": ids}

    def _stream(self, request, stream, streams, base: dict, echoes: list[str], received):
        """``stream``: what is read (one request's, or a batch's ``StreamBatch``, whose
        choices are numbered across the batch); ``streams``: its requests, in order."""
        echoed: set[int] = set()
        started: set[int] = set()
        as_ids = self.tokens_as_ids(request)
        sent: dict[int, int] = {}  # each choice's text so far (characters)

        def chunk(c: CompletionOutput) -> dict:
            prompt = c.index // request.n  # its position in the batch
            text = c.text
            if echoes[prompt] and c.index not in echoed:  # the prompt leads each choice
                echoed.add(c.index)
                text = echoes[prompt] + text
            prompt_ids = None if c.index in started else streams[prompt].prompt_token_ids
            started.add(c.index)
            before = sent.get(c.index, 0) + len(text) - len(c.text)  # the echo leads
            sent[c.index] = sent.get(c.index, 0) + len(text)
            choice = {
                "index": c.index,
                "text": text,
                "logprobs": self._logprobs(c, offset=before, as_ids=as_ids),
                "finish_reason": c.finish_reason,
                **self._token_ids(request, prompt_ids, c.token_ids),
            }
            return {**base, "choices": [choice]}

        include_usage, continuous_usage = request.stream_usage(self.args.enable_force_include_usage)
        return self.stream_events(
            stream,
            chunk,
            [],
            include_usage,
            lambda u: {**base, "choices": [], "usage": u.model_dump()},
            received,
            continuous_usage=continuous_usage,
            every_output=self._returns_token_ids(request),
        )


def _embeds_items(embeds: str | list[str] | None) -> list[str]:
    return [embeds] if isinstance(embeds, str) else list(embeds or [])


# Bytes a torch.save'd tensor holds beyond its values (zip entries, pickle), at most.
_SAVE_OVERHEAD = 1 << 16


def load_prompt_embeds(data: str, processor) -> torch.Tensor:
    """One ``prompt_embeds`` item (base64 of a ``torch.save``'d tensor) as the engine takes
    it (``Processor.check_prompt_embeds``), read safely: bounded in size by the longest
    prompt (max_model_len rows of hidden_size float64 values) before decoding,
    ``torch.load`` with ``weights_only=True`` (tensors only: no code runs). Anything wrong
    is a ``VLLMValidationError`` naming ``prompt_embeds`` (a 400)."""
    hidden = processor.embeds_hidden_size
    if hidden is None:  # the flag is off: check_prompt_embeds says so
        return processor.check_prompt_embeds(None)
    limit = processor.max_model_len * hidden * 8 + _SAVE_OVERHEAD
    if len(data) > (limit + 2) // 3 * 4:
        raise VLLMValidationError(
            f"prompt_embeds is larger than any prompt this model takes ({limit} bytes "
            "decoded at most)",
            "prompt_embeds",
        )
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise VLLMValidationError(
            f"prompt_embeds is not valid base64: {e}", "prompt_embeds"
        ) from None
    try:
        tensor = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
    except (MemoryError, torch.OutOfMemoryError):
        raise
    except Exception as e:  # noqa: BLE001 - torch has no one error for a bad file
        reason = str(e).strip()[:200] or type(e).__name__  # bounded: built from the bytes
        raise VLLMValidationError(
            f"prompt_embeds could not be read as a torch.save'd tensor: {reason}",
            "prompt_embeds",
        ) from None
    return processor.check_prompt_embeds(tensor)
