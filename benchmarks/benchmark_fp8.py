"""FP8 linear layers against dense ones on this machine: whether an FP8 checkpoint runs
``Fp8Linear`` or its dequantized weights by default (``model_loader.CPU_FP8_BY_DEFAULT``
on CPU; on CUDA >= 8.9 Fp8Linear).

For decode-sized (1, 8 rows) and prefill-sized (64, 256 rows) inputs and Llama-style
shapes, the median time of: ``F.linear`` on fp32 and bf16 weights, ``Fp8Linear`` (the
per-token activation quantization plus ``torch._scaled_mm``) and ``_scaled_mm`` alone. The
ratio column is Fp8Linear over the dense layer in the activations' dtype (below 1: FP8 is
faster). Prints the CPU model and its vector extensions (or the GPU's name).

    .venv/bin/python benchmarks/benchmark_fp8.py [--device cpu] [--repeats 20]
"""

from __future__ import annotations

import argparse
import platform
import re
import statistics
import time
from functools import partial

import torch
import torch.nn.functional as F

from vllm.model_executor.layers.quantization.fp8 import Fp8Linear, quantize_fp8_rows

SHAPES = [(2048, 2048), (2048, 8192), (8192, 2048)]  # (in, out): Llama-3.2-1B's
ROWS = [1, 8, 64, 256]


def machine(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model, flags = platform.processor() or "?", set()
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        model = re.search(r"model name\s*:\s*(.*)", info).group(1)
        flags = set(re.search(r"flags\s*:\s*(.*)", info).group(1).split())
    except (OSError, AttributeError):
        pass
    vector = sorted(f for f in flags if f.startswith(("avx", "amx", "fma")))
    return f"{model}, {torch.get_num_threads()} threads, {' '.join(vector) or 'no AVX'}"


def median_ms(fn, repeats: int, device: torch.device) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    device = torch.device(args.device)
    act = torch.float32 if device.type == "cpu" else torch.bfloat16
    print(f"# {machine(device)}; torch {torch.__version__}; activations {act}")
    print(f"{'in':>5} {'out':>5} {'rows':>4} | {'fp32 ms':>8} {'bf16 ms':>8} "
          f"{'fp8 ms':>8} {'mm ms':>8} | fp8/{str(act).removeprefix('torch.')}")  # fmt: skip
    torch.manual_seed(0)
    with torch.inference_mode():
        for k, n in SHAPES:
            dense = torch.nn.Linear(k, n, bias=False, device=device)
            fp8 = Fp8Linear.from_dense(dense)
            w32, w16 = dense.weight, dense.weight.to(torch.bfloat16)
            for m in ROWS:
                x32 = torch.randn(m, k, device=device)
                x16, x = x32.to(torch.bfloat16), x32.to(act)
                q, s = quantize_fp8_rows(x)
                t32, t16, t8, tmm = (
                    median_ms(fn, args.repeats, device)
                    for fn in (
                        partial(F.linear, x32, w32),
                        partial(F.linear, x16, w16),
                        partial(fp8, x),
                        partial(torch._scaled_mm, q, fp8.weight.t(), scale_a=s,
                                scale_b=fp8.weight_scale, out_dtype=act),
                    )
                )  # fmt: skip
                base = t32 if act == torch.float32 else t16
                print(f"{k:>5} {n:>5} {m:>4} | {t32:8.3f} {t16:8.3f} {t8:8.3f} {tmm:8.3f} | "
                      f"{t8 / base:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
