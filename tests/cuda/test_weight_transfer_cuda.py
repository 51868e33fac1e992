"""RL weight sync into an engine on CUDA: a gloo round from a CPU trainer into a bf16
engine with its CUDA graphs (the copies keep the graphs' addresses, so the replayed steps
read the new weights), checked against a fresh engine started on the trained checkpoint;
and an NCCL round from a trainer on a second GPU. The CPU tests are in
tests/distributed/test_weight_transfer.py.

Run with ``pytest -m cuda tests`` on a CUDA machine; skipped without one.
"""

from __future__ import annotations

import threading

import pytest
import torch

from tests.distributed.test_weight_transfer import PROMPTS, free_port, greedy, new_weights
from vllm.distributed.weight_transfer import (
    GlooTrainerInitInfo,
    GlooTrainerWeightTransferEngine,
    LLMWeightSyncClient,
    ModuleSource,
    NCCLTrainerInitInfo,
    NCCLTrainerWeightTransferEngine,
)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def cuda_llm(path, backend: str):
    from vllm import LLM

    return LLM(model=str(path), dtype="bfloat16", skip_tokenizer_init=True, max_model_len=128,
               num_gpu_blocks_override=64, enable_prefix_caching=True,
               weight_transfer_config={"backend": backend})  # fmt: skip


@pytest.fixture
def checkpoints(tmp_path):
    """A tiny Llama and its trained copy, both saved."""
    import transformers

    from tests.tiny_models import save_tiny_llama

    save_tiny_llama(tmp_path / "base")
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "base").eval()
    trained = new_weights(hf, seed=5)
    trained.save_pretrained(tmp_path / "trained")
    return tmp_path / "base", tmp_path / "trained", trained


def expected_greedy(path) -> list[list[int]]:
    llm = cuda_llm(path, "gloo")
    try:
        return greedy(llm)
    finally:
        llm.shutdown()


def test_a_gloo_round_reaches_the_graphs_of_a_cuda_engine(checkpoints):
    base, trained_path, trained = checkpoints
    want = expected_greedy(trained_path)
    llm = cuda_llm(base, "gloo")
    try:
        before = greedy(llm)
        assert before != want
        trainer = GlooTrainerWeightTransferEngine.trainer_init(
            GlooTrainerInitInfo(master_address="127.0.0.1", master_port=free_port()),
            client=LLMWeightSyncClient(llm), source=ModuleSource(trained),
        )  # fmt: skip
        trainer.send_weights(weight_version="v1")
        assert greedy(llm) == want  # the decode graphs replay over the new weights
        trainer.shutdown()
        llm.shutdown_weight_transfer_engine()
    finally:
        llm.shutdown()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs a second GPU for the trainer")
def test_an_nccl_round_from_a_trainer_on_another_gpu(checkpoints):
    base, trained_path, trained = checkpoints
    want = expected_greedy(trained_path)
    llm = cuda_llm(base, "nccl")  # on cuda:0
    errors: list[BaseException] = []

    def train():
        try:
            torch.cuda.set_device(1)
            model = trained.to("cuda:1")
            trainer = NCCLTrainerWeightTransferEngine.trainer_init(
                NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=free_port()),
                client=LLMWeightSyncClient(llm), source=ModuleSource(model),
            )  # fmt: skip
            trainer.send_weights(weight_version="v1")
            trainer.shutdown()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    try:
        thread = threading.Thread(target=train)
        thread.start()
        thread.join(300)
        assert not errors, errors
        assert greedy(llm, PROMPTS) == want
    finally:
        llm.shutdown()
