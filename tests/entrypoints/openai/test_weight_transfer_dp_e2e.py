"""End-to-end: RL weight sync into `vllm serve -dp 2` (two engines, two API servers).

The trainer opens one gloo group with both engines (world_size 3, as GET /get_world_size
says: the trainer's rank, then each engine at rank_offset + its data-parallel rank) and
broadcasts one round; both engines then serve transformers' greedy continuation of the
perturbed weights, and /weight_checker's checksums agree over the ranks. A world_size
that leaves an engine out is a 400 naming it, before anyone waits in a rendezvous.
"""

from __future__ import annotations

import pytest
import requests

from tests.entrypoints.openai.test_weight_transfer_e2e import (
    PROMPT,
    checksums,
    compare,
    greedy,
    perturbed,
    post,
)
from tests.utils import RemoteServer
from vllm.distributed.weight_transfer import (
    GlooTrainerInitInfo,
    GlooTrainerWeightTransferEngine,
    HTTPVLLMWeightSyncClient,
    ModuleSource,
)
from vllm.entrypoints.utils import get_open_port

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("weight_transfer_dp") / "server.log"
    srv = RemoteServer(
        "-dp", "2", "--quantization", "fp32", "--dtype", "float32", "--max-model-len", "512",
        "--weight-transfer-config", '{"backend": "gloo"}',
        log_path=str(log), env={"VLLM_SERVER_DEV_MODE": "1"},
    )  # fmt: skip
    try:
        yield srv
    finally:
        srv.stop()


def complete_on(server: RemoteServer, rank: int, prompt_ids: list[int]) -> list[int]:
    body = {"prompt": prompt_ids, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    r = requests.post(
        f"{server.base}/v1/completions", json=body, timeout=120,
        headers={"X-data-parallel-rank": str(rank)},
    )  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_one_round_reaches_every_engine(server, tokenizer, hf_model):
    prompt_ids = tokenizer(PROMPT).input_ids
    world = requests.get(f"{server.base}/get_world_size", timeout=30).json()["world_size"]
    assert world == 2  # the engines; the trainer's rank makes the group 3
    baseline = checksums(server)
    assert not any(d.startswith("differ") for d in baseline.values())
    trainer_model = perturbed(hf_model)
    expected = greedy(trainer_model, prompt_ids)
    assert complete_on(server, 0, prompt_ids) != expected

    # An engine left out of the group would leave the others waiting: refused at once.
    short = {"master_address": "127.0.0.1", "master_port": get_open_port(),
             "rank_offset": 1, "world_size": 2}  # fmt: skip
    r = post(server, "init_weight_transfer_engine", {"init_info": short})
    assert r.status_code == 400 and "world_size 2 must be" in r.json()["error"]["message"]

    assert post(server, "pause").json() == {"status": "paused"}
    client = HTTPVLLMWeightSyncClient(server.base)
    info = GlooTrainerInitInfo(
        master_address="127.0.0.1", master_port=get_open_port(), world_size=1 + world
    )
    trainer = GlooTrainerWeightTransferEngine.trainer_init(
        info, client=client, source=ModuleSource(trainer_model)
    )
    try:
        trainer.send_weights(weight_version="v1")
    finally:
        post(server, "shutdown_weight_transfer_engine")
        trainer.shutdown()
    assert post(server, "resume").json() == {"status": "resumed"}

    for rank in (0, 1):
        assert complete_on(server, rank, prompt_ids) == expected, f"engine {rank}"
    now = checksums(server)
    assert not any(d.startswith("differ") for d in now.values())  # the ranks agree
    assert compare(server, baseline)["match"] is False
    assert requests.get(f"{server.base}/weight_info", timeout=30).json() == {"weight_version": "v1"}
