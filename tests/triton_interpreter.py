"""Triton kernels on CPU tensors, in Triton's interpreter, for the kernel tests.

Triton reads ``TRITON_INTERPRET`` when a kernel is decorated, i.e. when the kernel's module
is imported, so the interpreted kernels run in a child process started with it set; this
process's compiled kernels are left alone. Skips the calling test where triton is not
installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_interpreted(module: str, stdin: str | None = None, timeout: float = 540) -> dict:
    """``module.interpreter_main()`` in a child with ``TRITON_INTERPRET=1`` (``stdin`` on its
    standard input); the last line it prints, parsed as JSON."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed, so its interpreter cannot run the kernels on CPU")
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    code = f"from {module} import interpreter_main; interpreter_main()"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        input=stdin,
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def interpreted_cases(module: str, case_ids: Iterable[str]) -> dict:
    """``run_interpreted`` of ``module`` with ``case_ids`` on its standard input, after
    checking that the kernels really ran in the interpreter (not compiled)."""
    results = run_interpreted(module, stdin=json.dumps(list(case_ids)))
    assert results["interpreted"] == "InterpretedFunction", results["interpreted"]
    return results


def print_case_results(
    interpreted: object, cases: Iterable[str], run: Callable[[str], dict]
) -> None:
    """The child's side: ``run(case_id)`` of each case (its traceback where it raises) and
    ``interpreted`` (what says the kernels ran in the interpreter), as the one JSON line
    ``run_interpreted`` reads."""
    results = {"interpreted": interpreted}
    for case_id in cases:
        try:
            results[case_id] = run(case_id)
        except Exception:
            results[case_id] = {"error": traceback.format_exc()}
    print(json.dumps(results))


# Shared memory a block may use (opt-in maximum): A100 (sm80) 163 KiB, H100 (sm90) 227 KiB.
MAX_SHARED = {80: 166912, 90: 232448}


def compile_for_cuda(kernel, pointers: dict[str, str], scalars: dict[str, str], constants: dict,
                     capability: int, **options) -> None:  # fmt: skip
    """Lower the Triton kernel ``kernel`` to a cubin for compute capability ``capability``
    (80: Ampere, 90: Hopper) with Triton's CUDA backend and its ptxas, on a machine without
    a GPU: what the interpreter does not check. ``pointers``: argument -> element type
    (``"bf16"``, ``"u8"``...); ``scalars``: argument -> type (``"i32"``, ``"fp32"``, or a
    pointer spelled ``"*fp64"``); ``constants``: the constexprs. Together they must name
    every argument, in order; ``options``: the launch's (``num_warps``, ``num_stages``).
    The cubin's shared memory must fit the capability's (``MAX_SHARED``). Skips without
    triton, in an interpreted process, or where the install has no ptxas."""
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError:
        pytest.skip("triton is not installed")
    if not hasattr(kernel, "arg_names"):
        pytest.skip("TRITON_INTERPRET is set in this process")
    signature = {name: "*" + t for name, t in pointers.items()}
    signature.update(scalars)
    signature.update((name, "constexpr") for name in constants)
    assert list(signature) == kernel.arg_names  # every argument, in order
    try:
        compiled = triton.compile(
            ASTSource(kernel, signature, constants),
            target=GPUTarget("cuda", capability, 32),
            options=options or None,
        )
    except RuntimeError as e:  # no ptxas in this install
        if "ptxas" in str(e):
            pytest.skip(str(e))
        raise
    assert compiled.asm["cubin"]
    assert compiled.metadata.shared <= MAX_SHARED[capability], compiled.metadata.shared
