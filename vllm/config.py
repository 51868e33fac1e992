"""Engine configuration: frozen dataclasses validated in ``__post_init__``.

Every tuning knob is a field with a docstring-comment; CLI flags (vLLM names) are
mapped onto these fields by ``vllm/engine/arg_utils.py``. Invalid values raise
``ValueError`` naming the field and the bad value.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
CONTINUUM_TTL_MODES = ("paper", "fixed")


def _bad(name: str, value: object, why: str) -> ValueError:
    return ValueError(f"{name} {why}, got {value!r}")


@dataclass(frozen=True)
class ModelConfig:
    # Model name (the embedded "SmolLM2-135M-Instruct"), a GGUF file or an HF directory.
    model: str = DEFAULT_MODEL
    # Tokenizer source; defaults to the model's own.
    tokenizer: str | None = None
    # Name reported by the API and in metrics labels; defaults to ``model``.
    served_model_name: str | None = None
    # Maximum prompt + output length; None: the model's max_position_embeddings.
    max_model_len: int | None = None
    # "auto" (float32 on CPU, bfloat16 on CUDA), "float32", "bfloat16", "float16".
    dtype: str = "auto"
    # Seed of the global RNG (per-request seeds override it for that request).
    seed: int = 0
    # Path of a Jinja chat template overriding the tokenizer's.
    chat_template: str | None = None

    def __post_init__(self) -> None:
        if not self.model:
            raise _bad("model", self.model, "must be a non-empty name or path")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise _bad("max_model_len", self.max_model_len, "must be >= 1")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise _bad("dtype", self.dtype, "must be auto, float32, bfloat16 or float16")

    @property
    def name(self) -> str:
        return self.served_model_name or self.model


@dataclass(frozen=True)
class CacheConfig:
    # Tokens per KV block.
    block_size: int = 16
    # Reuse KV blocks across requests sharing a prefix (chained block hashes).
    enable_prefix_caching: bool = True
    # Exact number of KV blocks (null block included); overrides the memory sizing.
    num_gpu_blocks_override: int | None = None
    # Bytes of KV cache; None: 1 GiB on CPU, gpu_memory_utilization on CUDA.
    kv_cache_memory_bytes: int | None = None
    # Fraction of GPU memory the engine may use (CUDA only).
    gpu_memory_utilization: float = 0.9

    def __post_init__(self) -> None:
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            raise _bad("block_size", self.block_size, "must be a power of two in [1, 256]")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise _bad("num_gpu_blocks_override", self.num_gpu_blocks_override, "must be >= 2")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise _bad("kv_cache_memory_bytes", self.kv_cache_memory_bytes, "must be > 0")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise _bad("gpu_memory_utilization", self.gpu_memory_utilization, "must be in (0, 1]")


@dataclass(frozen=True)
class SchedulerConfig:
    # Maximum number of running requests in one step.
    max_num_seqs: int = 128
    # Token budget of one step, shared by prefill chunks and decodes.
    max_num_batched_tokens: int = 2048
    # Maximum prompt + output length (filled from ModelConfig by VllmConfig).
    max_model_len: int = 8192
    # Split long prefills across steps when the budget is short.
    enable_chunked_prefill: bool = True
    # A prefill chunk is at most this many tokens (0: no limit beyond the budget).
    long_prefill_token_threshold: int = 0
    # Which policy orders waiting requests, picks victims, and decides pins.
    policy: str = "fcfs"

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise _bad("max_num_seqs", self.max_num_seqs, "must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise _bad("max_num_batched_tokens", self.max_num_batched_tokens, "must be >= 1")
        if self.max_model_len < 1:
            raise _bad("max_model_len", self.max_model_len, "must be >= 1")
        if self.long_prefill_token_threshold < 0:
            raise _bad(
                "long_prefill_token_threshold", self.long_prefill_token_threshold, "must be >= 0"
            )
        from vllm.v1.core.sched.policy.registry import policy_names  # no engine imports

        if self.policy not in policy_names():
            raise _bad("scheduling_policy", self.policy, f"must be one of {policy_names()}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise _bad(
                "max_num_batched_tokens",
                self.max_num_batched_tokens,
                f"must be >= max_model_len={self.max_model_len} without chunked prefill",
            )


@dataclass(frozen=True)
class PolicyConfig:
    """Knobs of the agent-aware policies (Continuum, ContextServe)."""

    # "paper": TTL from the empirical CDF rule of arXiv 2511.02230 §4;
    # "fixed": the research fork's rule (pin fixed_pin_s if the tool's mean <= threshold).
    continuum_ttl_mode: str = "paper"
    # Upper bound on any pin's TTL, seconds.
    max_ttl_s: float = 10.0
    # TTL used by the paper rule at cold start (<= min_records records in total).
    default_ttl_s: float = 2.0
    # K of the paper: records needed before a tool's own CDF (else the global one) is used.
    min_records: int = 100
    # Fixed mode: pin length, and the mean tool time above which nothing is pinned.
    fixed_pin_s: float = 2.0
    fixed_threshold_s: float = 2.0
    # Bounded waiting: a request that waited this long is served regardless of job order.
    max_wait_s: float = 30.0
    # Window (number of evictions) of the queueing-delay mean T in the TTL rule.
    queue_delay_window: int = 64

    def __post_init__(self) -> None:
        if self.continuum_ttl_mode not in CONTINUUM_TTL_MODES:
            raise _bad(
                "continuum_ttl_mode",
                self.continuum_ttl_mode,
                f"must be one of {CONTINUUM_TTL_MODES}",
            )
        for name in ("max_ttl_s", "default_ttl_s", "fixed_pin_s", "fixed_threshold_s"):
            if getattr(self, name) < 0:
                raise _bad(name, getattr(self, name), "must be >= 0")
        if self.max_wait_s <= 0:
            raise _bad("max_wait_s", self.max_wait_s, "must be > 0")
        if self.min_records < 0:
            raise _bad("min_records", self.min_records, "must be >= 0")
        if self.queue_delay_window < 1:
            raise _bad("queue_delay_window", self.queue_delay_window, "must be >= 1")


@dataclass(frozen=True)
class VllmConfig:
    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    policy_config: PolicyConfig = field(default_factory=PolicyConfig)
