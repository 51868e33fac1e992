"""vLLM's --enable-server-load-tracking and GET /load: the model requests in flight, from
arrival to the end of the response (a stream counts until its last chunk)."""

from __future__ import annotations

import pytest

from vllm.entrypoints.openai.api_server import is_load_path


def test_the_model_routes_are_counted_and_the_others_not():
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/messages",
                 "/v1/responses", "/v1/responses/resp_1/cancel", "/invocations", "/v2/rerank",
                 "/score"):  # fmt: skip
        assert is_load_path(path), path
    for path in ("/v1/models", "/tokenize", "/v1/responsesx", "/metrics", "/load"):
        assert not is_load_path(path), path


@pytest.mark.slow
def test_load_counts_a_stream_until_its_end(tmp_path):
    import requests

    from tests.entrypoints.test_generation_config import tiny_model
    from tests.utils import RemoteServer

    model = tiny_model(tmp_path / "tiny")
    server = RemoteServer("--model", model, "--enable-server-load-tracking",
                          log_path=str(tmp_path / "server.log"))  # fmt: skip

    def load() -> int:
        return requests.get(server.base + "/load", timeout=10).json()["server_load"]

    try:
        assert load() == 0
        body = {"model": model, "prompt": "One, two,", "max_tokens": 64, "stream": True,
                "ignore_eos": True}  # fmt: skip
        with requests.post(server.base + "/v1/completions", json=body, stream=True) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line).startswith(b"data: ")
            assert load() == 1  # the stream is open
            assert b"[DONE]" in b"".join(lines)
        assert requests.get(server.base + "/v1/models").ok  # not a model request
        assert load() == 0
    finally:
        server.stop()
