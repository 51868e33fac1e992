"""`vllm serve` freezes both processes' start-up heaps out of garbage collections
(vllm/utils/gc_utils.py), and VLLM_GC_DEBUG logs the collections that still run."""

from __future__ import annotations

import os
import re

import pytest

from tests.entrypoints.test_generation_config import tiny_model
from tests.utils import RemoteServer

pytestmark = pytest.mark.slow


def test_both_processes_freeze_their_start_up_heap(tmp_path):
    model = tiny_model(tmp_path / "model")
    log = tmp_path / "server.log"
    env = {**os.environ, "VLLM_GC_DEBUG": "1"}
    with RemoteServer(
        "--model", model, "--served-model-name", "tiny", "--max-model-len", "300",
        log_path=str(log), env=env,
    ) as server:  # fmt: skip
        client = server.client()
        for _ in range(3):
            reply = client.completions.create(model="tiny", prompt="Hello", max_tokens=8)
            assert reply.choices[0].text is not None
    text = log.read_text()
    found = re.findall(r"Froze (\d+) objects of the (engine core|API server)'s", text)
    frozen = {name: int(n) for n, name in found}
    assert set(frozen) == {"engine core", "API server"}, text[-3000:]
    assert all(n > 10_000 for n in frozen.values())  # torch, transformers, the model
    # The debug callback is on in both processes: young collections ran while serving.
    assert re.search(r"GC generation 0: [0-9.]+ ms, \d+ collected", text)
