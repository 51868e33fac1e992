from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def tokenizer():
    from vllm.transformers_utils.tokenizer import get_tokenizer

    return get_tokenizer("SmolLM2-135M-Instruct")


@pytest.fixture(scope="session")
def hf_model():
    import torch
    from transformers import AutoModelForCausalLM

    from vllm.model_executor.model_loader import resolve_model

    return AutoModelForCausalLM.from_pretrained(
        resolve_model("SmolLM2-135M-Instruct"), dtype=torch.float32
    ).eval()


def hf_greedy(hf_model, tokenizer, prompt: str, max_tokens: int) -> list[int]:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = hf_model.generate(ids, max_new_tokens=max_tokens, do_sample=False)
    return out[0, ids.shape[1] :].tolist()


LEFTOVER_GRACE_S = 15.0  # how long children may take to exit after the last test
# multiprocessing's own helper: it lives as long as this process and exits with it.
HELPERS = ("multiprocessing.resource_tracker",)


def pytest_sessionfinish(session, exitstatus):
    """Fail the run if a process that a test started outlives the session.

    Every test reaps what it spawned (an engine, a server). A survivor would keep the
    machine busy or, worse, hang the interpreter's exit (multiprocessing joins its daemon
    children there, and an engine ignores SIGTERM): it is killed and the run fails.
    """
    import psutil

    children = [p for p in psutil.Process().children(recursive=True) if not _is_helper(p)]
    _, alive = psutil.wait_procs(children, timeout=LEFTOVER_GRACE_S)
    if not alive:
        return
    lines = []
    for proc in alive:
        try:
            lines.append(f"  pid {proc.pid}: {' '.join(proc.cmdline())[:200]}")
            proc.kill()
        except psutil.NoSuchProcess:
            continue
    psutil.wait_procs(alive, timeout=5)
    if not lines:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    message = "processes left behind by the tests (killed):\n" + "\n".join(lines)
    if reporter is not None:
        reporter.write_line(message, red=True)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _is_helper(proc) -> bool:
    import psutil

    try:
        return any(h in " ".join(proc.cmdline()) for h in HELPERS)
    except psutil.NoSuchProcess:
        return True


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` skip cleanly where no CUDA device is (CI); `make test-gpu`
    runs them on a GPU machine."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    """``VLLM_TEST_PRINT_FAILURES=1`` (scripts/gpu/run.sh sets it): each failure's report
    printed when it happens, not at the session's end, which a run killed at its time
    limit never reaches (a GPU session lost two failures' reports so)."""
    if report.failed and os.environ.get("VLLM_TEST_PRINT_FAILURES") == "1":
        print(f"\n[failure] {report.nodeid} ({report.when})\n{report.longreprtext}", flush=True)
