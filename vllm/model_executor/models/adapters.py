"""A causal model as a sequence classifier (vLLM's ``as_seq_cls_model``).

transformers' ``*ForSequenceClassification`` decoders are the causal backbone and a
``score`` linear layer (hidden -> ``num_labels``, without a bias) read at the last
token's final-norm hidden state. ``as_seq_cls_model(cls)`` is ``cls`` with that head:
the same forward (the runner pools its rows), ``compute_scores(hidden)`` for the head,
and ``load_weights`` taking the checkpoint's ``score.weight`` (and ``score.bias`` where
one has it) beside the backbone's. The model's arch gains ``num_labels``
(``arch_from_hf``), so ``cls(arch)`` builds the head of the right size; its output head
(``lm_head``) is tied to the embeddings: such a checkpoint has none and nothing reads it.

The registry names the classes below for transformers' architectures; ``--convert
classify`` wraps a ``*ForCausalLM`` class the same way (its checkpoint must hold a
``score.weight``).

A token-based classifier (vLLM's ``classifier_from_token``, set with --hf-overrides) is a
*causal* checkpoint served as one: its head is built from the output head's rows of the
named tokens (``token_classifier`` resolves them on the HF config). ``method``
``from_2_way_softmax`` (``["no", "yes"]``): one row ``lm_head[yes] - lm_head[no]``, so
the sigmoid of the score is the softmax of the two tokens' logits (Qwen3-Reranker);
``no_post_processing``: one row per token. ``is_original_qwen3_reranker`` implies the
first with its two tokens.
"""

from __future__ import annotations

import functools
from dataclasses import field, fields, make_dataclass
from typing import Any

import torch
from torch import nn

from vllm.model_executor.models.gemma import GemmaForCausalLM
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.moe import MoeForCausalLM
from vllm.model_executor.models.token_classifier import FROM_2_WAY_SOFTMAX, config_value


def num_labels_of(hf_config: Any) -> int:
    """The classes the head scores: the config's ``num_labels`` (transformers derives it
    from ``id2label``; 2 by default). ValueError naming it when it is not >= 1."""
    n = getattr(hf_config, "num_labels", None)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"num_labels must be an integer >= 1 in the model's config, got {n!r}")
    return n


@functools.cache
def _labelled_arch_class(arch_cls: type) -> type:
    """``arch_cls`` (a frozen dataclass) with a ``num_labels`` field and the token-based
    head's plan (``score_token_ids``, ``score_method``; empty for a checkpoint's head)."""
    name = arch_cls.__name__.removesuffix("Arch") + "SeqClsArch"
    spec = [
        ("num_labels", int, field(default=2, kw_only=True)),
        ("score_token_ids", tuple[int, ...], field(default=(), kw_only=True)),
        ("score_method", str | None, field(default=None, kw_only=True)),
    ]
    return make_dataclass(name, spec, bases=(arch_cls,), frozen=True)


def with_num_labels(arch: Any, num_labels: int, hf_config: Any = None) -> Any:
    """``arch`` as its labelled class, its output head tied (no ``lm_head`` to load);
    a token-based classifier's plan read from ``hf_config`` (``verify_token_classifier``
    must have resolved it)."""
    values = {f.name: getattr(arch, f.name) for f in fields(arch) if f.init}
    values["tie_word_embeddings"] = True
    method = None if hf_config is None else config_value(hf_config, "method")
    ids = None if hf_config is None else config_value(hf_config, "classifier_from_token_ids")
    if method is not None and ids is None:
        raise ValueError(
            f"method {method!r}: classifier_from_token is not resolved to token ids "
            "(read the config through hf_config_of)"
        )
    return _labelled_arch_class(type(arch))(
        **values, num_labels=num_labels, score_token_ids=tuple(ids or ()), score_method=method
    )


def score_from_lm_head(lm_head: torch.Tensor, token_ids: tuple[int, ...], method: str):
    """(num_labels, hidden) fp32 head from the (vocab, hidden) output head's rows of
    ``token_ids``: their difference (true - false) for the 2-way softmax."""
    rows = lm_head[list(token_ids)].float()
    return rows[1:2] - rows[0:1] if method == FROM_2_WAY_SOFTMAX else rows


@functools.cache
def as_seq_cls_model(cls: type) -> type:
    """``cls`` (a causal model class) with transformers' sequence-classification head."""
    if getattr(cls, "is_classifier", False):
        return cls

    class ModelForSequenceClassification(cls):
        is_classifier = True

        @staticmethod
        def arch_from_hf(hf_config: Any) -> Any:
            arch = cls.arch_from_hf(hf_config)
            return with_num_labels(arch, num_labels_of(hf_config), hf_config)

        def __init__(self, arch: Any) -> None:
            super().__init__(arch)
            self.score = nn.Linear(arch.hidden_size, arch.num_labels, bias=False)

        @torch.inference_mode()
        def compute_scores(self, hidden: torch.Tensor) -> torch.Tensor:
            """(rows, hidden) final hidden states -> (rows, num_labels) fp32 logits."""
            return self.score(hidden.to(self.score.weight.dtype)).float()

        def load_weights(self, sd: dict[str, torch.Tensor]) -> None:
            sd = dict(sd)
            if self.arch.score_method is not None:
                return self._load_token_classifier(sd)
            weight = sd.pop("score.weight", None)
            bias = sd.pop("score.bias", None)
            if weight is None:
                raise ValueError(
                    "the checkpoint has no score.weight (the classification head): a "
                    "*ForCausalLM checkpoint cannot be served with --convert classify "
                    "unless it holds one"
                )
            if tuple(weight.shape) != tuple(self.score.weight.shape):
                raise ValueError(
                    f"score.weight has shape {list(weight.shape)}, expected "
                    f"{list(self.score.weight.shape)} (num_labels x hidden_size)"
                )
            super().load_weights(sd)
            with torch.no_grad():
                self.score.weight.copy_(weight)
                if bias is not None:
                    w = self.score.weight
                    self.score.bias = nn.Parameter(bias.to(w.device, w.dtype), requires_grad=False)

        def _load_token_classifier(self, sd: dict[str, torch.Tensor]) -> None:
            """A causal checkpoint's weights, its head from the output head's rows (the
            embedding matrix where the checkpoint ties them)."""
            lm_head = sd.pop("lm_head.weight", None)
            for name in ("score.weight", "score.bias"):  # replaced by the tokens' rows
                sd.pop(name, None)
            super().load_weights(sd)
            if lm_head is None:
                lm_head = self.embed_tokens.weight
            a = self.arch
            with torch.no_grad():
                self.score.weight.copy_(
                    score_from_lm_head(lm_head, a.score_token_ids, a.score_method)
                )

    name = cls.__name__.removesuffix("ForCausalLM") + "ForSequenceClassification"
    ModelForSequenceClassification.__name__ = ModelForSequenceClassification.__qualname__ = name
    return ModelForSequenceClassification


LlamaForSequenceClassification = as_seq_cls_model(LlamaForCausalLM)
GemmaForSequenceClassification = as_seq_cls_model(GemmaForCausalLM)
MoeForSequenceClassification = as_seq_cls_model(MoeForCausalLM)
