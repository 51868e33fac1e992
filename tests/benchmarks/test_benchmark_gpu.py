"""benchmarks/benchmark_gpu.py: the shapes it builds, what it counts as read per decode step,
and a whole run end to end on the tiny shape (CPU here; the same run on CUDA is marked cuda)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import uuid
from pathlib import Path

import pytest
import torch

from tests.utils import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "benchmark_gpu.py"
TINY_RUN = [
    "--shape",
    "tiny",
    "--num-requests",
    "1",
    "2",
    "--prompt-len",
    "32",
    "--max-tokens",
    "8",
]


@pytest.fixture(scope="module")
def bench():
    """benchmarks/ is a folder of scripts, not a package: load the script by its path."""
    return load_script(SCRIPT)


@pytest.mark.parametrize(
    "shape, params, tied",
    [
        # The published parameter counts of the models these shapes stand for.
        ("smollm2-135m", 134_515_008, True),
        ("llama-3.2-1b", 1_235_814_400, True),
        ("llama-3.1-8b", 8_030_261_248, False),
    ],
)
def test_shapes_have_the_real_models_sizes(bench, shape, params, tied):
    model = bench.build_model(shape, torch.bfloat16, torch.device("meta"), seed=0)
    facts = bench.model_facts(model)
    assert facts.num_params == params
    embed = model.config.vocab_size * model.config.hidden_size
    # A decode step gathers a few rows of the input embedding; an untied lm_head is read
    # whole. Tied, the one matrix is the lm_head and counts once.
    assert facts.weight_bytes_read == 2 * (params if tied else params - embed)


def test_8b_step_bytes_and_bandwidth_by_card_name(bench):
    model = bench.build_model("llama-3.1-8b", torch.bfloat16, torch.device("meta"), seed=0)
    facts = bench.model_facts(model)
    # 32 layers x 8 KV heads x 128 x (K, V) x 2 bytes = 128 KiB per token of context.
    assert facts.kv_bytes_per_token == 128 * 1024
    # 256 requests at the mean context 512 + 128 / 2: 15.0 GB of weights + 19.3 GB of KV.
    assert facts.step_bytes(256, 576) == facts.weight_bytes_read + 256 * 576 * 128 * 1024
    assert facts.lm_head_bytes == 2 * 128256 * 4096  # outside the decode graph
    assert bench.default_bandwidth("NVIDIA H100 80GB HBM3") == 3350
    assert bench.default_bandwidth("NVIDIA H100 PCIe") == 2000
    assert bench.default_bandwidth("NVIDIA H200") == 4800
    assert bench.default_bandwidth("Intel(R) Xeon(R) Processor") is None


def test_summary_of_decode_steps(bench):
    facts = bench.ModelFacts(num_params=10, weight_bytes_read=1000, kv_bytes_per_token=10)
    # 2 steps of batch 4 at context 25: (1000 + 4 * 25 * 10) bytes in 1 ms each = 2 GB/s.
    s = bench.summarize(4, 3, 0.5, 0.1, [(1e-3, 4), (1e-3, 4)], facts, 25.0, 4.0)
    assert s["output_tok_per_s"] == pytest.approx(24.0)
    assert s["tpot_ms"] == pytest.approx(1.0) and s["ttft_ms"] == pytest.approx(100.0)
    assert s["decode_gb_per_s"] == pytest.approx(2e-3 * 1000 / 1e6 * 1e3)
    assert s["hbm_fraction"] == pytest.approx(s["decode_gb_per_s"] / 4.0)
    assert bench.summarize(1, 2, 1.0, 0.5, [], facts, 1.0, None)["tpot_ms"] is None


def check_run(result: dict, device: str, dtype: str, engines=("hf", "ours")) -> None:
    assert result["machine"]["device"] == device and result["machine"]["device_name"]
    assert result["model"]["dtype"] == dtype
    for engine in engines:
        for n in (1, 2):
            f = result["engines"][engine][str(n)]
            assert "error" not in f, f
            assert f["output_tok_per_s"] > 0 and f["ttft_ms"] > 0 and f["tpot_ms"] > 0
            # 8 tokens: the first comes with the prefill, 7 decode steps of the whole batch.
            assert f["num_decode_steps"] == 7 and f["mean_decode_batch"] == n
            # All steps read the same bytes: the fraction is bytes / mean step / bandwidth.
            read = (
                result["model"]["weight_bytes_read"]
                + n * 36 * result["model"]["kv_bytes_per_token"]
            )
            expected = read / (f["tpot_ms"] / 1e3) / 1e9 / result["bandwidth_gbs"]
            assert f["hbm_fraction"] == pytest.approx(expected)
    probe = result["context_length"]
    assert probe["first_seen_ms"] > 0 and probe["seen_ms"] > 0
    if "hf" in engines:
        assert set(result["ratios"]) == {"1", "2"} and result["ratios"]["1"]["vs_hf"] > 0


@pytest.mark.slow
def test_tiny_run_end_to_end_writes_every_figure(bench, tmp_path, capsys):
    out = tmp_path / "gpu.json"
    argv = TINY_RUN + ["--bandwidth-gbs", "20", "--model-dir", str(tmp_path / "model")]
    assert bench.main(argv + ["--json-out", str(out)]) == 0
    result = json.loads(out.read_text())
    check_run(result, "cpu", "float32")
    assert result["mean_context"] == 36.0  # 32 + 8 / 2
    printed = capsys.readouterr().out
    assert "first-seen context lengths" in printed and "x vs_hf" in printed


@pytest.mark.slow
def test_sampled_run_samples_in_every_engine(bench, tmp_path, monkeypatch):
    # --temperature: both engines sample (with --top-p and --repetition-penalty), still
    # max_tokens each.
    seen = []
    sampling_params = bench.sampling
    monkeypatch.setattr(bench, "sampling", lambda a: seen.append(1) or sampling_params(a))
    out = tmp_path / "gpu.json"
    argv = TINY_RUN + ["--temperature", "0.8", "--top-p", "0.9", "--repetition-penalty", "1.2",
                       "--model-dir", str(tmp_path / "m")]  # fmt: skip
    assert bench.main(argv + ["--bandwidth-gbs", "20", "--json-out", str(out)]) == 0
    result = json.loads(out.read_text())
    check_run(result, "cpu", "float32")
    assert result["args"]["temperature"] == 0.8 and result["args"]["top_p"] == 0.9
    assert result["args"]["repetition_penalty"] == 1.2
    assert seen  # the runs asked for the sampling settings
    assert bench.sampling(bench.parse_args(["--temperature", "0.5"])) == {
        "temperature": 0.5,
        "top_p": 1.0,
        "repetition_penalty": 1.0,
    }
    with pytest.raises(SystemExit):
        bench.parse_args(["--top-p", "0"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--repetition-penalty", "0"])


@pytest.mark.slow
def test_top_p_method_too_runs_ours_again_with_that_method(bench, tmp_path, monkeypatch):
    # --top-p-method-too: the sweep again with VLLM_TOP_P_METHOD set, which the sampler
    # reads at each step (so the second engine's top-p rows used it), and its ratio.
    from vllm import envs
    from vllm.v1.sample import sampler

    monkeypatch.delenv("VLLM_TOP_P_METHOD", raising=False)
    methods = []
    apply_top_p = sampler.apply_top_p
    monkeypatch.setattr(sampler, "apply_top_p", lambda *a, **k: methods.append(
        envs.VLLM_TOP_P_METHOD) or apply_top_p(*a, **k))  # fmt: skip
    out = tmp_path / "gpu.json"
    argv = TINY_RUN + ["--skip-hf", "--temperature", "0.8", "--top-p", "0.9",
                       "--top-p-method-too", "sort", "--bandwidth-gbs", "20",
                       "--model-dir", str(tmp_path / "m"), "--json-out", str(out)]  # fmt: skip
    assert bench.main(argv) == 0
    result = json.loads(out.read_text())
    check_run(result, "cpu", "float32", engines=("ours", "ours-top-p-sort"))
    assert {n: set(r) for n, r in result["ratios"].items()} == {
        "1": {"top_p_sort_vs_default"},
        "2": {"top_p_sort_vs_default"},
    }
    assert methods[0] == "auto" and methods[-1] == "sort" and set(methods) == {"auto", "sort"}
    assert "VLLM_TOP_P_METHOD" not in os.environ  # set around the phase only
    with pytest.raises(SystemExit):
        bench.parse_args(["--top-p-method-too", "triton"])  # greedy: no top-p rows


def test_skip_hf_runs_our_engine_on_dummy_weights_with_no_checkpoint(bench, tmp_path, monkeypatch):
    out, folder = tmp_path / "gpu.json", tmp_path / "model"
    argv = TINY_RUN + ["--skip-hf", "--bandwidth-gbs", "20", "--model-dir", str(folder)]
    batches = []  # the number of prompts of each run of our engine
    run_ours = bench.run_ours
    monkeypatch.setattr(
        bench, "run_ours", lambda *a, **k: batches.append(len(a[2])) or run_ours(*a, **k)
    )
    argv += ["--profile", "--async-too", "--warmup", "1", "--json-out", str(out)]
    assert bench.main(argv) == 0
    # N=2, in each of the two engines: a warm-up run, then the measured one.
    assert batches.count(2) == 2 * 2
    result = json.loads(out.read_text())
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", "bfloat16") if cuda else ("cpu", "float32")
    check_run(result, device, dtype, engines=("ours", "ours-async"))
    # --async-too: the same sweep with async scheduling, and its ratio to the plain one.
    assert {n: set(r) for n, r in result["ratios"].items()} == {
        "1": {"async_vs_sync"},
        "2": {"async_vs_sync"},
    }
    # --profile: an eager forward's ops for the smallest and the largest N (and, on CUDA,
    # the graph's replay).
    profiled = result["forward_profile"]
    assert {"1 eager", "2 eager"} <= set(profiled)
    assert all(p["ms_per_forward"] > 0 and "Name" in p["table"] for p in profiled.values())
    assert result["load_format"] == "dummy" and "hf" not in result["engines"]
    # The byte counts come from the shape (counted on the meta device), not from weights.
    assert result["model"]["weight_bytes_read"] > 0
    assert (folder / "config.json").exists() and not list(folder.glob("*.safetensors"))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_tiny_run_on_cuda(bench, tmp_path):
    out = tmp_path / "gpu.json"
    argv = TINY_RUN + ["--bandwidth-gbs", "1000", "--model-dir", str(tmp_path / "model")]
    assert bench.main(argv + ["--json-out", str(out)]) == 0
    result = json.loads(out.read_text())
    check_run(result, "cuda", "bfloat16")
    assert result["machine"]["device_name"] == torch.cuda.get_device_name()
    probe = result["forward_probe"]  # each N's graph replay, timed on the device
    assert set(probe) == {"1", "2"} and all(p["replay_ms"] > 0 for p in probe.values())
    assert result["peak_gpu_memory_gib_ours"] > 0


# -- the run kit (scripts/gpu/) ------------------------------------------------------------
KIT = SCRIPT.parents[1] / "scripts" / "gpu"


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("limit, rc", [(30, 3), (1, 124)])
def test_reap_ends_what_a_step_leaves_in_a_session_of_its_own(tmp_path, limit, rc):
    # The step starts a sleeper in a new session (as RemoteServer starts `vllm serve`)
    # and exits 3 at once, or overruns its 1 s limit.
    pidfile = tmp_path / "pid"
    script = f"setsid sleep 300 & echo $! > {pidfile}; " + ("exit 3" if rc == 3 else "sleep 60")
    done = subprocess.run(
        [sys.executable, str(KIT / "reap.py"), str(limit), "bash", "-c", script], timeout=60
    )
    assert done.returncode == rc
    assert not alive(int(pidfile.read_text()))


@pytest.mark.slow
def test_run_sh_runs_a_tiny_bench_step(tmp_path):
    env = os.environ | {"GPU_RUN_NO_WHEELS": "1", "PYTHON": sys.executable, "OUT": str(tmp_path)}
    argv = ["bench", "--shape", "tiny", "--num-requests", "1", "--prompt-len", "16"]
    argv += ["--max-tokens", "4", "--model-dir", str(tmp_path / "model")]
    done = subprocess.run([str(KIT / "run.sh"), *argv], env=env, timeout=300)
    assert done.returncode == 0
    result = json.loads((tmp_path / "bench-1.json").read_text())
    assert result["engines"]["ours"]["1"]["num_decode_steps"] == 3
    log = (tmp_path / "run.log").read_text()
    assert "=== bench: exit status 0" in log and "device: no CUDA device" in log


@pytest.mark.slow
def test_run_sh_runs_a_tiny_study_step(tmp_path):
    # Two short jobs of two turns against the tiny random model, one continuum server.
    # A label of its own: study.py keeps results across calls (a later call resumes).
    label = f"cpu-test-{uuid.uuid4().hex[:8]}"
    env = os.environ | {"GPU_RUN_NO_WHEELS": "1", "PYTHON": sys.executable, "OUT": str(tmp_path)}
    argv = ["study", "--label", label, "--policies", "continuum+autotier", "--jps", "0.2"]
    argv += ["--duration", "10", "--drain-timeout", "60", "--turns", "2", "--max-tokens", "4"]
    argv += ["--num-gpu-blocks", "64", "--max-model-len", "1024", "--seed", "1"]
    try:
        done = subprocess.run([str(KIT / "run.sh"), *argv], env=env, timeout=400)
    finally:
        shutil.rmtree(f"/tmp/vllm-study-results/{label}", ignore_errors=True)
    assert done.returncode == 0, (tmp_path / "run.log").read_text()[-3000:]
    assert [p.name for p in tmp_path.glob("*.tar.gz")] == [f"study-{label}.tar.gz"]
    with tarfile.open(tmp_path / f"study-{label}.tar.gz") as tar:
        point = json.load(tar.extractfile(f"{label}/continuum+autotier_jps0.2.json"))
        config = json.load(tar.extractfile(f"{label}/sweep_config.json"))
    assert point["num_jobs"] >= 1 and point["num_completed"] == point["num_jobs"], point
    # +offload<k>x tiers are sized in the shape's own blocks: tiny, fp32 on CPU.
    assert config["kv_block_bytes"] == 2 * 2 * 16 * 2 * 32 * 4
    # Named as committed, not as on the machine that ran it.
    assert config["results_dir"] == "our_experiments/results"


def test_study_sizes_tiers_in_the_shapes_blocks():
    sys.path.insert(0, str(KIT))
    try:
        import study
    finally:
        sys.path.remove(str(KIT))
    itemsize = 2 if torch.cuda.is_available() else 4
    # SmolLM2-135M in fp32 is the sweep's default block; the 8B shape keeps 64 Ki values
    # a token (K and V x 32 layers x 8 heads x 128).
    assert study.kv_block_bytes("smollm2-135m") == 737_280 * itemsize // 4
    assert study.kv_block_bytes("llama-3.1-8b") == 16 * 65_536 * itemsize


def test_study_labels_a_tool_mix_other_than_fork_apart():
    sys.path.insert(0, str(KIT))
    try:
        import study
    finally:
        sys.path.remove(str(KIT))
    base = study.default_label("tiny")
    assert study.default_label("tiny", ["--jps", "1.5"]) == base
    assert study.default_label("tiny", ["--tool-mix", "fork"]) == base
    assert study.default_label("tiny", ["--tool-mix", "guided", "--jps", "1"]) == f"{base}-guided"
    assert study.default_label("tiny", ["--tool-mix=slow"]) == f"{base}-slow"
    assert study.default_label("tiny", ["--tool-m", "guided"]) == f"{base}-guided"  # as argparse


def test_run_sh_refuses_an_unknown_step(tmp_path):
    env = os.environ | {"GPU_RUN_NO_WHEELS": "1", "OUT": str(tmp_path)}
    done = subprocess.run([str(KIT / "run.sh"), "benchmark"], env=env, timeout=60)
    assert done.returncode == 2


@pytest.mark.parametrize(
    "shape, params, tied",
    # gpt-oss-20b's published 20.91 B (its experts in bf16 here) and Gemma-2-9B's 9.24 B.
    [("gpt-oss-20b", 20_914_757_184, False), ("gemma-2-9b", 9_241_705_984, True)],
)
def test_other_families_have_the_real_models_sizes(bench, shape, params, tied):
    test_shapes_have_the_real_models_sizes(bench, shape, params, tied)


def test_moe_and_window_step_bytes(bench):
    model = bench.build_model("gpt-oss-20b", torch.bfloat16, torch.device("meta"), seed=0)
    facts = bench.model_facts(model)
    # 24 layers x 8 KV heads x 64 x (K, V) x 2 bytes; half the layers see 128 tokens.
    layer_kv = 8 * 64 * 2 * 2
    assert facts.kv_bytes_per_token == 24 * layer_kv
    assert facts.windowed_kv == ((128, 12 * layer_kv),)
    # Experts: 24 layers x 32 x (2880 x 5760 + 5760 + 2880 x 2880 + 2880), in bf16.
    per_expert = 2880 * 5760 + 5760 + 2880 * 2880 + 2880
    assert facts.expert_bytes == 2 * 24 * 32 * per_expert
    assert (facts.experts_per_token, facts.num_experts) == (4, 32)
    dense = facts.weight_bytes_read - facts.expert_bytes
    # One token reads 4 of the 32 experts; 256 tokens reach nearly all of them.
    assert facts.step_bytes(1, 100) == pytest.approx(
        dense + facts.expert_bytes * 4 / 32 + 100 * 24 * layer_kv
    )
    at_576 = 576 * 24 * layer_kv - (576 - 128) * 12 * layer_kv
    expected = dense + facts.expert_bytes * (1 - (28 / 32) ** 256) + 256 * at_576
    assert facts.step_bytes(256, 576) == pytest.approx(expected)
    # A dense model with no windows is unchanged (the Llama shape's test above).
    gemma = bench.model_facts(
        bench.build_model("gemma-2-9b", torch.bfloat16, torch.device("meta"), seed=0)
    )
    assert gemma.expert_bytes == 0 and gemma.expert_share(64) == 1.0
    assert gemma.windowed_kv == ((4096, 21 * 8 * 256 * 2 * 2),)


def test_tiny_gpt_oss_runs_on_our_engine(bench, tmp_path):
    # The other families' path end to end on CPU: the folder from the shape's config, our
    # engine's dummy weights (sinks and windows through its attention backend).
    out = tmp_path / "oss.json"
    argv = ["--shape", "tiny-gpt-oss", "--skip-hf", "--num-requests", "1", "2",
            "--prompt-len", "16", "--max-tokens", "4", "--warmup", "0",
            "--model-dir", str(tmp_path / "model"), "--json-out", str(out)]  # fmt: skip
    assert bench.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["load_format"] == "dummy"
    ours = result["engines"]["ours"]
    assert set(ours) == {"1", "2"}
    assert all(r["output_tok_per_s"] > 0 for r in ours.values())
    assert result["model"]["shape"] == "tiny-gpt-oss"
    assert result["model"]["num_experts"] == 4 and result["model"]["windowed_kv"]


def test_deepseek_v2_lite_counts_one_latent_a_token_and_its_routed_experts(bench):
    model = bench.build_model("deepseek-v2-lite", torch.bfloat16, torch.device("meta"), seed=0)
    facts = bench.model_facts(model)
    assert 15.0e9 < facts.num_params < 16.5e9  # DeepSeek-V2-Lite: 15.7B
    assert facts.kv_bytes_per_token == 27 * (512 + 64) * 2  # not the 16 expanded heads
    assert (facts.experts_per_token, facts.num_experts) == (6, 64)
    # 26 MoE layers x 64 routed experts x 3 projections of 2048 x 1408, in bf16.
    assert facts.expert_bytes == 2 * 26 * 64 * 3 * 2048 * 1408


def test_tiny_deepseek_v2_runs_on_our_engine(bench, tmp_path):
    out = tmp_path / "ds.json"
    argv = ["--shape", "tiny-deepseek-v2", "--skip-hf", "--num-requests", "1", "2",
            "--prompt-len", "16", "--max-tokens", "4", "--warmup", "0",
            "--model-dir", str(tmp_path / "model"), "--json-out", str(out)]  # fmt: skip
    assert bench.main(argv) == 0
    result = json.loads(out.read_text())
    assert all(r["output_tok_per_s"] > 0 for r in result["engines"]["ours"].values())
    assert result["model"]["kv_bytes_per_token"] == 2 * (32 + 8) * 4  # fp32 on the CPU


def test_an_fp8_cache_halves_the_kv_bytes(bench):
    model = bench.build_model("gpt-oss-20b", torch.bfloat16, torch.device("meta"), seed=0)
    facts = bench.model_facts(model)
    args = bench.parse_args(["--shape", "gpt-oss-20b", "--dtype", "bfloat16"])
    assert bench.cache_facts(facts, args) == facts
    args.engine_args = '{"kv_cache_dtype": "fp8"}'
    fp8 = bench.cache_facts(facts, args)
    assert fp8.kv_bytes_per_token * 2 == facts.kv_bytes_per_token
    assert fp8.windowed_kv == ((128, facts.windowed_kv[0][1] // 2),)
    assert fp8.weight_bytes_read == facts.weight_bytes_read


def test_packed_mxfp4_experts_are_counted_at_their_size(bench):
    model = bench.build_model("gpt-oss-20b", torch.bfloat16, torch.device("meta"), seed=0)
    facts = bench.model_facts(model)
    args = bench.parse_args(["--shape", "gpt-oss-20b", "--dtype", "bfloat16"])
    packed = bench.cache_facts(facts, args, packed=True)
    values = facts.expert_bytes // 2
    assert packed.expert_bytes == int(values * 17 / 32)  # ~4.25 bits a value
    dense = facts.weight_bytes_read - facts.expert_bytes
    assert packed.weight_bytes_read == dense + packed.expert_bytes
    assert not bench.experts_packed("gpt-oss-20b", torch.device("cpu"))
    assert not bench.experts_packed("llama-3.1-8b", torch.device("cuda"))


def test_fp8_weights_halve_the_body_not_the_head(bench):
    model = bench.build_model("llama-3.1-8b", torch.bfloat16, torch.device("meta"), seed=0)
    facts = bench.model_facts(model)
    args = bench.parse_args(["--shape", "llama-3.1-8b", "--dtype", "bfloat16"])
    args.engine_args = '{"quantization": "fp8"}'
    fp8 = bench.cache_facts(facts, args)
    body = facts.weight_bytes_read - facts.lm_head_bytes
    assert fp8.weight_bytes_read == body // 2 + facts.lm_head_bytes
    assert fp8.kv_bytes_per_token == facts.kv_bytes_per_token
