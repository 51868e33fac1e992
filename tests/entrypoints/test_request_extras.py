"""vLLM's request extras: ``chat_template_kwargs`` (variables for the chat template, e.g.
Qwen3's enable_thinking) and ``cache_salt`` (a request shares prefix-cache blocks only with
requests of the same salt), offline and through the server."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tests.entrypoints.test_generation_config import tiny_model
from vllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from vllm.exceptions import VLLMValidationError

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

    from tests.utils import RemoteServer

    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE)
    model = tiny_model(tmp_path / "model")
    server = RemoteServer(
        "--model", model, "--served-model-name", "tiny", "--max-model-len", "512",
        "--chat-template", str(template), log_path=str(tmp_path / "server.log"),
    )  # fmt: skip
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
