"""``VLLMWeightSyncClient``s: how a trainer reaches the engine's control calls."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.entrypoints.llm import LLM


class WeightSyncError(RuntimeError):
    """The engine refused a weight-sync call (its message is the engine's)."""


class HTTPVLLMWeightSyncClient:
    """A ``vllm serve`` started with ``VLLM_SERVER_DEV_MODE=1`` and
    ``--weight-transfer-config``, at ``base_url`` (its root, not ``/v1``)."""

    def __init__(self, base_url: str, timeout: float = 300, api_key: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def _post(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        import requests

        response = requests.post(
            f"{self.base_url}/{path}", json=body, headers=self.headers, timeout=self.timeout
        )
        if response.status_code >= 400:
            try:
                detail = response.json()
                detail = detail.get("error", detail).get("message", detail)
            except (ValueError, AttributeError):
                detail = response.text
            raise WeightSyncError(f"/{path}: {response.status_code}: {detail}")
        return response.json() if response.content else {}

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._post("init_weight_transfer_engine", {"init_info": init_info})

    def shutdown_weight_transfer_engine(self) -> None:
        self._post("shutdown_weight_transfer_engine")

    def start_weight_update(self) -> None:
        self._post("start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._post("update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        body = None if weight_version is None else {"weight_version": weight_version}
        self._post("finish_weight_update", body)


class LLMWeightSyncClient:
    """An offline ``LLM`` in this process (``LLM(weight_transfer_config=...)``)."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.shutdown_weight_transfer_engine()

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)
