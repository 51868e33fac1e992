"""The model's generation config, as vLLM reads it: default sampling parameters for what a
request leaves unset (``--generation-config``, ``--override-generation-config``), and every
EOS id it lists ending a request (Llama 3.1 Instruct ends its turns with <|eot_id|>, which is
not its first EOS id)."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.tiny_models import save_tiny_llama
from vllm.config import DEFAULT_MODEL, ModelConfig
from vllm.entrypoints.openai.protocol import ChatCompletionRequest
from vllm.model_executor.model_loader import (
    default_sampling_params,
    eos_token_ids,
    resolve_model,
)
from vllm.sampling_params import SamplingParams
from vllm.transformers_utils.tokenizer import get_tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def tiny_model(path, generation: dict | None = None):
    """A tiny random Llama in folder ``path`` with SmolLM2's tokenizer (EOS 2) and
    ``generation`` as its generation_config.json (none if None)."""
    path.mkdir(parents=True, exist_ok=True)
    save_tiny_llama(path, vocab_size=49152, max_position_embeddings=512)
    embedded = resolve_model(DEFAULT_MODEL)
    for name in TOKENIZER_FILES:
        shutil.copy(f"{embedded}/{name}", path / name)
    (path / "generation_config.json").unlink(missing_ok=True)
    if generation is not None:
        (path / "generation_config.json").write_text(json.dumps(generation))
    return str(path)


SAMPLING = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1}


def test_defaults_come_from_the_generation_config(tmp_path):
    model = tiny_model(tmp_path, {**SAMPLING, "max_new_tokens": 7, "do_sample": True})
    assert default_sampling_params(ModelConfig(model=model)) == {**SAMPLING, "max_tokens": 7}
    assert default_sampling_params(ModelConfig(model=model, generation_config="vllm")) == {}
    over = ModelConfig(model=model, override_generation_config={"temperature": 0.2})
    assert default_sampling_params(over)["temperature"] == 0.2
    only = ModelConfig(
        model=model, generation_config="vllm", override_generation_config={"top_k": 5}
    )
    assert default_sampling_params(only) == {"top_k": 5}


def test_a_named_folder_and_a_model_without_one(tmp_path):
    (tmp_path / "gen").mkdir()
    (tmp_path / "gen" / "generation_config.json").write_text(json.dumps({"temperature": 0.3}))
    model = tiny_model(tmp_path / "m")
    assert default_sampling_params(ModelConfig(model=model)) == {}
    named = ModelConfig(model=model, generation_config=str(tmp_path / "gen"))
    assert default_sampling_params(named) == {"temperature": 0.3}
    # The embedded model's generation config sets no sampling field: vLLM's defaults.
    assert default_sampling_params(ModelConfig()) == {}


def test_bad_values_are_refused_at_start_up(tmp_path):
    model = tiny_model(tmp_path)
    with pytest.raises(ValueError, match="temperature"):
        default_sampling_params(
            ModelConfig(model=model, override_generation_config={"temperature": -1})
        )
    with pytest.raises(ValueError, match="generation_config"):
        ModelConfig(model=model, generation_config=str(tmp_path / "missing"))
    from vllm.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match="override_generation_config"):
        EngineArgs(override_generation_config="[1]").create_engine_config()


def test_eos_ids_the_tokenizers_first_and_the_listed_others(tmp_path):
    model = tiny_model(tmp_path, {"eos_token_id": [7, 2, 9]})
    tokenizer = get_tokenizer(model)
    assert eos_token_ids(ModelConfig(model=model), tokenizer) == (2, frozenset({7, 9}))
    params = SamplingParams()
    params.update_from_generation_config(2, {7, 9})
    assert params.all_stop_token_ids == {2, 7, 9}
    ignoring = SamplingParams(ignore_eos=True, stop_token_ids=[4])
    ignoring.update_from_generation_config(2, {7, 9})
    assert ignoring.all_stop_token_ids == {4}


def test_request_fields_left_unset_take_the_defaults():
    defaults = {"temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.1}
    messages = [{"role": "user", "content": "hi"}]
    unset = ChatCompletionRequest(messages=messages).to_sampling_params(8, None, False, defaults)
    assert (unset.temperature, unset.top_p, unset.top_k) == (0.6, 0.9, 0)
    assert unset.repetition_penalty == 1.1
    given = ChatCompletionRequest(messages=messages, temperature=0.0, top_p=1.0)
    params = given.to_sampling_params(8, None, False, defaults)
    assert (params.temperature, params.top_p) == (0.0, 1.0)
    plain = ChatCompletionRequest(messages=messages).to_sampling_params(8, None, False)
    assert (plain.temperature, plain.top_p, plain.repetition_penalty) == (1.0, 1.0, 1.0)


@pytest.mark.slow
def test_engine_stops_on_a_listed_eos_and_llm_uses_the_defaults(tmp_path):
    from vllm import LLM

    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = {"prompt_token_ids": [5, 17, 300, 4000, 12]}
    llm = LLM(model=tiny_model(tmp_path / "a"), kv_cache_memory="16MiB")
    tokens = llm.generate(prompt, greedy)[0].outputs[0].token_ids
    llm.shutdown()
    stop = tokens[2]
    assert stop not in tokens[:2] and stop != 2
    generation = {"eos_token_id": [2, stop], "max_new_tokens": 5, "temperature": 0.0}
    model = tiny_model(tmp_path / "b", generation)
    llm = LLM(model=model, kv_cache_memory="16MiB")
    try:
        out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8))[0].outputs[0]
        assert out.token_ids == tokens[:3]
        assert (out.finish_reason, out.stop_reason) == ("stop", stop)
        # ignore_eos ignores the listed ones too.
        assert llm.generate(prompt, greedy)[0].outputs[0].token_ids == tokens
        # No sampling params: the model's defaults (greedy, 5 tokens at most).
        assert llm.get_default_sampling_params().max_tokens == 5
        default = llm.generate(prompt)[0].outputs[0]
        assert default.token_ids == tokens[:3] and default.finish_reason == "stop"
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_server_applies_the_models_defaults(tmp_path):
    from tests.utils import RemoteServer

    model = tiny_model(tmp_path, {"max_new_tokens": 3, "temperature": 0.0})
    log = tmp_path / "server.log"
    server = RemoteServer(
        "--model", model, "--served-model-name", "tiny", "--max-model-len", "256",
        log_path=str(log),
    )  # fmt: skip
    try:
        client = server.client()
        messages = [{"role": "user", "content": "Say something."}]
        unset = client.chat.completions.create(
            model="tiny", messages=messages, extra_body={"ignore_eos": True}
        )
        assert unset.usage.completion_tokens == 3 and unset.choices[0].finish_reason == "length"
        # An explicit max_tokens wins; temperature 0 came from the config, so two runs agree.
        longer = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=6, extra_body={"ignore_eos": True}
        )
        assert longer.usage.completion_tokens == 6
        again = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=6, extra_body={"ignore_eos": True}
        )
        assert again.choices[0].message.content == longer.choices[0].message.content
    finally:
        server.stop()
    assert "Default sampling parameters have been overridden" in log.read_text()
