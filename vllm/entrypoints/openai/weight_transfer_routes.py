"""vLLM's RL weight-sync routes (``VLLM_SERVER_DEV_MODE=1``; the engine's end is
``vllm.v1.engine.weight_sync``, the trainer's ``vllm.distributed.weight_transfer``)."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, StrictStr

from vllm.entrypoints.openai import openapi
from vllm.entrypoints.openai.weight_transfer_metrics import weight_transfer_metrics
from vllm.exceptions import VLLMValidationError


class _StrictBody(BaseModel):
    """A dev-mode route's JSON body: an unknown field or a wrong type is a 400 naming it."""

    model_config = ConfigDict(extra="forbid", strict=True)


class InitWeightTransferRequest(_StrictBody):
    """``POST /init_weight_transfer_engine``: the backend's options for the engine's side
    of the process group (gloo/nccl: ``master_address``, ``master_port``,
    ``rank_offset``, ``world_size``); the engine checks them (400)."""

    init_info: dict[str, Any]


class UpdateWeightsRequest(_StrictBody):
    """``POST /update_weights``: what the trainer broadcasts next (gloo/nccl: ``names``,
    ``dtype_names``, ``shapes``); the engine receives it while the trainer sends."""

    update_info: dict[str, Any]


class FinishWeightUpdateRequest(_StrictBody):
    """``POST /finish_weight_update`` (the body may be absent): the version the new
    weights are; none keeps the current one."""

    weight_version: StrictStr | None = None


class UpdateWeightVersionRequest(_StrictBody):
    """``POST /update_weight_version``: the version /weight_info answers from now on."""

    new_version: StrictStr


class WeightCheckerRequest(_StrictBody):
    """``POST /weight_checker``: checksum (each parameter's sha256), reset (every parameter
    zeroed) or compare (the checksums against ``baseline``, a checksum answer's)."""

    action: Literal["checksum", "reset", "compare"]
    baseline: dict[StrictStr, StrictStr] | None = None


def add_weight_transfer_routes(app: FastAPI, vllm_config, engine, stats) -> None:
    """vLLM's RL weight sync (dev mode; the engine needs --weight-transfer-config): after
    /pause, the trainer calls /start_weight_update, then /update_weights while it
    broadcasts the tensors over the process group /init_weight_transfer_engine opened,
    then /finish_weight_update, then /resume. The engine answers a wrong order or a bad
    ``init_info`` / ``update_info`` with a ValueError: a 400. The five transfer calls are
    timed in ``vllm:rl_weight_update_operation_duration_seconds``."""
    metrics = weight_transfer_metrics(stats.registry)
    responses = openapi.WEIGHT_TRANSFER_RESPONSES

    @app.post("/init_weight_transfer_engine", responses=responses)
    async def init_weight_transfer_engine(request: InitWeightTransferRequest):
        """Open the engine's side of the trainer's process group (the trainer joins it at
        the same time, as rank 0)."""
        with metrics.record("init"):
            await engine.init_weight_transfer_engine(request.init_info)
        return {"message": "Weight transfer initialized"}

    @app.post("/shutdown_weight_transfer_engine", responses=responses)
    async def shutdown_weight_transfer_engine():
        with metrics.record("shutdown"):
            await engine.shutdown_weight_transfer_engine()
        return {"message": "Weight transfer shut down"}

    @app.post("/start_weight_update", responses=responses)
    async def start_weight_update():
        with metrics.record("start"):
            await engine.start_weight_update()
        return {"message": "Weight update started"}

    @app.post("/update_weights", responses=responses)
    async def update_weights(request: UpdateWeightsRequest):
        """Answers once the engine has received the tensors ``update_info`` describes
        (they are swapped in by /finish_weight_update)."""
        with metrics.record("update"):
            await engine.update_weights(request.update_info)
        return {"message": "Weights updated"}

    @app.post("/finish_weight_update", responses=responses)
    async def finish_weight_update(request: FinishWeightUpdateRequest | None = None):
        """The update is complete: the new weights serve from the next step on, as
        ``weight_version`` when given."""
        version = None if request is None else request.weight_version
        with metrics.record("finish"):
            await engine.finish_weight_update(version)
        return {"message": "Weight update finished"}

    @app.post("/update_weight_version", responses=responses)
    async def update_weight_version(request: UpdateWeightVersionRequest):
        await engine.update_weight_version(request.new_version)
        return {"success": True, "new_version": request.new_version}

    @app.get("/weight_info", responses=responses)
    async def weight_info():
        """The served weights' version: "default" until an update names one."""
        return {"weight_version": await engine.get_weight_version()}

    @app.post("/weight_checker", responses=responses)
    async def weight_checker(request: WeightCheckerRequest):
        """checksum: {"checksums": {name: sha256}}; reset: every parameter zeroed;
        compare: {"match", "mismatches"} (the sorted names whose checksum differs from
        the baseline's or is on one side only). compare without baseline is a 400."""
        if request.action == "reset":
            await engine.reset_weights()
            return {"status": "reset"}
        if request.action == "compare" and request.baseline is None:
            raise VLLMValidationError(
                "action 'compare' needs a 'baseline' (a checksum answer's checksums)",
                "baseline",
            )
        checksums = await engine.compute_weight_checksums()
        if request.action == "checksum":
            return {"checksums": checksums}
        baseline = request.baseline or {}
        names = checksums.keys() | baseline.keys()
        mismatches = sorted(n for n in names if checksums.get(n) != baseline.get(n))
        return {"match": not mismatches, "mismatches": mismatches}

    @app.get("/get_world_size", responses=responses)
    async def get_world_size(include_dp: bool = True):
        """The engine's devices: tensor x pipeline parallel, times data parallel with
        ``include_dp`` (true by default, as vLLM's)."""
        parallel = vllm_config.parallel_config
        size = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
        if include_dp:
            size *= parallel.data_parallel_size
        return {"world_size": size}
