"""ContextServeConfig is one VllmConfig group: every field is a --context-serve-* flag of
`vllm serve`, and the parsed flags reach the policy."""

from __future__ import annotations

import argparse

import pytest

from vllm.engine.arg_utils import EngineArgs, config_args
from vllm.utils.clock import FakeClock
from vllm.v1.core.sched.policy import create_policy


def parse(argv: list[str]) -> EngineArgs:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser(exit_on_error=False))
    return EngineArgs.from_cli_args(parser.parse_args(argv))


def test_every_field_is_a_documented_context_serve_flag():
    args = [a for a in config_args() if a.group == "context_serve_config"]
    assert args and all(a.flag.startswith("--context-serve-") and a.help for a in args)


def test_flags_reach_the_policy(tmp_path):
    rules = tmp_path / "rules.yaml"
    rules.write_text("fast: [jq]\n")
    args = parse(
        ["--scheduling-policy", "context_serve", "--context-serve-fast-threshold", "1.5",
         "--context-serve-rules", str(rules), "--no-context-serve-online-training"]
    )  # fmt: skip
    config = args.create_engine_config()
    policy = create_policy(config, decode=lambda ids: "", clock=FakeClock())
    cs = policy.settings.context_serve
    assert cs.fast_threshold_s == 1.5 and cs.rules == str(rules) and not cs.online_training
    assert cs.fast_pin_s == config.context_serve_config.fast_pin_s  # untouched: default


def test_unreadable_rules_file_is_a_one_line_error_naming_the_option(tmp_path):
    args = parse(["--context-serve-rules", str(tmp_path / "missing.json")])
    with pytest.raises(ValueError, match="rules") as e:
        args.create_engine_config()
    assert "\n" not in str(e.value)


def test_slow_turns_go_to_the_cpu_tier_only_when_the_engine_has_one():
    """Whether a tier exists is the engine's fact (``has_kv_tier``), not the flag's: the
    engine core derives it from the tier's block count and passes it down."""
    config = parse(["--scheduling-policy", "context_serve"]).create_engine_config()

    def build(has_kv_tier: bool):
        return create_policy(
            config, decode=lambda ids: "", clock=FakeClock(), has_kv_tier=has_kv_tier
        )

    without, with_tier = build(False), build(True)
    assert not without.settings.context_serve.offload_slow and not without.has_tier
    assert with_tier.settings.context_serve.offload_slow and with_tier.has_tier
