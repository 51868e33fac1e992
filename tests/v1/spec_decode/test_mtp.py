"""DeepSeek-V3's multi-token-prediction layer as the draft (``method`` mtp): the config,
and whole engines whose every proposal equals a reference's and whose greedy outputs
equal plain decoding's.

The target is a tiny DeepSeek-V3 written by transformers (MLA, experts, yarn); its
checkpoint gets an MTP layer ``model.layers.{n}.*`` as DeepSeek's files carry one. The
reference computes the MTP layer with transformers' own ``DeepseekV3DecoderLayer`` over
whole sequences (no paging, no cache), fed as DeepSeek feeds it: position p reads the
token at p + 1 and the target's final hidden state at p (its own output when drafting
ahead). The layer's weights mostly pass the target's state through to the target's head
(a "repeat the last token" guess), so some drafts are kept and some are not.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.v1.spec_decode.test_eagle import (
    check_pressure_prefix_hits_and_sampling,
    generate_as_the_reference,
    ref_spec_decode,
)
from vllm.config import SpeculativeConfig
from vllm.sampling_params import SamplingParams

K = 2


# -- the config -----------------------------------------------------------------------------
def test_mtp_needs_no_model_and_takes_vllms_old_name(caplog):
    spec = SpeculativeConfig({"method": "mtp", "num_speculative_tokens": 1})
    assert spec.method == "mtp" and spec.uses_draft_model and spec.num_lookahead_tokens == 1
    old = SpeculativeConfig({"method": "deepseek_mtp", "num_speculative_tokens": 2})
    assert old.method == "mtp" and "deprecated" in caplog.text
    with pytest.raises(ValueError, match=r"speculative_config\.prompt_lookup_max"):
        SpeculativeConfig({"method": "mtp", "num_speculative_tokens": 1, "prompt_lookup_max": 3})
    with pytest.raises(ValueError, match=r"speculative_config\.model"):
        SpeculativeConfig({"method": "mtp", "model": "", "num_speculative_tokens": 1})


# -- the checkpoint and the reference ---------------------------------------------------------
def _family(name: str):
    """(transformers' decoder layer and rotary classes, the target's saver, whether the
    next step reads the normed state) of an MTP family."""
    import transformers.models.deepseek_v3.modeling_deepseek_v3 as deepseek
    import transformers.models.glm4_moe.modeling_glm4_moe as glm

    from tests.model_executor.test_deepseek import save
    from tests.model_executor.test_moe import save_checkpoint

    if name == "deepseek_v3":  # MLA, experts, yarn
        return (deepseek.DeepseekV3DecoderLayer, deepseek.DeepseekV3RotaryEmbedding,
                lambda path, **kw: save("v3", path, **kw), True)  # fmt: skip
    if name == "glm4_moe_lite":  # GLM-4.7-Flash: V3's layer, GLM's feedback
        import transformers.models.glm4_moe_lite.modeling_glm4_moe_lite as lite

        from tests.model_executor.test_glm4_moe_lite import save as save_lite

        def mtp_layer(config, n):  # layer n (the MTP layer): sparse, as first_k_dense_replace
            types = [*config.mlp_layer_types, "sparse"]
            return lite.Glm4MoeLiteDecoderLayer(type(config)(**{**config.to_dict(),
                                                "mlp_layer_types": types}), n)  # fmt: skip

        return mtp_layer, lite.Glm4MoeLiteRotaryEmbedding, save_lite, False
    # GLM-4.5: q/k/v biases, q/k norms, half the head rotated, experts from layer 1 on
    return (glm.Glm4MoeDecoderLayer, glm.Glm4MoeRotaryEmbedding,
            lambda path, **kw: save_checkpoint("Glm4MoeForCausalLM", path, **kw),
            False)  # fmt: skip


def save_target_with_mtp(
    path: Path,
    family: str = "deepseek_v3",
    noise: float = 0.1,
    own_copies: bool = True,
    seed: int = 1,
    **overrides,
):
    """A tiny target of ``family`` (deepseek_v3: ``tests/model_executor/test_deepseek.py``'s
    "v3"; glm4_moe: ``test_moe.py``'s GLM-4.5) with one MTP layer in its checkpoint
    (``mtp.safetensors`` beside the model's file, the families' names, one tensor per
    expert); returns (transformers model, the MTP layer's tensors).

    The layer: ``eh_proj`` passes the hidden half through plus a random map of the
    embeddings' half of size ``noise``; its attention and experts' outputs are rescaled to
    about ``noise``; ``shared_head.head`` (and ``embed_tokens``) are the target's, written
    as copies with ``own_copies`` (DeepSeek's files), else left out (shared; GLM's).
    ``overrides``: HF config fields of the target."""
    from safetensors.torch import save_file

    layer_cls, _, save, _ = _family(family)
    hf = save(path, **overrides)
    config, n, h = hf.config, hf.config.num_hidden_layers, hf.config.hidden_size
    g = torch.Generator().manual_seed(seed)
    layer = layer_cls(config, n).float()
    tensors = {}
    for name, p in layer.state_dict().items():
        if name.endswith("norm.weight"):
            value = 0.5 + torch.rand(p.shape, generator=g)
        elif name.endswith("e_score_correction_bias"):
            value = 0.5 * torch.randn(p.shape, generator=g)
        else:
            value = 0.06 * torch.randn(p.shape, generator=g)
        if name.endswith(("o_proj.weight", "down_proj")) or "shared_experts.down" in name:
            value = value * noise
        tensors[name] = value
    gate_up, down = tensors.pop("mlp.experts.gate_up_proj"), tensors.pop("mlp.experts.down_proj")
    inter = config.moe_intermediate_size
    for e in range(config.n_routed_experts):  # the files: one tensor per expert
        tensors[f"mlp.experts.{e}.gate_proj.weight"] = gate_up[e, :inter]
        tensors[f"mlp.experts.{e}.up_proj.weight"] = gate_up[e, inter:]
        tensors[f"mlp.experts.{e}.down_proj.weight"] = down[e]
    embeds = torch.randn(h, h, generator=g) * noise / h**0.5
    tensors.update({
        "enorm.weight": 0.5 + torch.rand(h, generator=g),
        "hnorm.weight": 0.5 + torch.rand(h, generator=g),
        "eh_proj.weight": torch.cat([embeds, torch.eye(h)], dim=1),
        "shared_head.norm.weight": 0.5 + torch.rand(h, generator=g),
    })  # fmt: skip
    if own_copies:
        tensors["embed_tokens.weight"] = hf.model.embed_tokens.weight.detach()
        tensors["shared_head.head.weight"] = hf.lm_head.weight.detach()
    prefix = f"model.layers.{n}."
    tensors = {prefix + k: v.detach().contiguous().clone() for k, v in tensors.items()}
    save_file(tensors, str(path / "mtp.safetensors"))
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}))
    return hf, {k.removeprefix(prefix): v for k, v in tensors.items()}


class RefMTP:
    """The MTP layer over whole sequences, from its tensors and transformers' layer of
    the target's family (the ``RefHead`` interface ``ref_spec_decode`` steps)."""

    def __init__(self, target, tensors: dict[str, torch.Tensor]) -> None:
        config = target.config
        layer_cls, rotary_cls, _, self.recycles_normed = _family(config.model_type)
        self.target, self.sd = target, tensors
        self.layer = layer_cls(config, config.num_hidden_layers).float().eval()
        mtp_only = ("enorm.", "hnorm.", "eh_proj.", "embed_tokens.", "shared_head.", "mlp.experts.")
        own = {k: v for k, v in tensors.items() if not k.startswith(mtp_only)}
        e = config.n_routed_experts
        own["mlp.experts.gate_up_proj"] = torch.stack([
            torch.cat([tensors[f"mlp.experts.{i}.{p}_proj.weight"] for p in ("gate", "up")])
            for i in range(e)
        ])  # fmt: skip
        own["mlp.experts.down_proj"] = torch.stack(
            [tensors[f"mlp.experts.{i}.down_proj.weight"] for i in range(e)]
        )
        self.layer.load_state_dict(own)
        self.rotary = rotary_cls(config)
        self.embed = tensors.get("embed_tokens.weight", target.model.embed_tokens.weight.detach())
        self.head = tensors.get("shared_head.head.weight", target.lm_head.weight.detach())
        self.eps = config.rms_norm_eps

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.sd[name]

    def target_hidden(self, tokens: list[int]) -> torch.Tensor:
        """The target's final hidden states (after its norm), one row a token."""
        with torch.no_grad():
            out = self.target(torch.tensor([tokens]), output_hidden_states=True)
        return out.hidden_states[-1][0]

    @torch.no_grad()
    def forward(self, ids: list[int], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions 0.. of (token, hidden) rows -> (logits, the next rows' hidden)."""
        t = len(ids)
        embeds = self.embed[torch.tensor(ids)].clone()
        embeds[0] = 0  # position 0
        x = torch.cat([self._norm(embeds, "enorm.weight"), self._norm(hidden, "hnorm.weight")], -1)
        x = (x @ self.sd["eh_proj.weight"].T)[None]
        positions = torch.arange(t)[None]
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        x = self.layer(x, attention_mask=mask, position_ids=positions,
                       position_embeddings=self.rotary(x, positions))[0]  # fmt: skip
        out = self._norm(x, "shared_head.norm.weight")
        return out @ self.head.T, (out if self.recycles_normed else x)

    def drafts(self, tokens: list[int], k: int) -> list[int]:
        """The k greedy drafts after ``tokens`` (each recomputing every position)."""
        ids, hidden, out = tokens[1:], self.target_hidden(tokens[:-1]), []
        for _ in range(k):
            logits, nxt = self.forward(ids, hidden)
            out.append(int(logits[-1].argmax()))
            ids, hidden = ids + [out[-1]], torch.cat([hidden, nxt[-1:]])
        return out


def _engine(target: Path, k: int = K, **kwargs):
    from vllm import LLM

    spec = {"method": "mtp", "num_speculative_tokens": k}
    engine = {"kv_cache_memory": "8MiB", "max_model_len": 128, **kwargs}
    return LLM(model=str(target), skip_tokenizer_init=True, dtype="float32",
               speculative_config=spec, **engine)  # fmt: skip


PROMPTS = [[3 + (5 * i) % 90 for i in range(30)], [7, 8, 9, 10] * 5, list(range(40, 57))]
MAX_TOKENS = (20, 24, 16)


HEADS = {"deepseek_v3": "DeepseekMTP", "glm4_moe": "Glm4MoeMTP", "glm4_moe_lite": "Glm4MoeLiteMTP"}


@pytest.mark.parametrize(
    "family, own_copies",
    [("deepseek_v3", True), ("deepseek_v3", False), ("glm4_moe", False), ("glm4_moe_lite", False)],
)
def test_every_proposal_equals_the_reference_and_the_output_plain_decoding(
    tmp_path, family, own_copies
):
    """The MTP layer's drafts, step by step, are the reference's; the outputs are the
    target's greedy tokens; kept and rejected drafts both happen. Without copies of the
    embeddings and head in the layer's tensors the target's are used."""
    from tests.v1.spec_decode.test_draft_model import counting

    hf, tensors = save_target_with_mtp(tmp_path, family, own_copies=own_copies)
    ref = RefMTP(hf, tensors)
    expected = [ref_spec_decode(ref, p, n, K) for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)]
    llm = _engine(tmp_path)
    drafter = llm.engine_core.model_runner.drafter
    shared = drafter.model.embed_tokens is llm.engine_core.model_runner.model.embed_tokens
    assert shared == (not own_copies) and type(drafter.model).__name__ == HEADS[family]
    with counting(llm) as counts:
        generate_as_the_reference(llm, PROMPTS, MAX_TOKENS, expected)
    assert 0.05 < counts["accepted"] / counts["draft_tokens"] < 0.95, counts


@pytest.mark.parametrize("family", list(HEADS))
def test_the_layers_logits_and_states_equal_the_references_at_every_position(tmp_path, family):
    """One catch-up over a whole prompt (position 0 included, its embedding masked): the
    engine's MTP logits and next-step hidden states at every position are the
    reference's (DeepSeek's normed, GLM's before the norm)."""
    hf, tensors = save_target_with_mtp(tmp_path, family)
    ref = RefMTP(hf, tensors)
    llm = _engine(tmp_path)
    try:
        drafter = llm.engine_core.model_runner.drafter
        tokens = PROMPTS[0]
        n = len(tokens) - 1
        hidden = ref.target_hidden(tokens)[:n]
        table = list(range(-(-n // drafter.block_size)))  # idle engine: any blocks will do
        out = drafter._forward(tokens[1:], list(range(n)), [(0, n, table)], hidden)
        rows, states = drafter.model.split(out)
        logits = drafter.model.compute_logits(rows)
    finally:
        llm.shutdown()
    expected, expected_states = ref.forward(tokens[1:], hidden)
    torch.testing.assert_close(logits, expected, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(states, expected_states, atol=2e-4, rtol=1e-4)


def _cuda_backends(monkeypatch, family: str):
    """A factory of the backend CUDA would run for ``family``'s arch, on the CPU with its
    kernels emulated: TRITON_MLA for DeepSeek's (and GLM-4.7-Flash's) latent cache,
    TORCH_FLASH_ATTN with the Triton decode kernel for GLM-4.5."""
    from tests.v1.attention.test_torch_flash import install, ref_varlen_attn
    from tests.v1.attention.test_triton_decode import emulated_kernel
    from tests.v1.attention.test_triton_mla import emulated_kernel as emulated_mla
    from tests.v1.attention.test_triton_mla import emulated_prefill_kernel
    from vllm.v1.attention.backends import triton_decode, triton_mla_decode, triton_mla_prefill
    from vllm.v1.attention.backends.torch_flash import TorchFlashAttentionBackend
    from vllm.v1.attention.backends.triton_mla import TritonMLABackend

    if family in ("deepseek_v3", "glm4_moe_lite"):  # latent attention
        monkeypatch.setattr(triton_mla_decode, "mla_decode_attention", emulated_mla([]))
        monkeypatch.setattr(
            triton_mla_prefill, "mla_prefill_attention", emulated_prefill_kernel([])
        )

        def make(a):
            backend = TritonMLABackend(a.num_heads, 1, a.head_dim, torch.float32, "cpu", 16,
                                       value_size=a.latent_value_size)  # fmt: skip
            backend.prefill_kernel = True  # as on CUDA
            return backend

        return make
    install(monkeypatch, ref_varlen_attn)
    monkeypatch.setattr(triton_decode, "paged_decode_attention", emulated_kernel([]))

    def make(a):
        backend = TorchFlashAttentionBackend(
            a.num_heads, a.num_kv_heads, a.head_dim, torch.float32, "cpu", 16
        )
        backend.decode_kernel = "triton"
        return backend

    return make


@pytest.mark.parametrize("family", list(HEADS))
def test_replayed_mtp_steps_propose_as_eager_ones(monkeypatch, tmp_path, family):
    """CUDA's backend under the target and the MTP layer (kernels emulated), stand-in
    graphs captured: the layer's single-token steps and decode-row catch-ups replay
    graphs whose hidden-state input is a buffer. Proposals and outputs equal the eager
    engine's."""
    from tests.v1.spec_decode.test_eagle import recording_proposals
    from tests.v1.worker.test_cuda_graph import ReplayingGraph

    make_backend = _cuda_backends(monkeypatch, family)
    save_target_with_mtp(tmp_path, family)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    results = {}
    for graphs in (False, True):
        llm = _engine(tmp_path, enforce_eager=not graphs, max_num_seqs=4)
        runner = llm.engine_core.model_runner
        for owner, model in ((runner, runner.model), (runner.drafter, runner.drafter.model)):
            owner.attn_backend = make_backend(model.arch)
            model.set_attention_backend(owner.attn_backend)
        runner.capture_model(graph_factory=ReplayingGraph)
        try:
            with recording_proposals(llm) as proposals:
                outs = llm.generate(prompts, params)
            head, target = runner.drafter.graphs, runner.decode_graphs
            replays = (head and head.num_replays, target and target.num_replays)
        finally:
            llm.shutdown()
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        results[graphs] = (tokens, [proposals[o.request_id] for o in outs], replays)
    assert results[False][2] == (None, None)
    head_replays, target_replays = results[True][2]
    assert head_replays > 10 and target_replays > 0, results[True][2]
    assert results[True][:2] == results[False][:2]


def test_prefix_hits_preemption_and_sampling_keep_the_outputs(tmp_path):
    """Under a tiny pool, with prefix hits (the layer drafting over cached blocks'
    latents) and seeded sampled requests: test_eagle.py's check."""
    from vllm import LLM

    save_target_with_mtp(tmp_path)
    tiny = {"num_gpu_blocks_override": 7, "max_num_seqs": 3}
    plain = LLM(model=str(tmp_path), skip_tokenizer_init=True, dtype="float32",
                max_model_len=128, **tiny)  # fmt: skip
    check_pressure_prefix_hits_and_sampling(
        plain, lambda **pool: _engine(tmp_path, **pool), tiny, PROMPTS
    )


# -- what is refused ------------------------------------------------------------------------------
def test_a_model_without_an_mtp_layer_is_refused_naming_the_method(tmp_path):
    from tests.eagle_checkpoints import save_tiny_target
    from tests.model_executor.test_deepseek import save

    save("v3", tmp_path / "v3", num_nextn_predict_layers=0)  # Kimi-K2 has none
    save_tiny_target(tmp_path / "llama")
    for model in ("v3", "llama"):
        with pytest.raises(ValueError, match=r"speculative_config\.method: mtp .* has none"):
            _engine(tmp_path / model, load_format="dummy")


def test_a_checkpoint_without_the_layers_tensors_is_refused_naming_the_model(tmp_path):
    save_target_with_mtp(tmp_path)
    (tmp_path / "mtp.safetensors").unlink()
    with pytest.raises(ValueError, match=r"speculative_config\.model: .* no multi-token"):
        _engine(tmp_path)


def test_the_head_reads_only_its_own_tensors(tmp_path):
    from safetensors.torch import save_file

    from vllm.model_executor.model_loader import _read_safetensors

    file = tmp_path / "x.safetensors"
    save_file({"model.layers.3.a": torch.ones(2), "model.layers.2.b": torch.zeros(2)}, str(file))
    assert list(_read_safetensors(str(file), ("model.layers.3.",))) == ["model.layers.3.a"]
    assert len(_read_safetensors(str(file), None)) == 2


def test_vllms_spec_flags_fill_the_speculative_config(tmp_path):
    """``--spec-method``, ``--spec-model``, ``--spec-tokens`` (vLLM 0.32's shortcuts) are
    three of speculative_config's keys; a key given both ways is an error."""
    from vllm.entrypoints.cli.main import make_parser
    from vllm.entrypoints.cli.serve import build_config

    save_target_with_mtp(tmp_path)
    parse = make_parser().parse_args
    config = build_config(parse(["serve", str(tmp_path), "--spec-method", "mtp",
                                 "--spec-tokens", "2"]))  # fmt: skip
    assert config.speculative_config.speculative_config == {
        "method": "mtp", "num_speculative_tokens": 2,
    }  # fmt: skip
    assert config.draft_model_config.model == str(tmp_path)
    both = ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}']
    with pytest.raises(ValueError, match=r"--spec-tokens and speculative_config\.num_spec"):
        build_config(parse(["serve", str(tmp_path), *both, "--spec-tokens", "3"]))
    ngram = build_config(parse(["serve", str(tmp_path), "--spec-model", "[ngram]",
                                "--spec-tokens", "3"]))  # fmt: skip
    assert ngram.speculative_config.method == "ngram"
    assert SpeculativeConfig(spec_method="eagle3", spec_model="/h", spec_tokens=4) == (
        SpeculativeConfig({"method": "eagle3", "model": "/h", "num_speculative_tokens": 4})
    )
