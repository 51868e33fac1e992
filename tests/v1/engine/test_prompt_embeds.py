"""--enable-prompt-embeds (vLLM's): a prompt given as embeddings runs as the token prompt
whose embeddings they are, offline and on /v1/completions.

A tiny random Llama with a tokenizer (tests/lora's ``save_base``); ``prompt_embeds`` are
its own ``embed_tokens(ids)``, so greedy outputs must equal those of ``ids`` token for
token. The engine's step budget (32 tokens) and blocks (16) make prompts of 40+ tokens
prefill in chunks across steps and fill prefix-cacheable blocks."""

from __future__ import annotations

import asyncio
import base64
import gc
import io
import json

import pytest
import torch
from prometheus_client import CollectorRegistry

from tests.lora.test_lora import save_base
from vllm import LLM, SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.exceptions import VLLMValidationError
from vllm.lora.request import LoRARequest

ARGS = dict(max_model_len=256, max_num_batched_tokens=32, num_gpu_blocks_override=64)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("embeds-base")
    return str(path), save_base(path)


@pytest.fixture(scope="module")
def llm(model):
    llm = LLM(model[0], enable_prompt_embeds=True, **ARGS)
    yield llm
    del llm
    gc.collect()


def prompt_ids(seed: int, n: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (n,), generator=g).tolist()


