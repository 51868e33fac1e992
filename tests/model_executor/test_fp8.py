"""FP8 weights (``layers/quantization/fp8.py``, ``fp8_checkpoint.py``): tiny checkpoints of
a Llama, a Qwen3-MoE, a Mixtral and a DeepSeek-V3 in each FP8 format
(``fp8_checkpoints.py``) give the logits of transformers' model of their dequantized
weights (fp32, 1e-4) when dequantized;
kept in FP8 (``Fp8Linear``), the logits equal a reference quantizing the activations the
same way, keep the checkpoint's bytes, and stay near the dequantized model. The engine's
greedy tokens equal ``generate``; refused configs name their field; ``--quantization fp8``
serves a bf16 model."""

from __future__ import annotations

import pytest
import torch
import transformers

from tests.model_executor.fp8_checkpoints import SCHEMES, write_fp8_checkpoint
from tests.tiny_models import (
    TINY_LLAMA,
    check_engine_greedy_matches,
    load_cpu_runner,
    runner_logits,
)
from vllm.config import ModelConfig
from vllm.model_executor.layers.quantization.fp8 import FP8_DTYPE, Fp8Linear

FAMILIES = {
    "llama": ("LlamaForCausalLM", {}),
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(moe_intermediate_size=32, num_experts=8,
                                              num_experts_per_tok=2, norm_topk_prob=True)),
    "mixtral": ("MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    "deepseek_v3": ("DeepseekV3ForCausalLM", dict(
        moe_intermediate_size=32, num_hidden_layers=2, n_routed_experts=8, num_experts_per_tok=2,
        kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
        n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
        num_key_value_heads=4)),
}  # fmt: skip


def save_model(family: str, **overrides) -> torch.nn.Module:
    arch, fields = FAMILIES[family]
    config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    torch.manual_seed(0)
    model = getattr(transformers, arch)(config_cls(**{**TINY_LLAMA, **fields, **overrides}))
    with torch.no_grad():  # DeepSeek's routing correction starts at 0: make it choose
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.5)
    return model.eval()


def hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return hf(ids[None]).logits[0].float()


