"""--hf-overrides (vLLM's): fields set on the model's HF config before anything reads it,
so the limits, the loader and the model all see the overridden config."""

from __future__ import annotations

import json

import pytest
from transformers import PretrainedConfig

from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.model_loader import apply_hf_overrides


class _Text(PretrainedConfig):
    model_type = "text-part"

    def __init__(self, hidden_size: int = 8, **kw) -> None:
        self.hidden_size = hidden_size
        super().__init__(**kw)


class _Outer(PretrainedConfig):
    model_type = "outer"

    def __init__(self, text_config: dict | None = None, routing=None, **kw) -> None:
        self.text_config = _Text(**(text_config or {}))
        self.routing = routing
        super().__init__(**kw)


def test_a_nested_object_updates_a_sub_config_and_other_values_replace(caplog):
    config = _Outer(routing={"top_k": 2, "jitter": 0.1})
    apply_hf_overrides(
        config, {"text_config": {"hidden_size": 16}, "routing": {"top_k": 4}, "new_field": 1}
    )
    assert config.text_config.hidden_size == 16  # the sub-config updated, not replaced
    assert config.routing == {"top_k": 4}  # a plain dict field: replaced whole
    assert config.new_field == 1
    assert "hf_overrides.new_field: _Outer has no such field" in caplog.text


def test_the_flag_is_a_json_object_named_in_its_errors():
    assert EngineArgs(hf_overrides='{"a": 1}').parsed("hf_overrides") == {"a": 1}
    with pytest.raises(ValueError, match="hf_overrides must be a JSON object"):
        EngineArgs(hf_overrides="[1]").create_engine_config()


@pytest.mark.slow
def test_the_engine_runs_the_overridden_config(tmp_path):
    from tests.entrypoints.test_generation_config import tiny_model
    from vllm import LLM, SamplingParams

    model = tiny_model(tmp_path / "tiny")  # 512 positions, 2 layers
    assert json.loads((tmp_path / "tiny" / "config.json").read_text())["num_hidden_layers"] > 1
    llm = LLM(
        model=model,
        kv_cache_memory="16MiB",
        load_format="dummy",
        hf_overrides={"max_position_embeddings": 100, "num_hidden_layers": 1},
    )
    try:
        assert llm.vllm_config.scheduler_config.max_model_len == 100
        assert len(llm.engine_core.model_runner.model.layers) == 1
        out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=3))
        assert len(out[0].outputs[0].token_ids) == 3
        with pytest.raises(ValueError, match="100"):
            llm.generate({"prompt_token_ids": [5] * 101}, SamplingParams(max_tokens=1))
    finally:
        llm.shutdown()
