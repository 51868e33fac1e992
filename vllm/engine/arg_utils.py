"""``EngineArgs``: engine keyword arguments and CLI flags (vLLM names) -> ``VllmConfig``.

Nothing here restates a default. Every flag and every ``EngineArgs`` field is generated
from one config field (``vllm.config.config_field``): its flag, type, default, choices and
help. Only the defaults that depend on other settings are computed here, once, in
``EngineArgs.create_engine_config``.
"""

from __future__ import annotations

import argparse
import enum
import functools
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, Literal, get_args, get_origin, get_type_hints

from vllm.config import SchedulerConfig, VllmConfig, field_default, parse_bytes

__all__ = [
    "ConfigArg",
    "EngineArgs",
    "UsageContext",
    "config_args",
    "human_readable_int",
    "parse_bytes",
]

GiB = 1 << 30


class UsageContext(enum.Enum):
    """Who builds the engine (vLLM's ``UsageContext``): some defaults depend on it."""

    ENGINE_CONTEXT = "ENGINE_CONTEXT"  # the engine used directly (tests, benchmarks)
    LLM_CLASS = "LLM_CLASS"  # offline: ``vllm.LLM``
    OPENAI_API_SERVER = "OPENAI_API_SERVER"  # ``vllm serve``


def cuda_max_num_batched_tokens(usage_context: UsageContext) -> int | None:
    """vLLM's default step budget for the CUDA device the engine will run on (device 0),
    by usage context and device memory (its ``EngineArgs.get_batch_defaults``); None
    without CUDA (the CPU keeps SchedulerConfig's default) or for a context vLLM gives no
    default of its own. Reads the device's properties only: no CUDA context is created,
    so the API server's process holds no GPU memory."""
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    if props.total_memory >= 160 * GiB:  # B200-class
        defaults = {UsageContext.LLM_CLASS: 16384, UsageContext.OPENAI_API_SERVER: 16384}
    elif props.total_memory >= 70 * GiB and "a100" not in props.name.lower():
        # H100/H200. vLLM keeps A100 80GB on the smaller budget: a larger one measured
        # slower there (vLLM PR #17885).
        defaults = {UsageContext.LLM_CLASS: 16384, UsageContext.OPENAI_API_SERVER: 8192}
    else:
        defaults = {UsageContext.LLM_CLASS: 8192, UsageContext.OPENAI_API_SERVER: 2048}
    return defaults.get(usage_context)


@dataclass(frozen=True)
class ConfigArg:
    """One engine flag, generated from one config field."""

    group: str  # the VllmConfig field holding the config, e.g. "cache_config"
    field: str  # the config's field, e.g. "kv_cache_memory_bytes"
    dest: str  # EngineArgs attribute and argparse dest, e.g. "kv_cache_memory"
    flag: str  # e.g. "--kv-cache-memory"
    type: Any  # the config field's resolved type hint
    default: Any  # the flag's default: the field's, or None for derived fields
    help: str
    choices: Any  # a sequence, a callable returning one, or None
    parse: Callable[[str], Any] | None
    aliases: tuple[str, ...] = ()  # more flags for it, e.g. "-tp"

    @property
    def annotation(self) -> Any:
        """Type of the ``EngineArgs`` field (derived: may be None; parsed: may be text)."""
        hint = self.type | None if self.default is None else self.type
        return hint | str if self.parse is not None else hint

    def argparse_kwargs(self) -> dict[str, Any]:
        """``add_argument`` keywords; a callable ``choices`` is evaluated now."""
        kind, literal = _scalar_type(self.type)
        # argparse %-formats help strings.
        kwargs = {"dest": self.dest, "default": self.default, "help": self.help.replace("%", "%%")}
        if kind is bool:
            return kwargs | {"action": argparse.BooleanOptionalAction}
        if get_origin(kind) is tuple:  # one or more values, each parsed on its own
            kwargs["nargs"] = "+"
            kind = get_args(kind)[0]
        elif get_origin(kind) is list:  # repeatable: each use adds its values to the list
            kwargs |= {"action": "extend", "nargs": "+"}
            kind = get_args(kind)[0]
        choices = self.choices() if callable(self.choices) else self.choices
        if choices is not None or literal is not None:
            kwargs["choices"] = list(choices if choices is not None else literal)
        kwargs["type"] = _flag_type(self.parse) if self.parse is not None else kind
        return kwargs


