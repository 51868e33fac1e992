"""--async-scheduling: a deferred step makes the host wait for nothing on the device.

The step before is still running while a deferred step builds its inputs and samples; a
read of a device value, or a copy up from pageable memory, waits for it and throws the
overlap away. On CUDA, tests/cuda/test_async_scheduling_cuda.py watches real steps with
torch's sync debug mode; here the runner runs on ``FakeDevice``'s pretend ``cuda:0``
(tests/v1/sample/fake_device.py), which records the same operations, with a stand-in
model (its logits on the device) and the CUDA attention backend's metadata. Steps cover a
prefill batch (sampled rows picked out of the hidden states), decodes whose input tokens
are still on the device, greedy, random, logprob and penalised rows. Penalised rows take
their histories from the device's token tables (``PenaltyTable``, the runner's way), so
only a grammar's rows make a step land the one before it first.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.v1.sample.fake_device import FakeDevice
from tests.v1.worker.test_model_runner_inputs import new_req, sched_out
from vllm.config import CacheConfig, VllmConfig
from vllm.sampling_params import StructuredOutputsParams
from vllm.v1.attention.backends.torch_flash import TorchFlashAttentionBackend
from vllm.v1.worker import model_runner as runner_module
from vllm.v1.worker.model_runner import DeferredOutput, ModelRunner

VOCAB = 49152  # SmolLM2's, the default model's tokenizer: grammar masks fit the logits
BLOCK = 16


class _Event:
    """``torch.cuda.Event`` on a CPU-only build: the stand-in device has nothing pending."""

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _LogitsModel:
    """Hidden row i holds i; logits favour token 100 + (row's first input id) % 300."""

    def __call__(self, ids, positions, meta, kv_caches):
        return (ids.float() + positions.float() * 0)[:, None]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        token = 100 + hidden[:, 0].long() % 300
        logits = torch.zeros(len(hidden), VOCAB, device=hidden.device)
        return logits.scatter(1, token[:, None], 5.0)


SPECS = {
    "greedy": {},
    "random": {"temperature": 0.8, "top_p": 0.9},
    "logprobs": {"logprobs": 2},
    "penalised": {"repetition_penalty": 1.2, "presence_penalty": 0.5},
    "prompt_logprobs": {"prompt_logprobs": 2},
    "grammar": {"structured_outputs": StructuredOutputsParams(regex="[a-z ]+")},
}


@pytest.mark.parametrize(
    "kinds",
    [
        ["greedy", "random", "logprobs"],
        ["greedy", "penalised", "prompt_logprobs"],
        ["random", "grammar"],
    ],
)
def test_deferred_steps_read_nothing_from_the_device(monkeypatch, kinds):
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    threads = torch.get_num_threads()
    dev = FakeDevice()
    with dev:
        runner = ModelRunner(VllmConfig(cache_config=CacheConfig(block_size=BLOCK)), "cuda")
        runner.model = _LogitsModel()
        runner.arch = SimpleNamespace(vocab_size=VOCAB)
        runner.attn_backend = TorchFlashAttentionBackend(
            1, 1, 8, torch.bfloat16, torch.device("cuda"), BLOCK
        )
        prompts = {k: [7 + i, 30 + i, 50 + i, 11 * i + 3][: 2 + i] for i, k in enumerate(kinds)}
        reqs = [new_req(k, p, [i + 1], 0, **SPECS[k]) for i, (k, p) in enumerate(prompts.items())]
        steps = [sched_out(new=reqs, num_scheduled={k: len(p) for k, p in prompts.items()})]
        steps += [
            sched_out(
                cached=[(k, [], len(p) + j) for k, p in prompts.items()],
                num_scheduled=dict.fromkeys(prompts, 1),
            )
            for j in range(4)
        ]
        outputs, waits, landed = [], [], []
        for so in steps:
            dev.device_reads.clear()
            dev.blocking_uploads.clear()
            out = runner.execute_model(so, defer=True)
            assert isinstance(out, DeferredOutput)
            waits += [f"step {len(outputs)}: {w}" for w in dev.device_reads + dev.blocking_uploads]
            landed += [outputs[-1].done] if outputs else []
            outputs.append(out)
        tokens = {k: [] for k in prompts}
        for out in outputs:
            result = out.result()
            assert not result.errors
            for k, t in result.sampled_token_ids.items():
                tokens[k] += t
    torch.set_num_threads(threads)
    assert waits == []
    # A grammar's mask needs the step before's token on the host; nothing else does.
    assert landed == [("grammar" in kinds)] * (len(steps) - 1)
    if "penalised" in kinds:
        assert runner.penalty_table is not None and runner.penalty_table.num_used == 1
    assert all(len(t) == 5 for t in tokens.values())
    if "greedy" in tokens:  # the stand-in's logits: the prompt's last token, then its own
        assert tokens["greedy"][0] == 100 + prompts["greedy"][-1] % 300
        assert runner_module.is_bare_greedy(reqs[0].sampling_params)


def test_fake_device_records_reads_that_wait():
    dev = FakeDevice()
    with dev:
        x = dev.tensor(torch.arange(6.0))
        x.tolist()
        int(x[0])
        x[x > 2]  # a boolean mask: nonzero
        x[[0, 2]]  # a list index goes up from pageable memory
        x.nonzero()
        x.cpu()
        x.to("cpu", non_blocking=True)  # into pinned memory, read after an event: no wait
        x.index_select(0, dev.tensor(torch.tensor([0, 2])))  # an index on the device: no wait
    assert [r.split(" at")[0] for r in dev.device_reads] == [
        "tolist", "__int__", "__getitem__", "nonzero", "cpu",
    ]  # fmt: skip
    assert [r.split(" at")[0] for r in dev.blocking_uploads] == ["__getitem__"]
