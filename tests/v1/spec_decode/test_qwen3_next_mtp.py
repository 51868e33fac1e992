"""Qwen3-Next's and Qwen3.5's multi-token-prediction layer as the draft (``method`` mtp,
``models/qwen3_next_mtp.py``): its logits against a reference, a hybrid target drafted
for end to end (its recurrent states rolled back), and what is refused.

The targets are tests/model_executor/test_qwen3_next.py's tiny models (three Gated
DeltaNet layers, one gated full-attention layer) saved by transformers; their folders
get an MTP layer ``mtp.*`` as the released files carry one. The reference computes the
layer with transformers' own building blocks of the family (its decoder layer of type
full_attention, its zero-centred RMSNorm, its rotary embedding; a Linear for ``fc``) over
whole sequences: position p reads the token at p + 1 (its embedding not masked, even at
position 0) and the target's final hidden state at p, or the layer's own normed output
when drafting ahead.
"""

from __future__ import annotations

import copy
import importlib
import json
from pathlib import Path

import pytest
import torch
import transformers

from tests.model_executor.test_qwen3_next import make_config
from tests.tiny_models import hf_greedy, perturbed
from tests.v1.engine.test_recurrent_engine import _check_slots
from tests.v1.spec_decode.test_mtp import K, RefMTP, _engine
from vllm.config import SpeculativeConfig
from vllm.sampling_params import SamplingParams

FULL = "full_attention"
# architecture -> transformers' module of the family, and the names of its decoder
# layer, RMSNorm and rotary embedding
FAMILIES = {
    "Qwen3_5ForCausalLM": ("qwen3_5", "Qwen3_5DecoderLayer", "Qwen3_5RMSNorm",
                           "Qwen3_5TextRotaryEmbedding"),
    "Qwen3_5MoeForCausalLM": ("qwen3_5_moe", "Qwen3_5MoeDecoderLayer", "Qwen3_5MoeRMSNorm",
                              "Qwen3_5MoeTextRotaryEmbedding"),
    "Qwen3NextForCausalLM": ("qwen3_next", "Qwen3NextDecoderLayer", "Qwen3NextRMSNorm",
                             "Qwen3NextRotaryEmbedding"),
}  # fmt: skip
# The multimodal checkpoints': their language model's family.
FAMILIES["Qwen3_5ForConditionalGeneration"] = FAMILIES["Qwen3_5ForCausalLM"]


def _family(arch: str) -> tuple[type, type, type]:
    module, *names = FAMILIES[arch]
    mod = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    return tuple(getattr(mod, n) for n in names)


def _one_layer_config(config):
    """The MTP layer's config: a model of one full-attention layer (vLLM builds the
    layer as ``mtp.layers.0``: Qwen3-Next's expert rule reads index 0)."""
    one = copy.deepcopy(config.get_text_config())
    one.num_hidden_layers, one.layer_types = 1, [FULL]
    return one


def _language_model(hf):
    """transformers' text model of ``hf`` (a multimodal one's ``language_model``)."""
    return getattr(hf.model, "language_model", hf.model)


OUTPUTS = ("out_proj.weight", "o_proj.weight", "down_proj.weight", "experts.down_proj")


