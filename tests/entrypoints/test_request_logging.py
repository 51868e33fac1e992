"""vLLM's request and output logs: --enable-log-requests, --enable-log-outputs,
--enable-log-deltas, --max-log-len and --log-level (VLLM_LOGGING_LEVEL)."""

from __future__ import annotations

import logging

import pytest

from vllm.entrypoints.logger import RequestLogger, set_log_level
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind

LOGGER = "vllm.entrypoints.logger"


def output(*completions: tuple[int, str, list[int], str | None]) -> RequestOutput:
    outs = [CompletionOutput(i, text, ids, finish_reason=why) for i, text, ids, why in completions]
    finished = all(c.finish_reason is not None for c in outs)
    return RequestOutput("r1", None, [1, 2], outs, finished)


def messages(caplog, level=logging.INFO) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == level]


def test_a_stream_is_logged_delta_by_delta_and_whole_per_sample(caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    observe = RequestLogger(False, True, max_log_len=6).output_observer(
        "r1", RequestOutputKind.DELTA
    )
    observe(output((0, "Hel", [5], None), (1, "Yo", [7], None)))
    observe(output((0, "lo there", [6, 8], "stop"), (1, "", [], None)))
    observe(output((1, " you", [9], "length")))
    info = messages(caplog)
    assert info[:2] == [
        "Generated response r1 (streaming delta): output: 'Hel', finish_reason: None",
        "Generated response r1 (streaming delta): output: 'Yo', finish_reason: None",
    ]
    # Each sample's complete output when it finishes; --max-log-len cuts text and ids.
    assert (
        "Generated response r1 (streaming complete): output: 'Hello ', finish_reason: stop" in info
    )
    assert (
        "Generated response r1 (streaming complete): output: 'Yo you', finish_reason: length"
        in info
    )
    assert len(info) == 6  # 4 non-empty deltas, 2 completions (the empty delta: no line)
    debug = messages(caplog, logging.DEBUG)
    assert (
        "Generated response r1 (streaming complete) details: output_token_ids: [5, 6, 8]" in debug
    )


def test_without_deltas_or_streaming_only_the_finished_output_is_logged(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    quiet = RequestLogger(False, True, log_deltas=False).output_observer(
        "r1", RequestOutputKind.DELTA
    )
    quiet(output((0, "a", [1], None)))
    quiet(output((0, "b", [2], "stop")))
    whole = RequestLogger(False, True).output_observer("r1", RequestOutputKind.CUMULATIVE)
    whole(output((0, "ab", [1, 2], None)))
    whole(output((0, "abc", [1, 2, 3], "length")))
    assert messages(caplog) == [
        "Generated response r1 (streaming complete): output: 'ab', finish_reason: stop",
        "Generated response r1: output: 'abc', finish_reason: length",
    ]
    assert RequestLogger(True, False).output_observer("r1", RequestOutputKind.DELTA) is None


def test_inputs_are_logged_with_the_prompt_only_at_debug(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    log = RequestLogger(True, False, max_log_len=3)
    log.log_inputs("r1", "secret prompt", [10, 11, 12, 13], "SamplingParams(n=1)")
    assert messages(caplog) == [
        "Received request r1: params: SamplingParams(n=1), lora_request: None"
    ]
    assert messages(caplog, logging.DEBUG) == []
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    log.log_inputs("r2", "secret prompt", [10, 11, 12, 13], "p")
    assert "Request r2 details: prompt: 'sec', prompt_token_ids: [10, 11, 12]" in messages(
        caplog, logging.DEBUG
    )
    RequestLogger(False, True).log_inputs("r3", "x", [1], "p")  # outputs only: no input line
    assert not any("r3" in m for m in messages(caplog))


def test_log_level_comes_from_the_flag_then_the_variable(monkeypatch):
    vllm_logger = logging.getLogger("vllm")
    before = vllm_logger.level
    try:
        monkeypatch.setenv("VLLM_LOGGING_LEVEL", "warning")
        set_log_level(None)
        assert vllm_logger.level == logging.WARNING
        set_log_level("debug")
        assert vllm_logger.level == logging.DEBUG
        monkeypatch.setenv("VLLM_LOGGING_LEVEL", "LOUD")
        with pytest.raises(ValueError, match="VLLM_LOGGING_LEVEL"):
            set_log_level(None)
    finally:
        vllm_logger.setLevel(before)


@pytest.mark.slow
def test_a_server_logs_requests_and_outputs(tmp_path):
    import requests

    from tests.entrypoints.test_generation_config import tiny_model
    from tests.utils import RemoteServer

    model = tiny_model(tmp_path / "tiny")
    log_path = tmp_path / "server.log"
    server = RemoteServer(
        "--model", model, "--enable-log-requests", "--enable-log-outputs",
        "--no-enable-log-deltas", "--max-log-len", "12", "--log-level", "debug",
        log_path=str(log_path),
    )  # fmt: skip
    try:
        prompt = "The tide came in over the flats"
        body = {"model": model, "prompt": prompt, "max_tokens": 3, "request_id": "log-1"}
        assert requests.post(server.base + "/v1/completions", json=body).ok
        chat = {"model": model, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2, "stream": True}  # fmt: skip
        assert requests.post(server.base + "/v1/chat/completions", json=chat).ok
    finally:
        server.stop()
    text = log_path.read_text()
    assert "Received request cmpl-log-1-" in text and "params: SamplingParams(" in text
    assert f"prompt: {prompt[:12]!r}, prompt_token_ids: [" in text  # DEBUG, cut to 12
    assert "Generated response cmpl-log-1-" in text and "finish_reason: length" in text
    assert "(streaming complete): output: " in text
    assert "(streaming delta)" not in text
