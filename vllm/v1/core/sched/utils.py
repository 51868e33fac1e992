"""Small helpers of the scheduler: the step's token budget and stop checks."""

from __future__ import annotations

from vllm.v1.request import Request, RequestStatus


class TokenBudget:
    """Tokens left in this step, shared by prefill chunks and decodes."""

    def __init__(self, max_tokens: int, long_prefill_threshold: int = 0) -> None:
        self.remaining = max_tokens
        self.long_prefill_threshold = long_prefill_threshold

    def clip(self, num_tokens: int) -> int:
        """How many of ``num_tokens`` may run this step (a chunk, never above the budget)."""
        if self.long_prefill_threshold > 0:
            num_tokens = min(num_tokens, self.long_prefill_threshold)
        return max(0, min(num_tokens, self.remaining))

    def consume(self, num_tokens: int) -> None:
        if num_tokens > self.remaining:
            raise ValueError(f"budget overrun: {num_tokens} > {self.remaining}")
        self.remaining -= num_tokens

    def refund(self, num_tokens: int) -> None:
        self.remaining += num_tokens


def check_stop(request: Request, max_model_len: int) -> bool:
    """Set the finished status (and ``stop_reason``) if the last token ends the request.

    EOS and stop token ids count only after ``min_tokens`` outputs; EOS gives
    ``stop_reason`` None, a stop token id gives that id (as in vLLM). A repeated n-gram
    (``repetition_detection``) ends it too, after those and the length limits.
    """
    params = request.sampling_params
    if request.num_output_tokens >= params.min_tokens and request.output_token_ids:
        last = request.output_token_ids[-1]
        if last in params.all_stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = None if last == request.eos_token_id else last
            return True
    max_tokens = request.max_tokens
    if request.num_tokens >= max_model_len or (
        max_tokens is not None and request.num_output_tokens >= max_tokens
    ):
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    detection = params.repetition_detection
    if (
        detection is not None
        and detection.max_pattern_size
        and request.num_output_tokens >= params.min_tokens
        and detection.repeats(request.output_token_ids)
    ):
        request.status = RequestStatus.FINISHED_REPETITION
        request.stop_reason = "repetition_detected"  # vLLM's
        return True
    return False
