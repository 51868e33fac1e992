"""vLLM's request extras: ``chat_template_kwargs`` (variables for the chat template, e.g.
Qwen3's enable_thinking) and ``cache_salt`` (a request shares prefix-cache blocks only with
requests of the same salt), offline and through the server; and vLLM 0.32's fields that
were ignored before: ``documents``, ``reasoning_effort``, ``add_special_tokens``,
``request_id`` (and the ``X-Request-Id`` header), ``return_tokens_as_token_ids`` (and its
server flag), ``truncation_side``, ``repetition_detection``."""

from __future__ import annotations

import json
import threading

import pytest
from pydantic import ValidationError

from tests.entrypoints.test_generation_config import tiny_model
from vllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from vllm.entrypoints.openai.serving_engine import OpenAIServing
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import RepetitionDetectionParams, SamplingParams

TEMPLATE = (
    "{{ greeting | default('plain') }}:"
    "{% for m in messages %}{{ m['content'] }}|{% endfor %}"
    "{% if add_generation_prompt %}>{% endif %}"
)
MESSAGES = [{"role": "user", "content": "hi"}]
LONG = "The tide came in over the flats while the gulls argued about the last of the light. " * 4


def _cause(info) -> VLLMValidationError:
    return info.value.errors()[0]["ctx"]["error"]


def test_reserved_template_variables_and_empty_salts_are_refused_naming_the_field():
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest(messages=MESSAGES, chat_template_kwargs={"tools": []})
    assert _cause(info).param == "chat_template_kwargs"
    for request in (
        lambda: ChatCompletionRequest(messages=MESSAGES, cache_salt=""),
        lambda: CompletionRequest(prompt="x", cache_salt=""),
    ):
        with pytest.raises(ValidationError, match="cache_salt"):
            request()


def tiny_server(tmp_path, model: str, template: str, *flags: str):
    """``vllm serve`` of ``model`` as "tiny" with this chat template (a RemoteServer)."""
    from tests.utils import RemoteServer

    path = tmp_path / "template.jinja"
    path.write_text(template)
    return RemoteServer(
        "--model", model, "--served-model-name", "tiny", "--max-model-len", "512",
        "--chat-template", str(path), *flags, log_path=str(tmp_path / "server.log"),
    )  # fmt: skip


@pytest.mark.slow
def test_offline_template_variables_and_salted_prefix_cache(tmp_path):
    from vllm import LLM, SamplingParams

    llm = LLM(model=tiny_model(tmp_path), kv_cache_memory="16MiB")
    try:
        params = SamplingParams(temperature=0.0, max_tokens=2)
        out = llm.chat(MESSAGES, params, chat_template=TEMPLATE,
                       chat_template_kwargs={"greeting": "HELLO"})  # fmt: skip
        assert out[0].prompt == "HELLO:hi|>"
        assert llm.chat(MESSAGES, params, chat_template=TEMPLATE)[0].prompt == "plain:hi|>"

        def cached(salt: str | None) -> int:
            prompt = {"prompt": LONG} | ({"cache_salt": salt} if salt else {})
            return llm.generate(prompt, params)[0].num_cached_tokens

        assert cached("tenant-a") == 0
        assert cached("tenant-a") >= 16  # the same salt shares its blocks
        assert cached("tenant-b") == 0 and cached(None) == 0  # others do not
        assert cached(None) >= 16
        with pytest.raises(VLLMValidationError) as info:
            llm.generate({"prompt": LONG, "cache_salt": ""}, params)
        assert info.value.param == "cache_salt"
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_server_renders_template_kwargs_and_salts_the_cache(tmp_path):
    import requests

    model = tiny_model(tmp_path / "model")
    server = tiny_server(tmp_path, model, TEMPLATE)
    try:
        body = {"model": "tiny", "messages": MESSAGES, "chat_template_kwargs": {"greeting": "YO"}}
        rendered = requests.post(f"{server.base}/v1/chat/completions/render", json=body).json()
        from vllm.transformers_utils.tokenizer import get_tokenizer

        assert get_tokenizer(model).decode(rendered["token_ids"]) == "YO:hi|>"
        reserved = {**body, "chat_template_kwargs": {"messages": []}}
        refused = requests.post(f"{server.base}/v1/chat/completions", json=reserved)
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "chat_template_kwargs"

        client = server.client()

        def cached(salt: str) -> int:
            resp = client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": LONG}],
                max_tokens=2,
                extra_body={"cache_salt": salt},
            )
            return resp.usage.prompt_tokens_details.cached_tokens

        assert cached("a" * 43) == 0
        assert cached("a" * 43) >= 16
        assert cached("b" * 43) == 0
    finally:
        server.stop()


