"""Images in chat, end to end, on the tiny LLaVA (tests/multimodal/test_llava_engine.py):
``vllm serve`` answering the official ``openai`` client's ``image_url`` parts (a base64
data URL, as vLLM's docs send them) and ``LLM.chat`` give the greedy tokens of the
engine on the prompt the chat template writes, with the image in its placeholder, for a
template that takes text (the placeholder written before the text) and for one that
reads typed parts (llava-hf's ``chat_template.json``, which writes the placeholders
itself), and the Anthropic Messages API's image blocks likewise; a text-only model answers
an image with a 400."""

from __future__ import annotations

import base64
import io
import json

import anthropic
import openai
import pytest

from tests.multimodal.test_llava_engine import GREEDY, IMAGE, build_llava, image
from tests.utils import RemoteServer
from vllm import LLM, SamplingParams

PLACEHOLDER = "<empty_output>"  # the text of token IMAGE in SmolLM2's vocabulary
# A template that reads a message's parts, in the manner of llava-hf's: the images'
# placeholders first, then the texts.
TYPED_TEMPLATE = (
    "{% for m in messages %}{{ m['role'].upper() }}: "
    "{% for c in m['content'] | selectattr('type', 'equalto', 'image') %}"
    "<empty_output>\n{% endfor %}"
    "{% for c in m['content'] | selectattr('type', 'equalto', 'text') %}{{ c['text'] }}"
    "{% endfor %}\n{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)
QUESTION = "What is in the picture?"
RAW = {"do_rescale": False}  # the image processor's argument: pixels 255x larger


def data_url(img) -> str:
    buffer = io.BytesIO()
    img.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def messages(img) -> list[dict]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_url(img)}},
                {"type": "text", "text": QUESTION},
            ],
        }
    ]


@pytest.fixture(scope="module", params=["text", "typed"])
def folder(request, tmp_path_factory):
    """The tiny LLaVA with SmolLM2's chat template ("text") or, in its place, a template
    that reads parts in ``chat_template.json`` as llava-hf keeps it ("typed")."""
    path, _ = build_llava(tmp_path_factory.mktemp(f"llava-{request.param}"))
    if request.param == "typed":
        (path / "chat_template.jinja").unlink()
        (path / "chat_template.json").write_text(json.dumps({"chat_template": TYPED_TEMPLATE}))
    return path, request.param


def expected_prompt(kind: str) -> str:
    if kind == "typed":
        return f"USER: {PLACEHOLDER}\n{QUESTION}ASSISTANT:"  # (trim_blocks ate a newline)
    return f"{PLACEHOLDER}\n{QUESTION}"  # inside SmolLM2's template's user turn


