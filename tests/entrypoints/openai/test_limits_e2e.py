"""End-to-end: the limits that protect the server from one client (issue 16).

One server for the module: limits refused with a 400/413 naming the field, unsupported
parameters refused, unknown fields ignored with a warning, job_id escaped in the log,
half-open connections closed, a huge prompt tokenized off the event loop, and /health
following a stopped (SIGSTOP) engine.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import psutil
import pytest
import requests

from ...utils import RemoteServer

pytestmark = pytest.mark.slow
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"prompt": "hi", "max_tokens": 2}
READ_TIMEOUT_S = 2
STALL_TIMEOUT_S = 3
TOOL = {"type": "function", "function": {"name": "f", "parameters": {}}}

# (endpoint, fields over the base body, status, the param the error names)
REFUSED = [
    ("chat", {"n": 129}, 400, "n"),
    ("completions", {"n": 20000, "max_tokens": 1}, 400, "n"),
    ("chat", {"job_id": "j" * 257}, 400, "job_id"),
    ("completions", {"vllm_xargs": {"job_id": "j" * 10**6}}, 400, "job_id"),
    ("chat", {"stop": ["x" * 10] * 33}, 400, "stop"),
    ("completions", {"stop": ["x" * 1024] * 1000}, 400, "stop"),
    ("chat", {"stop": "x" * 513}, 400, "stop"),
    ("chat", {"chat_template": "{{ messages[0].content }}"}, 400, "chat_template"),
    # tool_choice "auto" (the default with tools) needs --enable-auto-tool-choice:
    ("chat", {"tools": [TOOL]}, 400, "tool_choice"),
    ("chat", {"tools": [TOOL], "tool_choice": "auto"}, 400, "tool_choice"),
    ("chat", {"tool_choice": "required"}, 400, "tool_choice"),
    ("completions", {"prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs"),
    ("completions", {"prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ("chat", {"logit_bias": {"forty-two": 5}}, 400, "logit_bias"),
    ("chat", {"logit_bias": {"99999999": 5}}, 400, "logit_bias"),
    ("completions", {"allowed_token_ids": [99999999]}, 400, "allowed_token_ids"),
    ("completions", {"response_format": {"type": "json_schema"}}, 400, "response_format"),
    ("completions", {"best_of": 3}, 400, "best_of"),
    ("completions", {"suffix": "end"}, 400, "suffix"),
    ("completions", {"echo": True, "logprobs": 1, "stream": True}, 400, "echo"),
    ("completions", {"prompt": "x" * (9 << 20)}, 413, None),
]
ACCEPTED = [  # values that ask for nothing unsupported
    ("chat", {"tools": [TOOL], "tool_choice": "none"}),
    ("chat", {"response_format": {"type": "text"}, "logit_bias": {}, "n": 128, "max_tokens": 1}),
    ("chat", {"logit_bias": {"42": 5}, "allowed_token_ids": [42, 43], "max_tokens": 1}),
    ("completions", {"best_of": 1, "prompt_logprobs": None, "stop": ["x" * 512] * 32}),
    ("chat", {"job_id": "j" * 256, "is_last_step": True}),
]


@pytest.fixture(scope="module")
def log_path(tmp_path_factory):
    return tmp_path_factory.mktemp("limits") / "server.log"


@pytest.fixture(scope="module")
def server(log_path):
    srv = RemoteServer(
        "--num-gpu-blocks-override",
        "256",
        "--max-model-len",
        "512",
        "--request-read-timeout",
        str(READ_TIMEOUT_S),
        "--engine-stall-timeout",
        str(STALL_TIMEOUT_S),
        log_path=str(log_path),
    )
    try:
        yield srv
    finally:
        srv.stop()


def post(server, endpoint: str, body: dict, **kw) -> requests.Response:
    url = f"{server.base}/v1/{'chat/completions' if endpoint == 'chat' else endpoint}"
    return requests.post(url, json=body, timeout=kw.pop("timeout", 120), **kw)


def test_limits_and_unsupported_parameters_are_refused(server):
    failures = []
    for endpoint, fields, status, param in REFUSED:
        r = post(server, endpoint, {**(CHAT if endpoint == "chat" else COMPLETION), **fields})
        err = r.json().get("error", {}) if r.headers["content-type"] == "application/json" else {}
        if r.status_code != status or err.get("param") != param or not err.get("message"):
            failures.append((endpoint, str(fields)[:60], r.status_code, r.text[:160]))
    for endpoint, fields in ACCEPTED:
        r = post(server, endpoint, {**(CHAT if endpoint == "chat" else COMPLETION), **fields})
        if r.status_code != 200:
            failures.append((endpoint, str(fields)[:60], r.status_code, r.text[:160]))
    assert not failures


def test_body_limit_without_content_length(server):
    # Chunked: no Content-Length to refuse up front; the limit applies while reading.
    body = json.dumps({"prompt": "x" * (9 << 20)}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        for i in range(0, len(body), 1 << 20):
            part = body[i : i + (1 << 20)]
            try:
                sock.sendall(b"%x\r\n%s\r\n" % (len(part), part))
            except OSError:
                break  # the server answered and closed
        head = b""
        while b"RequestTooLargeError" not in head:  # the body may come in a later packet
            try:
                part = sock.recv(4096)
            except OSError:
                break
            if not part:
                break
            head += part
    assert head.startswith(b"HTTP/1.1 413"), head[:200]
    assert b'"RequestTooLargeError"' in head


def test_echo(server):
    r = post(server, "completions", {**COMPLETION, "prompt": "Paris is", "echo": True})
    assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith("Paris is")
    body = {**COMPLETION, "prompt": "Paris is", "echo": True, "stream": True, "n": 2}
    r = post(server, "completions", body, stream=True)
    texts: dict[int, str] = {}
    for line in r.iter_lines():
        if line.startswith(b"data: {"):
            for c in json.loads(line[6:])["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert set(texts) == {0, 1} and all(t.startswith("Paris is") for t in texts.values())


def test_unknown_fields_and_job_id_are_logged_safely(server, log_path):
    forged = "job\nINFO forged line\r\x1b[31m"
    r = post(server, "chat", {**CHAT, "job_id": forged, "frobnicate": 1, "a\nb": 2})
    assert r.status_code == 200, r.text
    time.sleep(0.5)
    log = log_path.read_text()
    assert "Request fields ignored (not recognised): 'frobnicate', 'a\\nb'" in log
    assert "job_id='job\\nINFO forged line\\r\\x1b[31m'" in log
    assert not any(line.startswith("INFO forged") for line in log.splitlines())
    assert "\x1b" not in log


def test_half_open_connections_are_closed(server):
    socks = []
    for _ in range(200):
        s = socket.create_connection(("127.0.0.1", server.port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
        socks.append(s)
    try:
        start = time.monotonic()
        assert requests.get(server.base + "/health", timeout=5).status_code == 200
        assert time.monotonic() - start < 1
        time.sleep(READ_TIMEOUT_S + 1.5)
        for s in socks:
            s.settimeout(5)
            assert s.recv(100) == b""  # closed by the server
    finally:
        for s in socks:
            s.close()


def worst_health_while(server, work, pause_s: float = 0.0) -> float:
    """Run ``work`` in a thread, polling /health (each must answer 200) until it ends;
    the slowest answer, in seconds."""
    thread = threading.Thread(target=work)
    thread.start()
    worst = 0.0
    while thread.is_alive():
        start = time.monotonic()
        assert requests.get(server.base + "/health", timeout=30).status_code == 200
        worst = max(worst, time.monotonic() - start)
        time.sleep(pause_s)
    thread.join()
    return worst


def test_huge_prompt_does_not_block_the_event_loop(server):
    # ~7 MB of text: seconds of tokenization (then a 400: longer than max_model_len).
    prompt = "hello world, this is a test of a long prompt. " * 150_000
    result = {}

    def send():
        result["r"] = post(server, "completions", {**COMPLETION, "prompt": prompt}, timeout=300)

    worst = worst_health_while(server, send, pause_s=0.1)
    assert result["r"].status_code == 400 and result["r"].json()["error"]["param"] == "prompt"
    assert worst < 2.0, f"/health took {worst:.1f} s during the tokenization"


def _engine(server) -> psutil.Process:
    (engine,) = [
        p
        for p in psutil.Process(server.proc.pid).children()
        if "--multiprocessing-fork" in p.cmdline()
    ]
    return engine


def test_health_follows_a_stopped_engine(server):
    engine = _engine(server)
    body = {**COMPLETION, "max_tokens": 8, "ignore_eos": True}
    os.kill(engine.pid, signal.SIGSTOP)
    try:
        result = {}
        thread = threading.Thread(target=lambda: result.update(r=post(server, "completions", body)))
        thread.start()
        deadline = time.monotonic() + STALL_TIMEOUT_S + 10
        while (health := requests.get(server.base + "/health", timeout=5)).status_code == 200:
            assert time.monotonic() < deadline, "/health still 200 with the engine stopped"
            time.sleep(0.2)
        assert health.status_code == 503 and "stalled" in health.text
    finally:
        os.kill(engine.pid, signal.SIGCONT)
    thread.join(60)
    assert result["r"].status_code == 200 and result["r"].json()["usage"]["completion_tokens"] == 8
    assert requests.get(server.base + "/health", timeout=5).status_code == 200


def _send_head(server, head: bytes) -> bytes:
    """Send a request head; what the server answers before closing (b"" if nothing)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        try:
            sock.sendall(head)
        except OSError:
            pass  # refused and closed while we were still sending
        answer = b""
        try:
            while part := sock.recv(65536):
                answer += part
        except OSError:
            pass
        return answer


