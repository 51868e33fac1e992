"""Sampling on a real GPU (issue 27): seeds, penalties, batched temperature, grammar masks
and prompt logprobs on CUDA logits, against the CPU where results must agree.

Run with ``pytest -m cuda tests`` on a CUDA machine; skipped without one. The grammar test
needs a tokenizer: the embedded SmolLM2, or ``VLLM_TEST_MODEL`` (an HF folder with the
tokenizer files, such as shared/gpu/mkmodel.py's output); without either it skips.
The same paths run on CPU against a pretend device in tests/v1/sample/test_sampler_device.py.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field

import pytest
import torch

from tests.utils import save_smollm_vocab_llama
from tests.v1.structured_output.test_guided_decoding import WEATHER  # the CPU tests' schema
from vllm.sampling_params import SamplingParams, StructuredOutputsParams
from vllm.v1.sample.sampler import SamplingRow, apply_penalties, sample, token_logprobs

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda")
VOCAB = 49152


@pytest.fixture
def device() -> torch.device:
    return CUDA


def _logits(rows: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    cpu = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    return cpu.to(device)


def _row(device: torch.device, seed: int | None = None, output=(), **params) -> SamplingRow:
    gen = None if seed is None else torch.Generator(device=device).manual_seed(seed)
    return SamplingRow(SamplingParams(seed=seed, **params), gen, [1, 2, 3], list(output))


SEEDED = [
    {"seed": 1, "temperature": 0.8},
    {"seed": 2, "temperature": 1.0, "top_k": 50},
    {"seed": 3, "temperature": 1.2, "top_p": 0.9, "logprobs": 2},
    {"seed": 4, "temperature": 0.9, "min_p": 0.05},
    {"seed": 5, "temperature": 1.0, "presence_penalty": 0.5, "output": [7, 7, 9]},
    {"seed": 6, "temperature": 1.5},
]


def _seeded_tokens(device: torch.device, steps: int = 8) -> list[list[int]]:
    rows = [_row(device, **spec) for spec in SEEDED]
    logits = _logits(len(rows), device)
    out = []
    for _ in range(steps):
        result = sample(logits.clone(), rows)
        assert not result.errors, {i: f.message for i, f in result.errors.items()}
        out.append(result.token_ids)
    return out


@pytest.mark.parametrize("where", ["cuda", "cpu"])
def test_same_seed_same_tokens_on_each_device(where, device, caplog):
    # Each device is reproducible; CUDA's Philox and the CPU's Mersenne Twister give
    # different streams, so the two devices need not agree with each other.
    dev = device if where == "cuda" else torch.device("cpu")
    with caplog.at_level(logging.WARNING, logger="vllm"):
        first, again = _seeded_tokens(dev), _seeded_tokens(dev)
    assert first == again
    assert len({tuple(step) for step in first}) > 1  # real draws, not a constant
    assert not caplog.records, [r.getMessage() for r in caplog.records]


def test_penalties_on_cuda_match_the_cpu(device):
    logits = _logits(1, torch.device("cpu"))[0]
    for params in (
        {"repetition_penalty": 1.3},
        {"presence_penalty": 0.5, "frequency_penalty": 0.25},
        {"repetition_penalty": 0.8, "presence_penalty": -0.4, "frequency_penalty": 1.0},
    ):
        on_cpu = apply_penalties(
            logits.clone(), _row(torch.device("cpu"), output=[5, 5, 9], **params)
        )
        on_gpu = apply_penalties(logits.to(device), _row(device, output=[5, 5, 9], **params))
        assert on_gpu.device.type == "cuda"
        torch.testing.assert_close(on_gpu.cpu(), on_cpu, rtol=1e-6, atol=1e-6)
        greedy = [_row(device, temperature=0.0, output=[5, 5, 9], **params)]
        tokens, _, errors = sample(logits.to(device)[None].clone(), greedy)
        assert not errors and tokens == [int(on_cpu.argmax())]


def test_temperature_rows_are_batched_without_the_row_by_row_fallback(device, caplog):
    logits = _logits(16, device, seed=2)
    temps = [0.3, 0.7, 1.0, 1.5] * 4

    def rows():
        return [_row(device, seed=100 + i, temperature=t) for i, t in enumerate(temps)]

    with caplog.at_level(logging.WARNING, logger="vllm"):
        together = sample(logits.clone(), rows())
    assert not caplog.records, [r.getMessage() for r in caplog.records]  # no fallback
    assert not together.errors and sample(logits.clone(), rows()).token_ids == together.token_ids
    # Row by row (each row its own softmax and CDF): the same tokens, up to CUDA's
    # reductions rounding differently for a batch, which can move a draw at a boundary.
    one_by_one = [sample(logits[i : i + 1].clone(), [r]).token_ids[0] for i, r in enumerate(rows())]
    assert sum(a == b for a, b in zip(together.token_ids, one_by_one, strict=True)) >= 14
    assert len(set(together.token_ids)) > 8


def test_prompt_logprobs_on_cuda_match_the_cpu(device):
    logits = _logits(64, torch.device("cpu"), seed=5)
    targets = torch.randint(0, VOCAB, (64,), generator=torch.Generator().manual_seed(6)).tolist()
    expected = token_logprobs(logits, targets, 5)
    got = token_logprobs(logits.to(device), targets, 5)
    for e, g in zip(expected, got, strict=True):
        assert g.token_id == e.token_id and g.rank == e.rank
        assert g.logprob == pytest.approx(e.logprob, abs=1e-4)
        assert [t for t, _ in g.top] == [t for t, _ in e.top]
        assert [v for _, v in g.top] == pytest.approx([v for _, v in e.top], abs=1e-4)


def test_bf16_logits_sample_on_cuda(device):
    # The runner's logits are float32 (compute_logits casts), but a bf16 row must not fail.
    logits = _logits(3, device).bfloat16()
    rows = [_row(device, temperature=0.0), _row(device, 7, temperature=1.0), _row(device, 8)]
    assert not sample(logits, rows).errors


# -- grammar masks -----------------------------------------------------------------------


@dataclass
class _Req:
    req_id: str
    sampling_params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)


@pytest.fixture(scope="module")
def grammar_setup(tmp_path_factory):
    from vllm.model_executor.model_loader import resolve_model
    from vllm.transformers_utils.tokenizer import get_tokenizer
    from vllm.v1.structured_output import StructuredOutputManager

    pytest.importorskip("llguidance")
    model = os.environ.get("VLLM_TEST_MODEL")
    if model is None:  # SmolLM2's tokenizer: the embedded model's, or the GPU kit's copy
        path = tmp_path_factory.mktemp("grammar-tokenizer")
        save_smollm_vocab_llama(path, max_position_embeddings=128)  # config.json, tokenizer
        path = str(path)
    else:
        path = resolve_model(model)
    tokenizer = get_tokenizer(path)
    from vllm.config import ModelConfig, VllmConfig

    return StructuredOutputManager(VllmConfig(model_config=ModelConfig(model=path))), tokenizer


def test_grammar_masked_sampling_on_cuda_gives_schema_valid_json(grammar_setup, device):
    manager, tokenizer = grammar_setup
    vocab = manager.vocab_size
    gen = torch.Generator(device=device).manual_seed(0)
    for i in range(3):
        req = _Req(
            f"json{i}", SamplingParams(structured_outputs=StructuredOutputsParams(json=WEATHER))
        )
        plain = _Req(f"plain{i}", SamplingParams(temperature=0.0))
        for _ in range(200):
            logits = torch.randn(2, vocab, device=device, generator=gen)
            failures = manager.mask_logits(logits, [plain, req])
            assert failures == {}
            rows = [
                SamplingRow(plain.sampling_params, None, [], []),
                SamplingRow(SamplingParams(temperature=0.0), None, [], req.output_token_ids),
            ]
            tokens, _, errors = sample(logits, rows)
            assert not errors
            manager.accept([req], [tokens[1]])
            if tokens[1] == tokenizer.eos_token_id:
                break
            req.output_token_ids.append(tokens[1])
            if manager._matchers[req.req_id].is_stopped():  # "}" closed it: EOS is all left
                break
        value = json.loads(tokenizer.decode(req.output_token_ids))
        assert set(value) == {"city", "unit", "days"} and value["unit"] in ("celsius", "fahrenheit")
        manager.remove([req.req_id])


def test_grammar_mask_on_cuda_equals_the_cpu_mask(grammar_setup, device):
    manager, _ = grammar_setup
    so = StructuredOutputsParams(choice=["yes", "no", "maybe"])
    logits = torch.randn(1, manager.vocab_size, generator=torch.Generator().manual_seed(1))
    on_cpu = logits.clone()
    manager.mask_logits(on_cpu, [_Req("mask-cpu", SamplingParams(structured_outputs=so))])
    on_gpu = logits.to(device)
    manager.mask_logits(on_gpu, [_Req("mask-gpu", SamplingParams(structured_outputs=so))])
    assert torch.equal(on_gpu.cpu(), on_cpu) and torch.isinf(on_cpu).any()
    manager.remove(["mask-cpu", "mask-gpu"])


# -- the runner: generators on its device, one step end to end ---------------------------
def test_runner_samples_seeded_penalised_and_batched_rows_on_cuda(device, caplog):
    from types import SimpleNamespace

    from tests.v1.worker.test_model_runner_inputs import FLASH_BUILDER, new_req, sched_out
    from vllm.config import CacheConfig, VllmConfig
    from vllm.v1.worker.model_runner import ModelRunner

    class RandomLogitsModel:
        def __call__(self, ids, positions, meta, kv_caches):
            return torch.zeros(len(ids), 1, device=ids.device)

        def compute_logits(self, hidden):
            g = torch.Generator(device=hidden.device).manual_seed(0)
            return torch.randn(len(hidden), 512, device=hidden.device, generator=g)

    def run(tables: bool = True) -> dict[str, list[int]]:
        runner = ModelRunner(VllmConfig(cache_config=CacheConfig(block_size=4)), device=device)
        runner.model, runner.attn_backend = RandomLogitsModel(), FLASH_BUILDER
        runner.arch = SimpleNamespace(vocab_size=512)
        assert runner.use_penalty_tables  # the default: penalties from device tables
        runner.use_penalty_tables = tables
        specs = {
            "seeded": {"seed": 3, "temperature": 1.0},
            "seeded2": {"seed": 4, "temperature": 0.7},
            "penalised": {"seed": 5, "temperature": 0.9, "presence_penalty": 0.5,
                          "frequency_penalty": 0.5, "repetition_penalty": 1.2},
            "greedy": {"temperature": 0.0, "logprobs": 2, "prompt_logprobs": 2},
        }  # fmt: skip
        reqs = [
            new_req(r, [1, 2, 3], [2 * i + 1, 2 * i + 2], 0, **p)
            for i, (r, p) in enumerate(specs.items())
        ]
        out = runner.execute_model(sched_out(new=reqs, num_scheduled=dict.fromkeys(specs, 3)))
        tokens = {r: list(t) for r, t in out.sampled_token_ids.items()}
        assert not out.errors and out.prompt_logprobs["greedy"].entries
        for step in range(3, 6):
            cached = [(r, [], step) for r in specs]
            out = runner.execute_model(
                sched_out(cached=cached, num_scheduled=dict.fromkeys(specs, 1))
            )
            assert not out.errors, {r: f.message for r, f in out.errors.items()}
            for r, t in out.sampled_token_ids.items():
                tokens[r] += t
        assert runner.requests["seeded"].generator.device.type == "cuda"
        table = runner.penalty_table
        if tables:  # the penalised request's row: its prompt, its output counted on CUDA
            assert table.counts.device.type == "cuda" and table.num_used == 1
            assert int(table.counts.sum()) == len(tokens["penalised"])
        else:
            assert table is None
        return tokens

    with caplog.at_level(logging.WARNING, logger="vllm"):
        first = run()
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    assert all(len(t) == 4 for t in first.values())
    assert run() == first  # seeded rows (and greedy) are reproducible on CUDA
    assert run(tables=False) == first  # the sparse way's penalties: the same tokens


@pytest.mark.parametrize("mode", ["raw_logits", "processed_logprobs"])
def test_logprobs_modes_on_cuda_match_the_cpu(device, mode):
    # --logprobs-mode: greedy rows (penalised) and sampled ones (temperature, top-k,
    # top-p): the reported values agree across devices (tokens of greedy rows too).
    logits = _logits(3, torch.device("cpu"), seed=4)
    specs = [
        {"temperature": 0.0, "repetition_penalty": 1.3, "output": [5, 5], "logprobs": 3},
        {"temperature": 0.7, "top_k": 20, "seed": 1, "logprobs": 3},
        {"temperature": 1.0, "top_p": 0.8, "seed": 2, "logprobs": 3},
    ]
    got = {}
    for dev in (device, torch.device("cpu")):
        out = sample(logits.to(dev), [_row(dev, **s) for s in specs], logprobs_mode=mode)
        assert not out.errors
        got[dev.type] = out
    assert got["cuda"].token_ids[0] == got["cpu"].token_ids[0]
    cuda_top = dict(got["cuda"].logprobs[0].top)
    cpu_top = dict(got["cpu"].logprobs[0].top)
    assert cuda_top == pytest.approx(cpu_top, rel=1e-4, abs=1e-4)
