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
