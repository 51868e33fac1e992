"""vLLM's scoring routes on an embedding model (``--runner pooling``): ``/score`` and the
rerank API score pairs by the cosine similarity of their embeddings (a bi-encoder; a
cross-encoder's tests: test_cross_encoder.py), which
equal transformers' last hidden states; the pairings, the ordering, the token limits and
the refusals."""

from __future__ import annotations

import pytest
import requests
import torch
import transformers

from tests.entrypoints.test_embeddings import reference
from tests.lora.test_lora import save_base
from vllm.entrypoints.openai.serving_score import RerankRequest, ScoreRequest

pytestmark = pytest.mark.slow
API_KEY = "sk-score"
QUERY = "Which file holds the tests?"
DOCS = ["tests/test_main.py holds the tests.", "The sea is blue today.", "main.py", "utils"]


def test_the_bodies_take_vllm_s_names_and_refuse_unknown_fields():
    for names in (("text_1", "text_2"), ("data_1", "data_2"), ("queries", "documents"),
                  ("queries", "items")):  # fmt: skip
        request = ScoreRequest.model_validate({names[0]: "a", names[1]: ["b", "c"]})
        assert request.sides() == (["a"], ["b", "c"], names)
    with pytest.raises(ValueError, match="text_1 and text_2"):
        ScoreRequest.model_validate({"text_1": "a"}).sides()
    for field, value in (("padding", "max_length"), ("bogus", 1)):
        with pytest.raises(ValueError, match=field):
            RerankRequest.model_validate({"query": "q", "documents": ["d"], field: value})
    # A cross-encoder's fields: the body takes them, a bi-encoder refuses them (a 400).
    request = RerankRequest.model_validate({"query": "q", "documents": ["d"], "instruction": "x"})
    with pytest.raises(ValueError, match="instruction"):
        request.check_bi_encoder()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from vllm.benchmarks.server import RemoteServer

    path = tmp_path_factory.mktemp("score-base")
    hf = save_base(path)
    srv = RemoteServer(str(path), "--runner", "pooling", "--kv-cache-memory", "16MiB",
                       "--api-key", API_KEY, "--max-model-len", "256")  # fmt: skip
    try:
        yield srv, path, hf
    finally:
        srv.stop()


def post(server, route: str, body: dict, key: str | None = API_KEY) -> requests.Response:
    srv, path, _ = server
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return requests.post(f"{srv.base}{route}", json={"model": str(path), **body},
                         headers=headers, timeout=60)  # fmt: skip


def cosine(hf, tokenizer, a: str, b: str) -> float:
    ea = reference(hf, tokenizer(a)["input_ids"])
    eb = reference(hf, tokenizer(b)["input_ids"])
    return torch.nn.functional.cosine_similarity(ea, eb, dim=0).item()