def save_target_with_mtp(path: Path, arch: str = "Qwen3_5ForCausalLM", noise: float = 1.0,
                         bigram: float = 1.0, seed: int = 0, count_field: bool = True):  # fmt: skip
    """A tiny target of ``arch`` (test_qwen3_next.py's config, perturbed, saved by
    transformers) with one MTP layer in ``mtp.safetensors`` beside it (the released names,
    one tensor per expert); returns (transformers model, the layer's tensors without
    ``mtp.``). ``count_field``: the config says ``mtp_num_hidden_layers: 1`` (Qwen3.5's
    released configs; Qwen3-Next's name none).

    ``bigram`` scales the outputs of the target's layers: below 1 the target leans towards
    a bigram model, a token's successor read off its embedding by the final norm and the
    head. The MTP layer is built to predict that map from the token it reads: ``fc``
    passes the embedding half through, ``pre_fc_norm_embedding`` and ``norm`` compose to
    the target's final norm. ``noise`` sizes all else it does: a random map of both
    halves in ``fc``, its attention's and MLP's outputs, its norms' departures."""
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    hf = perturbed(getattr(transformers, arch)(make_config(arch)))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(-4.0, -1.5)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.3)
            elif name.endswith(OUTPUTS):
                p.mul_(bigram)
        hf.lm_head.weight.normal_(0.0, 0.3)
    hf.save_pretrained(path)
    config = hf.config.get_text_config()
    h = config.hidden_size
    g = torch.Generator().manual_seed(seed + 1)
    layer_cls, _, _ = _family(arch)
    tensors = {}
    for name, p in layer_cls(_one_layer_config(config), 0).state_dict().items():
        if "norm" in name:  # zero-centred: 1 + weight
            value = torch.rand(p.shape, generator=g) - 0.5
        elif name.endswith("mlp.gate.weight"):
            value = 0.3 * torch.randn(p.shape, generator=g)
        else:
            value = 0.15 * torch.randn(p.shape, generator=g)
        tensors[name] = value * noise if name.endswith(OUTPUTS) else value
    if "mlp.experts.gate_up_proj" in tensors:  # the files: one tensor per expert
        gate_up = tensors.pop("mlp.experts.gate_up_proj")
        down = tensors.pop("mlp.experts.down_proj")
        inter = config.moe_intermediate_size
        for e in range(config.num_experts):
            tensors[f"mlp.experts.{e}.gate_proj.weight"] = gate_up[e, :inter]
            tensors[f"mlp.experts.{e}.up_proj.weight"] = gate_up[e, inter:]
            tensors[f"mlp.experts.{e}.down_proj.weight"] = down[e]
    tensors = {f"layers.0.{k}": v for k, v in tensors.items()}
    fc = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)  # [embedding | hidden]

    def departure(*shape):
        return (torch.rand(shape, generator=g) - 0.5) * noise

    tensors.update({
        "fc.weight": fc + torch.randn(h, 2 * h, generator=g) * noise / h**0.5,
        "pre_fc_norm_embedding.weight": departure(h),
        "pre_fc_norm_hidden.weight": torch.rand(h, generator=g) - 0.5,
        "norm.weight": _language_model(hf).norm.weight.detach() + departure(h),
    })  # fmt: skip
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    save_file({f"mtp.{k}": v for k, v in tensors.items()}, str(path / "mtp.safetensors"))
    if count_field:
        cfg = json.loads((path / "config.json").read_text())
        text = cfg.get("text_config", cfg)  # a multimodal checkpoint's: its text config's
        text["mtp_num_hidden_layers"] = 1
        (path / "config.json").write_text(json.dumps(cfg))
    return hf, tensors


