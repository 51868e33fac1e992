"""The sampler keeps to the logits' device (issue 27), checked on a CPU-only machine.

On an H100 four paths failed only on CUDA, each a CPU tensor next to CUDA logits: seeded
rows (a CUDA generator asked for a CPU uniform), presence/frequency penalties (CPU counts),
batched temperature (CPU temperatures: the batch fell back row by row, warning every
step). Two fakes catch that here:

- ``FakeDevice`` (``fake_device.py``): real values on the CPU, reported as ``cuda:0``; it
  raises where eager CUDA raises and records every tensor made on the host. Each test
  samples the same batch on plain CPU logits and on "device" logits and wants the same
  tokens and logprobs, no error, no warning and no host-made tensor.

torch's FakeTensorMode cannot stand in: on a CPU-only build, Python indexing of its fake
CUDA tensors (``x[0]``, ``x[:, -1:]``) raises "PyTorch is not linked with support for
cuda devices", and the sampler indexes everywhere.

tests/cuda/test_sampling_cuda.py runs the same paths on a real GPU.
"""

from __future__ import annotations

import logging

import pytest
import torch

from tests.v1.sample.fake_device import DeviceMismatch, FakeDevice
from vllm.sampling_params import SamplingParams
from vllm.v1.sample.sampler import (
    SamplingRow,
    sample,
    sample_on_device,
    sampled_logprobs_on_device,
    token_logprobs,
)

VOCAB = 257


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


def _rows(specs: list[dict], dev: FakeDevice | None) -> list[SamplingRow]:
    """Rows of ``specs`` (SamplingParams plus ``prompt``/``output``); a seeded row gets a
    CPU generator, or one standing for a device generator when ``dev`` is given."""
    rows = []
    for spec in specs:
        spec = dict(spec)
        prompt, output = spec.pop("prompt", [1, 2, 3]), spec.pop("output", [4, 5, 5, 9])
        seed = spec.get("seed")
        gen = (
            None
            if seed is None
            else (dev.generator(seed) if dev else torch.Generator().manual_seed(seed))
        )
        rows.append(SamplingRow(SamplingParams(**spec), gen, prompt, output))
    return rows


def _same_on_device(specs: list[dict], caplog) -> FakeDevice:
    """Sample ``specs`` on CPU logits, then on the pretend device: the same result, and
    nothing on the device path failed, warned or was built on the host."""
    logits = _logits(len(specs))
    torch.manual_seed(0)  # unseeded rows draw from the global RNG
    expected = sample(logits.clone(), _rows(specs, None))
    assert not expected.errors
    dev = FakeDevice()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vllm"), dev:
        on_device = dev.tensor(logits)
        torch.manual_seed(0)
        got = sample(on_device, _rows(specs, dev))
    assert not got.errors, {i: f.message for i, f in got.errors.items()}
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    assert dev.host_tensors == []
    assert dev.blocking_uploads == []  # every host value went up without waiting
    assert got.token_ids == expected.token_ids
    assert got.logprobs == expected.logprobs
    # What a deferred step (--async-scheduling) runs of it reads nothing back (``sample``
    # reads the results once, after).
    dev.device_reads.clear()
    with dev:
        torch.manual_seed(0)
        rows, on_device = _rows(specs, dev), dev.tensor(logits)
        tokens, _, _ = sample_on_device(on_device, rows)
        sampled_logprobs_on_device(on_device, rows, tokens)
    assert dev.device_reads == []
    return dev


def test_greedy_rows_and_their_logprobs_stay_on_the_device(caplog):
    # A control: this path worked on CUDA before (it builds only the logprobs' targets).
    _same_on_device([{"temperature": 0.0}, {"temperature": 0.0, "logprobs": 3}], caplog)


def test_seeded_rows_draw_on_the_device_with_their_own_generator(caplog):
    # top_k / top_p / min_p rows go one by one through ``draw``.
    _same_on_device(
        [
            {"seed": 1, "temperature": 0.8, "top_k": 20},
            {"seed": 2, "temperature": 1.0, "top_p": 0.9, "logprobs": 2},
            {"seed": 3, "temperature": 1.2, "min_p": 0.05},
            {"temperature": 1.0, "top_k": 5},  # unseeded: the device's global RNG
        ],
        caplog,
    )


def test_temperature_rows_are_sampled_together_on_the_device(caplog):
    # Seeded and unseeded rows with a temperature only: one batch, no fallback warning.
    _same_on_device(
        [
            {"seed": 11, "temperature": 0.7},
            {"temperature": 1.0},
            {"seed": 12, "temperature": 1.5, "logprobs": 1},
            {"temperature": 0.3},
        ],
        caplog,
    )


