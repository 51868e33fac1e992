"""The pooling runner's heads (vLLM's ``layers/pooler``): what one prompt's last row
becomes.

- embed: the final-norm hidden state in fp32, L2-normalised by its activation;
- classify: the model's ``score`` head over it (``compute_scores``: fp32 logits,
  ``(rows, num_labels)``), calibrated ``(logit - logit_mean) / logit_sigma`` and then
  activated as transformers trains the head (``classify_activation``): softmax over the
  labels, a sigmoid for one label or a multi-label problem, nothing for a regression.

A request may turn the activation off (``use_activation=False``, vLLM's request field),
which leaves the calibrated logits (or the raw hidden state).
"""

from __future__ import annotations

from typing import Any, Literal

import torch

Activation = Literal["softmax", "sigmoid", "identity"]

# sentence-transformers cross-encoders name their activation in the config (vLLM reads it
# too); the ones a classifier may name, by class.
_NAMED_ACTIVATIONS: dict[str, Activation] = {
    "torch.nn.modules.linear.Identity": "identity",
    "torch.nn.modules.activation.Sigmoid": "sigmoid",
    "torch.nn.modules.activation.Softmax": "softmax",
}


def classify_activation(hf_config: Any) -> Activation:
    """The activation of a classifier's logits, as vLLM chooses it from the HF config:
    its ``problem_type`` (transformers' loss: regression, single- or multi-label), else
    a sentence-transformers activation it names, else softmax (sigmoid for one label).
    ValueError for an activation it names that is not one of torch's three above."""
    problem = getattr(hf_config, "problem_type", None)
    if problem == "regression":
        return "identity"
    if problem == "multi_label_classification":
        return "sigmoid"
    if problem != "single_label_classification":
        st = getattr(hf_config, "sentence_transformers", None)
        name = st.get("activation_fn") if isinstance(st, dict) else None
        name = name or getattr(hf_config, "sbert_ce_default_activation_function", None)
        if name is not None:
            if name not in _NAMED_ACTIVATIONS:
                raise ValueError(
                    f"the model's config names the activation {name!r}; this engine takes "
                    f"{sorted(_NAMED_ACTIVATIONS)}"
                )
            return _NAMED_ACTIVATIONS[name]
    return "softmax" if getattr(hf_config, "num_labels", 2) >= 2 else "sigmoid"


def activate(values: torch.Tensor, activation: Activation | Literal["normalize"]) -> torch.Tensor:
    """(rows, n) fp32 -> (rows, n): each row through ``activation``."""
    if activation == "normalize":
        return torch.nn.functional.normalize(values, p=2, dim=-1)
    if activation == "softmax":
        return torch.softmax(values, dim=-1)
    if activation == "sigmoid":
        return torch.sigmoid(values)
    return values


def pool_rows(
    model: Any,
    rows: torch.Tensor,
    use_activation: list[bool],
    activation: Activation | Literal["normalize"],
    calibration: tuple[float, float] | None = None,
) -> list[list[float]]:
    """Each request's pooled values from its last row (``rows``: (requests, hidden)):
    classify when ``calibration`` (logit_mean, logit_sigma) is given, embed otherwise;
    row ``i`` activated when ``use_activation[i]``."""
    if calibration is None:
        values = rows.float()
    else:
        values = model.compute_scores(rows)  # (requests, num_labels), fp32
        mean, sigma = calibration
        if (mean, sigma) != (0.0, 1.0):
            values = (values - mean) / sigma
    if all(use_activation):
        values = activate(values, activation)
    elif any(use_activation):
        mask = torch.tensor(use_activation, device=values.device).unsqueeze(-1)
        values = torch.where(mask, activate(values, activation), values)
    return values.cpu().tolist()


# Where a pooling request's own use_activation travels (SamplingParams.extra_args).
USE_ACTIVATION = "use_activation"


def pooling_use_activation(params: Any, default: bool) -> bool:
    """The request's ``use_activation`` (its ``extra_args``), else ``default``."""
    value = (getattr(params, "extra_args", None) or {}).get(USE_ACTIVATION)
    return default if value is None else bool(value)
