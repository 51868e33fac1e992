"""``PolicyConfig`` from upstream's ``--additional-config``.

``--additional-config '{"continuum": {"max_ttl_s": 5, "continuum_ttl_mode": "fixed"}}'``:
the keys are ``PolicyConfig``'s field names (help: ``python -m vllm_continuum.upstream.settings``).
``PolicyConfig`` validates them, so a bad value stops the start-up with the field's name.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm_continuum.config import PolicyConfig

SECTION = "continuum"


def policy_config_from(additional_config: dict[str, Any] | None) -> PolicyConfig:
    section = (additional_config or {}).get(SECTION) or {}
    if not isinstance(section, dict):
        raise ValueError(f"additional_config[{SECTION!r}] must be a dict, got {section!r}")
    fields = {f.name for f in dataclasses.fields(PolicyConfig)}
    unknown = sorted(set(section) - fields - {"policy"})
    if unknown:
        raise ValueError(
            f"additional_config[{SECTION!r}] has unknown keys {unknown}; known: {sorted(fields)}"
        )
    return PolicyConfig(**{k: v for k, v in section.items() if k in fields})


def describe() -> str:
    """One line per setting: name, default, help (from the config fields)."""
    lines = []
    for f in dataclasses.fields(PolicyConfig):
        lines.append(f"{f.name} (default {f.default!r}): {f.metadata.get('help', '')}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(describe())
