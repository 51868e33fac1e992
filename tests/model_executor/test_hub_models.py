"""A model given as a Hugging Face Hub id (``vllm serve org/name``): served from the HF
cache (the layout huggingface_hub writes: ``models--org--name/refs/<revision>`` naming a
commit, ``snapshots/<commit>/`` its files), ``--revision`` choosing the snapshot,
``--download-dir`` the cache. Offline here (``HF_HUB_OFFLINE=1``): the machine has no
network, and a test must not depend on one; online, huggingface_hub downloads the same
layout first."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.eagle_checkpoints import save_tiny_target
from vllm.model_executor.model_loader import hub_snapshot, resolve_model
from vllm.sampling_params import SamplingParams

REPO = "tiny-org/tiny-llama"
MAIN, V2 = "a" * 40, "b" * 40


@pytest.fixture
def hub(tmp_path, monkeypatch) -> Path:
    """An HF cache holding REPO at main (one tiny Llama) and at tag v2 (the same config
    with another seed's weights)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub_snapshot.cache_clear()
    cache = tmp_path / "hub"
    repo = cache / "models--tiny-org--tiny-llama"
    for commit, seed in ((MAIN, 0), (V2, 1)):
        save_tiny_target(repo / "snapshots" / commit, seed=seed)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN)
    (repo / "refs" / "v2").write_text(V2)
    yield cache
    hub_snapshot.cache_clear()


def test_a_hub_id_resolves_to_its_snapshot_by_revision(hub):
    snapshots = hub / "models--tiny-org--tiny-llama" / "snapshots"
    assert resolve_model(REPO, None, str(hub)) == str(snapshots / MAIN)
    assert resolve_model(REPO, "v2", str(hub)) == str(snapshots / V2)
    assert resolve_model(REPO, V2, str(hub)) == str(snapshots / V2)  # a commit
    with pytest.raises(ValueError, match=r"model 'tiny-org/other' is not a local path, .*"
                                         r"HF_HUB_OFFLINE"):  # fmt: skip
        resolve_model("tiny-org/other", None, str(hub))
    with pytest.raises(ValueError, match=r"model 'tiny-org/tiny-llama' .*revision"):
        resolve_model(REPO, "no-such-tag", str(hub))
    with pytest.raises(ValueError, match=r"model '\./missing/x' not found: .*Hub repository id"):
        resolve_model("./missing/x")


def test_the_engine_serves_a_hub_id_at_the_revision_asked(hub):
    from vllm import LLM

    snapshots = hub / "models--tiny-org--tiny-llama" / "snapshots"
    prompt = [{"prompt_token_ids": [5, 9, 13, 17, 21, 25]}]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine = dict(skip_tokenizer_init=True, dtype="float32", kv_cache_memory="8MiB",
                  max_model_len=128)  # fmt: skip
    outputs = {}
    for model, revision in ((REPO, None), (REPO, "v2"), (str(snapshots / V2), None)):
        llm = LLM(model=model, revision=revision, download_dir=str(hub), **engine)
        try:
            outputs[model, revision] = list(llm.generate(prompt, params)[0].outputs[0].token_ids)
            assert llm.vllm_config.model_config.model == model  # the name served
        finally:
            llm.shutdown()
    assert outputs[REPO, "v2"] == outputs[str(snapshots / V2), None]
    assert outputs[REPO, None] != outputs[REPO, "v2"]  # another snapshot's weights


