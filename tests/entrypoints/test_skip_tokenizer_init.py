"""vLLM's ``skip_tokenizer_init`` offline: a model folder without tokenizer files serves
token-id prompts, outputs carry token ids with empty text, EOS comes from the model's
generation config (or config.json), and whatever needs a tokenizer is a ``ValueError``
naming the argument, with nothing left in the engine."""

from __future__ import annotations

import json

import pytest

from tests.tiny_models import save_tiny_llama
from vllm import LLM, SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints.cli.main import make_parser
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import StructuredOutputsParams

PROMPT = [1, 2, 3]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def no_tokenizer_model(path, eos_in: str | None = None, eos: int | None = None, **config) -> str:
    """A tiny random Llama (``config``: its fields) with no tokenizer files; its EOS id
    ``eos`` written into ``eos_in`` ("generation_config" or "config"; None: as saved),
    the other one's dropped, so that only ``eos_in`` can say it."""
    save_tiny_llama(path, **config)
    assert not list(path.glob("tokenizer*")) and not list(path.glob("*.jinja"))
    if eos_in is not None:
        (path / "generation_config.json").unlink()
        config = json.loads((path / "config.json").read_text())
        config["eos_token_id"] = eos if eos_in == "config" else None
        (path / "config.json").write_text(json.dumps(config))
        if eos_in == "generation_config":
            (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return str(path)


def make_llm(model: str, **kwargs) -> LLM:
    return LLM(model, skip_tokenizer_init=True, max_model_len=64, num_gpu_blocks_override=32,
               **kwargs)  # fmt: skip


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    llm = make_llm(no_tokenizer_model(tmp_path_factory.mktemp("skip") / "m"))
    yield llm
    llm.shutdown()


def assert_idle(llm: LLM) -> None:
    assert not llm.output_processor.has_unfinished_requests()
    assert not llm.engine_core.has_unfinished_requests()


def test_token_prompts_give_token_ids_and_no_text(llm):
    out = llm.generate(
        [PROMPT, {"prompt_token_ids": [4, 5]}], SamplingParams(max_tokens=4, temperature=0.0)
    )
    for result, prompt in zip(out, (PROMPT, [4, 5]), strict=True):
        assert result.prompt_token_ids == prompt and result.prompt is None
        (c,) = result.outputs
        assert c.text == "" and len(c.token_ids) >= 1
        assert all(0 <= t < 96 for t in c.token_ids)  # the tiny model's vocabulary
    # n > 1 and logprobs (token ids, no text to decode) work as well.
    params = SamplingParams(n=2, max_tokens=3, temperature=1.0, seed=1, logprobs=2)
    (result,) = llm.generate({"prompt_token_ids": PROMPT}, params)
    assert [c.text for c in result.outputs] == ["", ""]
    assert all(len(c.logprobs) == len(c.token_ids) for c in result.outputs)
    assert_idle(llm)


def test_a_text_prompt_is_a_value_error_naming_the_prompt(llm):
    for prompt in ("Hello", {"prompt": "Hello"}, [PROMPT, "Hello"]):
        with pytest.raises(ValueError, match="skip_tokenizer_init") as e:
            llm.generate(prompt, GREEDY)
        assert isinstance(e.value, VLLMValidationError) and e.value.param == "prompt"
        assert_idle(llm)  # a batch with one bad prompt queued nothing
    assert llm.generate(PROMPT, GREEDY)[0].outputs[0].token_ids


@pytest.mark.parametrize(
    "params, param",
    [
        (SamplingParams(max_tokens=4, stop=["x"]), "stop"),
        (SamplingParams(max_tokens=4, bad_words=["x"]), "bad_words"),
        (
            SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="a+")),
            "structured_outputs",
        ),
    ],
)
def test_what_needs_a_tokenizer_is_refused(llm, params, param):
    with pytest.raises(VLLMValidationError, match="no tokenizer is loaded") as e:
        llm.generate(PROMPT, params)
    assert e.value.param == param
    assert_idle(llm)


def test_chat_and_get_tokenizer_are_refused(llm):
    with pytest.raises(VLLMValidationError, match="no tokenizer is loaded") as e:
        llm.chat([{"role": "user", "content": "hi"}])
    assert e.value.param == "messages"
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        llm.get_tokenizer()
    assert_idle(llm)


def test_stop_token_ids_and_beam_search_work_on_ids(llm):
    (first,) = llm.generate(PROMPT, GREEDY)
    ids = first.outputs[0].token_ids
    stop = SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=[ids[1]])
    (c,) = llm.generate(PROMPT, stop)[0].outputs
    assert c.token_ids == ids[:2] and c.finish_reason == "stop" and c.stop_reason == ids[1]
    from vllm.sampling_params import BeamSearchParams

    (beams,) = llm.beam_search([{"prompt_token_ids": PROMPT}], BeamSearchParams(2, 3))
    assert beams.sequences and all(s.text == "" for s in beams.sequences)
    assert all(s.tokens[: len(PROMPT)] == PROMPT for s in beams.sequences)


@pytest.mark.parametrize("eos_in", ["generation_config", "config"])
def test_eos_comes_from_the_model_configs(tmp_path, eos_in):
    # The greedy continuation, then the same model with its third token as the EOS id:
    # the output ends there, EOS included (as vLLM reports it), finish_reason "stop".
    probe = make_llm(no_tokenizer_model(tmp_path / "probe"))
    ids = probe.generate(PROMPT, GREEDY)[0].outputs[0].token_ids
    probe.shutdown()
    eos = ids[2]
    cut = ids.index(eos) + 1
    llm = make_llm(no_tokenizer_model(tmp_path / eos_in, eos_in, eos))
    try:
        assert llm.processor.eos_token_id == eos
        (c,) = llm.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0.0))[0].outputs
        assert c.token_ids == ids[:cut] and c.finish_reason == "stop" and c.text == ""
        (c,) = llm.generate(PROMPT, GREEDY)[0].outputs  # ignore_eos: past it
        assert c.token_ids == ids
    finally:
        llm.shutdown()


def test_a_policy_that_reads_outputs_runs_without_text(tmp_path):
    # continuum decodes finished outputs for tool calls: without a tokenizer it reads no
    # text (as the upstream plugin does) instead of failing the step.
    # (Its start-up profiles prefill chunks past the tiny model's 128 positions.)
    model = no_tokenizer_model(tmp_path / "m", max_position_embeddings=4096)
    llm = make_llm(model, scheduling_policy="continuum")
    try:
        assert llm.engine_core._decode([1, 2]) is None
        (c,) = llm.generate(PROMPT, SamplingParams(max_tokens=3))[0].outputs
        assert len(c.token_ids) >= 1 and c.text == ""
        assert_idle(llm)
    finally:
        llm.shutdown()


def test_the_flag_and_its_config():
    args = make_parser().parse_args(["serve", "--model", "m", "--skip-tokenizer-init"])
    assert EngineArgs.from_cli_args(args).skip_tokenizer_init is True
    assert EngineArgs().skip_tokenizer_init is False
    config = EngineArgs(skip_tokenizer_init=True).create_engine_config(2048)
    assert config.model_config.skip_tokenizer_init is True
    for name, value in (("tokenizer", "/tok"), ("chat_template", "{{ x }}")):
        with pytest.raises(ValueError, match=f"{name} is never read with skip_tokenizer_init"):
            EngineArgs(skip_tokenizer_init=True, **{name: value}).create_engine_config(2048)