def test_scores_are_the_cosine_of_the_embeddings_1_to_n_and_n_to_n(server):
    _, path, hf = server
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    one = post(server, "/score", {"text_1": QUERY, "text_2": DOCS}).json()
    assert one["object"] == "list" and one["id"].startswith("score-")
    assert [d["index"] for d in one["data"]] == [0, 1, 2, 3]
    expected = [cosine(hf, tokenizer, QUERY, d) for d in DOCS]
    assert [d["score"] for d in one["data"]] == pytest.approx(expected, abs=1e-4)
    tokens = len(tokenizer(QUERY)["input_ids"]) + sum(len(tokenizer(d)["input_ids"]) for d in DOCS)
    assert one["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    pairs = post(server, "/v1/score", {"queries": DOCS[:2], "documents": DOCS[2:]}).json()
    expected = [cosine(hf, tokenizer, DOCS[0], DOCS[2]), cosine(hf, tokenizer, DOCS[1], DOCS[3])]
    assert [d["score"] for d in pairs["data"]] == pytest.approx(expected, abs=1e-4)
    # Each text's budget: its first tokens.
    cut = post(server, "/score", {"text_1": QUERY, "text_2": DOCS[0], "max_tokens_per_doc": 3})
    short = tokenizer.decode(tokenizer(DOCS[0], add_special_tokens=False)["input_ids"][:3])
    expected = cosine(hf, tokenizer, QUERY, short)
    assert cut.json()["data"][0]["score"] == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize("route", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_returns_the_documents_best_first(server, route):
    full = post(server, route, {"query": QUERY, "documents": DOCS}).json()
    scores = post(server, "/score", {"text_1": QUERY, "text_2": DOCS}).json()["data"]
    order = sorted(range(len(DOCS)), key=lambda i: scores[i]["score"], reverse=True)
    assert [r["index"] for r in full["results"]] == order
    assert [r["document"]["text"] for r in full["results"]] == [DOCS[i] for i in order]
    assert [r["relevance_score"] for r in full["results"]] == pytest.approx(
        [scores[i]["score"] for i in order], abs=1e-6
    )
    if route == "/rerank":  # SageMaker's route takes a rerank body too
        via = post(server, "/invocations", {"query": QUERY, "documents": DOCS}).json()
        assert [r["index"] for r in via["results"]] == order
    top = post(server, route, {"query": QUERY, "documents": DOCS, "top_n": 2,
                               "return_documents": False}).json()  # fmt: skip
    assert [r["index"] for r in top["results"]] == order[:2]
    assert all(r["document"] is None for r in top["results"])


@pytest.mark.parametrize(
    "route, body, param",
    [
        ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),
        ("/score", {"text_1": "a", "text_2": []}, "text_2"),
        ("/score", {"text_1": "", "text_2": "b"}, "text_1"),
        ("/score", {"text_1": "a", "text_2": "b", "max_tokens_per_query": 256},
         "max_tokens_per_query"),
        ("/rerank", {"query": "q", "documents": ["d"], "instruction": "Judge"}, "instruction"),
        ("/rerank", {"query": "q", "documents": ["d"], "top_n": -1}, "top_n"),
        ("/rerank", {"query": "q", "documents": ["d"], "model": "nope"}, "model"),
    ],
)  # fmt: skip
def test_bad_requests_are_4xx_naming_the_field(server, route, body, param):
    resp = post(server, route, body)
    assert resp.status_code in (400, 404), resp.text
    assert resp.json()["error"]["param"] == param


def test_the_routes_sit_behind_the_api_key(server):
    for route in ("/score", "/v1/score", "/rerank", "/v2/rerank"):
        resp = post(server, route, {"query": "q", "documents": ["d"]}, key=None)
        assert resp.status_code == 401, route


def test_a_generating_server_refuses_to_score(tmp_path):
    from vllm.benchmarks.server import RemoteServer

    save_base(tmp_path)
    srv = RemoteServer(str(tmp_path), "--kv-cache-memory", "16MiB")
    try:
        resp = requests.post(f"{srv.base}/rerank", json={"query": "q", "documents": ["d"]},
                             timeout=60)  # fmt: skip
        assert resp.status_code == 400 and "--runner pooling" in resp.json()["error"]["message"]
    finally:
        srv.stop()


def test_offline_score_pairs_as_the_server_does(tmp_path):
    from vllm import LLM

    hf = save_base(tmp_path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    llm = LLM(model=str(tmp_path), runner="pooling", kv_cache_memory="16MiB")
    try:
        outs = llm.score(QUERY, DOCS)
        pairs = llm.score(DOCS[:2], DOCS[2:])
        with pytest.raises(ValueError, match="1:1, 1:N or N:N"):
            llm.score(DOCS[:2], DOCS[:3])
    finally:
        llm.shutdown()
    expected = [cosine(hf, tokenizer, QUERY, d) for d in DOCS]
    assert [o.outputs.score for o in outs] == pytest.approx(expected, abs=1e-4)
    query_ids = tokenizer(QUERY)["input_ids"]
    assert outs[1].prompt_token_ids == query_ids + tokenizer(DOCS[1])["input_ids"]
    expected = [cosine(hf, tokenizer, DOCS[0], DOCS[2]), cosine(hf, tokenizer, DOCS[1], DOCS[3])]
    assert [o.outputs.score for o in pairs] == pytest.approx(expected, abs=1e-4)
