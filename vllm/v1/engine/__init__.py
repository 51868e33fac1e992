"""Messages between the front end (LLM / AsyncLLM) and the engine core.

The wire between ``AsyncMPClient`` (front end, ``core_client.py``) and ``EngineCoreProc``
(engine process, ``core_proc.py``) is two one-way ZMQ sockets over IPC:

    input   front end PUSH (bind) ──▶ engine PULL (connect)   EngineCoreRequestType
    output  engine PUSH (connect) ──▶ front end PULL (bind)   EngineCoreOutputType

With ``vllm serve --api-server-count N`` there are N front ends (API server processes),
each with its own pair; the engine's one PULL socket connects to all N inputs, and it has
one PUSH socket per front end. A request's ``client_index`` says whose it is: its
outputs, its errors and the arrivals of its ids go to that front end alone; READY, FATAL
and every step's scheduler stats go to all of them.

Every message is two frames, ``[type.value, pickle(payload)]``: the one-byte type first,
as in vLLM, so a receiver rejects an unknown type before unpickling anything. Each type
has one payload type (``PAYLOAD_TYPES``):

    ADD            EngineCoreRequest     queue a request
    ABORT          list[str]             stop these request ids, free their blocks
    STOP           list[str]             these requests ended on a stop string (the front
                                         end's detokenizer saw it): finish them as
                                         stopped, so the policy decides their blocks
    SHUTDOWN       None                  finish the loop and exit
    UTILITY        UtilityCall           run one of the engine's utility methods
                                         (``UTILITY_METHODS``) between steps; its result
                                         goes back to the caller as UTILITY_RESULT
    READY          EngineCoreReady       once, first: the engine is built
    OUTPUTS        StampedOutputs        one step's outputs (or fresh stats while idle)
    REQUEST_ERROR  EngineCoreRequestError  a request the engine cannot serve: ADD rejected,
                                         or it failed inside a step (its blocks are freed;
                                         the front end answers 400, or 500 if internal)
    FATAL          str (a traceback)     last message: the engine failed and exits
    UTILITY_RESULT UtilityResult         a UTILITY call's return value, or its error

A message that breaks this contract (unknown type, wrong frame count, undecodable or
mistyped payload) is a ``ProtocolError``, never skipped: both ends are this package, so
it is a bug or a version mismatch. The engine reports it as FATAL and exits; the front end
marks the engine dead and fails every pending request.
"""

from __future__ import annotations

import enum
import operator
import pickle
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, TypeVar

from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.v1.metrics.stats import SchedulerStats
from vllm.v1.outputs import TokenLogprobs

if TYPE_CHECKING:
    import torch

    from vllm.multimodal.inputs import MultiModalFeature


class FinishReason(enum.IntEnum):
    STOP = 0  # EOS, a stop token id, or a stop string
    LENGTH = 1  # max_tokens or max_model_len
    ABORT = 2  # aborted by the client or the front end
    ERROR = 3  # failed inside the engine (vLLM's "error"; the server answers an error)
    REPETITION = 4  # the output ended in a repeated n-gram (vLLM's repetition_detection)

    def __str__(self) -> str:
        return ("stop", "length", "abort", "error", "repetition")[self.value]


@dataclass
class EngineCoreRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    # time.time() when the front end got the request, for its latency metrics (the engine
    # stamps its own Request.arrival_time on its clock when the request reaches it).
    arrival_wall_time: float = 0.0
    priority: int = 0
    cache_salt: str | None = None
    lora_request: LoRARequest | None = None  # the adapter it runs with; None: the base model
    client_index: int = 0  # the front end it came from (--api-server-count), set by its client
    # Its images (vllm.multimodal): pixel values and the prompt positions they fill.
    mm_features: list[MultiModalFeature] | None = None
    # --enable-prompt-embeds: (num_prompt_tokens, hidden_size) on the CPU in the model's
    # dtype, read in place of the embedding lookup at the prompt's positions, whose
    # prompt_token_ids are placeholders (0, as vLLM's); None: a token prompt.
    prompt_embeds: torch.Tensor | None = None
    # --data-parallel-size: the rank asked for (vLLM's X-data-parallel-rank); None: the
    # front end's DPAsyncMPClient chooses. The engine ignores it.
    data_parallel_rank: int | None = None


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    # Logprobs of prompt positions 1.. (SamplingParams.prompt_logprobs), all in the output
    # that carries the first token; None otherwise.
    new_prompt_logprobs: list[TokenLogprobs] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # Set on a request's first output: seconds from engine arrival to first scheduling,
    # and the prompt's length (the throughput log counts each prompt once, from it).
    queue_time_s: float | None = None
    num_prompt_tokens: int | None = None
    pooled: list[float] | None = None  # --runner pooling: the prompt's embedding
    # A disaggregated prefill's answer (its finishing output): where its KV is held.
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def __reduce__(self) -> tuple:
        # Pickled as the constructor's positional arguments: every step sends one per
        # running request, and this loads 3x faster (and is 25% smaller) than pickle's
        # default for a dataclass, which rebuilds the object and then sets its __dict__.
        return EngineCoreOutput, _output_fields(self)


_output_fields = operator.attrgetter(*(f.name for f in fields(EngineCoreOutput)))


@dataclass
class EngineCoreRequestError:
    """A request the engine will not serve; it is no longer in the engine.

    Either ``add_request`` raised ``ValueError`` (never queued), or the request failed
    inside a step and was finished with its blocks freed. ``internal``: the engine or the
    model failed (the server answers 500); otherwise the request's own values made it fail
    (400).
    """

    request_id: str
    message: str
    internal: bool = False


