"""Embeddings (``--runner pooling``): a causal model's last hidden state of each prompt,
L2-normalised (vLLM's defaults for a model such as Qwen3-Embedding), equal to
transformers' ``last_hidden_state``; chunked prefill, prefix hits and batches give the
same vectors; a pooling engine generates nothing and a generating one embeds nothing."""

from __future__ import annotations

import pytest
import torch
import transformers

from tests.lora.test_lora import VOCAB, save_base
from vllm.exceptions import VLLMValidationError


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("embed-base")
    return path, save_base(path)


def reference(hf, ids: list[int], normalize: bool = True) -> torch.Tensor:
    with torch.inference_mode():
        last = hf.model(torch.tensor([ids])).last_hidden_state[0, -1].float()
    return torch.nn.functional.normalize(last, dim=-1) if normalize else last


def test_embeddings_equal_transformers_last_hidden_state(base):
    from vllm import LLM

    path, hf = base
    g = torch.Generator().manual_seed(0)
    long = torch.randint(0, VOCAB, (90,), generator=g).tolist()  # 3 chunks of 32
    prompts = [long, long[:50] + [7, 8], [5, 6, 7]]
    llm = LLM(model=str(path), runner="pooling", max_num_batched_tokens=32,
              kv_cache_memory="16MiB")  # fmt: skip
    try:
        outs = llm.embed([{"prompt_token_ids": p} for p in prompts])
        again = llm.embed({"prompt_token_ids": long})[0]  # its blocks cached now
        with pytest.raises(VLLMValidationError, match="serves embeddings"):
            llm.generate("hello")
    finally:
        llm.shutdown()
    for out, prompt in zip(outs, prompts, strict=True):
        assert out.prompt_token_ids == prompt and out.outputs.hidden_size == 64
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), reference(hf, prompt),
                                   atol=1e-5, rtol=1e-4)  # fmt: skip
    torch.testing.assert_close(again.outputs.embedding, outs[0].outputs.embedding)


def test_unnormalised_embeddings_and_a_generating_engine(base):
    from vllm import LLM

    path, hf = base
    llm = LLM(model=str(path), runner="pooling", pooler_config={"normalize": False},
              kv_cache_memory="16MiB")  # fmt: skip
    try:
        out = llm.embed({"prompt_token_ids": [3, 4, 5, 6]})[0]
    finally:
        llm.shutdown()
    torch.testing.assert_close(
        torch.tensor(out.outputs.embedding),
        reference(hf, [3, 4, 5, 6], False),
        atol=1e-5,
        rtol=1e-4,
    )
    llm = LLM(model=str(path), kv_cache_memory="16MiB")
    try:
        with pytest.raises(VLLMValidationError, match="need a model served with --runner pooling"):
            llm.embed("hello")
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(runner="pooling", pooler_config={"pooling_type": "MEAN"}), "pooling_type"),
        (dict(runner="pooling", pooler_config={"dimensions": 8}), "does not take"),
        (dict(pooler_config={"normalize": True}), "needs --runner pooling"),
        (dict(runner="embed"), "runner"),
    ],
)
def test_bad_pooling_configs_are_refused(kwargs, match):
    from vllm.config import ModelConfig

    with pytest.raises(ValueError, match=match):
        ModelConfig(model="m", **kwargs)


@pytest.mark.slow
def test_v1_embeddings_through_the_openai_client(base):
    """`vllm serve --runner pooling`: the openai client's embeddings (several inputs, token
    ids, base64), usage, and the errors: generation refused, dimensions refused, an unknown
    model 404, a generating server refusing embeddings."""
    import base64
    import struct

    import openai

    from vllm.benchmarks.server import RemoteServer

    path, hf = base
    server = RemoteServer(str(path), "--runner", "pooling", "--kv-cache-memory", "16MiB")
    try:
        client = server.client()
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        texts = ["The sea is blue.", "A list of files: main.py utils.py"]
        out = client.embeddings.create(model=str(path), input=texts)
        assert [d.index for d in out.data] == [0, 1] and out.model == str(path)
        ids = [tokenizer(t)["input_ids"] for t in texts]
        assert out.usage.prompt_tokens == out.usage.total_tokens == sum(map(len, ids))
        for d, prompt in zip(out.data, ids, strict=True):
            torch.testing.assert_close(torch.tensor(d.embedding), reference(hf, prompt),
                                       atol=1e-5, rtol=1e-4)  # fmt: skip
        raw = client.embeddings.create(model=str(path), input=[ids[0]], encoding_format="base64")
        packed = base64.b64decode(raw.data[0].embedding)
        decoded = torch.tensor(struct.unpack(f"<{len(packed) // 4}f", packed))
        torch.testing.assert_close(decoded, torch.tensor(out.data[0].embedding))
        with pytest.raises(openai.BadRequestError, match="dimensions is not supported"):
            client.embeddings.create(model=str(path), input="x", dimensions=8)
        with pytest.raises(openai.BadRequestError, match="serves embeddings"):
            client.completions.create(model=str(path), prompt="x", max_tokens=2)
        with pytest.raises(openai.NotFoundError):
            client.embeddings.create(model="nope", input="x")
    finally:
        server.stop()
    server = RemoteServer(str(path), "--kv-cache-memory", "16MiB")
    try:
        with pytest.raises(openai.BadRequestError, match="--runner pooling"):
            server.client().embeddings.create(model=str(path), input="x")
    finally:
        server.stop()