def naive_repeats(ids: list[int], low: int, high: int, count: int) -> bool:
    """Whether ``ids`` ends in ``count`` equal consecutive chunks of one of the sizes."""
    for size in range(max(low, 1), high + 1):
        if size * count <= len(ids):
            chunks = [tuple(ids[len(ids) - size * (k + 1) : len(ids) - size * k])
                      for k in range(count)]  # fmt: skip
            if len(set(chunks)) == 1:
                return True
    return False


@pytest.mark.parametrize(
    "ids, sizes, count",
    [([1, 2, 3, 2, 3], (1, 2), 2), ([1, 2, 3, 2, 3], (1, 1), 2), ([5, 5, 5], (1, 3), 3),
     ([5, 5, 5], (1, 3), 4), ([1, 2, 1, 2, 1, 2], (0, 2), 3), ([9, 1, 2, 3, 1, 2, 3], (3, 4), 2),
     ([1, 2, 3, 4, 1, 2, 3, 5], (1, 4), 2), ([], (1, 4), 2)],
)  # fmt: skip
def test_repetition_detection_finds_a_repeated_tail(ids, sizes, count):
    params = RepetitionDetectionParams(sizes[1], sizes[0], count)
    assert params.repeats(ids) == naive_repeats(ids, *sizes, count)


@pytest.mark.parametrize(
    "fields, why",
    [({"max_pattern_size": 4, "min_count": 1}, "min_count"),
     ({"max_pattern_size": 2, "min_pattern_size": 3, "min_count": 2}, "min_pattern_size"),
     ({"max_pattern_size": 5000, "min_count": 2}, "1024"),
     ({"max_pattern_size": 1000, "min_count": 20}, "16384"),
     ({"max_pattern_size": -1}, ">= 0"), ({"max_pattern_size": 2, "count": 2}, "malformed")],
)  # fmt: skip
def test_bad_repetition_detection_is_refused_naming_it(fields, why):
    with pytest.raises(VLLMValidationError, match=why) as info:
        SamplingParams(repetition_detection=fields)
    assert info.value.param == "repetition_detection"


def test_request_fields_reach_the_sampling_params():
    request = CompletionRequest.model_validate(
        {"prompt": "x", "truncate_prompt_tokens": -1, "truncation_side": "right",
         "spaces_between_special_tokens": False,
         "repetition_detection": {"max_pattern_size": 3, "min_count": 2}}
    )  # fmt: skip
    params = request.to_sampling_params(4, None, False)
    assert (params.truncate_prompt_tokens, params.truncation_side) == (-1, "right")
    assert params.spaces_between_special_tokens is False
    assert params.repetition_detection == RepetitionDetectionParams(3, 0, 2)
    off = CompletionRequest.model_validate({"prompt": "x", "repetition_detection": {}})
    assert off.to_sampling_params(4, None, False).repetition_detection is None
    for body, param in (({"truncation_side": "middle"}, "truncation_side"),
                        ({"request_id": ""}, "request_id"),
                        ({"logprob_token_ids": [3]}, "logprob_token_ids"),
                        ({"kv_transfer_params": {"do_remote_decode": True}, "stream": True},
                         "kv_transfer_params"),
                        ({"mm_processor_kwargs": {"size": 1}}, "mm_processor_kwargs")):  # fmt: skip
        with pytest.raises(ValidationError, match=param):
            CompletionRequest.model_validate({"prompt": "x", **body})
    # Disaggregated prefill's params travel to the engine (which checks them).
    transfer = CompletionRequest.model_validate({"prompt": "x", "kv_transfer_params": {"a": 1}})
    extra = transfer.to_sampling_params(4, None, False).extra_args
    assert extra == {"kv_transfer_params": {"a": 1}}
    # Chat takes images, and so their processor's arguments (checked by the engine).
    chat = ChatCompletionRequest(messages=MESSAGES, mm_processor_kwargs={"max_pixels": 9})
    assert chat.mm_processor_kwargs == {"max_pixels": 9}


