"""``vllm run-batch``: OpenAI's batch file format, served offline, as vLLM's command does.

Each input line is a request, ``{"custom_id": ..., "method": "POST", "url":
"/v1/chat/completions", "body": {...}}`` (``/v1/completions``, ``/v1/embeddings`` and
the scoring routes ``/score``, ``/rerank`` too, as vLLM's); each output line, in input
order, is ``{"id", "custom_id", "response": {"status_code", "request_id", "body"},
"error"}``. The requests run through the server's own app in this process (every
check, limit and error of ``vllm serve``), side by side up to ``--max-concurrency``,
over an engine process started for the run. A request the
server refuses gets its status and error body; a line that is not a request at all gets
``response: null`` and an ``error``. Streaming is not a batch's: ``stream: true`` is
refused on its line.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import uuid
from typing import Any

logger = logging.getLogger("vllm.run_batch")
URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/score", "/v1/score",
        "/rerank", "/v1/rerank", "/v2/rerank")  # fmt: skip


def parse_line(line: str) -> tuple[dict | None, str | None]:
    """(the request, None), or (None, why the line is not one)."""
    try:
        item = json.loads(line)
    except ValueError as e:
        return None, f"not JSON: {e}"
    if not isinstance(item, dict):
        return None, "a line must be a JSON object"
    if not isinstance(item.get("custom_id"), str):
        return None, "custom_id must be a string"
    if item.get("method", "POST") != "POST":
        return None, f"method must be POST, got {item.get('method')!r}"
    if item.get("url") not in URLS:
        return None, f"url must be one of {list(URLS)}, got {item.get('url')!r}"
    if not isinstance(item.get("body"), dict):
        return None, "body must be a JSON object"
    if item["body"].get("stream"):
        return None, "stream is not served in a batch"
    return item, None


async def asgi_post(app, path: str, body: dict) -> tuple[int, bytes]:
    """POST ``body`` (JSON) to ``path`` of the ASGI ``app`` in this process: (status, the
    whole response body). The client stays until the response ends."""
    raw = json.dumps(body).encode()
    scope = {
        "type": "http", "http_version": "1.1", "method": "POST", "path": path,
        "raw_path": path.encode(), "query_string": b"", "scheme": "http", "root_path": "",
        "server": ("run-batch", 0), "client": ("run-batch", 0),
        "headers": [(b"content-type", b"application/json"),
                    (b"content-length", b"%d" % len(raw))],
    }  # fmt: skip
    done = asyncio.Event()
    sent: list[dict] = []
    messages = [{"type": "http.request", "body": raw, "more_body": False}]

    async def receive() -> dict:
        if messages:
            return messages.pop(0)
        await done.wait()  # nobody leaves: the answer is awaited
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body"):
            done.set()

    await app(scope, receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


async def call(app, path: str, body: dict) -> tuple[int, Any]:
    """``asgi_post``, its answer parsed: (status, the JSON, or the text if it is none)."""
    status, payload = await asgi_post(app, path, body)
    try:
        return status, json.loads(payload)
    except ValueError:
        return status, payload.decode(errors="replace")


async def run(app, lines: list[str], concurrency: int) -> list[dict]:
    """One output record a non-empty input line, in order."""
    limit = asyncio.Semaphore(concurrency)

    async def one(line: str) -> dict:
        record: dict[str, Any] = {"id": f"vllm-{uuid.uuid4().hex}", "custom_id": None}
        item, why = parse_line(line)
        if item is None:
            custom_id = None
            with contextlib.suppress(ValueError, AttributeError):  # whatever it names
                custom_id = json.loads(line).get("custom_id")
            return {**record, "custom_id": custom_id, "response": None,
                    "error": {"code": "invalid_request", "message": why}}  # fmt: skip
        async with limit:
            status, body = await call(app, item["url"], item["body"])
        response = {"status_code": status, "request_id": f"vllm-batch-{uuid.uuid4().hex}",
                    "body": body}  # fmt: skip
        return {**record, "custom_id": item["custom_id"], "response": response, "error": None}

    return list(await asyncio.gather(*(one(line) for line in lines if line.strip())))


async def run_batch(
    vllm_config, frontend, input_path: str, output_path: str, concurrency: int
) -> int:
    from vllm.entrypoints.openai.api_server import build_app
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.metrics.prometheus import PrometheusStatLogger

    with open(input_path) if input_path != "-" else sys.stdin as f:
        lines = f.read().splitlines()
    stats = PrometheusStatLogger(vllm_config.model_config.name)
    engine = AsyncLLM(vllm_config, [stats])
    try:
        await engine.start()
        app = build_app(vllm_config, frontend, engine, stats)
        records = await run(app, lines, concurrency)
    finally:
        engine.shutdown()
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    if output_path == "-":
        sys.stdout.write(text)
    else:
        with open(output_path, "w") as f:
            f.write(text)
    failed = sum(r["error"] is not None or r["response"]["status_code"] != 200 for r in records)
    logger.info("%d requests, %d failed; written to %s", len(records), failed, output_path)
    return 0
