"""LoRA through `vllm serve` and the official openai client: ``--lora-modules`` adapters are
models of their own (listed by /v1/models with their base as parent), a request's
``model`` picks one and its greedy tokens are the merged model's, unknown names are 404s,
and with VLLM_ALLOW_RUNTIME_LORA_UPDATING adapters are loaded and unloaded at run time."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import openai
import pytest
import requests
import torch

from tests.lora.test_lora import merged, save_base, write_adapter
from vllm.benchmarks.server import RemoteServer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The base folder (tiny Llama with the embedded tokenizer), two adapters, a server."""
    root = tmp_path_factory.mktemp("lora-server")
    base = root / "base"
    hf = save_base(base)
    sql = write_adapter(root / "sql", seed=1)
    other = write_adapter(root / "other", seed=2, targets=("q_proj", "v_proj"))
    env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"}
    server = RemoteServer(
        str(base), "--served-model-name", "tiny", "tiny-alias",
        "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
        "--lora-modules", f"sql={sql}",
        json.dumps({"name": "other", "path": str(other), "base_model_name": "base"}),
        "--kv-cache-memory", "16MiB", env=env,
    )  # fmt: skip
    try:
        yield server, hf, base, sql, other
    finally:
        server.stop()


def test_adapters_are_models_with_their_own_tokens(setup):
    server, hf, base, sql, _ = setup
    client = server.client()
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"tiny", "sql", "other"}
    assert cards["sql"].parent == "tiny" and cards["sql"].root == str(sql)
    assert cards["other"].parent == "base"
    prompt = [17, 2000, 31337, 5, 123, 4567, 89]
    with torch.inference_mode():
        want = {
            name: model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[
                0, len(prompt) :
            ].tolist()
            for name, model in (("tiny", hf), ("sql", merged(hf, sql)))
        }
    assert want["tiny"] != want["sql"]
    # --served-model-name's names all serve the base model; responses name the first.
    for name, reported in (("tiny", "tiny"), ("tiny-alias", "tiny"), ("sql", "sql")):
        out = client.completions.create(
            model=name, prompt=prompt, max_tokens=6, temperature=0.0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )  # fmt: skip
        assert out.model == reported
        assert out.choices[0].token_ids == want[reported]
    chat = client.chat.completions.create(
        model="sql", messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert chat.model == "sql"
    with pytest.raises(openai.NotFoundError, match="The model `nope` does not exist"):
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    metrics = requests.get(f"{server.base}/metrics", timeout=10).text
    info = [line for line in metrics.splitlines() if line.startswith("vllm:lora_requests_info{")]
    assert info and all('max_lora="2"' in line for line in info)
    assert any('running_lora_adapters="sql"' in line for line in info)


def test_adapters_load_and_unload_at_run_time(setup, tmp_path):
    server, hf, base, sql, _ = setup
    client = server.client()
    late = write_adapter(tmp_path / "late", seed=3, targets=("o_proj",))

    def post(route: str, **body) -> requests.Response:
        return requests.post(f"{server.base}/v1/{route}", json=body, timeout=30)

    r = post("load_lora_adapter", lora_name="late", lora_path=str(late))
    assert r.status_code == 200 and "added successfully" in r.text
    prompt = [5, 6, 7, 8, 9]
    with torch.inference_mode():
        want = merged(hf, late).generate(torch.tensor([prompt]), max_new_tokens=4,
                                         do_sample=False)[0, 5:].tolist()  # fmt: skip
    extra = {"ignore_eos": True, "return_token_ids": True}
    out = client.completions.create(
        model="late", prompt=prompt, max_tokens=4, temperature=0.0, extra_body=extra
    )
    assert out.choices[0].token_ids == want
    again = post("load_lora_adapter", lora_name="late", lora_path=str(late))
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    bad = post("load_lora_adapter", lora_name="bad", lora_path=str(tmp_path))
    assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
    gone = post("unload_lora_adapter", lora_name="late")
    assert gone.status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="late", prompt=prompt, max_tokens=1)
    missing = post("unload_lora_adapter", lora_name="late")
    assert missing.status_code == 404 and "cannot be found" in missing.json()["error"]["message"]
    assert {m.id for m in client.models.list().data} == {"tiny", "sql", "other"}


def test_bad_lora_flags_fail_before_the_engine_starts(tmp_path):
    def serve(*args: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120)

    done = serve("--lora-modules", f"x={tmp_path}")
    assert done.returncode == 2 and "--lora-modules needs --enable-lora" in done.stderr
    done = serve("--enable-lora", "--lora-modules", f"x={tmp_path}")
    assert done.returncode == 2 and "has no adapter_config.json" in done.stderr
    big = write_adapter(tmp_path / "big", seed=1, r=32)
    done = serve("--enable-lora", "--lora-modules", f"big={big}")
    assert done.returncode == 2 and "greater than max_lora_rank 16" in done.stderr


def test_runtime_adapter_routes_exist_only_when_allowed(monkeypatch):
    """Off by default (vLLM's switch): the routes are absent (404); allowed on a server
    without --enable-lora they answer 400 naming the flag."""
    from tests.entrypoints.openai.test_job_identity import _app, _call

    body = json.dumps({"lora_name": "x", "lora_path": "/nowhere"}).encode()
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    status, _, _ = _call(_app(), "/v1/load_lora_adapter", "POST", body)
    assert status == 404
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    status, payload, _ = _call(_app(), "/v1/load_lora_adapter", "POST", body)
    assert status == 400 and "--enable-lora" in json.loads(payload)["error"]["message"]
    status, payload, _ = _call(
        _app(), "/v1/unload_lora_adapter", "POST", json.dumps({"lora_name": "x"}).encode()
    )
    assert status == 404 and json.loads(payload)["error"]["code"] == "not_found"


def test_an_agent_job_on_an_adapter_is_pinned_between_turns(setup):
    """Continuum with LoRA: a job's turns on one adapter hit their pinned context; the same
    history on the base model shares none of it (the adapter keys the blocks)."""
    _, _, base, sql, _ = setup
    server = RemoteServer(
        str(base), "--scheduling-policy", "continuum", "--continuum-default-ttl", "5",
        "--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"sql={sql}",
        "--kv-cache-memory", "16MiB",
    )  # fmt: skip
    try:
        client = server.client()
        messages = [{"role": "user", "content": "List the files. " * 6}]

        def turn(model: str, last: bool):
            return client.chat.completions.create(
                model=model, messages=messages, max_tokens=8, temperature=0.0,
                extra_body={"job_id": f"job-{model}", "is_last_step": last},
            )  # fmt: skip

        first = turn("sql", False)
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "Output:\nmain.py utils.py README.md"},
        ]
        second = turn("sql", True)
        assert second.usage.prompt_tokens_details.cached_tokens >= 16
        on_base = turn(str(base), True)
        assert on_base.usage.prompt_tokens_details.cached_tokens == 0
        metrics = server.metrics()
        assert metrics["vllm:pins_total"] >= 1 and metrics["vllm:pin_hits_total"] >= 1
    finally:
        server.stop()