@dataclass
class EngineCoreOutputs:
    outputs: list[EngineCoreOutput] = field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    # Requests that failed in this step (finished, blocks freed): no output of theirs is
    # in ``outputs``. The engine process sends each as a REQUEST_ERROR message.
    errors: list[EngineCoreRequestError] = field(default_factory=list)
    # The weights' version (RL weight sync) that sampled this step's tokens.
    weight_version: str | None = None
    # Set in the front end by the data-parallel client (dp_client.py): the rank that sent
    # this, and its own stats (``scheduler_stats`` then has the gauges over every rank).
    engine_index: int = 0
    engine_stats: SchedulerStats | None = None


class EngineCoreRequestType(enum.Enum):
    """What the front end sends the engine, on the input socket."""

    ADD = b"\x00"
    ABORT = b"\x01"
    SHUTDOWN = b"\x02"
    STOP = b"\x03"
    UTILITY = b"\x04"


class EngineCoreOutputType(enum.Enum):
    """What the engine sends the front end, on the output socket.

    Not vLLM's ``EngineCoreEventType``, which names per-request events (queued,
    scheduled, preempted) and could be added under that name later.
    """

    READY = b"\x00"
    OUTPUTS = b"\x01"
    REQUEST_ERROR = b"\x02"
    FATAL = b"\x03"
    UTILITY_RESULT = b"\x04"


# The engine methods a front end may call by name (vLLM's utility calls): the prefix
# cache's reset, --profiler-config's start and stop, sleep mode's three, and the pause of
# generation's three (a ``pause`` that waits for running requests is answered once they
# have finished: core_proc.py).
UTILITY_METHODS = frozenset({
    "reset_prefix_cache", "profile", "sleep", "wake_up", "is_sleeping",
    "pause", "resume", "is_paused",
    # RL weight sync (weight_sync.py)
    "init_weight_transfer_engine", "shutdown_weight_transfer_engine", "start_weight_update",
    "update_weights", "finish_weight_update", "set_weight_version", "get_weight_version",
    "compute_weight_checksums", "reset_weights",
})  # fmt: skip

# vLLM's pause modes (``EngineCore.pause``): what happens to the requests in flight.
PAUSE_MODES = ("abort", "wait", "keep")


@dataclass
class UtilityCall:
    call_id: int  # the caller's, to match the result
    client_index: int  # the front end the result goes to
    method: str  # one of UTILITY_METHODS
    args: tuple = ()


@dataclass
class UtilityResult:
    call_id: int
    result: Any = None
    error: str | None = None  # the method raised: its message


@dataclass
class EngineCoreReady:
    num_gpu_blocks: int
    pid: int  # of the engine process


@dataclass
class StampedOutputs:
    """``EngineCoreOutputs`` with the engine process's clock readings.

    ``sent_at`` is ``time.monotonic()`` when the message left; ``arrivals`` maps the
    requests received since the previous OUTPUTS to their receipt time. The front end
    derives a request's time inside the engine process from them (the monotonic clock is
    shared by all processes of one machine).
    """

    outputs: EngineCoreOutputs
    sent_at: float
    arrivals: dict[str, float]


class ProtocolError(RuntimeError):
    """A message broke the wire contract (see the module docstring)."""


MessageType = TypeVar("MessageType", EngineCoreRequestType, EngineCoreOutputType)

PAYLOAD_TYPES: dict[enum.Enum, type] = {
    EngineCoreRequestType.ADD: EngineCoreRequest,
    EngineCoreRequestType.ABORT: list,
    EngineCoreRequestType.STOP: list,
    EngineCoreRequestType.SHUTDOWN: type(None),
    EngineCoreRequestType.UTILITY: UtilityCall,
    EngineCoreOutputType.READY: EngineCoreReady,
    EngineCoreOutputType.OUTPUTS: StampedOutputs,
    EngineCoreOutputType.REQUEST_ERROR: EngineCoreRequestError,
    EngineCoreOutputType.FATAL: str,
    EngineCoreOutputType.UTILITY_RESULT: UtilityResult,
}


def _check_payload(msg_type: enum.Enum, payload: Any) -> None:
    expected = PAYLOAD_TYPES[msg_type]
    if not isinstance(payload, expected):
        raise ProtocolError(
            f"{msg_type.name} carries {expected.__name__}, not {type(payload).__name__}"
        )


def encode_message(
    msg_type: EngineCoreRequestType | EngineCoreOutputType, payload: Any
) -> list[bytes]:
    """The frames of one message; ``ProtocolError`` if the payload has the wrong type."""
    _check_payload(msg_type, payload)
    return [msg_type.value, pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)]


def decode_message(type_enum: type[MessageType], frames: list[bytes]) -> tuple[MessageType, Any]:
    """``(type, payload)`` of a message of the ``type_enum`` enum; ``ProtocolError`` if invalid."""
    if len(frames) != 2:
        raise ProtocolError(f"a message has 2 frames, got {len(frames)}")
    try:
        msg_type = type_enum(frames[0])
    except ValueError:
        raise ProtocolError(f"unknown {type_enum.__name__} {frames[0]!r}") from None
    try:
        payload = pickle.loads(frames[1])
    except Exception as e:
        raise ProtocolError(f"undecodable {msg_type.name} payload: {e!r}") from e
    _check_payload(msg_type, payload)
    return msg_type, payload