def test_llm_chat_and_the_server_answer_with_the_image(folder, tmp_path):
    path, kind = folder
    llm = LLM(model=str(path), max_model_len=128)
    try:
        chats = [llm.chat(messages(image(s)), GREEDY)[0] for s in (0, 1)]
        raw = llm.chat(messages(image(0)), GREEDY, mm_processor_kwargs=RAW)[0]
        by_prompt = [
            llm.generate({"prompt": c.prompt, "multi_modal_data": {"image": image(s)}}, GREEDY)[0]
            for s, c in zip((0, 1), chats, strict=True)
        ]
    finally:
        llm.shutdown()
    for chat, direct in zip(chats, by_prompt, strict=True):
        assert expected_prompt(kind) in chat.prompt
        assert chat.prompt_token_ids.count(IMAGE) == 4  # the placeholder, expanded
        assert chat.outputs[0].token_ids == direct.outputs[0].token_ids
    assert chats[0].outputs[0].token_ids != chats[1].outputs[0].token_ids

    server = RemoteServer(str(path), "--max-model-len", "128", "--allowed-media-domains",
                          "example.com", log_path=str(tmp_path / "log"))  # fmt: skip
    try:
        client = server.client()
        for s, chat in enumerate(chats):
            reply = client.chat.completions.create(
                model=str(path), messages=messages(image(s)), max_tokens=6, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            assert reply.choices[0].message.content == chat.outputs[0].text
            assert reply.usage.prompt_tokens == len(chat.prompt_token_ids)
        # The image processor's arguments for one request (vLLM's mm_processor_kwargs).
        # A crop the tower cannot take is refused: the arguments reached the processor.
        crop = {"crop_size": {"height": 14, "width": 14}}
        for kwargs, want in ((RAW, raw.outputs[0].text), (crop, None)):
            body = {"ignore_eos": True, "mm_processor_kwargs": kwargs}
            try:
                reply = client.chat.completions.create(
                    model=str(path), messages=messages(image(0)), max_tokens=6, temperature=0,
                    extra_body=body,
                )  # fmt: skip
            except openai.BadRequestError as e:
                assert want is None and e.body["param"] == "mm_processor_kwargs"
                assert "made images of (14, 14) pixels" in e.body["message"]
            else:
                assert reply.choices[0].message.content == want
        # The Anthropic Messages API's image block (base64), through the same chat route.
        png = data_url(image(0)).removeprefix("data:image/png;base64,")
        answer = anthropic.Anthropic(base_url=server.base, api_key="x").messages.create(
            model=str(path), max_tokens=6,
            messages=[{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": png}},
                {"type": "text", "text": QUESTION},
            ]}],
            extra_body={"temperature": 0, "ignore_eos": True},
        )  # fmt: skip
        assert answer.content[0].text == chats[0].outputs[0].text
        # A screenshot in a tool_result (a computer-use agent's turn) is the tool message's
        # image part: the same reply as the chat API's tool message with that image.
        source = {"type": "base64", "media_type": "image/png", "data": png}
        call = {"type": "tool_use", "id": "t1", "name": "look", "input": {}}
        answer = anthropic.Anthropic(base_url=server.base, api_key="x").messages.create(
            model=str(path), max_tokens=6,
            messages=[{"role": "user", "content": QUESTION},
                      {"role": "assistant", "content": [call]},
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                          "content": [{"type": "image", "source": source}]}]}],
            extra_body={"temperature": 0, "ignore_eos": True},
        )  # fmt: skip
        tool_call = {
            "id": "t1",
            "type": "function",
            "function": {"name": "look", "arguments": "{}"},
        }
        reply = client.chat.completions.create(
            model=str(path), max_tokens=6, temperature=0, extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": QUESTION},
                      {"role": "assistant", "content": None, "tool_calls": [tool_call]},
                      {"role": "tool", "tool_call_id": "t1", "content": [
                          {"type": "image_url", "image_url": {"url": data_url(image(0))}}]}],
        )  # fmt: skip
        assert reply.usage.prompt_tokens > len(chats[0].prompt_token_ids)  # the image is in
        assert answer.content[0].text == reply.choices[0].message.content
        usage = answer.usage  # Anthropic's input_tokens leave out the prefix cache's
        cached = usage.cache_read_input_tokens + usage.cache_creation_input_tokens
        assert usage.input_tokens + cached == reply.usage.prompt_tokens
        with pytest.raises(openai.BadRequestError, match="could not be loaded") as e:
            client.chat.completions.create(
                model=str(path), max_tokens=2,
                messages=[{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                ]}],
            )  # fmt: skip
        assert e.value.body["param"] == "messages"
        # --allowed-media-domains: another host is refused before any connection.
        with pytest.raises(openai.BadRequestError, match="allowed-media-domains") as e:
            client.chat.completions.create(
                model=str(path), max_tokens=2,
                messages=[{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/a.png"}},
                ]}],
            )  # fmt: skip
        assert e.value.body["param"] == "messages"
    finally:
        server.stop()


def test_a_text_only_model_refuses_images(tmp_path):
    from tests.tiny_models import save_tiny_llama
    from tests.utils import copy_benchmark_tokenizer

    save_tiny_llama(tmp_path)
    copy_benchmark_tokenizer(tmp_path, chat_template=True)
    llm = LLM(model=str(tmp_path), max_model_len=64)
    try:
        with pytest.raises(ValueError, match="takes no images") as e:
            llm.chat(messages(image(0)), SamplingParams(max_tokens=2))
        assert e.value.param == "messages"
    finally:
        llm.shutdown()