def test_request_heads_are_bounded(server):
    # 64 KiB (--max-request-header-size) and 256 fields by default: over either, a JSON
    # 431 and the connection closes (the recv loop ends: closed, not kept alive).
    big = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (100 << 10) + b"\r\n\r\n"
    many = b"GET /health HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(300))
    for head in (big, many + b"\r\n"):
        answer = _send_head(server, head)
        assert answer.startswith(b"HTTP/1.1 431 "), answer[:100]
        assert b'"RequestHeaderFieldsTooLargeError"' in answer
    fits = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (60 << 10)
    answer = _send_head(server, fits + b"\r\nConnection: close\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:100]


def test_a_huge_header_is_cut_short_without_stalling_others(server):
    # Before the limit, one 120 MB header held the event loop ~10 s (httptools grows a
    # header by concatenation) and left the API server 255 MB larger.
    rss_before = psutil.Process(server.proc.pid).memory_info().rss
    result = {}

    def send() -> None:
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ")
            sent = 0
            try:
                while sent < 64 << 20:
                    sock.sendall(b"a" * (1 << 20))
                    sent += 1 << 20
            except OSError:
                pass
            result["sent"] = sent

    worst = worst_health_while(server, send)
    assert result["sent"] < 16 << 20, "the server kept reading the header"
    assert worst < 1.0, f"/health took {worst:.1f} s during the header"
    grown = psutil.Process(server.proc.pid).memory_info().rss - rss_before
    assert grown < 32 << 20, f"the API server grew {grown >> 20} MiB"


def test_many_messages_are_refused_before_they_are_built(server):
    body = {**CHAT, "messages": [{}] * 250_000}
    start = time.monotonic()
    r = post(server, "chat", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text[:200]
    assert time.monotonic() - start < 5
