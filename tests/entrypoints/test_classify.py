"""Sequence classification (vLLM's classify task): a ``*ForSequenceClassification``
checkpoint is served by the pooling runner on its own (``--runner auto``), each prompt's
class probabilities equal to transformers' softmaxed logits at its last token, whatever
the batch and the prefill chunks; ``--convert classify`` serves a causal checkpoint's
score head the same way; an embedding or generation call on a classifier (and a
classification on any other model) is refused; /classify and /pooling answer in vLLM's
shapes."""

from __future__ import annotations

import asyncio
import gc
import json
import shutil

import pytest
import torch
import transformers

from tests.lora.test_lora import VOCAB
from tests.tiny_models import TINY_LLAMA
from tests.utils import copy_benchmark_tokenizer
from vllm.exceptions import VLLMValidationError

LABELS = {0: "negative", 1: "neutral", 2: "positive"}


def save_classifier(path, cls=transformers.LlamaForSequenceClassification, config_cls=None,
                    **overrides):  # fmt: skip
    """A tiny random classifier (seed 0) with the embedded model's tokenizer; its HF model."""
    torch.manual_seed(0)
    config_cls = config_cls or transformers.LlamaConfig
    config = config_cls(**{**TINY_LLAMA, "vocab_size": VOCAB, "max_position_embeddings": 256,
                           **overrides})  # fmt: skip
    hf = cls(config).eval()
    hf.save_pretrained(path)
    copy_benchmark_tokenizer(path)
    return hf


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    path = tmp_path_factory.mktemp("classifier")
    hf = save_classifier(path, id2label=LABELS, label2id={v: k for k, v in LABELS.items()})
    return path, hf


def logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


