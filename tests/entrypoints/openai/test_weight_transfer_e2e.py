"""End-to-end: vLLM's RL weight sync (``VLLM_SERVER_DEV_MODE=1``,
``--weight-transfer-config``) on the default model served dense.

A trainer in this process (``vllm.distributed.weight_transfer``) pushes a perturbed copy
of the checkpoint into the running server over a gloo group: pause, start, update (the
server receives while the trainer broadcasts), finish as version "v1", resume. The
server's greedy completion is then transformers' greedy continuation with the perturbed
weights; /weight_info, /weight_checker and the Prometheus series follow. Calls out of
order and bad bodies are OpenAI-style 400s, and the server serves on.
"""

from __future__ import annotations

import copy

import pytest
import requests
import torch

from tests.utils import RemoteServer
from vllm.distributed.weight_transfer import (
    GlooTrainerInitInfo,
    GlooTrainerWeightTransferEngine,
    HTTPVLLMWeightSyncClient,
    ModuleSource,
)
from vllm.entrypoints.utils import get_open_port

pytestmark = pytest.mark.slow
PROMPT = "The capital of France is"
MAX_TOKENS = 8
# Seeded noise on every linear layer (the tied embedding kept): a greedy continuation
# unlike the checkpoint's, each step's top logit ahead of the next by > 0.1.
NOISE_SEED, NOISE_SCALE = 3, 0.15


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("weight_transfer") / "server.log"
    srv = RemoteServer(
        "--quantization", "fp32", "--dtype", "float32", "--max-model-len", "512",
        "--weight-transfer-config", '{"backend": "gloo"}', "--enable-scale-out",
        log_path=str(log), env={"VLLM_SERVER_DEV_MODE": "1"},
    )  # fmt: skip
    try:
        yield srv
    finally:
        srv.stop()


def post(server: RemoteServer, route: str, body: dict | None = None) -> requests.Response:
    return requests.post(f"{server.base}/{route}", json=body, timeout=120)


def get(server: RemoteServer, route: str) -> dict:
    r = requests.get(f"{server.base}/{route}", timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def complete(server: RemoteServer, prompt_ids: list[int]) -> list[int]:
    body = {"prompt": prompt_ids, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True}  # fmt: skip
    r = post(server, "v1/completions", body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def checksums(server: RemoteServer) -> dict[str, str]:
    r = post(server, "weight_checker", {"action": "checksum"})
    assert r.status_code == 200, r.text
    return r.json()["checksums"]


def compare(server: RemoteServer, baseline: dict[str, str]) -> dict:
    r = post(server, "weight_checker", {"action": "compare", "baseline": baseline})
    assert r.status_code == 200, r.text
    return r.json()


def perturbed(hf_model) -> torch.nn.Module:
    model = copy.deepcopy(hf_model)
    noise = torch.Generator().manual_seed(NOISE_SEED)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if weight.dim() == 2 and "embed" not in name:
                step = torch.randn(weight.shape, generator=noise) * weight.std() * NOISE_SCALE
                weight.add_(step)
    return model


def greedy(model, prompt_ids: list[int]) -> list[int]:
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, len(prompt_ids) :].tolist()


def assert_400(response: requests.Response, param: str | None = None) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400
    if param is not None:
        assert error["param"] == param


def test_a_trainer_s_weights_replace_the_served_ones(server, tokenizer, hf_model):
    prompt_ids = tokenizer(PROMPT).input_ids
    assert get(server, "weight_info") == {"weight_version": "default"}
    assert get(server, "get_world_size") == {"world_size": 1}
    baseline = checksums(server)
    assert baseline and all(len(digest) == 64 for digest in baseline.values())
    before = complete(server, prompt_ids)
    trainer_model = perturbed(hf_model)
    expected = greedy(trainer_model, prompt_ids)
    assert expected != before  # the perturbation changes the greedy continuation

    assert post(server, "pause").json() == {"status": "paused"}
    client = HTTPVLLMWeightSyncClient(server.base)
    trainer = GlooTrainerWeightTransferEngine.trainer_init(
        GlooTrainerInitInfo(master_address="127.0.0.1", master_port=get_open_port()),
        client=client,
        source=ModuleSource(trainer_model),
    )
    try:
        trainer.send_weights(weight_version="v1")
    finally:
        r = post(server, "shutdown_weight_transfer_engine")
        trainer.shutdown()
    assert r.json() == {"message": "Weight transfer shut down"}
    assert post(server, "resume").json() == {"status": "resumed"}

    assert complete(server, prompt_ids) == expected
    assert get(server, "weight_info") == {"weight_version": "v1"}
    # The tokens route says which weights sampled which tokens (vLLM's weight_versions).
    body = {"token_ids": prompt_ids, "sampling_params": {"max_tokens": 4, "temperature": 0}}
    r = post(server, "inference/v1/generate", body)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert choice["weight_versions"] == [{"version": "v1", "start": 0, "end": 4}]
    diff = compare(server, baseline)
    assert diff["match"] is False and diff["mismatches"]
    assert diff["mismatches"] == sorted(diff["mismatches"])
    now = checksums(server)
    assert compare(server, now) == {"match": True, "mismatches": []}
    r = post(server, "update_weight_version", {"new_version": "v1-checked"})
    assert r.json() == {"success": True, "new_version": "v1-checked"}
    assert get(server, "weight_info") == {"weight_version": "v1-checked"}

    metrics = requests.get(f"{server.base}/metrics", timeout=60).text
    count = "vllm:rl_weight_update_operation_duration_seconds_count"
    for operation in ("init", "start", "update", "finish", "shutdown"):
        assert f'{count}{{operation="{operation}"}} ' in metrics, operation
    gauge = 'vllm:rl_weight_update_operations_in_flight{operation="update"} 0.0'
    assert gauge in metrics


def test_calls_out_of_order_and_bad_bodies_are_400s(server, tokenizer):
    assert_400(post(server, "update_weights", {"update_info": {"names": []}}))
    assert_400(post(server, "finish_weight_update", {"weight_version": "v2"}))
    assert_400(post(server, "finish_weight_update"))  # no body: still no update started
    bogus = {"master_address": "127.0.0.1", "master_port": get_open_port(),
             "rank_offset": 1, "world_size": 2, "bogus": 1}  # fmt: skip
    r = post(server, "init_weight_transfer_engine", {"init_info": bogus})
    assert_400(r)
    assert "bogus" in r.json()["error"]["message"]
    assert_400(post(server, "weight_checker", {"action": "compare"}), "baseline")
    assert_400(post(server, "weight_checker", {"action": "verify"}), "action")
    assert_400(post(server, "init_weight_transfer_engine", {"init_info": {}, "x": 1}), "x")
    assert_400(post(server, "init_weight_transfer_engine", {}), "init_info")
    assert_400(post(server, "update_weight_version", {"new_version": 2}), "new_version")
    # The server serves on, and the version is untouched by the refused calls.
    version = get(server, "weight_info")["weight_version"]
    assert complete(server, tokenizer(PROMPT).input_ids)
    assert get(server, "weight_info")["weight_version"] == version
