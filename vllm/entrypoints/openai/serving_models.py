"""The models a server answers to (vLLM's ``OpenAIServingModels``): the base model under
its served name and each LoRA adapter under its own.

A request's ``model`` picks the adapter (``lora_request``); a name the server does not
serve is a 404 ``model_not_found``. ``--lora-modules`` adapters are checked at start-up;
with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` set, ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` add and remove adapters while the server runs. Each adapter
gets a new ``lora_int_id``, so one loaded again under an old name is read afresh.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from vllm.exceptions import VLLMValidationError
from vllm.lora.peft import read_adapter_config
from vllm.lora.request import LoRARequest


@dataclass(frozen=True)
class LoRAModulePath:
    """One ``--lora-modules`` entry: ``name=path`` or JSON ``{"name", "path",
    "base_model_name"}``."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModulePath:
    """``name=path`` or a JSON object -> ``LoRAModulePath`` (ValueError saying the forms)."""
    forms = "expected name=path or a JSON object with name and path"
    if text.lstrip().startswith("{"):
        try:
            entry = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-modules {text!r}: {e}; {forms}") from None
        unknown = set(entry) - {"name", "path", "base_model_name"}
        if unknown or not entry.get("name") or not entry.get("path"):
            raise ValueError(f"--lora-modules {text!r}: {forms} (and base_model_name)")
        return LoRAModulePath(entry["name"], entry["path"], entry.get("base_model_name"))
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {text!r}: {forms}")
    return LoRAModulePath(name, path)


class OpenAIServingModels:
    def __init__(
        self,
        base_model_name: str,
        max_model_len: int | None = None,
        lora_modules: tuple[LoRAModulePath, ...] = (),
        enable_lora: bool = False,
        max_lora_rank: int = 16,
        aliases: tuple[str, ...] = (),
    ) -> None:
        self.base_model_name = base_model_name
        # Every name of the base model (--served-model-name may give several).
        self.base_names = {base_model_name, *aliases}
        self.max_model_len = max_model_len
        self.enable_lora = enable_lora
        self.max_lora_rank = max_lora_rank
        self.lora_requests: dict[str, LoRARequest] = {}
        self._next_id = 1
        if lora_modules and not enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        for module in lora_modules:
            self._add(module.name, module.path, module.base_model_name)

    def _add(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        if name in self.base_names or name in self.lora_requests:
            raise VLLMValidationError(
                f"The lora adapter '{name}' has already been loaded.", "lora_name"
            )
        read_adapter_config(path, self.max_lora_rank)  # ValueError naming the problem
        lora = LoRARequest(name, self._next_id, path, base_model_name or self.base_model_name)
        self._next_id += 1
        self.lora_requests[name] = lora
        return lora

    def lora_request(self, model: str | None) -> LoRARequest | None:
        """The adapter ``model`` names; None for the base model (or no model given).
        404 ``model_not_found`` for a name this server does not serve."""
        if model is None or model in self.base_names:
            return None
        lora = self.lora_requests.get(model)
        if lora is None:
            raise VLLMValidationError(
                f"The model `{model}` does not exist.", "model", code="model_not_found"
            )
        return lora

    def model_cards(self) -> list[Any]:
        """``/v1/models``: the base model, then each adapter (its ``parent`` the base, its
        ``root`` the adapter's folder, as vLLM lists them)."""
        from vllm.entrypoints.openai.protocol import ModelCard

        cards = [ModelCard(id=self.base_model_name, max_model_len=self.max_model_len)]
        cards += [
            ModelCard(id=name, root=lora.lora_path, parent=lora.base_model_name,
                      max_model_len=self.max_model_len)
            for name, lora in self.lora_requests.items()
        ]  # fmt: skip
        return cards

    def load_lora_adapter(self, name: str | None, path: str | None) -> str:
        if not self.enable_lora:
            raise VLLMValidationError("LoRA is not enabled (--enable-lora)", "lora_name")
        if not name or not path:
            raise VLLMValidationError(
                "Both 'lora_name' and 'lora_path' must be provided.", "lora_name"
            )
        try:
            self._add(name, path)
        except VLLMValidationError:
            raise
        except ValueError as e:
            raise VLLMValidationError(str(e), "lora_path") from e
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload_lora_adapter(self, name: str | None) -> str:
        if not name:
            raise VLLMValidationError("'lora_name' needs to be provided.", "lora_name")
        if self.lora_requests.pop(name, None) is None:
            raise VLLMValidationError(
                f"The lora adapter '{name}' cannot be found.", "lora_name", code="not_found"
            )
        return f"Success: LoRA adapter '{name}' removed successfully."
