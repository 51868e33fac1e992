"""Errors that carry what the user got wrong, so no layer parses it back out of a message."""

from __future__ import annotations

from typing import Any


class VLLMValidationError(ValueError):
    """Bad user input, found by whichever layer owns the check.

    ``param`` names the offending request field (``"temperature"``, ``"messages"``) and
    ``value`` the value given, when it helps. The OpenAI server turns the error into a
    400 ``{"error": {"message", "type", "param", "code"}}``; the offline ``LLM`` lets it
    propagate as the ``ValueError`` it is.
    """

    def __init__(
        self,
        message: str,
        param: str | None = None,
        value: Any = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.param = param
        self.value = value
        self.code = code


class GenerationError(RuntimeError):
    """A request failed inside the engine (the model runner or the sampler raised while
    serving it); the engine itself goes on. The server answers 500 (vLLM's name)."""

    status = 500
    err_type = "InternalServerError"


class GracefulHTTPError(RuntimeError):
    """An expected refusal that the server answers with its own HTTP status (vLLM's name):
    ``status`` and ``err_type`` (``HTTPStatus(status).phrase``, as vLLM writes it) go into
    ``{"error": {"message", "type", "param", "code"}}``. Raised before the request holds
    anything, so a client may simply retry."""

    status = 503
    err_type = "Service Unavailable"


class QueueOverflowError(GracefulHTTPError):
    """``--max-num-queued-reqs`` would be exceeded: 503, so that load balancers and client
    SDKs retry on another instance."""

    def __init__(self) -> None:
        super().__init__(
            "The engine is currently busy and cannot accept new requests. "
            "Please try again later or on a different instance."
        )


class MaxQueuedTokensError(GracefulHTTPError):
    """``--max-num-queued-tokens`` reached (the prefill backlog, in prompt tokens): 503."""

    def __init__(self) -> None:
        super().__init__(
            "The engine has reached its prefill token backlog limit. "
            "Please try again later or on a different instance."
        )