IDS = torch.randint(0, TINY_LLAMA["vocab_size"], (40,), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_dequantized_fp8_checkpoint_gives_the_dequantized_models_logits(family, scheme, tmp_path):
    reference = write_fp8_checkpoint(save_model(family), tmp_path, scheme)
    runner = load_cpu_runner(ModelConfig(model=str(tmp_path), max_model_len=128))
    # auto on CPU: dequantized (dense weights in the model's dtype)
    assert not any(isinstance(m, Fp8Linear) for m in runner.model.modules())
    ours = runner_logits(runner, IDS)
    ref = hf_logits(reference, IDS)
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()


def _reference_forward(self: Fp8Linear, x: torch.Tensor) -> torch.Tensor:
    """Fp8Linear's product in fp32 from the same quantized activations."""
    q, scale = self.quantize_input(x.reshape(-1, self.in_features))
    y = (q.float() * scale) @ self.dequantized_weight(torch.float32).t()
    y = y if self.bias is None else y + self.bias
    return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("scheme", [s for s in SCHEMES if s != "fp8_block"])
def test_fp8_linear_keeps_the_checkpoint_and_multiplies_in_fp8(
    family, scheme, tmp_path, monkeypatch
):
    reference = write_fp8_checkpoint(save_model(family), tmp_path, scheme)
    runner = load_cpu_runner(
        ModelConfig(model=str(tmp_path), max_model_len=128, quantization="fp8")
    )
    layers = {n: m for n, m in runner.model.named_modules() if isinstance(m, Fp8Linear)}
    expected = {"llama": 8, "qwen3_moe": 4, "mixtral": 4, "deepseek_v3": 12}[family]
    assert len(layers) == expected, sorted(layers)
    assert not isinstance(runner.model.lm_head, Fp8Linear)
    _check_stored_values(runner.model, tmp_path, family, scheme)
    ours = runner_logits(runner, IDS)
    monkeypatch.setattr(Fp8Linear, "forward", _reference_forward)
    same_activations = runner_logits(runner, IDS)
    assert torch.allclose(ours, same_activations, atol=1e-5), (ours - same_activations).abs().max()
    dequantized = hf_logits(reference, IDS)
    # Activations in FP8 cost 3-6% of the logits' spread here; the dequantized model 0.
    err = (ours - dequantized).abs().max() / dequantized.abs().max()
    assert 1e-4 < err < 0.08, err


def _check_stored_values(model, path, family, scheme) -> None:
    """The first layer's fused q/k/v (the Llama families) or o_proj (DeepSeek) holds the
    checkpoint's FP8 bytes and scales (a per-tensor scale repeated over its rows)."""
    from safetensors.torch import load_file

    sd = load_file(path / "model.safetensors")
    scale_name = SCHEMES[scheme][1]
    names = ["o_proj"] if family == "deepseek_v3" else ["q_proj", "k_proj", "v_proj"]
    layer = model.layers[0]
    linear = layer.self_attn.o_proj if family == "deepseek_v3" else layer.qkv_proj
    prefix = "model.layers.0.self_attn."
    stored = torch.cat([sd[f"{prefix}{n}.weight"] for n in names])
    assert linear.weight.dtype == FP8_DTYPE
    assert torch.equal(linear.weight.view(torch.uint8), stored.view(torch.uint8))
    scales = torch.cat([
        sd[f"{prefix}{n}.{scale_name}"].reshape(-1).expand(sd[f"{prefix}{n}.weight"].shape[0])
        for n in names
    ])  # fmt: skip
    assert torch.equal(linear.weight_scale.flatten(), scales)
    if SCHEMES[scheme][3]:  # static: the largest input scale of the fused parts
        name = "activation_scale" if scheme.startswith("fp8") else "input_scale"
        largest = max(sd[f"{prefix}{n}.{name}"] for n in names)
        assert linear.activation == "static" and torch.equal(
            linear.input_scale.flatten()[0], largest
        )


@pytest.mark.parametrize(
    "family, scheme", [("llama", "fp8_block"), ("qwen3_moe", "ct_channel_dynamic"),
                       ("deepseek_v3", "fbgemm")],
)  # fmt: skip
def test_engine_greedy_tokens_equal_the_dequantized_models_generate(family, scheme, tmp_path):
    hf = save_model(family, vocab_size=49152, max_position_embeddings=256)
    reference = write_fp8_checkpoint(hf, tmp_path, scheme)
    check_engine_greedy_matches(reference, tmp_path, max_tokens=6)


def test_quantization_fp8_serves_a_bf16_model(tmp_path):
    """--quantization fp8 quantizes a bf16 model's linear layers per channel at load (not
    the output head) and the engine serves it: its greedy tokens are the bf16 model's
    where the two agree on the first token."""
    from vllm import LLM, SamplingParams

    model = save_model("llama")
    model.to(torch.bfloat16).save_pretrained(tmp_path)
    runner = load_cpu_runner(
        ModelConfig(model=str(tmp_path), max_model_len=128, dtype="bfloat16", quantization="fp8")
    )
    qkv = runner.model.layers[0].qkv_proj
    assert isinstance(qkv, Fp8Linear) and not isinstance(runner.model.lm_head, Fp8Linear)
    weight = torch.cat([model.model.layers[0].self_attn.q_proj.weight,
                        model.model.layers[0].self_attn.k_proj.weight,
                        model.model.layers[0].self_attn.v_proj.weight]).float()  # fmt: skip
    scale = weight.abs().amax(dim=1) / 448
    assert torch.allclose(qkv.weight_scale.flatten(), scale, rtol=1e-6)
    assert (qkv.dequantized_weight(torch.float32) - weight).abs().max() <= scale.max() * 16
    ours = runner_logits(runner, IDS)
    dense = hf_logits(model, IDS)
    assert ours.dtype == torch.float32
    assert (ours - dense).abs().max() / dense.abs().max() < 0.06
    llm = LLM(model=str(tmp_path), dtype="bfloat16", quantization="fp8", skip_tokenizer_init=True,
              kv_cache_memory="16MiB")  # fmt: skip
    try:
        params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
        out = llm.generate({"prompt_token_ids": IDS.tolist()}, params)[0].outputs[0]
    finally:
        llm.shutdown()
    assert len(out.token_ids) == 5
    assert out.token_ids[0] == int(ours[-1].argmax())


def test_quantization_fp32_dequantizes_an_fp8_checkpoint_and_fp8_keeps_it(tmp_path):
    """The same FP8 checkpoint: --quantization fp32 serves its dequantized weights (the
    exactness reference), --quantization fp8 its Fp8Linear layers."""
    write_fp8_checkpoint(save_model("llama"), tmp_path, "fbgemm")
    dense = load_cpu_runner(ModelConfig(model=str(tmp_path), quantization="fp32"))
    fp8 = load_cpu_runner(ModelConfig(model=str(tmp_path), quantization="fp8"))
    assert isinstance(fp8.model.layers[0].down_proj, Fp8Linear)
    assert type(dense.model.layers[0].down_proj) is torch.nn.Linear
    assert torch.equal(
        dense.model.layers[0].down_proj.weight,
        fp8.model.layers[0].down_proj.dequantized_weight(torch.float32),
    )


def test_fp8_layers_never_exist_dense_on_the_device(tmp_path, monkeypatch):
    """Loaded onto the meta device (standing in for a GPU, as test_load_dtype.py does), in
    bf16: the layers kept in FP8 are made FP8 before any storage exists (the loader's meta
    dry run), so the storage given to the model (to_empty) is its dense parameters and
    buffers in bf16 and the FP8 weights, never those weights dequantized."""
    from tests.model_executor.test_load_dtype import DeviceDtypes
    from vllm.model_executor.layers.quantization import fp8_checkpoint
    from vllm.model_executor.model_loader import get_model_config, load_model_weights
    from vllm.model_executor.models.llama import LlamaForCausalLM

    write_fp8_checkpoint(save_model("llama"), tmp_path, "ct_channel_dynamic")
    recorder = DeviceDtypes("meta")
    plan = fp8_checkpoint.plan_fp8_linears

    def unrecorded_plan(*args):  # the dry run is on meta on a GPU machine too: no storage
        recorder.recording = False
        try:
            return plan(*args)
        finally:
            recorder.recording = True

    monkeypatch.setattr(fp8_checkpoint, "plan_fp8_linears", unrecorded_plan)
    with recorder:
        model = load_model_weights(
            LlamaForCausalLM, get_model_config(str(tmp_path)), str(tmp_path), "meta",
            torch.bfloat16,
        )  # fmt: skip
    fp8 = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert len(fp8) == 8 and all(m.weight.dtype == FP8_DTYPE for m in fp8)
    # What to_empty allocated (empty_like): the storage the model holds on the device.
    allocated = {}
    for dtype, numel, op in recorder.outputs:
        if "empty_like" in op:
            allocated[dtype] = allocated.get(dtype, 0) + numel
    dense = [*model.parameters(), *(b for b in model.buffers() if b.dtype != FP8_DTYPE)]
    assert allocated[torch.bfloat16] == sum(t.numel() for t in dense if t.dtype == torch.bfloat16)
    assert allocated[FP8_DTYPE] == sum(m.weight.numel() for m in fp8)


def test_quantization_fp8_refuses_to_requantize_a_block_scaled_checkpoint(tmp_path):
    write_fp8_checkpoint(save_model("llama"), tmp_path, "fp8_block")
    with pytest.raises(ValueError, match="quantization='fp8': this fp8 checkpoint's FP8 weights"):
        load_cpu_runner(ModelConfig(model=str(tmp_path), quantization="fp8"))


@pytest.mark.cuda
def test_auto_keeps_an_fp8_checkpoint_in_fp8_on_a_gpu_with_fp8_gemms(tmp_path):
    from vllm.model_executor.layers.quantization.fp8 import fp8_supported
    from vllm.model_executor.model_loader import (
        apply_quantization,
        get_model_config,
        load_model_weights,
    )
    from vllm.model_executor.models.llama import LlamaForCausalLM

    ok, why = fp8_supported("cuda")
    if not ok:
        pytest.skip(why)
    write_fp8_checkpoint(save_model("llama"), tmp_path, "ct_channel_dynamic")
    config = get_model_config(str(tmp_path))
    model = load_model_weights(LlamaForCausalLM, config, str(tmp_path), "cuda", torch.bfloat16)
    assert apply_quantization(model, ModelConfig(model=str(tmp_path))) == "fp8"
    layer = model.layers[0].qkv_proj
    assert isinstance(layer, Fp8Linear) and layer.weight.is_cuda
    x = torch.randn(8, 64, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        ours, ref = layer(x).float(), _reference_forward(layer, x.float())
    assert torch.allclose(ours, ref, rtol=2e-2, atol=1e-2 * ref.abs().max().item())


def test_auto_on_an_ampere_card_keeps_block_scaled_layers_only(monkeypatch):
    # sm80 has no FP8 tensor cores (torch._scaled_mm), but the block-scaled layers' Triton
    # kernels widen FP8 weights there: a block-scaled checkpoint stays FP8, a row-scaled
    # one is dequantized. (The device checks stubbed: no GPU here.)
    from vllm.model_executor import model_loader
    from vllm.model_executor.layers.quantization import fp8

    monkeypatch.setattr(fp8, "fp8_supported", lambda d: (False, "compute capability 8.0"))
    monkeypatch.setattr(fp8, "block_fp8_supported", lambda d: (True, ""))
    cuda = torch.device("cuda")
    assert model_loader.fp8_auto(cuda, scaled_mm=False)[0] == "fp8"
    choice, why = model_loader.fp8_auto(cuda, scaled_mm=True)
    assert choice == "fp32" and "8.0" in why
    monkeypatch.setattr(fp8, "block_fp8_supported", lambda d: (False, "triton is not installed"))
    assert model_loader.fp8_auto(cuda, scaled_mm=False) == (
        "fp32",
        "auto: an FP8 checkpoint, dequantized (triton is not installed)",
    )