def test_a_named_request_answers_under_its_name_and_runs_under_a_unique_one():
    named = ChatCompletionRequest(messages=MESSAGES, request_id="mine")
    response_id, engine_id = OpenAIServing.request_ids(named, "chatcmpl")
    assert response_id == "chatcmpl-mine" and engine_id.startswith("chatcmpl-mine-")
    assert OpenAIServing.request_ids(named, "chatcmpl")[1] != engine_id
    response_id, engine_id = OpenAIServing.request_ids(CompletionRequest(prompt="x"), "cmpl")
    assert response_id == engine_id and response_id.startswith("cmpl-")


# Greedy output of the tiny random model over a few allowed tokens soon loops on one of
# them; a pair repeated three times (six tokens of the loop) ends it.
LOOPING = {"allowed_token_ids": [7, 8, 9, 10, 11]}
DETECTION = {"min_pattern_size": 2, "max_pattern_size": 4, "min_count": 3}


@pytest.mark.slow
def test_offline_repetition_detection_and_truncation_side(tmp_path):
    from vllm import LLM

    llm = LLM(model=tiny_model(tmp_path), kv_cache_memory="16MiB")
    try:
        prompt = {"prompt_token_ids": list(range(100, 140))}
        loop = dict(temperature=0.0, max_tokens=48, ignore_eos=True, **LOOPING)
        ids = list(llm.generate(prompt, SamplingParams(**loop))[0].outputs[0].token_ids)
        stops = [n for n in range(1, len(ids) + 1) if naive_repeats(ids[:n], 2, 4, 3)]
        assert stops and stops[0] > 6, ids  # a pair thrice at the soonest
        out = llm.generate(prompt, SamplingParams(**loop, repetition_detection=DETECTION))
        assert list(out[0].outputs[0].token_ids) == ids[: stops[0]]
        finish = (out[0].outputs[0].finish_reason, out[0].outputs[0].stop_reason)
        assert finish == ("repetition", "repetition_detected")
        # Not before min_tokens: the first repeat after them ends it.
        late = SamplingParams(**loop, repetition_detection=DETECTION, min_tokens=stops[0] + 1)
        assert len(llm.generate(prompt, late)[0].outputs[0].token_ids) == stops[1]

        def kept(side: str | None, k: int) -> list[int]:
            params = SamplingParams(max_tokens=1, truncate_prompt_tokens=k,
                                    **({"truncation_side": side} if side else {}))  # fmt: skip
            return llm.generate(prompt, params)[0].prompt_token_ids

        assert kept(None, 5) == list(range(135, 140)) == kept("left", 5)
        assert kept("right", 5) == list(range(100, 105))
        assert kept("right", -1) == list(range(100, 140))  # -1: max_model_len
        with pytest.raises(VLLMValidationError) as info:
            kept("right", 0)
        assert info.value.param == "truncate_prompt_tokens"
    finally:
        llm.shutdown()


EXTRAS_TEMPLATE = (
    "effort={{ reasoning_effort | default('unset') }};"
    "thinking={{ enable_thinking | default('unset') }};"
    "{% for d in documents or [] %}[{{ d['title'] }}]{% endfor %}"
    "{% for m in messages %}{{ m['content'] }}|{% endfor %}"
    "{% if add_generation_prompt %}>{% endif %}"
)


def bos_tiny_model(path) -> str:
    """``tiny_model`` whose tokenizer puts ``<|endoftext|>`` (id 0) before every text, as
    a Llama tokenizer puts its BOS (SmolLM2's own adds nothing)."""
    model = tiny_model(path)
    tokenizer = path / "tokenizer.json"
    data = json.loads(tokenizer.read_text())
    bos = "<|endoftext|>"
    data["post_processor"]["single"].insert(0, {"SpecialToken": {"id": bos, "type_id": 0}})
    data["post_processor"]["special_tokens"] = {bos: {"id": bos, "ids": [0], "tokens": [bos]}}
    tokenizer.write_text(json.dumps(data))
    return model


