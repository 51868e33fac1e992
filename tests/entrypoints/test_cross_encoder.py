"""Scoring with a cross-encoder (vLLM's, for a classifier with one label: a reranker):
``/score``, ``/rerank`` and ``LLM.score`` run each (query, document) pair as one prompt,
the tokenizer's pair encoding (or a score template's rendering), and answer the
classifier's sigmoid of the logit, equal to transformers' ``*ForSequenceClassification``;
a classifier with more labels is refused."""

from __future__ import annotations

import asyncio
import gc
import json

import pytest
import torch
import transformers

from tests.entrypoints.test_classify import Served, logits, save_classifier
from vllm.entrypoints.score_utils import ScoringModel, pair_token_ids, template_kwargs
from vllm.exceptions import VLLMValidationError

QUERY = "Which file holds the tests?"
DOCS = ["tests/test_main.py holds the tests.", "The sea is blue today.", "main.py", "utils"]
# A score template reading the pair's two messages and an optional instruction.
TEMPLATE = (
    "{% if instruction %}<instruct>{{ instruction }}</instruct>{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
)


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    """A tiny random Qwen3 reranker (one label) with a real tokenizer; its HF model and
    tokenizer."""
    path = tmp_path_factory.mktemp("reranker")
    hf = save_classifier(path, transformers.Qwen3ForSequenceClassification,
                         transformers.Qwen3Config, num_labels=1, head_dim=16)  # fmt: skip
    return path, hf, transformers.AutoTokenizer.from_pretrained(path)


def expected(hf, tokenizer, query: str, doc: str, activation: bool = True) -> float:
    """transformers' score of the pair's encoding ``tokenizer(query, doc)``."""
    logit = logits(hf, tokenizer(query, doc)["input_ids"])[0]
    return (torch.sigmoid(logit) if activation else logit).item()


def leave(served: Served, path: str, body: dict) -> int:
    """POST ``body`` to the app and disconnect at once: the response's status."""
    raw = json.dumps(body).encode()
    scope = {"type": "http", "http_version": "1.1", "method": "POST", "path": path,
             "raw_path": path.encode(), "query_string": b"", "scheme": "http", "root_path": "",
             "server": ("t", 0), "client": ("t", 0),
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", b"%d" % len(raw))]}  # fmt: skip
    messages = [{"type": "http.request", "body": raw, "more_body": False}]
    sent: list[dict] = []

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    served.loop.run_until_complete(served.app(scope, receive, send))
    return next(m["status"] for m in sent if m["type"] == "http.response.start")


def test_score_and_rerank_routes_equal_transformers(reranker):
    """/score 1:N and N:N, use_activation off (the logit), a document's token budget;
    /rerank on every path and through /invocations best first, top_n and
    return_documents; the refusals; a client leaving aborts every pair."""
    path, hf, tokenizer = reranker
    served = Served(str(path))
    try:
        status, body = served.json("/score", {"model": "tiny", "text_1": QUERY, "text_2": DOCS})
        assert status == 200, body
        assert body["object"] == "list" and body["id"].startswith("score-")
        want = [expected(hf, tokenizer, QUERY, d) for d in DOCS]
        assert [d["index"] for d in body["data"]] == [0, 1, 2, 3]
        assert [d["score"] for d in body["data"]] == pytest.approx(want, abs=1e-5)
        tokens = sum(len(tokenizer(QUERY, d)["input_ids"]) for d in DOCS)
        assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}

        status, nn = served.json("/v1/score", {"queries": DOCS[:2], "documents": DOCS[2:],
                                               "use_activation": False})  # fmt: skip
        raw = [expected(hf, tokenizer, DOCS[i], DOCS[i + 2], activation=False) for i in (0, 1)]
        assert [d["score"] for d in nn["data"]] == pytest.approx(raw, abs=1e-5)
        status, cut = served.json("/score", {"text_1": QUERY, "text_2": DOCS[0],
                                             "max_tokens_per_doc": 3})  # fmt: skip
        short = tokenizer.decode(tokenizer(DOCS[0], add_special_tokens=False)["input_ids"][:3])
        assert cut["data"][0]["score"] == pytest.approx(
            expected(hf, tokenizer, QUERY, short), abs=1e-5
        )

        order = sorted(range(len(DOCS)), key=lambda i: want[i], reverse=True)
        for route in ("/rerank", "/v1/rerank", "/v2/rerank", "/invocations"):
            status, ranked = served.json(route, {"query": QUERY, "documents": DOCS})
            assert status == 200, (route, ranked)
            assert [r["index"] for r in ranked["results"]] == order, route
            assert [r["document"]["text"] for r in ranked["results"]] == [DOCS[i] for i in order]
            assert [r["relevance_score"] for r in ranked["results"]] == pytest.approx(
                [want[i] for i in order], abs=1e-5
            )
        status, top = served.json("/rerank", {"query": QUERY, "documents": DOCS, "top_n": 2,
                                              "return_documents": False})  # fmt: skip
        assert [r["index"] for r in top["results"]] == order[:2]
        assert all(r["document"] is None for r in top["results"])
        status, via = served.json("/invocations", {"text_1": QUERY, "text_2": DOCS})
        assert [d["score"] for d in via["data"]] == pytest.approx(want, abs=1e-5)

        for route, request, param in [
            ("/rerank", {"query": "q", "documents": ["d"], "instruction": "Judge"},
             "instruction"),
            ("/score", {"text_1": "q", "text_2": "d", "chat_template_kwargs": {"a": 1}},
             "chat_template_kwargs"),
            ("/rerank", {"query": "q", "documents": ["d"], "padding": "max_length"}, "padding"),
            ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),
            ("/rerank", {"query": "q", "documents": []}, "documents"),
            ("/score", {"text_1": "a", "text_2": "b", "max_tokens_per_query": 128},
             "max_tokens_per_query"),
        ]:  # fmt: skip
            status, error = served.json(route, request)
            assert status == 400 and error["error"]["param"] == param, (route, error)

        assert leave(served, "/rerank", {"query": QUERY, "documents": DOCS * 16}) == 499
        for _ in range(100):  # the aborts reach the engine
            if served.engine.num_unfinished_requests == 0:
                break
            served.loop.run_until_complete(asyncio.sleep(0.01))
        assert served.engine.num_unfinished_requests == 0
    finally:
        served.close()
        gc.collect()  # the engine's sockets, before the next module's


