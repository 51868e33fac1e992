"""--quantization gguf against the fp32 reference, on the embedded SmolLM2 Q4_1 GGUF.

The fp32 model is the GGUF dequantized at load, and the quantized layers multiply by the
very same blocks (the load checks bit-equality), so the two may differ only by float
rounding (another summation order in the kernels): logits at every position of 8 prompts
agree to ~1e-4 and their top-1 tokens agree; greedy outputs match. That holds for the exact
prefill (VLLM_CPU_GGUF_PREFILL_DTYPE=fp32), which these tests pin; the bf16 prefill has its
own tolerances in test_gguf_bf16_prefill.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vllm.config import CacheConfig, ModelConfig, VllmConfig
from vllm.model_executor.layers.quantization.gguf import (
    GGUFLinear,
    quantized_weight_bytes,
    unpermute_rows,
)
from vllm.model_executor.model_loader import apply_quantization

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "List three primary colors:",
    "<|im_start|>user\nWhat is 17 times 3?<|im_end|>\n<|im_start|>assistant\n",
    "Water boils at a temperature of",
    "The quick brown fox",
    # Past the kernels' dense-GEMM threshold (48 tokens): that path is compared too.
    "In the beginning of the twentieth century, physicists discovered that light behaves "
    "both as a wave and as a particle. This duality led to quantum mechanics, which "
    "describes the behaviour of electrons in atoms, molecules and solids. Its predictions "
    "have been confirmed to many decimal places, and it led eventually to",
]
BLOCK = 16


def test_unpermute_rows_inverts_the_gguf_rotary_interleave():
    # llama.cpp writes W.reshape(h, 2, hd/2, ...).swapaxes(1, 2): each head's halves
    # interleaved. Undoing it must give back the HF row order exactly.
    heads, head_dim, cols = 3, 8, 5
    hf = torch.randn(heads * head_dim, cols)
    gguf = hf.reshape(heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(hf.shape)
    assert torch.equal(gguf[unpermute_rows(heads * head_dim, heads)], hf)


def test_quantization_field_is_validated():
    with pytest.raises(ValueError, match="quantization"):
        ModelConfig(quantization="int3")
    with pytest.raises(ValueError, match="quantization"):
        ModelConfig(quantization="gguf", dtype="bfloat16")
    ModelConfig(quantization="fp32")


def test_gguf_needs_a_gguf_model(tmp_path):
    with pytest.raises(ValueError, match="needs a .gguf model"):
        apply_quantization(None, ModelConfig(model=str(tmp_path), quantization="gguf"))


def _prompt_logits(runner, tokenizer) -> list[torch.Tensor]:
    """Logits at every position of each prompt, prefilled alone into blocks 1..n."""
    out = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = tokenizer(prompt).input_ids
            blocks = list(range(1, -(-len(ids) // BLOCK) + 1))
            meta = runner.attn_backend.build_metadata([(0, len(ids), blocks)])
            hidden = runner.model(torch.tensor(ids), torch.arange(len(ids)), meta, runner.kv_caches)
            out.append(runner.model.compute_logits(hidden))
    return out


@pytest.fixture
def exact_prefill(monkeypatch):
    """The gguf prefill GEMMs in fp32 (not bf16 on a CPU with native bf16)."""
    monkeypatch.setenv("VLLM_CPU_GGUF_PREFILL_DTYPE", "fp32")


@pytest.mark.slow
def test_quantized_logits_match_fp32(tokenizer, exact_prefill):
    from vllm.v1.worker.model_runner import ModelRunner

    threads = torch.get_num_threads()
    config = VllmConfig(
        model_config=ModelConfig(quantization="fp32"), cache_config=CacheConfig(block_size=BLOCK)
    )
    runner = ModelRunner(config, device="cpu")
    runner.load_model()
    runner.initialize_kv_cache(16)
    fp32 = _prompt_logits(runner, tokenizer)
    dense_bytes = quantized_weight_bytes(runner.model)
    apply_quantization(runner.model, ModelConfig(quantization="gguf"))
    quant = _prompt_logits(runner, tokenizer)
    torch.set_num_threads(threads)

    linears = [m for m in runner.model.modules() if isinstance(m, GGUFLinear)]
    assert len(linears) == 4 * runner.arch.num_layers + 1  # + the tied Q8_0 lm_head
    # 538 MB of fp32 linear weights -> ~96 MB of blocks read per decode step.
    assert quantized_weight_bytes(runner.model) < dense_bytes / 5
    diff = max((q - f).abs().max().item() for q, f in zip(quant, fp32, strict=True))
    top1 = torch.cat([q.argmax(-1) == f.argmax(-1) for q, f in zip(quant, fp32, strict=True)])
    print(f"max |logit diff| {diff:.2e}; top-1 agreement {int(top1.sum())}/{top1.numel()}")
    assert diff < 1e-2
    assert top1.float().mean().item() >= 0.99


def logits_agreement(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """Max |logit difference| and the share of positions whose top-1 token is the same."""
    diff = (got - ref).abs().max().item()
    top1 = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    return diff, top1


@torch.inference_mode()
def chunked_logits(runner, ids: list[int], tokens_per_step: int) -> torch.Tensor:
    """Logits at every position of ``ids``, fed ``tokens_per_step`` tokens a forward (the KV
    cache carries the context), so every linear layer sees decode-sized batches."""
    from vllm.benchmarks.model_runner import forward

    out = []
    for start in range(0, len(ids), tokens_per_step):
        chunk = ids[start : start + tokens_per_step]
        out.append(runner.model.compute_logits(forward(runner, chunk, start)))
    return torch.cat(out)


# The accuracy tests' text: the start of docs/design.md as it was when their bounds were
# measured (7f440d2), frozen here. eval_perplexity's default is the live docs/design.md,
# which sessions edit: by session 23 its first 512 tokens had a perplexity of 76.9
# against 107.2, and the int8 decode path's ratio to fp32 had moved from +0.6% to +1.05%
# on the same Xeon, past the 1% bound, with no change to any kernel.
ACCURACY_TEXT = Path(__file__).resolve().parent / "data" / "perplexity_text.md"


def decode_act_vs_fp32(
    monkeypatch, act: str, tokens_per_step: int = 16, num_tokens: int = 256
) -> tuple[float, float]:
    """Max |logit difference| and top-1 agreement of the gguf model loaded with
    ``VLLM_CPU_GGUF_DECODE_ACT=act`` (every layer checked to take it) against fp32, at every
    position of ``ACCURACY_TEXT``'s first ``num_tokens`` tokens, ``tokens_per_step`` a
    forward."""
    from tests.benchmarks.test_eval_perplexity import SCRIPT
    from tests.utils import load_script
    from vllm.benchmarks.model_runner import load_runner, quantize

    monkeypatch.setenv("VLLM_CPU_GGUF_DECODE_ACT", act)
    script = load_script(SCRIPT)
    ids = script.text_tokens(ACCURACY_TEXT, num_tokens)
    runner = load_runner(len(ids))
    fp32 = chunked_logits(runner, ids, tokens_per_step)
    quantize(runner)
    assert {m.decode_act for m in runner.model.modules() if isinstance(m, GGUFLinear)} == {act}
    diff, top1 = logits_agreement(chunked_logits(runner, ids, tokens_per_step), fp32)
    print(f"{act} decode: max |logit diff| {diff:.3f}, top-1 agreement {top1:.4f} of {len(ids)}")
    return diff, top1


def gguf_perplexities(tokens_per_step: int, num_tokens: int = 512) -> dict[str, float]:
    """eval_perplexity's fp32 and gguf perplexities on ``ACCURACY_TEXT``, ``tokens_per_step``
    tokens a forward (the gguf switches as the environment sets them)."""
    from tests.benchmarks.test_eval_perplexity import SCRIPT
    from tests.utils import load_script

    script = load_script(SCRIPT)
    ids = script.text_tokens(ACCURACY_TEXT, num_tokens)
    ppl = script.perplexities(ids, tokens_per_step=tokens_per_step)
    print(f"perplexity on {num_tokens} tokens, {tokens_per_step} per forward: {ppl}")
    return ppl


def greedy_same_as_fp32(monkeypatch, env: dict[str, str] | None = None) -> int:
    """How many of PROMPTS (decoded together, 24 greedy tokens) come out the same from the
    fp32 model and from ``--quantization gguf`` loaded with the variables ``env`` set."""
    from vllm import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = []
    for quantization in ("fp32", "gguf"):
        if quantization:
            for name, value in (env or {}).items():
                monkeypatch.setenv(name, value)
        llm = LLM(model="SmolLM2-135M-Instruct", quantization=quantization)
        outputs.append([o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)])
        del llm
    return sum(a == b for a, b in zip(*outputs, strict=True))


@pytest.mark.slow
def test_quantized_greedy_matches_fp32(exact_prefill, monkeypatch):
    same = greedy_same_as_fp32(monkeypatch)
    print(f"greedy outputs identical on {same}/{len(PROMPTS)} prompts")
    assert same >= len(PROMPTS) - 1