@pytest.mark.slow
def test_server_takes_vllm_s_request_fields(tmp_path):
    import requests

    from vllm.transformers_utils.tokenizer import get_tokenizer

    model = bos_tiny_model(tmp_path / "model")
    server = tiny_server(tmp_path, model, EXTRAS_TEMPLATE, "--return-tokens-as-token-ids")
    decode = get_tokenizer(model).decode
    try:

        def post(path: str, body: dict, **headers) -> requests.Response:
            return requests.post(f"{server.base}{path}", json={"model": "tiny", **body},
                                 headers=headers, timeout=60)  # fmt: skip

        def render(**fields) -> list[int]:
            body = {"messages": MESSAGES, **fields}
            return post("/v1/chat/completions/render", body).json()["token_ids"]

        assert decode(render()) == "effort=unset;thinking=unset;hi|>"
        docs = [{"title": "A", "text": "x"}, {"title": "B", "text": "y"}]
        assert decode(render(documents=docs, reasoning_effort="low")) == (
            "effort=low;thinking=True;[A][B]hi|>"
        )
        kept = render(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True})
        assert decode(kept) == "effort=none;thinking=True;hi|>"  # the request's own kwargs win
        plain = render()
        assert render(add_special_tokens=True) == [0, *plain]  # chat's default: false

        def completion(**fields) -> dict:
            body = {"prompt": "hello there", "max_tokens": 3, "temperature": 0.0, **fields}
            return post("/v1/completions", body).json()

        with_bos = completion(logprobs=1)
        assert completion(add_special_tokens=False)["usage"]["prompt_tokens"] == (
            with_bos["usage"]["prompt_tokens"] - 1
        )  # completions' default: true
        # --return-tokens-as-token-ids: token ids for names; a request may turn it off.
        assert all(t.startswith("token_id:") for t in with_bos["choices"][0]["logprobs"]["tokens"])
        as_text = completion(logprobs=1, return_tokens_as_token_ids=False)
        assert as_text["choices"][0]["text"] == "".join(as_text["choices"][0]["logprobs"]["tokens"])
        logprobs = {"messages": MESSAGES, "max_tokens": 2, "logprobs": True, "top_logprobs": 2}
        content = post("/v1/chat/completions", logprobs).json()["choices"][0]["logprobs"]["content"]
        assert all(e["token"].startswith("token_id:") for e in content)
        assert all(t["token"].startswith("token_id:") for e in content for t in e["top_logprobs"])

        # request_id names the response (the X-Request-Id header wins); two requests of one
        # name at once both run (the engine's ids are made unique).
        body = {"messages": MESSAGES, "max_tokens": 2, "request_id": "turn-7"}
        assert post("/v1/chat/completions", body).json()["id"] == "chatcmpl-turn-7"
        headed = post("/v1/chat/completions", body, **{"X-Request-Id": "hdr-1"}).json()
        assert headed["id"] == "chatcmpl-hdr-1"
        answers: list[dict] = []
        same = {"prompt": "a b c", "max_tokens": 16, "ignore_eos": True, "request_id": "twin"}
        threads = [threading.Thread(target=lambda: answers.append(post("/v1/completions",
                                                                       same).json()))
                   for _ in range(2)]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [a.get("id") for a in answers] == ["cmpl-twin", "cmpl-twin"]
        assert all(a["usage"]["completion_tokens"] == 16 for a in answers)

        # repetition_detection: greedy output that repeats ends as "repetition".
        loop = {"prompt": [list(range(100, 140))], "max_tokens": 48, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True, **LOOPING}  # fmt: skip
        free = post("/v1/completions", loop).json()["choices"][0]
        cut = post("/v1/completions", {**loop, "repetition_detection": DETECTION}).json()
        choice = cut["choices"][0]
        stop = next(n for n in range(1, 49) if naive_repeats(free["token_ids"][:n], 2, 4, 3))
        assert choice["token_ids"] == free["token_ids"][:stop]
        assert (choice["finish_reason"], choice["stop_reason"]) == (
            "repetition", "repetition_detected"
        )  # fmt: skip

        for body, param in (({"logprob_token_ids": [1]}, "logprob_token_ids"),
                            ({"truncation_side": "up"}, "truncation_side")):  # fmt: skip
            refused = post("/v1/chat/completions", {"messages": MESSAGES, **body})
            assert refused.status_code == 400 and param in refused.text
        refused = post("/v1/chat/completions", {"messages": MESSAGES},
                       **{"X-Vllm-Priority": "urgent"})  # fmt: skip
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "X-Vllm-Priority"
    finally:
        server.stop()