def test_offline_score_equals_transformers_and_a_template_renders_the_pair(reranker, tmp_path):
    from vllm import LLM
    from vllm.pooling_params import PoolingParams

    path, hf, tokenizer = reranker
    llm = LLM(model=str(path), kv_cache_memory="16MiB")
    try:
        outs = llm.score(QUERY, DOCS)
        raw = llm.score(DOCS[:2], DOCS[2:], pooling_params=PoolingParams(use_activation=False))
        templated = llm.score(QUERY, DOCS[0], chat_template=TEMPLATE)
        with pytest.raises(ValueError, match="1:1, 1:N or N:N"):
            llm.score(DOCS[:2], DOCS[:3])
        with pytest.raises(VLLMValidationError, match="pairs texts"):
            llm.score({"prompt_token_ids": [1, 2]}, DOCS)
    finally:
        llm.shutdown()
    assert [o.outputs.score for o in outs] == pytest.approx(
        [expected(hf, tokenizer, QUERY, d) for d in DOCS], abs=1e-5
    )
    assert outs[1].prompt_token_ids == tokenizer(QUERY, DOCS[1])["input_ids"]
    assert [o.outputs.score for o in raw] == pytest.approx(
        [expected(hf, tokenizer, DOCS[i], DOCS[i + 2], activation=False) for i in (0, 1)],
        abs=1e-5,
    )
    rendered = tokenizer(f"<query>{QUERY}<document>{DOCS[0]}")["input_ids"]
    assert templated[0].prompt_token_ids == rendered
    want = torch.sigmoid(logits(hf, rendered)[0]).item()
    assert templated[0].outputs.score == pytest.approx(want, abs=1e-5)


def test_the_pair_prompt_and_what_scores(reranker, tmp_path):
    """The pair's prompt (pair encoding, joined texts, a template with an instruction);
    which models score, and how (no engine started)."""
    from vllm.config import ModelConfig

    path, _, tokenizer = reranker
    assert pair_token_ids(tokenizer, "a b", "c") == tokenizer("a b", "c")["input_ids"]
    assert pair_token_ids(tokenizer, "a b", "c", sep_token=False) == tokenizer("a bc")["input_ids"]
    kwargs = template_kwargs("Judge", None, TEMPLATE)
    assert kwargs == {"instruction": "Judge"}
    assert template_kwargs("Judge", {"instruction": "Mine"}, TEMPLATE) == {"instruction": "Mine"}
    ids = pair_token_ids(tokenizer, "q", "d", TEMPLATE, kwargs)
    assert ids == tokenizer("<instruct>Judge</instruct><query>q<document>d")["input_ids"]
    with pytest.raises(VLLMValidationError, match="needs a score template"):
        template_kwargs("Judge", None, None)
    with pytest.raises(VLLMValidationError, match="may not set tokenize"):
        template_kwargs(None, {"tokenize": True}, TEMPLATE)

    model = ScoringModel.of(ModelConfig(model=str(path)))
    assert (model.require(), model.sep_token, model.template) == ("cross-encoder", True, None)
    with_template = ScoringModel.of(ModelConfig(model=str(path), chat_template=TEMPLATE))
    assert with_template.template == TEMPLATE
    assert ScoringModel.of(ModelConfig(model=str(path), convert="embed")).kind == "bi-encoder"
    with pytest.raises(VLLMValidationError, match="--runner pooling"):
        ScoringModel.of(ModelConfig(model=str(path), runner="generate")).require()
    three = tmp_path / "three"
    save_classifier(three, num_labels=3)
    with pytest.raises(VLLMValidationError, match="has 3 labels"):
        ScoringModel.of(ModelConfig(model=str(three))).require()