def test_vllm_serve_takes_the_revision_and_download_dir_flags(hub, tmp_path):
    from vllm.entrypoints.cli.main import make_parser
    from vllm.entrypoints.cli.serve import build_config

    args = make_parser().parse_args(
        ["serve", REPO, "--revision", "v2", "--download-dir", str(hub), "--skip-tokenizer-init"]
    )
    config = build_config(args)
    assert (config.model_config.revision, config.model_config.download_dir) == ("v2", str(hub))
    assert config.model_config.max_model_len == 512  # read from v2's config.json
    # A Hub head served as the model brings its verifier (speculators' format).
    head = hub / "models--tiny-org--head" / "snapshots" / MAIN
    head.mkdir(parents=True)
    shutil.copy(hub / "models--tiny-org--tiny-llama" / "snapshots" / MAIN / "config.json", head)
    cfg = json.loads((head / "config.json").read_text())
    spec = {"proposal_methods": [{"speculative_tokens": 2}], "verifier": {"name_or_path": REPO}}
    (head / "config.json").write_text(json.dumps({
        **cfg, "speculators_model_type": "eagle3", "speculators_config": spec,
    }))  # fmt: skip
    (head.parent.parent / "refs").mkdir()
    (head.parent.parent / "refs" / "main").write_text(MAIN)
    from vllm.engine.arg_utils import EngineArgs

    served = EngineArgs(model="tiny-org/head", download_dir=str(hub))
    served.serve_speculators_head()
    assert served.model == REPO
    assert served.speculative_config == {
        "method": "eagle3", "model": "tiny-org/head", "num_speculative_tokens": 2,
    }  # fmt: skip


def test_a_hub_tokenizer_is_read_at_its_own_revision(hub, tmp_path):
    """``--tokenizer org/name --tokenizer-revision v2``: the tokenizer's snapshot at v2
    (main has no tokenizer files), whatever the model's revision."""
    from tests.utils import copy_benchmark_tokenizer
    from vllm.config import ModelConfig
    from vllm.transformers_utils.tokenizer import init_tokenizer_from_config

    repo = hub / "models--tiny-org--tok"
    (repo / "snapshots" / MAIN).mkdir(parents=True)
    (repo / "snapshots" / V2).mkdir(parents=True)
    copy_benchmark_tokenizer(repo / "snapshots" / V2)
    for commit in (MAIN, V2):  # a folder the resolver takes has a config.json
        config = hub / "models--tiny-org--tiny-llama" / "snapshots" / MAIN / "config.json"
        shutil.copy(config, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN)
    (repo / "refs" / "v2").write_text(V2)
    base = dict(model=REPO, tokenizer="tiny-org/tok", download_dir=str(hub))
    tok = init_tokenizer_from_config(ModelConfig(**base, tokenizer_revision="v2"))
    assert tok.decode(tok.encode("hello world")) == "hello world"
    with pytest.raises((OSError, ValueError)):  # main: no tokenizer files
        init_tokenizer_from_config(ModelConfig(**base))


def test_hf_token_goes_to_the_hub_and_is_never_shown(hub, monkeypatch):
    import huggingface_hub

    from vllm.config import ModelConfig
    from vllm.entrypoints.cli.main import make_parser
    from vllm.entrypoints.cli.serve import build_config
    from vllm.entrypoints.openai.api_server import dump_config

    calls = []
    real = huggingface_hub.snapshot_download

    def snapshot_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs.get("token")))
        return real(repo_id, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    secret = "hf_tinySecret42"
    args = make_parser().parse_args(["serve", REPO, "--download-dir", str(hub),
                                     "--hf-token", secret, "--skip-tokenizer-init"])  # fmt: skip
    config = build_config(args)
    assert config.model_config.hf_token == secret
    assert calls and all(call == (REPO, secret) for call in calls)
    dumped = dump_config(config)
    assert secret not in dumped and '"hf_token": "***"' in dumped
    assert secret not in repr(config) and secret not in str(config.model_config)
    # Without the flag huggingface_hub's own token is used (None here); vLLM's True means it.
    assert ModelConfig(hf_token=True).hf_token is None
    assert '"hf_token": null' in dump_config(build_config(make_parser().parse_args(["serve"])))
    for bad in ("", "hf_ x", 42):
        with pytest.raises(ValueError, match=r"^hf_token must be a non-empty string") as e:
            ModelConfig(hf_token=bad)
        assert "hf_ x" not in str(e.value)  # a credential is not echoed
