"""What the quantized checkpoints' readers (``fp8_checkpoint``, ``wna16_checkpoint``) share
when they read a ``quantization_config``: the refusal naming its field, unknown fields, and
compressed-tensors' outer layout (one config group; the schemes not implemented)."""

from __future__ import annotations

from typing import Any

# compressed-tensors' top-level fields; sparsity and transform configs are refused when set
# (the KV-cache scheme is read by kv_scales.py).
CT_FIELDS = {"quant_method", "config_groups", "ignore", "format", "quantization_status",
             "kv_cache_scheme", "sparsity_config", "transform_config",
             "global_compression_ratio", "version", "provider"}  # fmt: skip
CT_NOT_IMPLEMENTED = ("sparsity_config", "transform_config")
CT_GROUP_FIELDS = {"targets", "weights", "input_activations", "output_activations", "format"}


def bad_field(field: str, value: Any, why: str) -> ValueError:
    """The error for ``quantization_config.<field>`` = ``value``, with why it is refused."""
    return ValueError(f"quantization_config.{field} {value!r} is not supported: {why}")


def check_keys(config: dict, known: set[str], where: str = "") -> None:
    """Every field of ``config`` (at ``where``) is one of ``known``."""
    for key in config:
        if key not in known:
            raise bad_field(where + key, config[key], "unknown field")


def compressed_tensors_group(q: dict) -> tuple[dict, str]:
    """A compressed-tensors config's one config group and its field prefix, after the
    checks both readers make: known fields, no sparsity / transform scheme, exactly one
    group, known group fields."""
    check_keys(q, CT_FIELDS)
    for key in CT_NOT_IMPLEMENTED:
        if q.get(key):
            raise bad_field(key, q[key], "not implemented")
    groups = list((q.get("config_groups") or {}).items())
    if len(groups) != 1:
        raise bad_field("config_groups", [n for n, _ in groups], "exactly one group")
    name, group = groups[0]
    where = f"config_groups.{name}."
    check_keys(group, CT_GROUP_FIELDS, where)
    return group, where
