"""Native kernels with pure-torch fallbacks.

``reshape_and_cache`` writes this step's K/V into their paged slots (csrc/cpu/cache_kernels.cpp);
``ggml_linear`` / ``ggml_dequantize`` multiply by / expand GGUF-quantized weights
(csrc/cpu/quant_kernels.cpp); ``fused_add_rms_norm``, ``rotary_embedding`` and
``silu_and_mul`` do in one op each what torch does in several (csrc/cpu/layer_kernels.cpp);
``paged_decode_attention`` attends decode queries over the paged cache in place
(csrc/cpu/attention_kernels.cpp); the class ``SuffixTree`` (csrc/cpu/suffix_tree.cpp) is
Suffix Decoding's tree (``vllm/v1/spec_decode/suffix_tree.py``). On CUDA, the layer ops
(and ``rms_norm``) run as one Triton kernel each (``model_executor/layers/triton_ops.py``)
where triton imports, unless ``VLLM_CUDA_FUSED_OPS=0``. The native versions are used
when they have been built — by CMake into ``vllm/_C.so`` or by ``python -m
vllm._custom_ops --build`` into the cache folder — and the pure-torch versions otherwise.
The KV writes, the dequantization and the rotation are bit-identical; the rest agree up
to float rounding (another summation order, another exp).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import hashlib
import logging
import shutil
import subprocess
from pathlib import Path

import torch

from vllm import envs

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).resolve().parent.parent / "csrc" / "cpu"
# Every .cpp of csrc/cpu is compiled, here and by CMakeLists.txt (which globs the same
# folder): the folder is the one list of sources.
_SOURCES = sorted(_CSRC.glob("*.cpp"))
# Not compiled alone, but part of the build's identity.
_HEADERS = sorted(_CSRC.glob("*.h"))
_native = None  # the torch op once loaded, else None
_tried = False
_ops: dict[str, object] = {}  # name -> the loaded op's default overload, or None


def _cache_dir() -> Path:
    return Path(envs.VLLM_CACHE_ROOT) / "kernels"


def _jit_name() -> str:
    """The JIT library's name carries a hash of the sources, so a build cached from older
    sources (without today's ops) is never loaded in place of the current one."""
    h = hashlib.sha256()
    for src in _SOURCES + _HEADERS:
        h.update(src.read_bytes() if src.exists() else b"")
    return f"vllm_continuum_C_{h.hexdigest()[:12]}"


def _load_native():
    global _native, _tried
    if _tried:
        return _native
    _tried = True
    for lib in (Path(__file__).with_name("_C.so"), _cache_dir() / f"{_jit_name()}.so"):
        if lib.exists():
            try:
                torch.ops.load_library(str(lib))
                _native = torch.ops.vllm_continuum_C.reshape_and_cache
                logger.info("Using native KV kernels from %s", lib)
                break
            except (OSError, RuntimeError) as e:  # stale build for another torch
                logger.warning("Ignoring native kernels at %s: %s", lib, e)
    return _native


@contextlib.contextmanager
def _build_lock(out: Path):
    """One build of the cache folder at a time, under an ``flock`` that the kernel drops
    when its holder dies. torch's own lock is a bare file (``out/lock``) that a build killed
    midway (a server stopped while it compiles, a test run cut short) leaves behind, and
    every later build then waits on it forever; under our lock no build of ours is running,
    so such a file is stale and is removed."""
    with open(out / "build.flock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            stale = out / "lock"
            if stale.exists():
                logger.warning("Removing a stale build lock left by a killed build: %s", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build(verbose: bool = False) -> Path:
    """JIT-compile the native kernels into the cache folder (needs a C++ compiler)."""
    from torch.utils.cpp_extension import load

    if not _SOURCES:  # an install without the repository's csrc/
        raise RuntimeError(f"no kernel sources in {_CSRC}")
    out = _cache_dir()
    out.mkdir(parents=True, exist_ok=True)
    with _build_lock(out):
        load(
            name=_jit_name(),
            sources=[str(src) for src in _SOURCES],
            extra_cflags=["-O3", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(out),
            is_python_module=False,
            verbose=verbose,
        )
    global _tried
    _tried = False
    _ops.clear()
    return out / f"{_jit_name()}.so"


def _op(name: str):
    """The native op ``name`` (its default overload: the cheapest call from Python), or None
    when no native library is loaded or the loaded one predates the op. Looked up once."""
    if name not in _ops:
        lib = torch.ops.vllm_continuum_C if _load_native() is not None else None
        _ops[name] = getattr(lib, name).default if lib is not None and hasattr(lib, name) else None
    return _ops[name]


def reshape_and_cache_torch(
    key: torch.Tensor,
    value: torch.Tensor | None,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    padded: bool = True,
) -> None:
    """Pure-torch version. key/value: (num_tokens, kv_heads, head_size); slots int64.
    ``value`` None: a latent cache ``(1, num_blocks, ...)``, keys only (MLA: a value is
    its key's first dims, backends/abstract.py).

    No host sync (CUDA graphs can capture it). A padding token (slot < 0) is written to
    the slot of the first real token with that token's K/V, so every write to one slot
    carries the same bytes and ``index_copy_``'s order among duplicates does not matter;
    with no real token at all, slot 0 gets its own contents back. ``padded=False``: the
    caller knows every slot is >= 0 (built from block ids), so the plain copies suffice.
    An FP8 cache gets the values saturated and cast (``kv_cache_dtype.to_cache``), copied
    as bytes (torch has no ``index_copy_`` for FP8 types)."""
    new = [key] if value is None else [key, value]
    if kv_cache.shape[0] != len(new):
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)} for {len(new)} of K and V")
    if key.dtype != kv_cache.dtype:
        from vllm.v1.attention.kv_cache_dtype import to_cache

        new = [to_cache(t, kv_cache.dtype) for t in new]
    if kv_cache.element_size() == 1:
        kv_cache, new = kv_cache.view(torch.uint8), [t.view(torch.uint8) for t in new]
    # unbind, not flat[0]: Python indexing cannot run on FakeTensorMode's CUDA tensors on a
    # CPU-only build, which is how tests check this path's devices and syncs.
    halves = kv_cache.view(len(new), -1, kv_cache.shape[3], kv_cache.shape[4]).unbind(0)
    if padded and slot_mapping.numel():  # a shape: known on the host
        new, slot_mapping = _redirect_padding(new, halves, slot_mapping)
    for cached, rows in zip(halves, new, strict=True):
        cached.index_copy_(0, slot_mapping, rows)


def _redirect_padding(
    new: list[torch.Tensor],  # the step's K (and V): (num_tokens, kv_heads, head_size)
    halves: tuple[torch.Tensor, ...],  # (slots, kv_heads, head_size): the cache's halves
    slot_mapping: torch.Tensor,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``reshape_and_cache_torch``'s padding rule, in device ops only (see there)."""
    keep = slot_mapping >= 0
    first = keep.int().argmax().view(1)  # the first real token; 0 when there is none
    has_real = keep.index_select(0, first).view(1, 1, 1)
    target = slot_mapping.index_select(0, first).clamp_(min=0)  # (1,)
    slots = torch.where(keep, slot_mapping, target)
    rows = keep.view(-1, 1, 1)
    out = []
    for t, cached in zip(new, halves, strict=True):
        fill = torch.where(has_real, t.index_select(0, first), cached.index_select(0, target))
        out.append(torch.where(rows, t, fill))
    return out, slots


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor | None,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write K/V of each token into ``kv_cache[:, slot // bs, slot % bs]`` (slot < 0: skip);
    an FP8 cache (the native op writes the model's dtype only) and a latent one (``value``
    None: keys only; the native op writes two halves) through the torch version."""
    cpu = kv_cache.device.type == "cpu" and kv_cache.dtype == key.dtype and value is not None
    native = _op("reshape_and_cache") if cpu else None
    if native is not None:
        native(key, value, kv_cache, slot_mapping)
    else:
        reshape_and_cache_torch(key, value, kv_cache, slot_mapping)


def has_native_kernels() -> bool:
    return _load_native() is not None


# -- GGUF-quantized weights ------------------------------------------------------------------
# GGML type ids (gguf.GGMLQuantizationType) -> bytes per block of 32 weights.
GGML_Q4_1 = 3
GGML_Q8_0 = 8
GGML_BLOCK_BYTES = {GGML_Q4_1: 20, GGML_Q8_0: 34}
GGML_BLOCK_WEIGHTS = 32


def _quant_ops():
    """torch.ops.vllm_continuum_C when its build has the quantized kernels, else None
    (a library built before they existed has only reshape_and_cache)."""
    return torch.ops.vllm_continuum_C if _op("ggml_linear") is not None else None


def has_quant_kernels() -> bool:
    return _quant_ops() is not None


# The ops of the current sources: a library missing one of them is an older build.
NATIVE_OPS = (
    "reshape_and_cache",
    "ggml_linear",
    "ggml_dequantize",
    "fused_add_rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "paged_decode_attention",
    "prefill_attention",
)


def has_all_native_kernels() -> bool:
    return all(_op(name) is not None for name in NATIVE_OPS)


def ensure_native_kernels() -> bool:
    """Every native kernel, JIT-built once into the cache folder when missing and a C++
    compiler exists (about a minute, then cached); False means fallbacks run for some ops."""
    if has_all_native_kernels():
        return True
    if _native is not None:  # an older build is loaded: it cannot be replaced in-process
        logger.warning(
            "Native kernels lack some ops (%s): rebuild them with "
            "`python -m vllm._custom_ops --build` and restart",
            ", ".join(n for n in NATIVE_OPS if _op(n) is None),
        )
        return False
    if shutil.which("c++") is None:
        return False
    logger.info("Building the native kernels (one time, about a minute)...")
    try:
        build()
    except (RuntimeError, OSError, subprocess.CalledProcessError) as e:
        logger.warning("Building the native kernels failed: %s", e)
        return False
    return has_all_native_kernels()


def ensure_quant_kernels() -> bool:
    """The quantized kernels (built with the others when missing, see
    ``ensure_native_kernels``); False means the fallback runs."""
    ensure_native_kernels()
    return has_quant_kernels()


def ggml_dequantize_torch(qweight: torch.Tensor, qtype: int) -> torch.Tensor:
    """uint8 (N, blocks * block_bytes) -> fp32 (N, blocks * 32), computed as gguf-py does
    (q * d, then + m), so it equals the fp32 weights transformers converts a GGUF into."""
    if qtype not in GGML_BLOCK_BYTES:
        raise ValueError(f"unsupported GGML type {qtype} (supported: Q4_1=3, Q8_0=8)")
    n = qweight.shape[0]
    blocks = qweight.view(n, -1, GGML_BLOCK_BYTES[qtype])  # (N, nb, block_bytes)
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()  # (N, nb, 1)
    if qtype == GGML_Q8_0:
        q = blocks[..., 2:].contiguous().view(torch.int8).float()
        return (q * d).reshape(n, -1)
    m = blocks[..., 2:4].contiguous().view(torch.float16).float()
    qs = blocks[..., 4:]  # byte j: weight j (low nibble), weight j + 16 (high nibble)
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()
    return (q * d + m).reshape(n, -1)


def ggml_dequantize(
    qweight: torch.Tensor, qtype: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The weight matrix of GGUF blocks in ``dtype``: fp32 (native and fallback are
    bit-identical), or bf16 (the fp32 matrix rounded to nearest even, natively in one pass
    without writing the fp32 one)."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dtype={dtype}: expected torch.float32 or torch.bfloat16")
    to_bf16 = _op("ggml_dequantize_bf16") if dtype == torch.bfloat16 else None
    if to_bf16 is not None:
        return to_bf16(qweight, qtype)
    ops = _quant_ops()
    native = ops is not None
    w = ops.ggml_dequantize(qweight, qtype) if native else ggml_dequantize_torch(qweight, qtype)
    return w.to(dtype)


def ggml_linear_torch(x: torch.Tensor, qweight: torch.Tensor, qtype: int) -> torch.Tensor:
    """Pure-torch reference: dequantize, then a dense matmul. x: (M, K) -> (M, N)."""
    return torch.nn.functional.linear(x, ggml_dequantize_torch(qweight, qtype))


# The native kernel's ``variant`` argument per decode activation type: "fp32" multiplies the
# fp32 rows (AVX-512 or AVX2), "int8" quantizes each 32-value block of a row to int8 with an
# fp32 scale first (AVX512-VNNI; CPUs without it run "fp32"), "bf16" rounds rows and weights
# to bf16 and sums the products in fp32 on AMX tiles (CPUs without AMX-BF16 run "fp32").
# Batches of 1-4 rows: fp32 always.
DECODE_ACT_VARIANTS = {"fp32": 0, "int8": 1, "bf16": 3}


def ggml_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qtype: int,
    dense_min_tokens: int = 32,
    dense_dtype: torch.dtype = torch.float32,
    decode_act: str = "fp32",
    keep_dense_dtype: bool = False,
) -> torch.Tensor:
    """``x @ W.T`` for GGUF-quantized W; x: (M, K) fp32 -> (M, N) fp32. Below
    ``dense_min_tokens`` rows the native kernel reads the blocks directly (decode: bound by
    weight bytes), its activations in ``decode_act`` (a ``DECODE_ACT_VARIANTS`` key; the
    pure-torch fallback is fp32); from there on a dequantized dense GEMM is faster (prefill:
    bound by arithmetic), run in ``dense_dtype``: fp32 is bit-identical to
    ``ggml_linear_torch``; bf16 rounds x and W to bf16 (8-bit mantissa) and the product back.
    ``keep_dense_dtype``: a dense GEMM's product stays in ``dense_dtype`` (for a consumer that
    takes it, e.g. bf16 ``silu_and_mul`` before the next bf16 GEMM: one conversion pass less
    each way); x may then already be in ``dense_dtype``. The result is fp32 otherwise."""
    if decode_act not in DECODE_ACT_VARIANTS:
        raise ValueError(f"decode_act={decode_act!r}: expected one of {list(DECODE_ACT_VARIANTS)}")
    linear = _op("ggml_linear")
    dense = x.shape[0] >= dense_min_tokens
    if x.dtype != torch.float32 and not (dense and x.dtype == dense_dtype):
        x = x.float()  # only a dense GEMM takes its own dtype's input as it is
    if linear is not None and not dense:
        if decode_act == "fp32":  # the default variant: a library built before int8 has it too
            return linear(x, qweight, qtype)
        return linear(x, qweight, qtype, DECODE_ACT_VARIANTS[decode_act])
    if dense_dtype == torch.float32 or not dense:
        return torch.nn.functional.linear(x, ggml_dequantize(qweight, qtype))
    w = ggml_dequantize(qweight, qtype, dense_dtype)
    y = torch.nn.functional.linear(x.to(dense_dtype), w)
    return y if keep_dense_dtype else y.float()


# -- per-layer ops of the Llama family ------------------------------------------------------
def _fused(t: torch.Tensor):
    """``triton_ops`` for a CUDA tensor when it can run (``VLLM_CUDA_FUSED_OPS`` on, triton
    importable), else None: pure torch."""
    return _fused_module() if t.device.type == "cuda" else None


@functools.cache
def _fused_module():
    if not envs.VLLM_CUDA_FUSED_OPS:
        return None
    from vllm.model_executor.layers import triton_ops

    return triton_ops if triton_ops.triton is not None else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``rms_norm(x) * weight`` over the last dimension, as a new tensor."""
    fused = _fused(x)
    if fused is not None and x.dim() == 2 and x.stride(-1) == 1:
        return fused.rms_norm(x, weight, eps)
    return torch.nn.functional.rms_norm(x, weight.shape, weight, eps)


def fused_add_rms_norm_torch(
    input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    residual.add_(input)
    input.copy_(torch.nn.functional.rms_norm(residual, weight.shape, weight, eps))


def fused_add_rms_norm(
    input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    """In place, as vLLM's: ``residual += input``, then ``input = rms_norm(residual) * weight``.
    Both (num_tokens, hidden) contiguous fp32 for the native kernel."""
    native = _op("fused_add_rms_norm") if input.device.type == "cpu" else None
    fused = _fused(input)
    if native is not None and input.dtype == torch.float32:
        native(input, residual, weight, eps)
    elif fused is not None and input.dim() == 2 and input.is_contiguous():
        fused.fused_add_rms_norm(input, residual, weight, eps)
    else:
        fused_add_rms_norm_torch(input, residual, weight, eps)


def rotary_embedding_torch(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    neox: bool = True,
) -> None:
    """``rotary_embedding`` in torch. ``neox`` False: GPT-J style (Cohere's, vLLM's
    ``is_neox_style=False``): dimensions ``(2i, 2i + 1)`` rotate as a pair by pair ``i``'s
    angle, where Neox style pairs ``i`` with ``i + rot_dim / 2``; computed in fp32, as
    transformers computes Cohere's."""
    cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)  # (T, 1, rot_dim/2)
    rot_dim = cos_sin_cache.shape[-1]
    if not neox:
        cos, sin = cos.float(), sin.float()
    for x in (query, key):
        heads = x.view(x.shape[0], -1, head_size)
        if rot_dim != head_size:  # partial rotary: the leading rot_dim dimensions only
            heads = heads[..., :rot_dim]
        if neox:
            x1, x2 = heads.chunk(2, dim=-1)
            heads.copy_(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1))
        else:
            x1, x2 = heads.float().unflatten(-1, (-1, 2)).unbind(-1)
            rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
            heads.copy_(rotated.flatten(-2))


def rotary_embedding_interleaved(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
) -> None:
    """GPT-J-style ``rotary_embedding`` (``rotary_embedding_torch(..., neox=False)``)."""
    rotary_embedding_torch(positions, query, key, head_size, cos_sin_cache, neox=False)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
) -> None:
    """Neox-style rotary embedding of every head of ``query`` (T, heads * head_size) and
    ``key`` (T, kv_heads * head_size), in place; rows may be strided views. cos_sin_cache:
    (max_position, rot_dim) = [cos | sin]; the first ``rot_dim`` dimensions of each head
    rotate (all of them but for a partial rotary embedding, which takes the torch path).
    Native and fallback are bit-identical."""
    if cos_sin_cache.shape[-1] != head_size:
        rotary_embedding_torch(positions, query, key, head_size, cos_sin_cache)
        return
    native = _op("rotary_embedding") if query.device.type == "cpu" else None
    fused = _fused(query)
    if native is not None and query.dtype == torch.float32:
        native(positions, query, key, head_size, cos_sin_cache, True)
    elif fused is not None and query.dim() == key.dim() == 2:
        fused.rotary_embedding(positions, query, key, head_size, cos_sin_cache)
    else:
        rotary_embedding_torch(positions, query, key, head_size, cos_sin_cache)


def rotary_embedding_and_cache(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """``rotary_embedding`` of query and key (in place), then key and value (T, kv_heads *
    head_size) into their cache slots as ``reshape_and_cache_torch(..., padded=False)``
    writes them (every slot >= 0): one Triton launch for CUDA tensors
    (``triton_ops.rotary_embedding_and_cache``), else the two ops."""
    fused = _fused(query)
    whole = cos_sin_cache.shape[-1] == head_size  # the fused kernel rotates whole heads
    if fused is not None and whole and query.dim() == key.dim() == value.dim() == 2:
        fused.rotary_embedding_and_cache(
            positions, query, key, value, head_size, cos_sin_cache, kv_cache, slot_mapping
        )
        return
    rotary_embedding(positions, query, key, head_size, cos_sin_cache)
    kv_heads = key.shape[-1] // head_size
    reshape_and_cache_torch(
        key.view(-1, kv_heads, head_size),
        value.view(-1, kv_heads, head_size),
        kv_cache,
        slot_mapping,
        padded=False,
    )


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for x (..., 2d), as a new (..., d) tensor. A bf16 x
    (the gguf path's bf16 prefill) is computed in fp32 and rounded to bf16 once."""
    d = x.shape[-1] // 2
    fused = _fused(x)
    if fused is not None and x.stride(-1) == 1:
        return fused.silu_and_mul(x)
    native = _op("silu_and_mul") if x.device.type == "cpu" else None
    if x.dtype == torch.bfloat16 and (native is None or not x.is_contiguous()):
        return silu_and_mul(x.float()).to(torch.bfloat16)
    if native is None or x.dtype not in (torch.float32, torch.bfloat16) or not x.is_contiguous():
        return torch.nn.functional.silu(x[..., :d]) * x[..., d:]
    out = torch.empty(x.shape[:-1] + (d,), dtype=x.dtype)
    native(out, x)
    return out


def has_paged_decode_attention() -> bool:
    return _op("paged_decode_attention") is not None


def paged_decode_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> None:
    """Native only (the torch backend keeps its gather + SDPA fallback): writes out (n, heads,
    dim) for decode queries (n, heads, dim) over their first ``seq_lens`` cache positions
    through ``block_table`` (n, max_blocks) int64."""
    _op("paged_decode_attention")(out, query, kv_cache, block_table, seq_lens, scale)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Build the optional native kernels.")
    parser.add_argument("--build", action="store_true", help="JIT-compile csrc/ now")
    parser.add_argument(
        "--ensure", action="store_true", help="build only if this source's build is missing"
    )
    args = parser.parse_args()
    if args.build:
        print(f"built {build(verbose=True)}")
    elif args.ensure:
        ensure_native_kernels()
    print(f"native kernels available: {has_native_kernels()}")
    print(f"native quantized kernels available: {has_quant_kernels()}")
    print(f"all native kernels of these sources available: {has_all_native_kernels()}")
