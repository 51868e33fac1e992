"""No copy of host data to the device that makes the host wait, on the path of a step.

On CUDA ``torch.tensor(values, device="cuda")`` and ``host.to("cuda")`` copy from pageable
memory and synchronize the stream: the host waits for every kernel queued before. With
--async-scheduling the step before is still on the device when the next one builds its
inputs and samples, so each such copy loses the overlap (one of them in
``_tokens_ahead`` cost it on every step until session 21). The step's modules go through
``vllm/utils/device.py`` instead (pinned memory, ``non_blocking=True``); this reads their
source for the patterns that wait. The sampler's values are checked at run time by
tests/v1/sample/test_sampler_device.py (``FakeDevice.blocking_uploads``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import vllm

ROOT = Path(vllm.__file__).parent
STEP_MODULES = [
    "v1/sample/sampler.py",
    "v1/worker/model_runner.py",
    "v1/worker/cuda_graph.py",
    "v1/attention/backends/torch_flash.py",
    "v1/attention/backends/triton_decode.py",
    "v1/attention/backends/torch_sdpa.py",
    "v1/attention/backends/varlen_metadata.py",
    "v1/structured_output/manager.py",
    "lora/layers.py",
]


def waiting_uploads(source: str) -> list[str]:
    """The calls that copy host data to the device and wait: ``torch.tensor(...,
    device=X)`` and ``torch.as_tensor(..., device=X)`` (X not the string "cpu"), and
    ``.cuda()``. (``.to(...)`` is left out: read alone, a call cannot tell a dtype cast
    or a device-to-device move from an upload.)"""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        name = node.func.attr
        kwargs = {k.arg: k.value for k in node.keywords}
        base = node.func.value
        if name in ("tensor", "as_tensor") and isinstance(base, ast.Name) and base.id == "torch":
            device = kwargs.get("device")
            if device is not None and not (
                isinstance(device, ast.Constant) and device.value == "cpu"
            ):
                found.append(f"line {node.lineno}: torch.{name}(..., device=...)")
        elif name == "cuda" and not node.args:
            found.append(f"line {node.lineno}: .cuda()")
    return found


@pytest.mark.parametrize("module", STEP_MODULES)
def test_the_step_makes_no_waiting_upload(module):
    assert waiting_uploads((ROOT / module).read_text()) == []


def test_the_check_finds_what_waits():
    src = (
        "import torch\n"
        "a = torch.tensor([1, 2], device=dev)\n"
        "b = torch.as_tensor(x, dtype=torch.long, device=self.device)\n"
        "c = torch.tensor([1], device='cpu')\n"
        "d = host.cuda()\n"
    )
    assert waiting_uploads(src) == [
        "line 2: torch.tensor(..., device=...)",
        "line 3: torch.as_tensor(..., device=...)",
        "line 5: .cuda()",
    ]
