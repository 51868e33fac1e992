"""The engine core's RL weight-sync calls (vLLM's weight-transfer API), a mixin of
``EngineCore``: each runs between two steps, as a utility call of the engine process."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.v1.worker.weight_update import WeightUpdater

logger = logging.getLogger(__name__)

DEFAULT_WEIGHT_VERSION = "default"  # vLLM's, before any update names one


class WeightSyncMixin:
    """``init_weight_transfer_engine`` .. ``finish_weight_update`` and the weight version.
    ``ValueError`` for a call out of order or without --weight-transfer-config."""

    _weight_updater: WeightUpdater | None = None
    _weight_version: str = DEFAULT_WEIGHT_VERSION

    def _updater(self) -> WeightUpdater:
        if self._weight_updater is None:
            config = self.vllm_config.weight_transfer_config
            if not config.enabled:
                raise ValueError(
                    "weight transfer is off: start the engine with --weight-transfer-config "
                    '\'{"backend": "gloo"}\' (LLM(weight_transfer_config={"backend": "gloo"}))'
                )
            from vllm import envs
            from vllm.v1.worker.weight_update import WeightUpdater

            runner = self.model_runner
            self._weight_updater = WeightUpdater(
                runner,
                config.backend_for(runner.device.type),
                dp_rank=envs.VLLM_DP_RANK,
                dp_size=self.vllm_config.parallel_config.data_parallel_size,
            )
        return self._weight_updater

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Join the trainer's group (blocks until it joins too, or its timeout). With data
        parallelism every rank's engine joins, as rank ``rank_offset`` + its DP rank."""
        self._updater().init(init_info)

    def shutdown_weight_transfer_engine(self) -> None:
        self._updater().shutdown()

    def start_weight_update(self) -> None:
        self._updater().start()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._updater().update(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Swap the round's weights in; then no KV computed by the old ones may be hit
        again: Continuum's pins are released and the prefix cache (and CPU tier) emptied.
        Requests still holding blocks (a "keep" pause, or no pause) go on with theirs,
        and then the cache cannot be emptied: a warning says so (pause first)."""
        self._updater().finish()
        if weight_version is not None:
            self.set_weight_version(weight_version)
        self.scheduler.pins.release_all(self.clock())
        if not self.reset_prefix_cache():
            logger.warning(
                "Weight update: the prefix cache was not emptied (running requests hold "
                "blocks); cached prefixes of the old weights may be hit. Pause with "
                "mode abort or wait before an update to avoid this"
            )

    def set_weight_version(self, weight_version: str) -> None:
        if not isinstance(weight_version, str):
            raise ValueError(f"weight_version must be a string, got {weight_version!r}")
        self._weight_version = weight_version

    def get_weight_version(self) -> str:
        return self._weight_version

    def compute_weight_checksums(self) -> dict[str, str]:
        """sha256 of each parameter of the served model, by checkpoint-style name."""
        from vllm.v1.worker.weight_update import weight_digests

        if self.model_runner.model is None:
            raise ValueError("the engine has no weights loaded (asleep at level 2?)")
        return weight_digests(self.model_runner.model)

    def reset_weights(self) -> None:
        """Zero every parameter (vLLM's weight_checker "reset", for testing a sync)."""
        import torch

        if self.model_runner.model is None:
            raise ValueError("the engine has no weights loaded (asleep at level 2?)")
        with torch.no_grad():
            for param in self.model_runner.model.parameters():
                param.zero_()
        self.reset_prefix_cache()
