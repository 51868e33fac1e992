"""Configuration of the agent-aware policies, shared by every engine binding.

``config_field`` declares a field once with its help text and CLI description (flag
name, choices, parser) in ``dataclasses.field(metadata=...)``: an engine generates its
flags from these fields (ours: ``vllm/engine/arg_utils.py``; a plugin: from its own
settings). Invalid values raise ``ValueError`` naming the field and the bad value.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

ContinuumTTLMode = Literal["paper", "fixed"]
CONTINUUM_TTL_MODES: tuple[str, ...] = get_args(ContinuumTTLMode)


def bad_value(name: str, value: object, why: str) -> ValueError:
    """The error of an invalid config value: ``name`` first, then why, then the value."""
    return ValueError(f"{name} {why}, got {value!r}")


def config_field(
    default: Any,
    help: str,
    *,
    flag: str | None = None,
    choices: Sequence[Any] | Callable[[], Sequence[Any]] | None = None,
    parse: Callable[[str], Any] | None = None,
    cli: bool = True,
    derived: bool = False,
    aliases: tuple[str, ...] = (),
    secret: bool = False,
) -> Any:
    """A config field carrying its own documentation and CLI description.

    ``help``: what the knob does (also the flag's help). ``flag``: the vLLM flag when it is
    not ``--field-name``. ``choices``: allowed values, or a callable returning them when the
    parser is built (a registry filled later). ``parse``: text -> value for the flag and for
    string keyword arguments (sizes). ``cli=False``: filled from other fields, no flag.
    ``derived``: the flag defaults to None and the engine computes the value from other
    settings (``EngineArgs.create_engine_config``). ``aliases``: more flags, e.g. ``-tp``.
    ``secret``: a credential: left out of the config's repr and masked in the start-up
    config dump.
    """
    meta = {"help": help, "flag": flag, "choices": choices, "parse": parse, "aliases": aliases}
    meta |= {"cli": cli, "derived": derived, "secret": secret}
    return field(default=default, repr=not secret, metadata=meta)


@dataclass(frozen=True)
class PolicyConfig:
    """Knobs of the agent-aware policies (Continuum, ContextServe)."""

    continuum_ttl_mode: ContinuumTTLMode = config_field(
        "paper",
        "Continuum pin TTL rule. paper: the empirical CDF rule of arXiv 2511.02230 §4; "
        "fixed: the research fork's rule (pin fixed_pin_s if the tool's mean <= threshold).",
    )
    max_ttl_s: float = config_field(
        10.0, "Upper bound on any pin's TTL, seconds.", flag="--continuum-max-ttl"
    )
    default_ttl_s: float = config_field(
        2.0,
        "TTL in seconds used by the paper rule at cold start (<= min_records records in total).",
        flag="--continuum-default-ttl",
    )
    min_records: int = config_field(
        100,
        "K of the paper: tool records needed before a tool's own CDF (else the global one) "
        "is used.",
        flag="--continuum-min-records",
    )
    fixed_pin_s: float = config_field(
        2.0, "Fixed TTL mode: pin length, seconds.", flag="--continuum-fixed-pin"
    )
    fixed_threshold_s: float = config_field(
        2.0,
        "Fixed TTL mode: mean tool time (seconds) above which nothing is pinned.",
        flag="--continuum-fixed-threshold",
    )
    max_wait_s: float = config_field(
        30.0,
        "Bounded waiting: a request that waited this many seconds is served regardless of "
        "job order.",
        flag="--max-wait-time",
    )
    job_admission: bool = config_field(
        False,
        "Job-level admission: a new job starts only when the KV memory holds it next to the "
        "active jobs' contexts and their next turns' growth (older jobs' turns go first). "
        "While no job runs it admits a new job that fits beside the pinned jobs' growth "
        "(work-conserving). Off by default: on the CPU study it finished 8 vs 7 of 17 jobs "
        "at 0.16 JPS and was level at 0.08 JPS, but with a CPU KV tier it finished 15 vs "
        "17 (the tier brings contexts back cheaply, so holding new jobs back costs more).",
        flag="--continuum-job-admission",
    )
    pins_yield_to_tier: bool = config_field(
        True,
        "With a CPU KV tier (--kv-offloading-size), a waiting turn of another job may take "
        "pinned memory at once (the newest job's pin first; it goes to the tier and comes "
        "back in milliseconds) instead of waiting for the pin's TTL. Without a tier a pin "
        "is released for other work only when nothing runs or the turn waited "
        "--max-wait-time.",
        flag="--continuum-pins-yield-to-tier",
    )
    job_admission_max_wait_s: float = config_field(
        300.0,
        "Starvation bound of job-level admission: a new job that waited this many seconds "
        "starts regardless of memory.",
        flag="--continuum-admission-max-wait",
    )
    job_idle_timeout_s: float = config_field(
        120.0,
        "A job silent this many seconds (no running turn) stops counting in job-level "
        "admission (an agent that gave up must not hold a reservation).",
        flag="--continuum-job-idle-timeout",
    )
    log_jobs: bool = config_field(
        True,
        "Log each job's arrivals and pin decisions at INFO (else DEBUG); `vllm serve "
        "--disable-log-requests` turns it off.",
        cli=False,
    )
    queue_delay_window: int = config_field(
        64,
        "Window (number of evictions) of the queueing-delay mean T in the TTL rule.",
        flag="--continuum-queue-delay-window",
    )

    def __post_init__(self) -> None:
        if self.continuum_ttl_mode not in CONTINUUM_TTL_MODES:
            raise bad_value(
                "continuum_ttl_mode",
                self.continuum_ttl_mode,
                f"must be one of {CONTINUUM_TTL_MODES}",
            )
        for name in ("max_ttl_s", "default_ttl_s", "fixed_pin_s", "fixed_threshold_s"):
            if getattr(self, name) < 0:
                raise bad_value(name, getattr(self, name), "must be >= 0")
        if self.job_admission_max_wait_s < self.max_wait_s:
            raise bad_value(
                "job_admission_max_wait_s",
                self.job_admission_max_wait_s,
                f"must be >= max_wait_s={self.max_wait_s}",
            )
        if self.job_idle_timeout_s <= 0:
            raise bad_value("job_idle_timeout_s", self.job_idle_timeout_s, "must be > 0")
        if self.max_wait_s <= 0:
            raise bad_value("max_wait_s", self.max_wait_s, "must be > 0")
        if self.min_records < 0:
            raise bad_value("min_records", self.min_records, "must be >= 0")
        if self.queue_delay_window < 1:
            raise bad_value("queue_delay_window", self.queue_delay_window, "must be >= 1")