@pytest.mark.parametrize(
    "penalty",
    [
        {"repetition_penalty": 1.3},
        {"presence_penalty": 0.5},
        {"frequency_penalty": 0.4},
        {"presence_penalty": -0.3, "frequency_penalty": 0.7, "repetition_penalty": 0.9},
    ],
)
def test_penalties_index_on_the_device(penalty, caplog):
    _same_on_device(
        [{"temperature": 0.0, **penalty}, {"seed": 5, "temperature": 0.9, **penalty}], caplog
    )


def test_a_batch_of_every_kind_of_row_is_sampled_together_on_the_device(caplog):
    # Penalties, processors and filters in one batch: one sampling pass on the device
    # (what --async-scheduling leaves there), nothing built on the host.
    _same_on_device(
        [
            {"temperature": 0.0, "repetition_penalty": 1.2, "logit_bias": {3: 2.0}},
            {"seed": 1, "temperature": 0.9, "top_p": 0.8, "frequency_penalty": 0.5},
            {"seed": 2, "temperature": 1.1, "top_k": 7, "min_tokens": 5, "stop_token_ids": [9]},
            {"temperature": 0.7, "min_p": 0.02, "presence_penalty": 0.3, "logprobs": 2},
            {"temperature": 0.0, "allowed_token_ids": [1, 4, 5, 9]},
        ],
        caplog,
    )


def test_prompt_logprobs_stay_on_the_device():
    logits = _logits(6)
    expected = token_logprobs(logits, [3, 0, 256, 7, 7, 100], 4)
    dev = FakeDevice()
    with dev:
        got = token_logprobs(dev.tensor(logits), [3, 0, 256, 7, 7, 100], 4)
    assert got == expected and dev.host_tensors == [] and dev.blocking_uploads == []


# -- the fake itself: it must catch what CUDA raises, or the tests above prove nothing ------
def test_fake_device_raises_where_cuda_raises():
    dev = FakeDevice()
    with dev:
        x = dev.tensor(torch.zeros(4))
        assert x.device == torch.device("cuda", 0) and (x + 1).device.type == "cuda"
        with pytest.raises(DeviceMismatch):
            x - torch.ones(4)  # a host operand of one dimension
        with pytest.raises(DeviceMismatch):
            torch.searchsorted(x, torch.tensor(0.5))  # no 0-dim exemption there
        with pytest.raises(DeviceMismatch):
            torch.rand((), generator=dev.generator(0))  # a device generator, host tensor
        with pytest.raises(DeviceMismatch):
            x.numpy()
        assert x[torch.tensor([1, 2])].device.type == "cuda"  # host indices are fine
        assert (x * torch.tensor(2.0)).device.type == "cuda"  # so is a host scalar
        assert x.cpu().device.type == "cpu" and torch.ones(2).to(x.device).device.type == "cuda"
        torch.rand((), generator=dev.generator(0), device=x.device)
    # Made without a device: zeros (the input), ones(4), tensor(0.5), tensor([1, 2]),
    # tensor(2.0), ones(2).
    assert dev.host_tensors == ["zeros", "ones", "tensor", "tensor", "tensor", "ones"]


def test_fake_device_records_copies_to_it_that_wait():
    dev = FakeDevice()
    with dev:
        x = dev.tensor(torch.zeros(4))
        host = torch.ones(4)
        torch.tensor([1, 2], device=x.device)  # waits on CUDA
        host.to(x.device)  # waits
        x.copy_(host)  # waits
        assert dev.blocking_uploads == ["tensor", "to", "copy_"]
        host.to(x.device, non_blocking=True)
        x.copy_(host, non_blocking=True)
        x.to(x.device)  # already there
        x.cpu()
        torch.zeros(3, device=x.device)  # nothing copied
    assert dev.blocking_uploads == ["tensor", "to", "copy_"]


def test_min_tokens_masks_stop_tokens_on_the_device(caplog):
    # Every row has 4 outputs; the stop tokens are masked until 9 (one index copy).
    specs = [
        {"temperature": 0.0, "min_tokens": 9, "stop_token_ids": [3, 7]},
        {"seed": 4, "temperature": 0.8, "min_tokens": 9, "stop_token_ids": [11]},
    ]
    _same_on_device(specs, caplog)


def test_allowed_token_ids_and_logit_bias_index_on_the_device(caplog):
    specs = [
        {"temperature": 0.0, "allowed_token_ids": [3, 8, 40], "logprobs": 2},
        {"seed": 6, "temperature": 0.9, "logit_bias": {5: 4.0, 9: -100.0}},
        {"temperature": 0.7, "top_k": 10, "allowed_token_ids": [1, 2, 3], "logit_bias": {2: 1.0}},
    ]
    _same_on_device(specs, caplog)
