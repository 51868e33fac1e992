"""ContextServeConfig declares its flags the way the engine generates them (config_field):
at merge it becomes one more VllmConfig group, and every field a --context-serve-* flag."""

from __future__ import annotations

import argparse
from dataclasses import fields
from typing import get_type_hints

from vllm.engine.arg_utils import ConfigArg
from vllm_continuum.context_serve.config import ContextServeConfig


def config_args() -> list[ConfigArg]:
    hints = get_type_hints(ContextServeConfig)
    out = []
    for f in fields(ContextServeConfig):
        meta = f.metadata
        dest = meta["flag"].removeprefix("--").replace("-", "_")
        out.append(ConfigArg("context_serve_config", f.name, dest, meta["flag"], hints[f.name],
                             f.default, meta["help"], meta["choices"], meta["parse"]))  # fmt: skip
    return out


def test_every_field_is_a_documented_context_serve_flag():
    args = config_args()
    assert all(a.flag.startswith("--context-serve-") and a.help for a in args)
    assert len({a.flag for a in args}) == len(args)


def test_flags_parse_into_a_valid_config(tmp_path):
    rules = tmp_path / "rules.yaml"
    rules.write_text("fast: [jq]\n")
    parser = argparse.ArgumentParser()
    for a in config_args():
        parser.add_argument(a.flag, **a.argparse_kwargs())
    ns = parser.parse_args(
        ["--context-serve-fast-threshold", "1.5", "--context-serve-rules", str(rules),
         "--no-context-serve-online-training", "--context-serve-min-observations", "3"]
    )  # fmt: skip
    by_dest = {a.dest: a.field for a in config_args()}
    config = ContextServeConfig(**{by_dest[k]: v for k, v in vars(ns).items()})
    assert config.fast_threshold_s == 1.5 and config.rules == str(rules)
    assert config.online_training is False and config.min_observations == 3
    assert config.fast_pin_s == 3.0  # untouched flags keep the field defaults
