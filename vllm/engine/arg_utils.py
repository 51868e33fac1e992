"""``EngineArgs``: engine keyword arguments and CLI flags (vLLM names) -> ``VllmConfig``."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, fields

from vllm.config import (
    CONTINUUM_TTL_MODES,
    DEFAULT_MODEL,
    CacheConfig,
    ModelConfig,
    PolicyConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.v1.core.sched.policy.registry import policy_names

_UNITS = {
    "": 1,
    "b": 1,
    "k": 2**10,
    "kb": 2**10,
    "kib": 2**10,
    "m": 2**20,
    "mb": 2**20,
    "mib": 2**20,
    "g": 2**30,
    "gb": 2**30,
    "gib": 2**30,
}


def parse_bytes(text: str | int) -> int:
    """'512MiB', '1G', '1.5GiB' or an integer -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"kv_cache_memory must be a size like 512MiB or 2GiB, got {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass
class EngineArgs:
    model: str = DEFAULT_MODEL
    tokenizer: str | None = None
    served_model_name: str | None = None
    max_model_len: int | None = None
    dtype: str = "auto"
    seed: int = 0
    chat_template: str | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None
    kv_cache_memory: int | str | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 128
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"
    continuum_ttl_mode: str = "paper"
    continuum_max_ttl: float = 10.0
    continuum_default_ttl: float = 2.0
    continuum_min_records: int = 100
    max_wait_time: float = 30.0

    def create_engine_config(self, model_max_len: int | None = None) -> VllmConfig:
        """Build the validated config. ``model_max_len``: the model's own limit, if known."""
        if self.max_model_len is not None and model_max_len is not None:
            if self.max_model_len > model_max_len:
                raise ValueError(
                    f"max_model_len {self.max_model_len} exceeds the model's "
                    f"max_position_embeddings {model_max_len}"
                )
        max_model_len = self.max_model_len or model_max_len or 8192
        model_config = ModelConfig(
            model=self.model,
            tokenizer=self.tokenizer,
            served_model_name=self.served_model_name,
            max_model_len=max_model_len,
            dtype=self.dtype,
            seed=self.seed,
            chat_template=self.chat_template,
        )
        kv_bytes = None if self.kv_cache_memory is None else parse_bytes(self.kv_cache_memory)
        cache_config = CacheConfig(
            block_size=self.block_size,
            enable_prefix_caching=self.enable_prefix_caching,
            num_gpu_blocks_override=self.num_gpu_blocks_override,
            kv_cache_memory_bytes=kv_bytes,
            gpu_memory_utilization=self.gpu_memory_utilization,
        )
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = 2048 if self.enable_chunked_prefill else max(2048, max_model_len)
        scheduler_config = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_model_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            policy=self.scheduling_policy,
        )
        policy_config = PolicyConfig(
            continuum_ttl_mode=self.continuum_ttl_mode,
            max_ttl_s=self.continuum_max_ttl,
            default_ttl_s=self.continuum_default_ttl,
            min_records=self.continuum_min_records,
            max_wait_s=self.max_wait_time,
        )
        return VllmConfig(model_config, cache_config, scheduler_config, policy_config)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Engine flags with vLLM's names."""
        g = parser.add_argument_group("engine")
        g.add_argument("--tokenizer", type=str, default=None, help="Tokenizer name or path.")
        g.add_argument(
            "--served-model-name",
            type=str,
            default=None,
            help="Model name the API reports and accepts (default: the model).",
        )
        g.add_argument(
            "--max-model-len",
            type=int,
            default=None,
            help="Maximum prompt + output tokens (default: the model's limit).",
        )
        g.add_argument(
            "--dtype",
            choices=["auto", "float32", "bfloat16", "float16"],
            default="auto",
            help="Weight/activation dtype (auto: fp32 on CPU).",
        )
        g.add_argument("--seed", type=int, default=0, help="Global random seed.")
        g.add_argument(
            "--chat-template",
            type=str,
            default=None,
            help="Path of a Jinja chat template overriding the tokenizer's.",
        )
        g.add_argument("--block-size", type=int, default=16, help="Tokens per KV block.")
        g.add_argument(
            "--enable-prefix-caching",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="Reuse KV blocks of shared prefixes.",
        )
        g.add_argument(
            "--num-gpu-blocks-override",
            type=int,
            default=None,
            help="Exact number of KV blocks (ignores memory sizing).",
        )
        g.add_argument(
            "--kv-cache-memory",
            type=str,
            default=None,
            help="KV cache size, e.g. 512MiB or 2GiB (default 1GiB on CPU).",
        )
        g.add_argument(
            "--gpu-memory-utilization",
            type=float,
            default=0.9,
            help="Fraction of GPU memory to use (CUDA only).",
        )
        g.add_argument(
            "--max-num-seqs", type=int, default=128, help="Maximum running requests per step."
        )
        g.add_argument(
            "--max-num-batched-tokens",
            type=int,
            default=None,
            help="Token budget per step (default 2048).",
        )
        g.add_argument(
            "--enable-chunked-prefill",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="Split long prefills across steps.",
        )
        g.add_argument(
            "--long-prefill-token-threshold",
            type=int,
            default=0,
            help="Cap on one prefill chunk (0: the step budget).",
        )
        g.add_argument(
            "--scheduling-policy",
            choices=list(policy_names()),
            default="fcfs",
            help="Request scheduling policy.",
        )
        g.add_argument(
            "--continuum-ttl-mode",
            choices=list(CONTINUUM_TTL_MODES),
            default="paper",
            help="Continuum pin TTL: the paper's CDF rule or the fork's fixed rule.",
        )
        g.add_argument(
            "--continuum-max-ttl",
            type=float,
            default=10.0,
            help="Upper bound on a pin's TTL in seconds.",
        )
        g.add_argument(
            "--continuum-default-ttl",
            type=float,
            default=2.0,
            help="Cold-start TTL in seconds (paper mode).",
        )
        g.add_argument(
            "--continuum-min-records",
            type=int,
            default=100,
            help="Tool records before a tool's own CDF is trusted (paper's K).",
        )
        g.add_argument(
            "--max-wait-time",
            type=float,
            default=30.0,
            help="Seconds after which a waiting request is served regardless "
            "of job order (bounded waiting).",
        )
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})
