"""The engine core's side of ``--kv-transfer-config`` (disaggregated prefill): it builds the
connector (``vllm.distributed.kv_transfer.connector``) and calls it around each step."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.connector import (
    KVTransferConnector,
    check_transfer_params,
    transfer_params,
)
from vllm.v1.engine import EngineCoreRequestError
from vllm.v1.request import Request, RequestStatus

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output.ahead import PendingGrammars
    from vllm.v1.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class KVTransferMixin:
    """``EngineCore``'s disaggregated prefill; ``kv_connector`` is None without the flag."""

    vllm_config: VllmConfig
    scheduler: Scheduler
    model_runner: ModelRunner
    grammars: PendingGrammars
    kv_connector: KVTransferConnector | None = None

    def _check_kv_transfer_model(self) -> None:
        """Before the tier is sized: P/D moves one full-attention KV cache."""
        if not self.vllm_config.kv_transfer_config.enabled:
            return
        runner = self.model_runner
        windows = list(runner.kv_cache_windows)
        if runner.recurrent_specs is not None or windows != [None] * len(windows) or not windows:
            raise ValueError(
                "--kv-transfer-config: disaggregated prefill moves one full-attention KV "
                "cache; this model has sliding-window, recurrent or no attention layers"
            )
        if len(windows) > 1:
            raise ValueError(
                "--kv-transfer-config: models with several KV cache groups are not supported"
            )

    def _init_kv_transfer(self) -> None:
        config = self.vllm_config.kv_transfer_config
        if not config.enabled:
            return
        kvm = self.scheduler.kv_cache_manager
        runner = self.model_runner
        if kvm.offload is None or runner.kv_offload is None:
            raise ValueError(
                "--kv-transfer-config moves blocks through the CPU KV tier: drop "
                "--kv-offloading-size 0 (unset, the engine sizes one)"
            )
        self.kv_connector = KVTransferConnector(
            config,
            kvm,
            lambda: runner.kv_offload,  # replaced by a wake-up from sleep
            self.vllm_config.cache_config.block_size,
            self._admit,
            self.scheduler.clock,
        )
        self.scheduler.kv_transfer = self.kv_connector

    def _admit(self, request: Request) -> None:
        if not self.grammars.hold(request):
            self.scheduler.add_request(request)

    def _take_for_transfer(self, request: Request) -> bool:
        """ValueError for kv_transfer_params this engine cannot serve; True when the
        connector took the request (its blocks are being fetched)."""
        config = self.vllm_config.kv_transfer_config
        params = transfer_params(request)
        check_transfer_params(params, config.is_producer, config.is_consumer)
        if self.kv_connector is None or not (params or {}).get("do_remote_prefill"):
            return False
        self.scheduler.check_request(request)  # before its blocks travel for nothing
        return self.kv_connector.maybe_fetch(request)

    def _kv_transfer_before_step(self, outputs_errors: list[EngineCoreRequestError]) -> None:
        if self.kv_connector is None:
            return
        idle = not self.scheduler.has_work() and not len(self.grammars)
        for rid, message, internal in self.kv_connector.before_step(idle):
            # A failed fetch: the servers' side failed, not the request's values (a 500).
            outputs_errors.append(EngineCoreRequestError(rid, message, internal=internal))

    def _kv_transfer_after_step(self) -> None:
        if self.kv_connector is None:
            return
        requests = self.scheduler.requests

        def settled(rid: str) -> bool:  # scheduled (its loads planned) or gone
            request = requests.get(rid)
            return request is None or request.status != RequestStatus.WAITING

        self.kv_connector.after_step(settled, self._run_kv_plan)

    def _run_kv_plan(self) -> None:
        """Run the copies planned since the last step now (a producer's saves)."""
        kvm = self.scheduler.kv_cache_manager
        transfers = kvm.take_kv_transfers()
        if not transfers:
            return
        try:
            self.model_runner.transfer_kv(transfers)
        except Exception:
            kvm.discard_kv_saves(transfers)
            raise

    def _cancel_fetches(self, request_ids: list[str]) -> list[str]:
        return self.kv_connector.cancel(request_ids) if self.kv_connector else []
