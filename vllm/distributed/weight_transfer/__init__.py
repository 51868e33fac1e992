"""RL weight sync (vLLM's weight-transfer API): a trainer pushes new weights into a running
engine. The trainer's end is here; the engine's is ``vllm.v1.worker.weight_update``.

    client = HTTPVLLMWeightSyncClient("http://127.0.0.1:8000")
    trainer = GlooTrainerWeightTransferEngine.trainer_init(
        GlooTrainerInitInfo(master_address="127.0.0.1", master_port=29600),
        client=client, source=ModuleSource(model))
    trainer.send_weights(weight_version="step-1")
"""

from vllm.distributed.weight_transfer.base import (
    ModuleSource,
    ParamMeta,
    WeightSource,
    WeightTransferInitInfo,
)
from vllm.distributed.weight_transfer.clients import (
    HTTPVLLMWeightSyncClient,
    LLMWeightSyncClient,
    WeightSyncError,
)
from vllm.distributed.weight_transfer.torch_group import (
    GlooTrainerInitInfo,
    GlooTrainerWeightTransferEngine,
    NCCLTrainerInitInfo,
    NCCLTrainerWeightTransferEngine,
    TorchGroupTrainer,
    TrainerInitInfo,
    VLLMWeightSyncClient,
)

__all__ = [
    "GlooTrainerInitInfo",
    "GlooTrainerWeightTransferEngine",
    "HTTPVLLMWeightSyncClient",
    "LLMWeightSyncClient",
    "ModuleSource",
    "NCCLTrainerInitInfo",
    "NCCLTrainerWeightTransferEngine",
    "ParamMeta",
    "TorchGroupTrainer",
    "TrainerInitInfo",
    "VLLMWeightSyncClient",
    "WeightSource",
    "WeightSyncError",
    "WeightTransferInitInfo",
]
