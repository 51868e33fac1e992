"""Token-based classifiers (vLLM's ``classifier_from_token``): a causal checkpoint served
as a classifier through --hf-overrides, its head the output head's rows of the named
tokens. Qwen3-Reranker's overrides (``["no", "yes"]``, ``is_original_qwen3_reranker``)
score a pair as softmax([logit_no, logit_yes])[1] of the causal model on the score
template's prompt; ``no_post_processing`` classifies over the tokens' softmax."""

from __future__ import annotations

import pytest
import torch
import transformers

from tests.entrypoints.test_classify import logits, save_classifier
from vllm.entrypoints.score_utils import pair_token_ids

QUERY = "Which file holds the tests?"
DOCS = ["tests/test_main.py holds the tests.", "The sea is blue today."]
# The reranker's prompt format, shortened (Qwen3-Reranker's judge prompt and its yes/no).
TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the Query. Answer only "
    '"yes" or "no".<|im_end|>\n<|im_start|>user\n'
    "{% for m in messages %}<{{ m.role }}>: {{ m.content }}\n{% endfor %}"
    "<|im_end|>\n<|im_start|>assistant\n"
)
RERANKER = {"architectures": ["Qwen3ForSequenceClassification"],
            "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": True}  # fmt: skip


def save_causal(path, tied: bool) -> transformers.Qwen3ForCausalLM:
    return save_classifier(path, transformers.Qwen3ForCausalLM, transformers.Qwen3Config,
                           head_dim=16, tie_word_embeddings=tied)  # fmt: skip


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    """A tiny random Qwen3ForCausalLM (tied embeddings, as Qwen3-Reranker-0.6B) with a
    real tokenizer; its HF model and tokenizer."""
    path = tmp_path_factory.mktemp("qwen3_reranker")
    hf = save_causal(path, tied=True)
    return path, hf, transformers.AutoTokenizer.from_pretrained(path)


def test_qwen3_reranker_scores_the_yes_no_softmax(reranker):
    """LLM.score with Qwen3-Reranker's overrides and a score template: each pair's score
    is softmax([logit_no, logit_yes])[1] at the causal model's last position."""
    from vllm import LLM

    path, hf, tokenizer = reranker
    no, yes = tokenizer.convert_tokens_to_ids(["no", "yes"])
    llm = LLM(model=str(path), hf_overrides=RERANKER, chat_template=TEMPLATE,
              kv_cache_memory="16MiB")  # fmt: skip
    try:
        outs = llm.score(QUERY, DOCS)
    finally:
        llm.shutdown()
    for doc, out in zip(DOCS, outs, strict=True):
        ids = pair_token_ids(tokenizer, QUERY, doc, TEMPLATE, sep_token=False)
        assert out.prompt_token_ids == ids
        last = logits(hf, ids)[-1]
        want = torch.softmax(last[[no, yes]], dim=-1)[1].item()
        assert out.outputs.score == pytest.approx(want, abs=1e-5)
    assert abs(outs[0].outputs.score - outs[1].outputs.score) > 1e-4  # not a constant


def test_token_list_classifier_gives_the_tokens_softmax(tmp_path):
    """``no_post_processing`` over three tokens of an untied checkpoint: LLM.classify's
    probabilities are the softmax of those tokens' logits; a score is refused."""
    from vllm import LLM

    hf = save_causal(tmp_path, tied=False)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    tokens = ["no", "yes", "maybe"]
    overrides = {"architectures": ["Qwen3ForSequenceClassification"],
                 "classifier_from_token": tokens, "method": "no_post_processing"}  # fmt: skip
    prompt = tokenizer("Is the sea blue? Answer:")["input_ids"]
    llm = LLM(model=str(tmp_path), hf_overrides=overrides, kv_cache_memory="16MiB")
    try:
        probs = llm.classify({"prompt_token_ids": prompt})[0].outputs.probs
        with pytest.raises(Exception, match="3 labels"):
            llm.score("q", "d")
    finally:
        llm.shutdown()
    want = torch.softmax(logits(hf, prompt)[-1][tokenizer.convert_tokens_to_ids(tokens)], -1)
    torch.testing.assert_close(torch.tensor(probs), want, atol=1e-5, rtol=0)


def test_malformed_token_classifiers_are_refused(reranker):
    """A string that is not one token, two tokens missing for the reranker, tokens
    without a method, an unknown method: ValueError naming the field."""
    from vllm.config import ModelConfig
    from vllm.model_executor.model_loader import hf_config_of

    path = str(reranker[0])

    def read(overrides: dict):
        return hf_config_of(ModelConfig(model=path, hf_overrides=overrides))

    config = read(RERANKER)
    assert (config.method, config.num_labels, config.use_sep_token) == (
        "from_2_way_softmax", 1, False)  # fmt: skip
    with pytest.raises(ValueError, match="classifier_from_token: 'hello world' is not one"):
        read({**RERANKER, "classifier_from_token": ["no", "hello world"]})
    with pytest.raises(ValueError, match="is_original_qwen3_reranker needs classifier_from"):
        read({**RERANKER, "classifier_from_token": ["yes"]})
    with pytest.raises(ValueError, match="classifier_from_token needs a method"):
        read({"classifier_from_token": ["yes"]})
    with pytest.raises(ValueError, match="method must be one of"):
        read({"classifier_from_token": ["yes"], "method": "softmax"})
