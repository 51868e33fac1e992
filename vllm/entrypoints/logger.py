"""vLLM's request and output logs (``--enable-log-requests``, ``--enable-log-outputs``).

A request is logged as the engine takes it: its id, sampling parameters and adapter at
INFO; its prompt and prompt token ids at DEBUG. Its output is logged as it finishes (text
and finish reason at INFO, token ids at DEBUG) and, for a stream, delta by delta unless
``--no-enable-log-deltas``. ``--max-log-len`` cuts prompts, outputs and id lists.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from vllm.outputs import RequestOutput
from vllm.sampling_params import RequestOutputKind

logger = logging.getLogger(__name__)


def set_log_level(level: str | None) -> None:
    """The level of every ``vllm`` logger, this process's and (it inherits it) its engine
    core's: ``--log-level`` when given, else ``VLLM_LOGGING_LEVEL`` (vLLM's), else INFO."""
    from vllm import envs

    name = (level or envs.VLLM_LOGGING_LEVEL).upper()
    if name not in ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG"):
        raise ValueError(f"VLLM_LOGGING_LEVEL must be a log level (e.g. DEBUG), got {name!r}")
    logging.getLogger("vllm").setLevel(name)


class RequestLogger:
    def __init__(
        self,
        log_inputs: bool,
        log_outputs: bool,
        log_deltas: bool = True,
        max_log_len: int | None = None,
    ) -> None:
        self.log_inputs_on = log_inputs
        self.log_outputs_on = log_outputs
        self.log_deltas = log_deltas
        self.max_log_len = max_log_len
        if not logger.isEnabledFor(logging.INFO):
            logger.warning(
                "request logging is on, but the log level is above INFO: nothing is logged"
            )

    def _cut(self, items: Sequence[Any] | str | None) -> Any:
        if items is None or self.max_log_len is None:
            return items
        return items[: self.max_log_len]

    def log_inputs(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        prompt_token_ids: Sequence[int] | None,
        params: Any,
        lora_request: Any = None,
    ) -> None:
        if not self.log_inputs_on:
            return
        if logger.isEnabledFor(logging.DEBUG):
            text = prompt if isinstance(prompt, str) else None
            logger.debug(
                "Request %s details: prompt: %r, prompt_token_ids: %s",
                request_id,
                self._cut(text),
                self._cut(list(prompt_token_ids) if prompt_token_ids is not None else None),
            )
        logger.info(
            "Received request %s: params: %s, lora_request: %s", request_id, params, lora_request
        )

    def output_observer(self, request_id: str, kind: RequestOutputKind):
        """A callback for each ``RequestOutput`` of one request (its stream's
        ``on_output``), or None when outputs are not logged. DELTA outputs (a stream) are
        logged one by one (``log_deltas``) and as a whole when their completion finishes;
        CUMULATIVE ones once, finished."""
        if not self.log_outputs_on:
            return None
        streaming = kind == RequestOutputKind.DELTA
        texts: dict[int, list[str]] = {}
        ids: dict[int, list[int]] = {}

        def observe(out: RequestOutput) -> None:
            for c in out.outputs:
                if not streaming:
                    if c.finish_reason is not None:
                        self._log_output(request_id, c.text, c.token_ids, c.finish_reason, "")
                    continue
                texts.setdefault(c.index, []).append(c.text)
                ids.setdefault(c.index, []).extend(c.token_ids)
                if self.log_deltas and (c.text or c.token_ids):
                    self._log_output(
                        request_id, c.text, c.token_ids, c.finish_reason, " (streaming delta)"
                    )
                if c.finish_reason is not None:
                    text = "".join(texts.pop(c.index))
                    tokens = ids.pop(c.index)
                    label = " (streaming complete)"
                    self._log_output(request_id, text, tokens, c.finish_reason, label)

        return observe

    def _log_output(
        self,
        request_id: str,
        text: str,
        token_ids: Sequence[int],
        finish_reason: str | None,
        label: str,
    ) -> None:
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "Generated response %s%s details: output_token_ids: %s",
                request_id,
                label,
                self._cut(list(token_ids)),
            )
        logger.info(
            "Generated response %s%s: output: %r, finish_reason: %s",
            request_id,
            label,
            self._cut(text),
            finish_reason,
        )