def _scalar_type(hint: Any) -> tuple[type, tuple | None]:
    """(scalar type, Literal values or None) of ``X``, ``X | None`` or ``Literal[...]``."""
    if get_origin(hint) in (types.UnionType, typing.Union):
        hint = next(a for a in get_args(hint) if a is not type(None))
    if get_origin(hint) is Literal:
        values = get_args(hint)
        return type(values[0]), values
    return hint, None


def _flag_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` whose ValueError becomes argparse's one-line error naming the flag."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return convert


@functools.cache
def config_args() -> tuple[ConfigArg, ...]:
    """Every engine flag, in ``VllmConfig`` order (one group per config)."""
    out = []
    for group, cls in get_type_hints(VllmConfig).items():
        hints = get_type_hints(cls)
        for f in fields(cls):
            meta = f.metadata
            if "help" not in meta:
                raise TypeError(f"{cls.__name__}.{f.name}: declare it with config_field")
            if not meta["cli"]:
                continue
            flag = meta["flag"] or "--" + f.name.replace("_", "-")
            default = None if meta["derived"] else f.default
            dest = flag.removeprefix("--").replace("-", "_")
            args = (meta["help"], meta["choices"], meta["parse"], meta["aliases"])
            out.append(ConfigArg(group, f.name, dest, flag, hints[f.name], default, *args))
    dests = [a.dest for a in out]
    if len(set(dests)) != len(dests):
        raise TypeError(f"two config fields share a flag: {sorted(dests)}")
    return tuple(out)


def _with_config_fields(cls: type) -> type:
    """Give ``cls`` one field per engine flag (so ``@dataclass`` makes them keywords)."""
    for arg in config_args():
        cls.__annotations__[arg.dest] = arg.annotation
        setattr(cls, arg.dest, arg.default)
    return cls


def human_readable_int(text: str | int) -> int:
    """vLLM's integers with a suffix: '1k' / '1.5m' / '2g' / '1t' decimal (1000s), '1K' /
    '2M' / '4G' / '1T' binary (1024s, whole numbers only), or digits (ValueError)."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)([kmgtKMGT]?)\s*", str(text))
    if m is None:
        raise ValueError(f"expected an integer like 536870912, 512M or 1.5g, got {text!r}")
    number, suffix = m.groups()
    if suffix.isupper():
        if "." in number:
            raise ValueError(
                f"{text!r}: binary suffixes ({suffix}) take whole numbers; did you mean "
                f"{number}{suffix.lower()} (decimal)?"
            )
        return int(number) * 1024 ** ("KMGT".index(suffix) + 1)
    if not suffix:
        if "." in number:
            raise ValueError(f"expected an integer, got {text!r}")
        return int(number)
    return int(float(number) * 1000 ** ("kmgt".index(suffix) + 1))


# vLLM's name for --kv-cache-memory: bytes as an integer, or with vLLM's suffixes.
KV_CACHE_MEMORY_BYTES_HELP = (
    "vLLM's name of --kv-cache-memory: the KV cache size in bytes, an integer or with "
    "vLLM's suffixes (k/m/g/t: 1000s, K/M/G/T: 1024s; 512M = 512MiB). Give one of the two."
)


@dataclass
@_with_config_fields
class EngineArgs:
    """Engine keyword arguments: one per engine flag, named after it (``max_num_seqs``,
    ``kv_cache_memory``, ``scheduling_policy``...), defaulting to its config field;
    ``kv_cache_memory_bytes``: vLLM's name of ``kv_cache_memory`` (bytes)."""

    kv_cache_memory_bytes: int | str | None = None

    def create_engine_config(
        self,
        model_max_len: int | None = None,
        usage_context: UsageContext = UsageContext.ENGINE_CONTEXT,
        recurrent: bool = False,
    ) -> VllmConfig:
        """Build the validated config. ``model_max_len``: the model's own limit, if known;
        ``usage_context``: who asks (the CUDA step budget's default depends on it);
        ``recurrent``: the model has recurrent layers (``has_recurrent_layers``): the flags
        it cannot serve with are refused before it loads (``refuse_unsupported``)."""
        values: dict[str, dict[str, Any]] = {g: {} for g in get_type_hints(VllmConfig)}
        for arg in config_args():
            values[arg.group][arg.field] = self._parse(arg)
        if self.kv_cache_memory_bytes is not None:
            values["cache_config"]["kv_cache_memory_bytes"] = self._kv_cache_memory_bytes()
        max_model_len = self._max_model_len(model_max_len)
        values["model_config"]["max_model_len"] = max_model_len
        scheduler = values["scheduler_config"]
        scheduler["max_model_len"] = max_model_len
        if scheduler["max_num_batched_tokens"] is None:
            budget = cuda_max_num_batched_tokens(usage_context) or field_default(
                SchedulerConfig, "max_num_batched_tokens"
            )
            # Without chunking a whole prompt must fit in one step.
            if not scheduler["enable_chunked_prefill"]:
                budget = max(budget, max_model_len)
            scheduler["max_num_batched_tokens"] = budget
        configs = get_type_hints(VllmConfig)
        config = VllmConfig(**{g: configs[g](**kwargs) for g, kwargs in values.items()})
        if recurrent:
            from vllm.model_executor.layers.recurrent import refuse_unsupported

            refuse_unsupported(config)
        return config

    def _kv_cache_memory_bytes(self) -> int:
        """--kv-cache-memory-bytes (vLLM's name), refused next to --kv-cache-memory."""
        if self.kv_cache_memory is not None:
            raise ValueError(
                "--kv-cache-memory-bytes and --kv-cache-memory both set the KV cache size "
                f"({self.kv_cache_memory_bytes!r}, {self.kv_cache_memory!r}): give one"
            )
        try:
            return human_readable_int(self.kv_cache_memory_bytes)
        except ValueError as e:
            raise ValueError(f"kv_cache_memory_bytes: {e}") from None

    def serve_speculators_head(self) -> None:
        """vLLM's speculators models: when ``model`` is a ``speculators``-format head
        (``vllm serve RedHatAI/Llama-3.1-8B-Instruct-speculator.eagle3``), serve the
        verifier its config names, with the head as its speculative model and the
        head's method and draft count. ``speculative_config`` may add to that or change
        ``num_speculative_tokens``; a ``method`` or ``model`` of its own that differs is a
        ValueError. Called before the model's HF config is read (``LLM``, ``vllm serve``)."""
        from vllm.model_executor.model_loader import speculators_verifier

        found = speculators_verifier(self.model, self.revision, self.download_dir, self.hf_token)
        if found is None:
            return
        verifier, implied = found
        given = dict(self.parsed("speculative_config") or {})
        shortcuts = {"method": "spec_method", "model": "spec_model",
                     "num_speculative_tokens": "spec_tokens"}  # fmt: skip
        for key, dest in shortcuts.items():  # --spec-*: as the key, said once
            if getattr(self, dest) is not None:
                if key in given:
                    raise ValueError(
                        f"--{dest.replace('_', '-')} and speculative_config.{key} are "
                        "mutually exclusive"
                    )
                given[key] = getattr(self, dest)
                setattr(self, dest, None)
        for key in ("method", "model"):
            if key in given and given[key] != implied[key]:
                raise ValueError(
                    f"speculative_config.{key}: {given[key]!r}, but the model {self.model} "
                    f"is a speculators {implied['method']} head ({key} {implied[key]!r})"
                )
        self.speculative_config = {**implied, **given}
        self.model = verifier

    def _parse(self, arg: ConfigArg) -> Any:
        value = getattr(self, arg.dest)
        if arg.parse is not None and isinstance(value, str):
            value = arg.parse(value)
        return value

    def parsed(self, dest: str) -> Any:
        """One argument's value as its config field takes it (a flag's JSON text parsed),
        for what is read before the config exists (the model's HF config)."""
        return self._parse(next(arg for arg in config_args() if arg.dest == dest))

    def _max_model_len(self, model_max_len: int | None) -> int:
        """The flag, else the model's limit, else SchedulerConfig's default."""
        if self.max_model_len is None:
            if model_max_len is not None:
                return model_max_len
            return field_default(SchedulerConfig, "max_model_len")
        if model_max_len is not None and self.max_model_len > model_max_len:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's longest context "
                f"{model_max_len} (its max_position_embeddings, times a linear rope factor)"
            )
        return self.max_model_len

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Engine flags with vLLM's names, one argument group per config."""
        configs = get_type_hints(VllmConfig)
        groups: dict[str, Any] = {}
        for arg in config_args():
            if arg.group not in groups:
                cls = configs[arg.group]
                groups[arg.group] = parser.add_argument_group(cls.__name__, cls.__doc__)
            groups[arg.group].add_argument(arg.flag, *arg.aliases, **arg.argparse_kwargs())
        groups["cache_config"].add_argument(
            "--kv-cache-memory-bytes",
            dest="kv_cache_memory_bytes",
            default=None,
            type=_flag_type(human_readable_int),
            help=KV_CACHE_MEMORY_BYTES_HELP.replace("%", "%%"),
        )
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})