class RefQwenMTP(RefMTP):
    """The MTP layer over whole sequences from transformers' blocks of the target's
    family: its decoder layer (experts stacked back), its RMSNorm for the three norms, a
    Linear for ``fc``; the target's embeddings and head."""

    def __init__(self, target, tensors: dict[str, torch.Tensor]) -> None:
        arch = type(target).__name__
        layer_cls, norm_cls, rotary_cls = _family(arch)
        config = _one_layer_config(target.config)
        self.target = target
        own = {k.removeprefix("layers.0."): v for k, v in tensors.items()
               if k.startswith("layers.0.")}  # fmt: skip
        if "mlp.experts.0.gate_proj.weight" in own:
            e = config.num_experts
            own["mlp.experts.gate_up_proj"] = torch.stack([
                torch.cat([own.pop(f"mlp.experts.{i}.{p}_proj.weight") for p in ("gate", "up")])
                for i in range(e)
            ])  # fmt: skip
            own["mlp.experts.down_proj"] = torch.stack(
                [own.pop(f"mlp.experts.{i}.down_proj.weight") for i in range(e)]
            )
        self.layer = layer_cls(config, 0).float().eval()
        self.layer.load_state_dict(own)
        self.rotary = rotary_cls(config)
        h, eps = config.hidden_size, config.rms_norm_eps
        self.norms = {}
        for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            norm = self.norms[name] = norm_cls(h, eps=eps)
            norm.load_state_dict({"weight": tensors[f"{name}.weight"]})
        self.fc = torch.nn.Linear(2 * h, h, bias=False)
        self.fc.load_state_dict({"weight": tensors["fc.weight"]})

    def target_hidden(self, tokens: list[int]) -> torch.Tensor:
        """The target's final hidden states (after its norm), one row a token."""
        with torch.no_grad():
            return _language_model(self.target)(torch.tensor([tokens])).last_hidden_state[0]

    @torch.no_grad()
    def forward(self, ids: list[int], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions 0.. of (token, hidden) rows -> (logits, the next rows' hidden)."""
        t = len(ids)
        embeds = self.target.get_input_embeddings()(torch.tensor(ids))  # position 0 too
        n = self.norms
        x = self.fc(torch.cat([n["pre_fc_norm_embedding"](embeds),
                               n["pre_fc_norm_hidden"](hidden)], -1))[None]  # fmt: skip
        positions = torch.arange(t)[None]
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        x = self.layer(x, position_embeddings=self.rotary(x, positions), attention_mask=mask,
                       position_ids=positions)  # fmt: skip
        out = n["norm"](x)[0]
        return self.target.lm_head(out), out


PROMPTS = [[3 + (5 * i) % 90 for i in range(30)], [7, 8, 9, 10] * 5, list(range(40, 57))]
MAX_TOKENS = (24, 20, 28)


# -- the layer against the reference -----------------------------------------------------------
@pytest.mark.parametrize("arch", list(FAMILIES))
def test_the_layers_logits_and_states_equal_transformers(tmp_path, arch):
    """One catch-up over a whole prompt, position 0 included (its embedding not masked):
    the engine's MTP logits and next-step hidden states (the normed output) at every
    position are the reference's, fp32. Qwen3.5 dense, Qwen3.5-MoE, Qwen3-Next (whose MTP
    layer is a mixture of experts by index 0's rule; its config names no layer count), and
    a multimodal Qwen3.5 checkpoint (its count in the text config; text prompts)."""
    hf, tensors = save_target_with_mtp(tmp_path, arch, count_field=arch != "Qwen3NextForCausalLM")
    ref = RefQwenMTP(hf, tensors)
    llm = _engine(tmp_path)
    try:
        runner = llm.engine_core.model_runner
        drafter = runner.drafter
        assert type(drafter.model).__name__ == "Qwen3NextMTP"
        assert drafter.model.embed_tokens is runner.model.embed_tokens  # shared, not copied
        assert drafter.model.shared_head.head is runner.model.lm_head
        moe = arch in ("Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM")
        assert (type(drafter.model.layers[0].mlp).__name__ == "SparseMoeBlock") == moe
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
    assert expected.std() > 0.3
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(states, expected_states, atol=1e-4, rtol=1e-4)


def test_the_layers_arch_follows_the_families_rules():
    """The layer's experts by index 0's rule (Qwen3-Next's ``mlp_only_layers`` and
    ``decoder_sparse_step``); the count of layers from the text config's field, one where
    the config names none, and a model whose config says 0 has none."""
    from vllm.model_executor.models.mtp import mtp_head_class, mtp_layer_count
    from vllm.model_executor.models.qwen3_next_mtp import Qwen3NextMTP

    def arch(config):
        return Qwen3NextMTP.arch_from_hf(config)

    nxt = make_config("Qwen3NextForCausalLM")  # mlp_only_layers [2]
    assert arch(nxt).sparse_layers == (0,) and arch(nxt).layer_types == (FULL,)
    assert arch(nxt).num_layers == 1 and arch(nxt).num_experts == 4
    for change in ({"mlp_only_layers": [0]}, {"decoder_sparse_step": 2}):
        dense = copy.deepcopy(nxt)
        for key, value in change.items():
            setattr(dense, key, value)
        assert arch(dense).sparse_layers == (), change
    assert arch(make_config("Qwen3_5MoeForCausalLM")).sparse_layers == (0,)
    assert arch(make_config("Qwen3_5ForCausalLM")).sparse_layers == ()
    multimodal = make_config("Qwen3_5ForConditionalGeneration")
    assert mtp_layer_count(nxt) == 1 and mtp_layer_count(multimodal) == 1
    assert mtp_head_class(multimodal) is Qwen3NextMTP
    assert arch(multimodal).hidden_size == multimodal.text_config.hidden_size
    multimodal.text_config.mtp_num_hidden_layers = 0
    with pytest.raises(ValueError, match=r"speculative_config\.method: mtp .* has none"):
        mtp_head_class(multimodal)


# -- a hybrid target drafted for end to end -----------------------------------------------------
def test_greedy_tokens_are_transformers_with_every_proposal_the_references(tmp_path, monkeypatch):
    """The tiny Qwen3.5 (Gated DeltaNet layers: its states rolled back to the drafts kept)
    drafted for by its MTP layer, k = 2, prefix caching on (drafted steps stop short of a
    block boundary), prompts in chunks: the greedy tokens are transformers' own; every
    proposal equals the reference's drafts after the tokens it followed. The layer is
    built to predict the target's near-bigram map (``save_target_with_mtp``), so drafts
    are kept as well as rejected: steps keep 0, 1 and 2 of their 2 drafts (each a
    different roll-back). No state slot leaks; the scheduler's invariants hold."""
    from vllm.v1.metrics.stats import SpecDecodingStats

    hf, tensors = save_target_with_mtp(tmp_path, noise=0.1, bigram=0.3)
    ref = RefQwenMTP(hf, tensors)
    expected = hf_greedy(hf, PROMPTS, max(MAX_TOKENS))
    expected = [e[:n] for e, n in zip(expected, MAX_TOKENS, strict=True)]
    seen: list[tuple[int, int]] = []
    observe = SpecDecodingStats.observe
    monkeypatch.setattr(SpecDecodingStats, "observe",
                        lambda self, n, a: seen.append((n, a)) or observe(self, n, a))  # fmt: skip
    llm = _engine(tmp_path, max_num_batched_tokens=16)
    try:
        drafter = llm.engine_core.model_runner.drafter
        propose, proposals = drafter.propose_step, []

        def recorded(reqs, target_hidden):
            before = {r.state.req_id: list(r.state.token_ids) for r in reqs}
            drafts = propose(reqs, target_hidden)
            proposals.extend((before[req_id], d) for req_id, d in drafts.items())
            return drafts

        drafter.propose_step = recorded
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        _check_slots(llm)
        llm.engine_core.scheduler.check_invariants()
    finally:
        llm.shutdown()
    assert [list(o.outputs[0].token_ids) for o in outs] == expected
    assert {a for n, a in seen if n == K} == {0, 1, 2}, seen
    drafted, kept = sum(n for n, _ in seen), sum(a for _, a in seen)
    assert 0.2 < kept / drafted < 0.9, seen
    assert len(proposals) >= len(seen)
    for tokens, drafts in proposals:
        assert drafts == ref.drafts(tokens, len(drafts)), tokens


# -- what is refused, the config ----------------------------------------------------------------
def test_a_checkpoint_without_the_layers_tensors_is_refused_naming_the_flag(tmp_path):
    """The files transformers saves (no ``mtp.*``) with ``mtp``: refused when the head
    reads them, naming the flag as for DeepSeek; a config that counts no layer: refused
    before loading, naming the method."""
    save_target_with_mtp(tmp_path)
    (tmp_path / "mtp.safetensors").unlink()
    with pytest.raises(ValueError, match=r"speculative_config\.model: .* no multi-token"):
        _engine(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "mtp_num_hidden_layers": 0}))
    with pytest.raises(ValueError, match=r"speculative_config\.method: mtp .* has none"):
        _engine(tmp_path)


@pytest.mark.parametrize("method", ["eagle", "eagle3", "draft_model"])
def test_other_model_drafts_are_still_refused(tmp_path, method):
    """A draft model's or an EAGLE head's proposer would need recurrent states of its own:
    still refused for a model with recurrent layers, naming the method."""
    from vllm import LLM

    save_target_with_mtp(tmp_path)
    spec = {"method": method, "model": str(tmp_path), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match=f"--speculative-config: method '{method}' is not"):
        LLM(model=str(tmp_path), skip_tokenizer_init=True, speculative_config=spec)


def test_vllms_older_name_is_taken_with_a_warning(caplog):
    spec = SpeculativeConfig({"method": "qwen3_next_mtp", "num_speculative_tokens": 2})
    assert spec.method == "mtp" and "deprecated" in caplog.text