def embeds_of(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf.model.embed_tokens(torch.tensor(ids)).clone()


def test_embeds_equal_token_prompts_in_a_mixed_chunked_batch(llm, model):
    """Embeds prompts (2-D, and 3-D with a batch of 1) beside token prompts in one batch,
    prompts of 40-70 tokens chunked over steps of 32: each output equals its token
    prompt's, its prompt ids are placeholders and it has no prompt text."""
    hf = model[1]
    vocab = hf.config.vocab_size
    prompts = [prompt_ids(i, n, vocab) for i, n in enumerate((45, 70, 5, 40))]
    reference = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    mixed = [
        {"prompt_embeds": embeds_of(hf, prompts[0])},
        {"prompt_token_ids": prompts[1]},
        {"prompt_embeds": embeds_of(hf, prompts[2])[None]},  # (1, n, hidden)
        {"prompt_embeds": embeds_of(hf, prompts[3])},
    ]
    outs = llm.generate(mixed, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert outs[0].prompt is None and outs[0].prompt_token_ids == [0] * 45
    assert outs[2].prompt_token_ids == [0] * 5


def test_prefix_cache_never_mixes_embeds_and_tokens(llm, model):
    """A token prompt of the placeholder ids themselves is cached first: an embeds prompt
    of other tokens takes none of its blocks. The same embeddings again hit their own
    blocks (hashed by their bytes) with the same output."""
    hf = model[1]
    ids = prompt_ids(7, 48, hf.config.vocab_size)
    llm.generate([{"prompt_token_ids": [0] * 48}], GREEDY)
    reference = llm.generate([ids], GREEDY)[0].outputs[0].token_ids
    llm.reset_prefix_cache()
    llm.generate([{"prompt_token_ids": [0] * 48}], GREEDY)
    first = llm.generate([{"prompt_embeds": embeds_of(hf, ids)}], GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert first.outputs[0].token_ids == reference
    again = llm.generate([{"prompt_embeds": embeds_of(hf, ids)}], GREEDY)[0]
    assert again.num_cached_tokens == 32  # two full blocks of 16 (never the whole prompt)
    assert again.outputs[0].token_ids == reference
    other = embeds_of(hf, ids)
    other[40] += 0.5  # the third block differs: the first two are still shared
    assert llm.generate([{"prompt_embeds": other}], GREEDY)[0].num_cached_tokens == 32
    other[3] += 0.5  # the first block differs: nothing is shared
    assert llm.generate([{"prompt_embeds": other}], GREEDY)[0].num_cached_tokens == 0


@pytest.mark.parametrize(
    ("prompt", "params", "param"),
    [
        (torch.zeros(4, 7), GREEDY, "prompt_embeds"),  # hidden size 7, the model's 64
        (torch.zeros(4, 64, dtype=torch.long), GREEDY, "prompt_embeds"),
        (torch.zeros(2, 4, 64), GREEDY, "prompt_embeds"),
        (torch.zeros(0, 64), GREEDY, "prompt_embeds"),
        (torch.full((4, 64), float("nan")), GREEDY, "prompt_embeds"),
        (torch.zeros(4, 64), SamplingParams(max_tokens=2, prompt_logprobs=1), "prompt_logprobs"),
        (
            torch.zeros(4, 64),
            SamplingParams(max_tokens=2, repetition_penalty=1.2),
            "repetition_penalty",
        ),
    ],  # fmt: skip
)
def test_bad_embeds_requests_are_refused(llm, prompt, params, param):
    with pytest.raises(VLLMValidationError) as e:
        llm.generate([{"prompt_embeds": prompt}], params)
    assert e.value.param == param


def test_refused_without_the_flag_and_with_what_does_not_combine(model):
    llm = LLM(model[0], **ARGS)
    with pytest.raises(VLLMValidationError, match="--enable-prompt-embeds") as e:
        llm.generate([{"prompt_embeds": torch.zeros(4, 64)}], GREEDY)
    assert e.value.param == "prompt_embeds"
    assert llm.generate([[5, 6, 7]], GREEDY)[0].outputs[0].token_ids  # the engine goes on
    del llm
    gc.collect()
    with pytest.raises(ValueError, match="--enable-prompt-embeds"):
        EngineArgs(
            model=model[0], enable_prompt_embeds=True, runner="pooling"
        ).create_engine_config(128)
    with pytest.raises(ValueError, match="--enable-prompt-embeds"):
        EngineArgs(
            model=model[0],
            enable_prompt_embeds=True,
            speculative_config='{"method": "ngram", "num_speculative_tokens": 2}',
        ).create_engine_config(128)


def test_a_lora_request_with_embeds_is_refused(llm):
    lora = LoRARequest("a", 1, "/nonexistent")
    with pytest.raises(VLLMValidationError):  # LoRA is off here; with it on, as refused
        llm.generate([{"prompt_embeds": torch.zeros(4, 64)}], GREEDY, lora_request=lora)
    processor = llm.processor
    with pytest.raises(VLLMValidationError, match="LoRA") as e:
        processor._check_embeds_request(GREEDY, lora, None, False)
    assert e.value.param == "lora_request"


def b64(tensor: torch.Tensor) -> str:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


def test_v1_completions_with_base64_prompt_embeds(model):
    """In process (the ASGI app over an AsyncLLM): one embeds prompt, a list beside a text
    prompt (embeds first), and the 400s naming prompt_embeds."""
    from vllm.entrypoints.openai.api_server import build_app
    from vllm.entrypoints.openai.cli_args import FrontendArgs
    from vllm.entrypoints.openai.run_batch import asgi_post
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.metrics.prometheus import PrometheusStatLogger

    path, hf = model
    tokenizer = __import__("transformers").AutoTokenizer.from_pretrained(path)
    text = "The sea is blue and the sky is"
    ids = tokenizer(text)["input_ids"]
    loop = asyncio.new_event_loop()
    config = EngineArgs(
        model=path, served_model_name=("tiny",), enable_prompt_embeds=True, **ARGS
    ).create_engine_config(256)
    engine = AsyncLLM(config, stat_loggers=[])
    try:
        loop.run_until_complete(engine.start())
        stats = PrometheusStatLogger("tiny", registry=CollectorRegistry())
        app = build_app(config, FrontendArgs(), engine, stats)

        def post(body: dict) -> tuple[int, dict]:
            greedy = {"model": "tiny", "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
            status, payload = loop.run_until_complete(
                asgi_post(app, "/v1/completions", {**greedy, **body})
            )
            return status, json.loads(payload)

        status, ref = post({"prompt": ids})
        assert status == 200, ref
        status, out = post({"prompt": "", "prompt_embeds": b64(embeds_of(hf, ids))})
        assert status == 200, out
        assert out["choices"][0]["text"] == ref["choices"][0]["text"]
        assert out["usage"]["prompt_tokens"] == len(ids)
        status, out = post({"prompt": text, "prompt_embeds": [b64(embeds_of(hf, ids))]})
        assert status == 200, out
        texts = [c["text"] for c in sorted(out["choices"], key=lambda c: c["index"])]
        assert texts == [ref["choices"][0]["text"]] * 2
        bad = [
            {"prompt_embeds": "not base64!"},
            {"prompt_embeds": base64.b64encode(b"junk").decode()},
            {"prompt_embeds": b64(torch.zeros(3, 5))},
            {"prompt_embeds": b64(torch.zeros(3, 64, dtype=torch.int32))},
            {"prompt_embeds": b64(torch.zeros(3, 64)), "echo": True},
        ]
        for body in bad:
            status, err = post(body)
            assert status == 400, (body, err)
            assert err["error"]["param"] in ("prompt_embeds", "echo"), err
    finally:
        engine.shutdown()
        loop.close()
        gc.collect()
