"""The policies' settings from upstream's ``--additional-config``.

``--additional-config '{"continuum": {"max_ttl_s": 5, "continuum_ttl_mode": "fixed"}}'``:
the keys of the ``continuum`` section are ``PolicyConfig``'s field names (both policies);
those of the ``context_serve`` section, ``ContextServeConfig``'s (ContextServe's
predictor). Help: ``python -m vllm_continuum.upstream.settings``. The config classes
validate the values, so a bad value stops the start-up with the field's name.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from vllm_continuum.config import PolicyConfig
from vllm_continuum.context_serve.config import ContextServeConfig

SECTION = "continuum"
CONTEXT_SERVE_SECTION = "context_serve"
# Settings with no meaning on upstream: none since the plugin drives upstream's host KV tier
# (``pins_yield_to_tier`` and ``offload_slow`` act when it exists, as in our engine).
_NOT_ON_UPSTREAM: dict[str, set[str]] = {}

C = TypeVar("C")


def config_from(cls: type[C], additional_config: dict[str, Any] | None, section: str) -> C:
    """``cls`` built from ``additional_config[section]`` (its defaults if absent)."""
    values = (additional_config or {}).get(section) or {}
    if not isinstance(values, dict):
        raise ValueError(f"additional_config[{section!r}] must be a dict, got {values!r}")
    fields = {f.name for f in dataclasses.fields(cls)} - _NOT_ON_UPSTREAM.get(section, set())
    unknown = sorted(set(values) - fields - {"policy"})
    if unknown:
        raise ValueError(
            f"additional_config[{section!r}] has unknown keys {unknown}; known: {sorted(fields)}"
        )
    return cls(**{k: v for k, v in values.items() if k in fields})


def policy_config_from(additional_config: dict[str, Any] | None) -> PolicyConfig:
    return config_from(PolicyConfig, additional_config, SECTION)


def context_serve_config_from(additional_config: dict[str, Any] | None) -> ContextServeConfig:
    """ContextServe's settings (``offload_slow`` acts only with a host KV tier: without one
    the policy frees SLOW turns' blocks, ``ContextServePolicy.from_settings``)."""
    return config_from(ContextServeConfig, additional_config, CONTEXT_SERVE_SECTION)


def describe() -> str:
    """One line per setting: section, name, default, help (from the config fields)."""
    lines = []
    for section, cls in ((SECTION, PolicyConfig), (CONTEXT_SERVE_SECTION, ContextServeConfig)):
        skip = _NOT_ON_UPSTREAM.get(section, set())
        for f in dataclasses.fields(cls):
            if f.name not in skip:
                help_text = f.metadata.get("help", "")
                lines.append(f"{section}.{f.name} (default {f.default!r}): {help_text}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(describe())