def test_classify_equals_transformers_probabilities(classifier):
    """Three prompts in one batch, the long one over three 32-token chunks; again alone
    (its blocks cached); encode gives the same; use_activation=False gives the logits;
    generation and embeddings are refused."""
    from vllm import LLM
    from vllm.pooling_params import PoolingParams

    path, hf = classifier
    g = torch.Generator().manual_seed(0)
    long = torch.randint(0, VOCAB, (90,), generator=g).tolist()
    prompts = [long, long[:50] + [7, 8], [5, 6, 7]]
    llm = LLM(model=str(path), max_num_batched_tokens=32, kv_cache_memory="16MiB")
    try:
        assert llm.processor.pooling_task == "classify"  # --runner auto chose it
        outs = llm.classify([{"prompt_token_ids": p} for p in prompts])
        again = llm.classify({"prompt_token_ids": long})[0]
        encoded = llm.encode({"prompt_token_ids": prompts[2]})[0]
        raw = llm.classify({"prompt_token_ids": prompts[2]},
                           pooling_params=PoolingParams(use_activation=False))[0]  # fmt: skip
        with pytest.raises(VLLMValidationError, match="is a classifier"):
            llm.generate("hello")
        with pytest.raises(VLLMValidationError, match="embeddings need an embedding model"):
            llm.embed("hello")
        with pytest.raises(VLLMValidationError, match="pooling_params.task"):
            llm.classify("hello", pooling_params=PoolingParams(task="embed"))
        with pytest.raises(VLLMValidationError, match="use_activation"):
            PoolingParams(use_activation="yes")
    finally:
        llm.shutdown()
    for out, prompt in zip(outs, prompts, strict=True):
        assert out.prompt_token_ids == prompt and out.outputs.num_classes == 3
        expected = torch.softmax(logits(hf, prompt), -1)
        torch.testing.assert_close(torch.tensor(out.outputs.probs), expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(again.outputs.probs, outs[0].outputs.probs, atol=1e-6, rtol=0)
    torch.testing.assert_close(encoded.outputs.data, outs[2].outputs.probs, atol=1e-6, rtol=0)
    torch.testing.assert_close(torch.tensor(raw.outputs.probs), logits(hf, prompts[2]),
                               atol=1e-5, rtol=0)  # fmt: skip


def test_one_label_is_a_sigmoid_and_convert_classify_reads_a_causal_checkpoint(
    classifier, tmp_path
):
    """A Qwen3 classifier with one label, saved as a Qwen3ForCausalLM whose checkpoint
    holds the score head: --convert classify serves it, sigmoid((logit - mean) / sigma)
    with the pooler config's calibration; --runner auto would generate with it."""
    from vllm import LLM
    from vllm.config import ModelConfig

    hf = save_classifier(tmp_path, transformers.Qwen3ForSequenceClassification,
                         transformers.Qwen3Config, num_labels=1, head_dim=16)  # fmt: skip
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["Qwen3ForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert ModelConfig(model=str(tmp_path)).pooling_task is None  # a causal model: generate
    calibration = {"logit_mean": 0.25, "logit_sigma": 2.0}
    llm = LLM(model=str(tmp_path), convert="classify", pooler_config=calibration,
              kv_cache_memory="16MiB")  # fmt: skip
    try:
        out = llm.classify({"prompt_token_ids": [3, 4, 5, 6]})[0]
    finally:
        llm.shutdown()
    expected = torch.sigmoid((logits(hf, [3, 4, 5, 6]) - 0.25) / 2.0)
    assert out.outputs.num_classes == 1
    torch.testing.assert_close(torch.tensor(out.outputs.probs), expected, atol=1e-5, rtol=0)


def test_convert_and_pooler_config_are_checked(classifier, tmp_path):
    from vllm.config import ModelConfig
    from vllm.model_executor.models.adapters import LlamaForSequenceClassification
    from vllm.model_executor.models.registry import ModelRegistry, model_class_for_task

    path, _ = classifier
    assert ModelConfig(model=str(path)).is_pooling
    assert ModelConfig(model=str(path), runner="pooling").pooling_task == "classify"
    assert ModelConfig(model=str(path), convert="embed").pooling_task == "embed"
    assert ModelConfig(model=str(path), runner="generate").pooling_task is None
    with pytest.raises(ValueError, match="convert"):
        ModelConfig(model=str(path), convert="reward")
    with pytest.raises(ValueError, match="convert"):
        ModelConfig(model=str(path), runner="generate", convert="classify")
    with pytest.raises(ValueError, match="logit_sigma"):
        ModelConfig(model=str(path), pooler_config={"logit_sigma": 0})
    with pytest.raises(ValueError, match="does not take"):
        ModelConfig(model=str(path), pooler_config={"activation": "softmax"})
    with pytest.raises(ValueError, match="pooler_config.normalize"):
        ModelConfig(model=str(path), pooler_config={"normalize": False}).pooling_task  # noqa: B018
    with pytest.raises(ValueError, match="use_activation"):
        ModelConfig(model=str(path), pooler_config={"use_activation": 1})
    causal = tmp_path / "causal"
    shutil.copytree(path, causal)
    config = json.loads((causal / "config.json").read_text())
    config["architectures"] = ["LlamaForCausalLM"]
    (causal / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="convert"):
        ModelConfig(model=str(causal), runner="pooling", convert="none").pooling_task  # noqa: B018
    with pytest.raises(ValueError, match="needs --runner pooling"):
        ModelConfig(model=str(causal), pooler_config={"use_activation": False})
    cls, arch = ModelRegistry.resolve_model_cls(transformers.AutoConfig.from_pretrained(path))
    assert cls is LlamaForSequenceClassification
    with pytest.raises(ValueError, match="not --runner generate"):
        model_class_for_task(cls, arch, None)


class Served:
    """The real app and AsyncLLM over ``model``, driven through ASGI in this process."""

    def __init__(self, model: str) -> None:
        from prometheus_client import CollectorRegistry

        from vllm.engine.arg_utils import EngineArgs
        from vllm.entrypoints.openai.api_server import build_app
        from vllm.entrypoints.openai.cli_args import FrontendArgs
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.metrics.prometheus import PrometheusStatLogger

        self.loop = asyncio.new_event_loop()
        config = EngineArgs(model=model, served_model_name=("tiny",), max_model_len=128,
                            num_gpu_blocks_override=32).create_engine_config(128)  # fmt: skip
        stats = PrometheusStatLogger("tiny", registry=CollectorRegistry())
        self.engine = AsyncLLM(config, stat_loggers=[stats])
        self.loop.run_until_complete(self.engine.start())
        self.app = build_app(config, FrontendArgs(), self.engine, stats)

    def json(self, path: str, body: dict) -> tuple[int, dict]:
        from vllm.entrypoints.openai.run_batch import asgi_post

        status, payload = self.loop.run_until_complete(asgi_post(self.app, path, body))
        return status, json.loads(payload)

    def close(self) -> None:
        self.engine.shutdown()
        self.loop.close()


def test_classify_and_pooling_routes(classifier):
    """POST /classify (one input, several, token ids) in vLLM's shape, labels from
    id2label; POST /pooling the same probabilities; the refusals are 400s (a 404 for an
    unknown model), nothing left in the engine."""
    path, hf = classifier
    served = Served(str(path))
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        texts = ["The sea is blue.", "A list of files: main.py utils.py"]
        status, body = served.json("/classify", {"model": "tiny", "input": texts})
        assert status == 200, body
        assert body["object"] == "list" and body["model"] == "tiny"
        assert body["id"].startswith("classify") and isinstance(body["created"], int)
        ids = [tokenizer(t)["input_ids"] for t in texts]
        assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] == sum(map(len, ids))
        for i, (item, prompt) in enumerate(zip(body["data"], ids, strict=True)):
            probs = torch.softmax(logits(hf, prompt), -1)
            assert item["index"] == i and item["num_classes"] == 3
            assert item["label"] == LABELS[int(probs.argmax())]
            torch.testing.assert_close(torch.tensor(item["probs"]), probs, atol=1e-5, rtol=0)
        status, one = served.json("/classify", {"input": ids[0], "priority": 0})
        assert status == 200 and len(one["data"]) == 1
        close = dict(atol=1e-6, rtol=0)
        torch.testing.assert_close(one["data"][0]["probs"], body["data"][0]["probs"], **close)
        status, pooled = served.json("/pooling", {"input": texts[0]})
        assert status == 200 and pooled["id"].startswith("pool")
        assert pooled["data"][0]["object"] == "pooling"
        torch.testing.assert_close(pooled["data"][0]["data"], body["data"][0]["probs"], **close)
        status, raw = served.json("/classify", {"input": ids[0], "use_activation": False})
        torch.testing.assert_close(torch.tensor(raw["data"][0]["probs"]), logits(hf, ids[0]),
                                   atol=1e-5, rtol=0)  # fmt: skip
        for route, request, match in [
            ("/v1/embeddings", {"input": "x"}, "is a classifier"),
            ("/v1/completions", {"prompt": "x", "max_tokens": 2}, "is a classifier"),
            ("/classify", {"input": []}, "input"),
            ("/classify", {"input": "x", "normalize": True}, "normalize"),
            ("/pooling", {"input": "x", "task": "embed"}, "task"),
            ("/pooling", {"input": "x", "dimensions": 4}, "dimensions"),
        ]:
            status, error = served.json(route, {"model": "tiny", **request})
            assert status == 400 and match in json.dumps(error), (route, error)
        status, _ = served.json("/classify", {"model": "nope", "input": "x"})
        assert status == 404
        assert served.engine.num_unfinished_requests == 0
    finally:
        served.close()
        gc.collect()  # the engine's sockets, before the next module's
