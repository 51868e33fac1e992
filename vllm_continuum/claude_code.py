"""Claude Code's identity for a turn, shared by every engine binding: the session it sends
and the conversation inside it, as one Continuum job.

Claude Code (and the Claude Agent SDK, which runs it) sends its session id with every
``/v1/messages`` request: the ``X-Claude-Code-Session-Id`` header (2.1.86+), and the
``session_id`` inside ``metadata.user_id`` (a JSON string since 2.1.78, a
``user_<hash>_account_<id>_session_<uuid>`` string before). One session runs several
conversations (the main agent, its subagents, short side requests such as title
generation), each with its own system prompt, and since 2.1.139 each subagent's requests
carry ``X-Claude-Code-Agent-Id`` (the main agent's carry none). A job is the session plus
a digest of the agent id and the request's top-level system prompt:
``<session>/<12 hex digits of their SHA-256>``, so two subagents of one type (one system
prompt) running side by side are two jobs. The digest leaves out the
``x-anthropic-billing-header`` block, which changes with every request, and the system
messages inside ``messages`` (per-turn reminders).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from typing import Any

SESSION_HEADER = "x-claude-code-session-id"
AGENT_HEADER = "x-claude-code-agent-id"
BILLING_HEADER = "x-anthropic-billing-header"
_LEGACY_SESSION = re.compile(r"_session_([A-Za-z0-9-]+)$")


def session_id(headers: Mapping[str, str], metadata: Any) -> str | None:
    """The Claude Code session a request belongs to, if it says; ``headers`` are looked up
    by their lower-case name."""
    header = headers.get(SESSION_HEADER)
    if header:
        return header
    user_id = metadata.get("user_id") if isinstance(metadata, dict) else None
    if not isinstance(user_id, str):
        return None
    if user_id.startswith("{"):
        try:
            session = json.loads(user_id).get("session_id")
        except (ValueError, AttributeError, RecursionError):
            return None
        return session if isinstance(session, str) and session else None
    match = _LEGACY_SESSION.search(user_id)
    return match[1] if match else None


def system_text(system: Any) -> str:
    """The text of a Messages request's top-level ``system`` (a string or text blocks),
    without the billing header block; blocks are joined by a blank line."""
    if isinstance(system, str):
        return "" if system.startswith(BILLING_HEADER) else system
    if not isinstance(system, list):
        return ""
    texts = []
    for block in system:
        text = block.get("text") if isinstance(block, dict) else None
        if isinstance(text, str) and text and not text.startswith(BILLING_HEADER):
            texts.append(text)
    return "\n\n".join(texts)


def job_id(headers: Mapping[str, str], body: Mapping[str, Any]) -> str | None:
    """The job of a Messages request body from Claude Code (see the module doc); None if it
    names no session."""
    session = session_id(headers, body.get("metadata"))
    if session is None:
        return None
    agent = headers.get(AGENT_HEADER) or ""
    conversation = f"{agent}\0{system_text(body.get('system'))}"
    digest = hashlib.sha256(conversation.encode()).hexdigest()[:12]
    return f"{session}/{digest}"
