"""The one record of a finished turn that every engine binding hands to a policy core."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FinishedTurn:
    """A turn that stopped, in plain values (each binding translates its own request).

    ``last_unless_tool_call``: the client says the job ends with this turn unless its
    output calls a tool (an API whose turn without a tool call answers the user, such as
    a Responses chain); the core decides once it has parsed ``text``.
    """

    job: str  # the job key (vllm_continuum.jobs)
    request_id: str
    now: float
    text: str | None  # its output, decoded; None without output
    is_last_step: bool
    named: bool  # a user-named job: only those can be matched by a later turn, so pinned
    num_tokens: int  # prompt + output: the context its KV holds
    last_unless_tool_call: bool = False
