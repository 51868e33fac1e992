"""Top-level ``job_id`` / ``is_last_step`` in a request body, moved into ``vllm_xargs``.

Upstream accepts unknown top-level fields and ignores them, so the openai client's
``extra_body={"job_id": "j1", "is_last_step": False}`` would be lost; with
``--middleware vllm_continuum.upstream.middleware.JobFieldsMiddleware`` it lands in
``SamplingParams.extra_args`` like ``extra_body={"vllm_xargs": {"job_id": "j1"}}`` (which
works without the middleware). A pure ASGI middleware: only JSON POST bodies that carry
one of the fields are rewritten; streaming responses pass through untouched. A ``job_id``
that breaks the job-key rule (``vllm_continuum.jobs``: empty, or not a string), at the top
level or in ``vllm_xargs``, is a 400 in OpenAI's error shape, as on our own server.
Claude Code's turns on upstream's ``/v1/messages`` get their job from its session
(``move_fields``): Claude Code with upstream vLLM and this plugin is served as on ours.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any

from vllm_continuum import claude_code
from vllm_continuum.jobs import LAST_UNLESS_TOOL_CALL, validate_job_id

FIELDS = ("job_id", "is_last_step")
CACHE_KEY = "prompt_cache_key"
MESSAGES_PATH = "/v1/messages"  # upstream's Anthropic Messages route
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def move_fields(
    body: bytes, path: str = "", headers: Mapping[str, str] | None = None
) -> bytes | None:
    """The rewritten body, or None when there is nothing to move.

    OpenAI's own ``prompt_cache_key`` names the job when no ``job_id`` is given (as on our
    server; upstream still sees the key). On upstream's ``/v1/messages`` (the Anthropic
    API), a Claude Code turn without a job names the job by its session and conversation
    (``vllm_continuum.claude_code``, as on our server; ``headers`` by lower-case name), and
    unless it says ``is_last_step`` it ends the job only if it calls no tool
    (``last_step_unless_tool_call``). ``ValueError`` naming ``job_id`` if the body's job_id
    breaks the job-key rule."""
    messages = path == MESSAGES_PATH
    if not messages and not any(f.encode() in body for f in (*FIELDS, CACHE_KEY)):
        return None
    try:
        payload = json.loads(body)
    except ValueError:
        return None
    if not isinstance(payload, dict):
        return None
    xargs = payload.get("vllm_xargs") or {}
    if not isinstance(xargs, dict):
        return None  # upstream's own validation reports it
    job_id = validate_job_id(payload.get("job_id", xargs.get("job_id")))
    key = payload.get(CACHE_KEY)
    by_key = job_id is None and isinstance(key, str) and key != ""
    session_job = None
    if messages and job_id is None and not by_key:
        session_job = claude_code.job_id(headers or {}, payload)
    if not by_key and session_job is None and not any(f in payload for f in FIELDS):
        return None
    if session_job is not None:
        xargs["job_id"] = session_job
        if "is_last_step" not in payload and "is_last_step" not in xargs:
            xargs[LAST_UNLESS_TOOL_CALL] = 1
    for field in FIELDS:
        if field in payload:
            value = payload.pop(field)
            # vllm_xargs values are str/int/float: a JSON bool becomes 0/1.
            xargs.setdefault(field, int(value) if isinstance(value, bool) else value)
    if by_key:
        xargs["job_id"] = key
    payload["vllm_xargs"] = xargs
    return json.dumps(payload).encode()


class JobFieldsMiddleware:
    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        chunks = []
        while True:
            message = await receive()
            if message["type"] != "http.request":  # a disconnect before the body ended
                await self.app(scope, _replay([message], receive), send)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        named = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            rewritten = move_fields(body, scope.get("path", ""), named)
        except ValueError as e:
            await _bad_request(send, str(e), "job_id")
            return
        if rewritten is not None:
            body = rewritten
            headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
            scope = dict(scope, headers=[*headers, (b"content-length", str(len(body)).encode())])
        first = {"type": "http.request", "body": body, "more_body": False}
        await self.app(scope, _replay([first], receive), send)


async def _bad_request(send: Send, message: str, param: str) -> None:
    """A 400 with OpenAI's error body."""
    error = {"message": message, "type": "BadRequestError", "param": param, "code": 400}
    body = json.dumps({"error": error}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": 400, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A receive that returns ``messages`` first, then defers to the real one."""
    pending = list(messages)

    async def replay() -> Message:
        return pending.pop(0) if pending else await receive()

    return replay
