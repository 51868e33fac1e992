"""A token-based classifier's configuration (vLLM's ``classifier_from_token``, set with
--hf-overrides), resolved on the HF config as the config is read (``hf_config_of``): no
torch here, so the front end reads it cheaply. ``adapters.as_seq_cls_model`` builds the
head it describes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# vLLM's ways of building a classifier's head from a causal model's output head.
FROM_2_WAY_SOFTMAX = "from_2_way_softmax"
TOKEN_CLASSIFIER_METHODS = (FROM_2_WAY_SOFTMAX, "no_post_processing")


def config_value(hf_config: Any, name: str) -> Any:
    """``name`` on the config, else on its text config (upstream reads both)."""
    value = getattr(hf_config, name, None)
    if value is None and hasattr(hf_config, "get_text_config"):
        value = getattr(hf_config.get_text_config(), name, None)
    return value


def _setconfig_value(hf_config: Any, name: str, value: Any) -> None:
    setattr(hf_config, name, value)
    if hasattr(hf_config, "get_text_config"):
        setattr(hf_config.get_text_config(), name, value)


def _token_id(tokenizer: Any, token: Any, vocab_size: int | None) -> int:
    """The id of the vocabulary entry ``token``; ValueError naming classifier_from_token
    when it is not one token of the tokenizer."""
    tid = tokenizer.convert_tokens_to_ids(token) if isinstance(token, str) else None
    unknown = tid == getattr(tokenizer, "unk_token_id", None) and token != tokenizer.unk_token
    if tid is None or unknown or (vocab_size is not None and not 0 <= tid < vocab_size):
        raise ValueError(
            f"classifier_from_token: {token!r} is not one token of the model's tokenizer "
            "(each entry must be a single vocabulary entry, e.g. 'yes')"
        )
    return tid


def verify_token_classifier(hf_config: Any, tokenizer_of: Callable[[], Any]) -> None:
    """Resolve a token-based classifier on ``hf_config`` in place (vLLM's
    ``verify_and_update_config`` for it): ``is_original_qwen3_reranker`` sets ``method``
    ``from_2_way_softmax``; with a ``method``, ``num_labels`` becomes 1 (2-way softmax)
    or the token count, ``classifier_from_token_ids`` the tokens' ids (``tokenizer_of()``
    is called only then) and ``use_sep_token`` defaults to off (an LLM reads a pair as
    one text). A config naming neither is left alone. ValueError naming the field for a
    malformed one."""
    tokens = config_value(hf_config, "classifier_from_token")
    if config_value(hf_config, "is_original_qwen3_reranker"):
        if not isinstance(tokens, list | tuple) or len(tokens) != 2:
            raise ValueError(
                "is_original_qwen3_reranker needs classifier_from_token: the reranker's "
                f'two answer tokens, ["no", "yes"]; got {tokens!r}'
            )
        _setconfig_value(hf_config, "method", FROM_2_WAY_SOFTMAX)
    method = config_value(hf_config, "method")
    if method is None:
        if tokens is not None:
            raise ValueError(
                f"classifier_from_token needs a method: one of {list(TOKEN_CLASSIFIER_METHODS)}"
                " (or is_original_qwen3_reranker), e.g. in --hf-overrides"
            )
        return
    if method not in TOKEN_CLASSIFIER_METHODS:
        raise ValueError(f"method must be one of {list(TOKEN_CLASSIFIER_METHODS)}, got {method!r}")
    if not isinstance(tokens, list | tuple) or not tokens:
        raise ValueError(f"method {method!r} needs classifier_from_token: a list of tokens")
    if method == FROM_2_WAY_SOFTMAX and len(tokens) != 2:
        raise ValueError(
            f"classifier_from_token must name two tokens (false, true) for {method}, got {tokens!r}"
        )
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    tokenizer = tokenizer_of()
    ids = [_token_id(tokenizer, t, getattr(text, "vocab_size", None)) for t in tokens]
    _setconfig_value(hf_config, "classifier_from_token_ids", ids)
    _setconfig_value(hf_config, "num_labels", 1 if method == FROM_2_WAY_SOFTMAX else len(ids))
    sep = config_value(hf_config, "use_sep_token")
    _setconfig_value(hf_config, "use_sep_token", bool(sep))
