"""Weights are created and loaded in the target dtype (``load_model_weights``).

On CUDA the model used to be built in fp32 on the device and cast afterwards: an fp32
copy of every weight existed on the GPU (32 GB for an 8B model), which the caching
allocator then kept and the KV sizing counted as used. Here the load runs under
FakeTensorMode on a fake ``cuda`` device (no GPU needed) with a dispatch mode recording
the dtype of every tensor any op produces there: nothing on the device is fp32 when bf16
is asked. On CPU the bf16 result equals the old build-then-cast path bit for bit, and an
fp32 load is unchanged.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.tiny_models import TINY_LLAMA, save_tiny_llama
from vllm.model_executor.model_loader import load_model_weights
from vllm.model_executor.models.llama import LlamaForCausalLM

TINY = TINY_LLAMA


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(hf_config, folder) of a tiny random Llama saved by transformers (fp32)."""
    path = tmp_path_factory.mktemp("tiny-llama")
    return save_tiny_llama(path), str(path)


class DeviceDtypes(TorchDispatchMode):
    """Records (dtype, numel, op) of every tensor an op outputs on ``device_type`` while
    ``recording``."""

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.device_type = device_type
        self.recording = True
        self.outputs: list[tuple[torch.dtype, int, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            new = not any(t is a for a in args)  # not an in-place op's own destination
            if self.recording and new and isinstance(t, torch.Tensor) and t.device == self.device:
                self.outputs.append((t.dtype, t.numel(), str(func)))
        return out

    @property
    def device(self) -> torch.device:
        return torch.device(self.device_type)


def _load_recorded(checkpoint, dtype):
    """Load onto the meta device, standing in for the GPU (the checkpoint is on the CPU, as
    on a GPU machine): the model and what every op produced on the device after the
    model's construction (which is on meta by design: shapes only, nothing allocated)."""
    config, path = checkpoint
    recorder = DeviceDtypes("meta")

    class Recorded(LlamaForCausalLM):
        def __init__(self, arch) -> None:
            recorder.recording = False
            super().__init__(arch)
            recorder.recording = True

    with recorder:
        model = load_model_weights(Recorded, config, path, "meta", dtype)
    return model, recorder.outputs


def test_no_fp32_tensor_is_ever_made_on_the_device(checkpoint):
    model, outputs = _load_recorded(checkpoint, torch.bfloat16)
    tensors = list(model.parameters()) + list(model.buffers())
    assert all(t.is_meta and t.dtype == torch.bfloat16 for t in tensors)
    assert outputs, "the recorder saw nothing on the device: the test would prove nothing"
    fp32 = [o for o in outputs if o[0] == torch.float32]
    assert not fp32, f"fp32 tensors made on the device while loading bf16: {fp32[:5]}"
    # No second copy of the model in any dtype: every parameter was made twice, by
    # ``.to(dtype)`` on meta (no memory) and by ``to_empty`` (the real allocation); the
    # rotary table once more, when ``load_weights`` moves the computed one in.
    assert {d for d, _, _ in outputs} == {torch.bfloat16}
    params = sum(p.numel() for p in model.parameters())
    buffers = sum(b.numel() for b in model.buffers())
    assert sum(n for _, n, _ in outputs) == 2 * params + 3 * buffers


def test_fp32_load_stays_fp32_on_the_device(checkpoint):
    model, outputs = _load_recorded(checkpoint, torch.float32)
    assert outputs and {d for d, _, _ in outputs} == {torch.float32}
    assert all(p.dtype == torch.float32 for p in model.parameters())


def _old_build_then_cast(checkpoint, dtype) -> torch.nn.Module:
    """The previous loader: built in fp32 on the device, loaded, then cast as a whole."""
    from safetensors.torch import load_file

    config, path = checkpoint
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaForCausalLM.arch_from_hf(config))
    model = model.to_empty(device="cpu")
    model.load_weights(load_file(f"{path}/model.safetensors"))
    return model.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_load_equals_the_build_then_cast_path(checkpoint, dtype):
    config, path = checkpoint
    new = load_model_weights(LlamaForCausalLM, config, path, "cpu", dtype)
    old = _old_build_then_cast(checkpoint, dtype)
    new_state, old_state = new.state_dict(), old.state_dict()
    assert new_state.keys() == old_state.keys()
    for name, tensor in new_state.items():
        assert tensor.dtype == dtype, name
        assert torch.equal(tensor, old_state[name]), name
    assert new.rope.cos_sin_cache.dtype == dtype
    assert torch.equal(new.rope.cos_sin_cache, old.rope.cos_sin_cache.to(dtype))
