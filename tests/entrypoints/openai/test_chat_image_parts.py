"""Image content parts in chat messages (vLLM's OpenAI server): parsed in order beside the
text, rendered as the model's placeholder the way vLLM writes a "string" chat template's
content, loaded off the event loop and handed to the engine as ``multi_modal_data``.

The app is the real one (``build_app``) over a fake engine: its chat template writes
``[role]content``, its token ids are the prompt's characters, and it records what
``add_request`` was given.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
from types import SimpleNamespace

import pytest
from PIL import Image

from vllm.config import LoRAConfig
from vllm.entrypoints.openai import serving_chat
from vllm.entrypoints.openai.api_server import build_app
from vllm.entrypoints.openai.cli_args import FrontendArgs
from vllm.entrypoints.openai.protocol import (
    NO_IMAGES,
    ChatCompletionRequest,
    ImagePart,
    parse_messages,
    validate_messages,
)
from vllm.entrypoints.openai.protocol_responses import items_to_messages, normalize_input
from vllm.exceptions import VLLMValidationError
from vllm.outputs import CompletionOutput, RequestOutput

from .test_job_identity import _call

pytestmark = pytest.mark.timeout(60)


def png_url(size=(5, 3), color=(200, 10, 10)) -> str:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


A, B, C = png_url((5, 3)), png_url((7, 2)), png_url((2, 9))


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def text(t: str) -> dict:
    return {"type": "text", "text": t}


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [], **fields})


# -- parsing ------------------------------------------------------------------------------
def test_text_only_messages_are_unchanged():
    req = chat(messages=[{"role": "user", "content": [text("a"), text("b")]}])
    (message,) = req.messages
    assert message.content == "ab" and message.image_urls == [] and not req.has_images
    assert message.for_template() == {"role": "user", "content": "ab"}
    # A placeholder changes nothing for a message without images, even one whose text
    # holds the placeholder's characters.
    literal = chat(messages=[{"role": "user", "content": "<image> as text"}]).messages[0]
    assert literal.for_template("<image>") == {"role": "user", "content": "<image> as text"}
    assert message.model_dump() == {"role": "user", "content": "ab"}


def test_image_parts_are_kept_in_order_beside_the_text():
    content = [
        text("What"),
        image("http://h/a.png"),
        {"image_url": "http://h/b.png"},  # vLLM's shorthand without "type"
        text(" differs?"),
        {"type": "input_image", "image_url": "http://h/c.png", "detail": "low"},
        {"image_url": {"url": "http://h/d.png"}},
    ]
    req = chat(messages=[{"role": "system", "content": "s"}, {"role": "user", "content": content}])
    message = req.messages[1]
    assert req.has_images and req.messages[0].image_urls == []
    assert message.image_urls == [f"http://h/{n}.png" for n in "abcd"]
    assert message._parts == (
        "What",
        ImagePart("http://h/a.png"),
        ImagePart("http://h/b.png"),
        " differs?",
        ImagePart("http://h/c.png"),
        ImagePart("http://h/d.png"),
    )
    assert message.content == "What differs?"  # what echo and the logs read
    # vLLM's "string" content: one placeholder per image, each on its own line, first.
    assert message.for_template("<image>")["content"] == "<image>\n" * 4 + "What differs?"


def test_placeholders_the_text_already_holds_are_used():
    def rendered(content, placeholder="<image>"):
        return (
            chat(messages=[{"role": "user", "content": content}])
            .messages[0]
            .for_template(placeholder)["content"]
        )

    assert rendered([text("left <image> right"), image(A), image(B)]) == (
        "<image>\nleft <image> right"
    )
    assert rendered([image(A)]) == "<image>"  # no text: no trailing newline
    assert rendered([image(A), text("x")], "<img>") == "<img>\nx"
    with pytest.raises(VLLMValidationError, match="holds 2 image placeholders") as e:
        rendered([text("<image><image>"), image(A)])
    assert e.value.param == "messages"
    with pytest.raises(VLLMValidationError, match="takes no images") as e:
        rendered([image(A)], None)
    assert e.value.param == "messages"


def test_offline_helpers():
    # LLM.chat's path: validate, then render with the model's placeholder.
    messages = [{"role": "user", "content": [image(A), text("hi")]}]
    assert validate_messages(messages)[0].image_urls == [A]
    assert parse_messages(messages, "<image>") == [{"role": "user", "content": "<image>\nhi"}]
    with pytest.raises(VLLMValidationError) as e:
        parse_messages(messages)
    assert e.value.param == "messages"


# -- the server ---------------------------------------------------------------------------
class _Stream:
    request_id = "r"
    engine_latency_s = None

    def __init__(self, prompt_token_ids: list[int]) -> None:
        self.prompt_token_ids = prompt_token_ids

    async def _outputs(self):
        done = CompletionOutput(0, "ok", [111, 107], finish_reason="stop")
        yield RequestOutput("r", None, self.prompt_token_ids, [done], True)

    def __aiter__(self):
        return self._outputs()

    async def aclose(self) -> None:
        pass


class _Engine:
    is_alive = True
    num_unfinished_requests = 0
    engine_load = 0
    chat_template = "{{ messages }}"
    processor = SimpleNamespace(max_logprobs=20, eos_token_id=0)

    def __init__(self, placeholder: str | None = "<image>", limit=None, refusal=None) -> None:
        self._placeholder = placeholder
        self.placeholder_reads = 0
        self.refusal = refusal  # a VLLMValidationError add_request raises
        model_config = SimpleNamespace(limit_mm_per_prompt=limit)
        cache_config = SimpleNamespace(block_size=16, enable_prefix_caching=True)
        self.config = SimpleNamespace(model_config=model_config, cache_config=cache_config)
        self.added: list[tuple[str, dict]] = []

    @property
    def image_placeholder(self) -> str | None:
        self.placeholder_reads += 1
        return self._placeholder

    def stalled_for(self) -> float:
        return 0.0

    def apply_chat_template(
        self, messages, template, add_generation_prompt, tools, kwargs=None, cont=False
    ):
        return "".join(f"[{m['role']}]{m['content']}" for m in messages)

    def tokenize(self, prompt, add_special_tokens=True):
        return [ord(c) for c in prompt]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))

    async def add_request(self, prompt, params, request_id, priority=0, executor=None, **kw):
        if self.refusal is not None:
            raise self.refusal
        self.added.append((prompt, kw))
        return _Stream(self.tokenize(prompt))


def _app(engine: _Engine, **args):
    config = SimpleNamespace(
        model_config=SimpleNamespace(name="m", served_names=("m",)),
        scheduler_config=SimpleNamespace(max_model_len=4096),
        lora_config=LoRAConfig(),
    )
    return build_app(config, FrontendArgs(**args), engine, SimpleNamespace(registry=None))


def post(engine: _Engine, path: str, body: dict, **args) -> tuple[int, dict]:
    status, payload, _ = _call(_app(engine, **args), path, "POST", json.dumps(body).encode())
    return status, json.loads(payload)


@pytest.fixture
def loads(monkeypatch):
    """The URLs the server loads images from (each still loaded)."""
    seen: list[str] = []
    real = serving_chat.load_image

    def load_image(url, **kw):
        seen.append(url)
        return real(url, **kw)

    monkeypatch.setattr(serving_chat, "load_image", load_image)
    return seen


CONVERSATION = [
    {"role": "user", "content": [image(A), text("first")]},
    {"role": "assistant", "content": "ok"},
    {"role": "user", "content": [text("second"), image(B), image(C)]},
]


def test_images_reach_the_engine_in_order(loads):
    engine = _Engine()
    status, body = post(engine, "/v1/chat/completions", {"messages": CONVERSATION})
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] == "ok"
    ((prompt, kw),) = engine.added
    assert prompt == "[user]<image>\nfirst[assistant]ok[user]<image>\n<image>\nsecond"
    images = kw["multi_modal_data"]["image"]
    assert [(i.mode, i.size) for i in images] == [("RGB", (5, 3)), ("RGB", (7, 2)), ("RGB", (2, 9))]
    assert loads == [A, B, C]


def test_a_text_only_request_does_not_change():
    engine = _Engine()
    messages = [{"role": "user", "content": [text("first")]}, {"role": "user", "content": "x"}]
    status, _ = post(engine, "/v1/chat/completions", {"messages": messages})
    assert status == 200
    ((prompt, kw),) = engine.added
    assert prompt == "[user]first[user]x" and "multi_modal_data" not in kw
    assert engine.placeholder_reads == 0  # nothing about images is even looked up


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/chat/completions/render"])
def test_a_text_only_model_refuses_images_before_loading_any(loads, path):
    engine = _Engine(placeholder=None)
    status, body = post(engine, path, {"messages": CONVERSATION})
    assert status == 400
    assert body == {
        "error": {"message": NO_IMAGES, "type": "BadRequestError", "param": "messages", "code": 400}
    }
    assert loads == [] and engine.added == []


def test_more_images_than_the_limit_are_refused_before_loading(loads):
    engine = _Engine(limit={"image": 2})
    status, body = post(engine, "/v1/chat/completions", {"messages": CONVERSATION})
    assert status == 400 and body["error"]["param"] == "messages"
    assert body["error"]["message"] == ("at most 2 images a prompt (--limit-mm-per-prompt), got 3")
    assert loads == [] and engine.added == []


def test_an_image_that_fails_to_load_is_a_400_naming_messages():
    engine = _Engine()
    messages = [{"role": "user", "content": [image(A), image("data:image/png;base64,@@")]}]
    status, body = post(engine, "/v1/chat/completions", {"messages": messages})
    assert status == 400 and body["error"]["param"] == "messages"
    message = body["error"]["message"]
    assert message.startswith("image 1 of the messages could not be loaded: ")
    assert "not valid base64" in message
    assert engine.added == []


def test_file_urls_follow_the_server_flag(tmp_path):
    Image.new("RGB", (3, 3)).save(tmp_path / "x.png")
    messages = [{"role": "user", "content": [image((tmp_path / "x.png").as_uri())]}]
    status, body = post(_Engine(), "/v1/chat/completions", {"messages": messages})
    assert status == 400 and "--allowed-local-media-path" in body["error"]["message"]
    engine = _Engine()
    status, _ = post(
        engine,
        "/v1/chat/completions",
        {"messages": messages},
        allowed_local_media_path=str(tmp_path),
    )
    assert status == 200
    assert engine.added[0][1]["multi_modal_data"]["image"][0].size == (3, 3)


def test_render_shows_the_placeholders_without_loading_images(loads):
    engine = _Engine()
    messages = [{"role": "user", "content": [text("what"), image("http://unreachable/a.png")]}]
    status, body = post(engine, "/v1/chat/completions/render", {"messages": messages})
    assert status == 200
    assert body["token_ids"] == [ord(c) for c in "[user]<image>\nwhat"]
    assert loads == []


def test_the_engine_s_image_refusals_name_messages():
    refusal = VLLMValidationError("the prompt holds 0 image placeholder tokens", "multi_modal_data")
    engine = _Engine(refusal=refusal)
    status, body = post(engine, "/v1/chat/completions", {"messages": CONVERSATION})
    assert status == 400 and body["error"]["param"] == "messages"
    assert body["error"]["message"] == "the prompt holds 0 image placeholder tokens"


def test_beam_search_refuses_images(loads):
    body = {"messages": CONVERSATION, "use_beam_search": True}
    status, body = post(_Engine(), "/v1/chat/completions", body)
    assert status == 400 and body["error"]["param"] == "use_beam_search"
    assert loads == []


@pytest.mark.parametrize(
    "part, message",
    [
        (
            {"type": "image_url", "image_url": "http://h/a.png"},  # vLLM refuses it too
            "part 1: image_url must be {'url': <string>}, got a string",
        ),
        (
            {"type": "image_url", "image_url": {"url": ""}},
            "part 1: image_url must be {'url': <string>}, got an object whose url is an "
            "empty string",
        ),
        (
            {"type": "image_url", "image_url": {"url": 5}},
            "part 1: image_url must be {'url': <string>}, got an object whose url is a number",
        ),
        (
            {"type": "image_url", "image_url": {"url": "http://h/a.png", "detail": "max"}},
            "part 1: detail must be one of auto, low, high, got 'max'",
        ),
        (
            {"type": "input_image", "file_id": "file-1"},
            "part 1: file_id is not supported: send the image as image_url",
        ),
        (
            {"type": "audio_url", "audio_url": {"url": "http://h/a.wav"}},
            "part 1 must be {'type': 'text', 'text': <string>} or {'type': 'image_url', "
            "'image_url': {'url': <string>}}, got type 'audio_url'",
        ),
        (
            "a bare string",
            "part 1 must be {'type': 'text', 'text': <string>} or {'type': 'image_url', "
            "'image_url': {'url': <string>}}",
        ),
    ],
)
def test_bad_parts_are_400s_naming_messages(loads, part, message):
    messages = [{"role": "user", "content": [text("hi"), part]}]
    status, body = post(_Engine(), "/v1/chat/completions", {"messages": messages})
    assert status == 400
    assert body == {
        "error": {
            "message": f"messages.0.content: {message}",
            "type": "BadRequestError",
            "param": "messages",
            "code": 400,
        }
    }
    assert loads == []


# A llava-hf (LLaVA-1.5) style template: it reads typed content parts and writes the image
# placeholders itself; text content renders as nothing there.
PARTS_TEMPLATE = (
    "{% for message in messages %}{{ message['role'].upper() + ': ' }}"
    "{% for c in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\\n' }}{% endfor %}"
    "{% for c in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ c['text'] + ' ' }}{% endfor %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


class _JinjaEngine(_Engine):
    """Renders its template as transformers would, and records the messages it got."""

    chat_template = PARTS_TEMPLATE

    def __init__(self) -> None:
        super().__init__()
        self.rendered: list[list[dict]] = []

    def apply_chat_template(
        self, messages, template, add_generation_prompt, tools, kwargs=None, cont=False
    ):
        import jinja2

        self.rendered.append(messages)
        return (
            jinja2.Environment()
            .from_string(template or self.chat_template)
            .render(messages=messages, add_generation_prompt=add_generation_prompt)
        )


def test_templates_that_read_parts_get_typed_parts():
    question = [{"role": "user", "content": [text("what is it?"), image(A)]}]
    engine = _JinjaEngine()
    assert post(engine, "/v1/chat/completions", {"messages": question})[0] == 200
    assert engine.rendered[0][0]["content"] == [
        {"type": "text", "text": "what is it?"},
        {"type": "image"},
    ]
    assert engine.added[0][0] == "USER: <image>\nwhat is it? ASSISTANT:"
    # A text-only request renders as it always has (auto)...
    post(engine, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert engine.rendered[1][0]["content"] == "hi"
    # ... unless the flag says every template reads parts, as vLLM's does.
    typed = {"chat_template_content_format": "openai"}
    post(engine, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, **typed)
    assert engine.rendered[2][0]["content"] == [{"type": "text", "text": "hi"}]
    assert engine.added[2][0] == "USER: hi ASSISTANT:"
    # "string": the placeholders are written into the text, whatever the template.
    as_text = {"chat_template_content_format": "string"}
    post(engine, "/v1/chat/completions", {"messages": question}, **as_text)
    assert engine.rendered[3][0]["content"] == "<image>\nwhat is it?"


def test_the_server_flags():
    parser = argparse.ArgumentParser()
    FrontendArgs.add_cli_args(parser)
    args = parser.parse_args(
        ["--chat-template-content-format", "openai", "--allowed-local-media-path", "/"]
    )
    parsed = FrontendArgs.from_cli_args(args)
    assert (parsed.chat_template_content_format, parsed.allowed_local_media_path) == ("openai", "/")
    assert FrontendArgs().allowed_local_media_path is None  # vLLM's default: no local files
    with pytest.raises(ValueError, match="allowed_local_media_path: no such directory"):
        FrontendArgs(allowed_local_media_path="/no/such/dir")


# -- the Responses API --------------------------------------------------------------------
def test_responses_input_images_become_chat_image_parts():
    content = [
        {"type": "input_text", "text": "what is it?"},
        {"type": "input_image", "image_url": A},
    ]
    (item,) = normalize_input([{"role": "user", "content": content}])
    assert item["content"][1] == {"type": "input_image", "image_url": A, "detail": "auto"}
    (message,) = items_to_messages([item])
    assert message["content"] == [
        {"type": "text", "text": "what is it?"},
        {"type": "image_url", "image_url": {"url": A, "detail": "auto"}},
    ]


@pytest.mark.parametrize(
    "item, match",
    [
        (
            {"role": "assistant", "content": [{"type": "input_image", "image_url": A}]},
            r"must be a text part \(input_text, output_text\), got 'input_image'",
        ),
        (
            {"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]},
            "file_id: uploaded files are not supported",
        ),
        (
            {"role": "user", "content": [{"type": "input_image", "image_url": {"url": A}}]},
            "image_url must be a URL string",
        ),
        (
            {"role": "user", "content": [{"type": "input_image", "image_url": A, "detail": 1}]},
            "detail must be one of auto, low, high",
        ),
        (
            {"role": "user", "content": [{"type": "input_file", "file_id": "f"}]},
            r"or an image part \(input_image\), got 'input_file'",
        ),
    ],
)
def test_responses_image_items_it_cannot_take(item, match):
    with pytest.raises(VLLMValidationError, match=match) as e:
        normalize_input([item])
    assert e.value.param == "input"


def test_responses_images_reach_the_engine(loads):
    engine = _Engine()
    content = [{"type": "input_image", "image_url": B}, {"type": "input_text", "text": "hm"}]
    body = {"input": [{"role": "user", "content": content}], "store": False}
    status, response = post(engine, "/v1/responses", body)
    assert status == 200, response
    ((prompt, kw),) = engine.added
    assert prompt == "[user]<image>\nhm"
    assert [i.size for i in kw["multi_modal_data"]["image"]] == [(7, 2)]
    assert loads == [B]
    # A model that takes none: the 400 names the Responses field.
    status, response = post(_Engine(placeholder=None), "/v1/responses", body)
    assert status == 400 and response["error"]["param"] == "input"
