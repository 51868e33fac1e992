"""Small helpers of the entry points (no heavy imports: the CLI imports this)."""

from __future__ import annotations

import os
import socket

LOOPBACK = "127.0.0.1"
# On every /v1 response: which server answered (its host:port, ``api_server.instance_id``).
# Behind vllm-router, which passes response headers through, a client learns the replica
# that served each request.
INSTANCE_HEADER = "x-vllm-instance"


def get_open_port(host: str = LOOPBACK) -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_chat_template(chat_template: str | None) -> None:
    """ValueError if ``chat_template`` looks like a file path but no such file exists.

    A value that is not path-like is template text (as in vLLM); a typo in a path would
    otherwise silently become a one-line template.
    """
    if chat_template is None or os.path.isfile(chat_template):
        return
    path_like = chat_template.endswith((".jinja", ".j2")) or (
        os.sep in chat_template and "{" not in chat_template and "\n" not in chat_template
    )
    if path_like:
        raise ValueError(f"chat_template {chat_template!r} looks like a path but is no file")
