"""EAGLE speculative decoding (``method`` eagle / eagle3): the config, and whole engines
whose every proposal must equal a reference's and whose greedy outputs must equal plain
decoding's.

The reference recomputes everything from the checkpoint files with plain torch: the
target's hidden states by transformers (``output_hidden_states``; the last layer's stream
before the final norm by a hook), the head's layers by the few lines below (no paging,
no cache: each draft recomputes every position), greedy drafts from the token after the
last one. The heads are made from the target's own weights plus noise
(``tests/eagle_checkpoints.py``), so that some drafts are kept and some are not: an
off-by-one in a position, a hidden-state row or a token changes which.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.eagle_checkpoints import (
    add_qk_norms,
    save_as_speculators,
    save_eagle,
    save_tiny_target,
)
from vllm.config import SpeculativeConfig
from vllm.sampling_params import SamplingParams

K = 3


# -- the config -----------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_eagle_methods_take_the_draft_model_keys(method):
    spec = SpeculativeConfig({"method": method, "model": "/x", "num_speculative_tokens": 2})
    assert spec.method == method and spec.uses_draft_model and spec.num_lookahead_tokens == 2
    with pytest.raises(ValueError, match=r"speculative_config\.prompt_lookup_min"):
        SpeculativeConfig({"method": method, "model": "/x", "num_speculative_tokens": 2,
                           "prompt_lookup_min": 2})  # fmt: skip
    with pytest.raises(ValueError, match=r"speculative_config\.model"):
        SpeculativeConfig({"method": method, "num_speculative_tokens": 2})


# -- the reference ----------------------------------------------------------------------------
def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class RefHead:
    """An EAGLE head computed from its checkpoint's tensors, over whole sequences."""

    def __init__(self, folder: Path, target, method: str) -> None:
        from safetensors.torch import load_file
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        sd = {
            k.replace("midlayer.", "layers.0."): v
            for k, v in load_file(folder / "model.safetensors").items()
        }
        self.cfg = json.loads((folder / "config.json").read_text())
        self.sd, self.eagle3 = sd, method == "eagle3"
        self.embed = sd.get("embed_tokens.weight", target.model.embed_tokens.weight.detach())
        self.head = sd["lm_head.weight"] if self.eagle3 else target.lm_head.weight.detach()
        self.vocab = target.config.vocab_size
        self.d2t = sd.get("d2t")
        self.eps = self.cfg.get("rms_norm_eps", 1e-6)
        self.rotary = LlamaRotaryEmbedding(LlamaConfig(**self.cfg))
        self.target = target
        n = target.config.num_hidden_layers
        ids = (
            self.cfg.get("eagle_aux_hidden_state_layer_ids")
            or (self.cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
            or [2, n // 2, n - 3]
        )
        self.aux_ids = sorted(set(ids))

    def target_hidden(self, tokens: list[int]) -> torch.Tensor:
        """The target's hidden states over ``tokens`` the head reads, one row a token."""
        stream = {}
        hook = self.target.model.norm.register_forward_hook(
            lambda mod, args, out: stream.update(last=args[0][0])  # None: output kept
        )
        try:
            with torch.no_grad():
                out = self.target(torch.tensor([tokens]), output_hidden_states=True)
        finally:
            hook.remove()
        states = [h[0] for h in out.hidden_states[:-1]] + [stream["last"]]
        if not self.eagle3:
            return out.hidden_states[-1][0]  # after the final norm
        aux = torch.cat([states[i] for i in self.aux_ids], dim=-1)
        if "input_norm.weight" in self.sd:
            aux = _rms(aux, self.sd["input_norm.weight"], self.eps)
        return aux @ self.sd["fc.weight"].T

    def _attention(self, i: int, h: torch.Tensor) -> torch.Tensor:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        p, cfg = f"layers.{i}.self_attn.", self.cfg
        heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        d = cfg.get("head_dim") or cfg["hidden_size"] // heads
        t = h.shape[0]
        q = (h @ self.sd[p + "q_proj.weight"].T).view(t, heads, d).transpose(0, 1)
        k = (h @ self.sd[p + "k_proj.weight"].T).view(t, kv_heads, d).transpose(0, 1)
        v = (h @ self.sd[p + "v_proj.weight"].T).view(t, kv_heads, d).transpose(0, 1)
        if p + "q_norm.weight" in self.sd:  # a Qwen3 layer: each head's q and k normed
            q = _rms(q, self.sd[p + "q_norm.weight"], self.eps)
            k = _rms(k, self.sd[p + "k_norm.weight"], self.eps)
        cos, sin = self.rotary(v[None], torch.arange(t)[None])
        q, k = apply_rotary_pos_emb(q[None], k[None], cos, sin)
        rep = heads // kv_heads
        k, v = k[0].repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
        out = F.scaled_dot_product_attention(q[0], k, v, is_causal=True)
        return out.transpose(0, 1).reshape(t, heads * d) @ self.sd[p + "o_proj.weight"].T

    def _mlp(self, i: int, h: torch.Tensor) -> torch.Tensor:
        p = f"layers.{i}.mlp."
        gate, up = h @ self.sd[p + "gate_proj.weight"].T, h @ self.sd[p + "up_proj.weight"].T
        return (F.silu(gate) * up) @ self.sd[p + "down_proj.weight"].T

    def forward(self, ids: list[int], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions 0.. of (token, hidden) rows -> (logits, the next rows' hidden)."""
        sd, eps = self.sd, self.eps
        embeds = self.embed[torch.tensor(ids)]
        if self.eagle3:
            normed = _rms(hidden, sd["layers.0.hidden_norm.weight"], eps)
            x = normed if self.cfg.get("norm_before_residual") else hidden
            h = torch.cat([_rms(embeds, sd["layers.0.input_layernorm.weight"], eps), normed], -1)
        else:
            x = torch.cat([embeds, hidden], dim=-1) @ sd["fc.weight"].T
            h = x  # layer 0 has no input norm
        for i in range(self.cfg["num_hidden_layers"]):
            if i > 0:
                h = _rms(x, sd[f"layers.{i}.input_layernorm.weight"], eps)
            x = x + self._attention(i, h)
            x = x + self._mlp(i, _rms(x, sd[f"layers.{i}.post_attention_layernorm.weight"], eps))
        out = _rms(x, sd["norm.weight"], eps) if self.eagle3 else x
        logits = out @ self.head.T
        if self.d2t is not None:
            full = torch.full((logits.shape[0], self.vocab), float("-inf"))
            full[:, torch.arange(len(self.d2t)) + self.d2t] = logits
            logits = full
        return logits, (out if self.cfg.get("norm_output") else x)

    def drafts(self, tokens: list[int], k: int) -> list[int]:
        """The k greedy drafts after ``tokens`` (each recomputing every position)."""
        ids, hidden = tokens[1:], self.target_hidden(tokens[:-1])
        out = []
        for _ in range(k):
            logits, nxt = self.forward(ids, hidden)
            out.append(int(logits[-1].argmax()))
            ids, hidden = ids + [out[-1]], torch.cat([hidden, nxt[-1:]])
        return out


def ref_spec_decode(head: RefHead, prompt: list[int], max_tokens: int, k: int):
    """Greedy speculative decoding as the engine steps it: (tokens, each step's drafts,
    how many of them were kept)."""
    target = head.target

    def argmaxes(tokens):
        with torch.no_grad():
            return target(torch.tensor([tokens])).logits[0].argmax(-1).tolist()

    tokens, steps, kept_counts = list(prompt), [], []
    tokens.append(argmaxes(tokens)[-1])
    while len(tokens) - len(prompt) < max_tokens:
        n = min(k, max_tokens - (len(tokens) - len(prompt)) - 1)
        drafts = head.drafts(tokens, n) if n > 0 else []
        steps.append(drafts)
        best = argmaxes(tokens + drafts)[len(tokens) - 1 :]
        kept = 0
        while kept < len(drafts) and drafts[kept] == best[kept]:
            kept += 1
        tokens += drafts[:kept] + [best[kept]]
        kept_counts.append(kept)
    return tokens[len(prompt) :][:max_tokens], steps, kept_counts


# -- engines against the reference ---------------------------------------------------------------
PROMPTS = [[5 + (7 * i) % 200 for i in range(40)], [11, 12, 13, 14] * 6, list(range(100, 117))]
MAX_TOKENS = (24, 20, 28)

# name -> (method, save_eagle's options). A head's noise sets how far it strays from
# passing the target's hidden state through: at 0.3 about a third of the drafts are kept;
# at 3 none, but every draft is the head's own computation (its attention over its KV,
# its positions), which the small noise hides beyond the first draft.
VARIANTS = {
    "eagle": ("eagle", {"noise": 0.3}),
    "eagle3": ("eagle3", {"noise": 0.3}),
    "eagle3-d2t": ("eagle3", {"noise": 0.3, "draft_vocab_size": 128}),
    "eagle3-options": (
        "eagle3",
        {"noise": 0.3, "norm_before_residual": True, "with_embed_tokens": True},
    ),
    "eagle3-default-layers": ("eagle3", {"noise": 0.3, "aux_layer_ids": None}),
    "eagle-noisy": ("eagle", {"noise": 3.0}),
    "eagle-short": ("eagle", {"noise": 0.3}),  # the "eagle" head, its config cut to 32
    "eagle3-speculators": ("eagle3", {"noise": 0.3}),  # the "eagle3" head, speculators' format
    # The "eagle3-qk" head (q/k norms added) as speculators' Qwen3 head.
    "eagle3-speculators-qwen3": ("eagle3", {"noise": 0.3}),
    "eagle3-noisy": ("eagle3", {"noise": 3.0}),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle")
    save_tiny_target(root / "target")
    for name, (method, options) in VARIANTS.items():
        if name in ("eagle-short", "eagle3-speculators", "eagle3-speculators-qwen3"):
            continue
        save_eagle(root / name, root / "target", method, **options)
    # A head whose config says 32 positions drafts at every position the target serves
    # (vLLM raises its max_position_embeddings to the target's length).
    short = root / "eagle-short"
    short.mkdir()
    (short / "model.safetensors").symlink_to(root / "eagle" / "model.safetensors")
    config = json.loads((root / "eagle" / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 32}))
    save_as_speculators(root / "eagle3", root / "eagle3-speculators", speculative_tokens=K)
    add_qk_norms(root / "eagle3", root / "eagle3-qk")
    save_as_speculators(
        root / "eagle3-qk", root / "eagle3-speculators-qwen3", "qwen3", speculative_tokens=K
    )
    return root


@contextlib.contextmanager
def recording_proposals(llm):
    """Every request's drafts, in the order the engine proposed them."""
    drafter = llm.engine_core.model_runner.drafter
    propose, seen = drafter.propose_step, {}

    def recorded(reqs, target_hidden):
        drafts = propose(reqs, target_hidden)
        for req_id, d in drafts.items():
            seen.setdefault(req_id, []).append(d)
        return drafts

    drafter.propose_step = recorded
    try:
        yield seen
    finally:
        drafter.propose_step = propose


def generate_as_the_reference(llm, prompts, max_tokens, expected) -> None:
    """Greedy outputs of ``llm`` (shut down after) equal ``expected``'s tokens (from
    ``ref_spec_decode``), and every request's proposals, step by step, its drafts."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    try:
        with recording_proposals(llm) as proposals:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        llm.engine_core.scheduler.check_invariants()
    finally:
        llm.shutdown()
    for out, (tokens, steps, _) in zip(outs, expected, strict=True):
        assert list(out.outputs[0].token_ids) == tokens
        assert proposals[out.request_id] == [s for s in steps if s]


def _engine(target: Path, head: Path | None, method: str, **kwargs):
    from vllm import LLM

    spec = None
    if head is not None:
        spec = {"method": method, "model": str(head), "num_speculative_tokens": K}
    engine = {"kv_cache_memory": "8MiB", "max_model_len": 256, **kwargs}
    return LLM(model=str(target), skip_tokenizer_init=True, dtype="float32",
               speculative_config=spec, **engine)  # fmt: skip


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_proposal_equals_the_reference_and_the_output_plain_decoding(checkpoints, variant):
    from transformers import LlamaForCausalLM

    from tests.v1.spec_decode.test_draft_model import counting

    method, _ = VARIANTS[variant]
    target = LlamaForCausalLM.from_pretrained(checkpoints / "target", torch_dtype=torch.float32)
    # One head, two formats.
    same = {"eagle3-speculators": "eagle3", "eagle3-speculators-qwen3": "eagle3-qk"}
    same = same.get(variant, variant)
    ref = RefHead(checkpoints / same, target.eval(), method)
    expected = [ref_spec_decode(ref, p, n, K) for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)]
    llm = _engine(checkpoints / "target", checkpoints / variant, method)
    with counting(llm) as counts:
        generate_as_the_reference(llm, PROMPTS, MAX_TOKENS, expected)
    # LLM.get_metrics (vLLM's): the counters, and the drafts kept at each position.
    metrics = {m.name: m for m in llm.get_metrics()}
    assert metrics["vllm:spec_decode_num_draft_tokens"].value == counts["draft_tokens"]
    assert metrics["vllm:spec_decode_num_accepted_tokens"].value == counts["accepted"]
    per_pos = [0] * K
    for _, _, kept_counts in expected:
        for kept in kept_counts:
            for i in range(kept):
                per_pos[i] += 1
    assert metrics["vllm:spec_decode_num_accepted_tokens_per_pos"].values == per_pos
    kept = counts["accepted"] / counts["draft_tokens"]
    if VARIANTS[variant][1]["noise"] < 1:  # both kept and rejected drafts
        assert 0.1 < kept < 0.95, counts


# -- CUDA graphs (stand-ins on the CPU) ------------------------------------------------------------
@pytest.mark.parametrize("variant", ["eagle", "eagle3"])
def test_replayed_head_steps_propose_as_eager_ones(monkeypatch, checkpoints, variant):
    """The head's single-token forwards and decode-row catch-ups replay graphs whose
    hidden-state input is a buffer; EAGLE-3's target replays leave its auxiliary hidden
    states in a buffer of theirs. Proposals and outputs equal the eager engine's."""
    from tests.v1.spec_decode.test_draft_model_graphs import _engine as graph_engine

    method, target = VARIANTS[variant][0], str(checkpoints / "target")
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    results = {}
    for graphs in (False, True):
        llm = graph_engine(monkeypatch, target, str(checkpoints / variant), graphs, K, method)
        runner = llm.engine_core.model_runner
        try:
            with recording_proposals(llm) as proposals:
                outs = llm.generate(prompts, params)
            head_graphs, target_graphs = runner.drafter.graphs, runner.decode_graphs
            replays = (
                head_graphs and head_graphs.num_replays,
                target_graphs and target_graphs.num_replays,
            )
        finally:
            llm.shutdown()
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        results[graphs] = (tokens, [proposals[o.request_id] for o in outs], replays)
    assert results[False][2] == (None, None)
    head_replays, target_replays = results[True][2]
    assert head_replays > 20 and target_replays > 5
    assert results[True][:2] == results[False][:2]


# -- prefix hits, preemption, sampling ------------------------------------------------------------
def check_pressure_prefix_hits_and_sampling(plain, make_engine, tiny: dict, prompts) -> None:
    """Greedy outputs of ``make_engine(**tiny)`` (a tiny pool: requests preempted and
    recomputed) and of ``make_engine()`` (then the prompts again: prefix hits, the head
    drafting over cached blocks' KV) equal those of ``plain`` (an engine without drafts;
    both shut down here); seeded sampled requests (drafts from the head's q, rejection
    sampling) are reproducible; drafts are kept; nothing leaks."""
    from tests.v1.spec_decode.test_draft_model import _assert_no_leaks, counting

    params = [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)] * len(prompts)
    prompts = [{"prompt_token_ids": p} for p in prompts]

    def tokens(outs):
        return [list(o.outputs[0].token_ids) for o in outs]

    try:
        base = tokens(plain.generate(prompts, params))
    finally:
        plain.shutdown()
    for pool in (tiny, {}):
        llm = make_engine(**pool)
        try:
            with counting(llm) as counts:
                assert tokens(llm.generate(prompts, params)) == base
                assert counts["accepted"] > 0
                if pool:
                    assert counts["preemptions"] > 0
                    continue
                again = llm.generate(prompts, params)
            assert tokens(again) == base and min(o.num_cached_tokens for o in again) >= 16
            _assert_no_leaks(llm)
            hot = SamplingParams(temperature=0.8, max_tokens=32, ignore_eos=True, seed=3)
            with counting(llm) as counts:
                runs = [tokens(llm.generate(prompts, [hot] * len(prompts))) for _ in range(2)]
            assert runs[0] == runs[1]  # seeded: reproducible under the same schedule
            assert [len(t) for t in runs[0]] == [32] * len(prompts) and counts["accepted"] > 0
            _assert_no_leaks(llm)
        finally:
            llm.shutdown()


def test_prefix_hits_preemption_and_sampling_keep_the_outputs(checkpoints):
    target = checkpoints / "target"
    tiny = {"num_gpu_blocks_override": 9, "max_num_seqs": 3, "max_model_len": 128}
    plain = _engine(target, None, "eagle", **tiny)
    check_pressure_prefix_hits_and_sampling(
        plain, lambda **pool: _engine(target, checkpoints / "eagle3", "eagle3", **pool), tiny,
        PROMPTS,
    )  # fmt: skip


# -- a speculators head as the model ---------------------------------------------------------------
def _speculators_model(checkpoints: Path, out: Path, **speculators_config) -> Path:
    """The "eagle3-speculators" head, its verifier the target's absolute path (as a hub
    head names its target), ``speculators_config`` replacing keys of its own."""
    out.mkdir()
    head = checkpoints / "eagle3-speculators"
    (out / "model.safetensors").symlink_to(head / "model.safetensors")
    config = json.loads((head / "config.json").read_text())
    verifier = {"name_or_path": str(checkpoints / "target")}
    spec = {**config["speculators_config"], "verifier": verifier}
    config["speculators_config"] = {**spec, **speculators_config}
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_a_speculators_head_as_the_model_serves_its_verifier_with_it(checkpoints, tmp_path):
    """vLLM's ``vllm serve RedHatAI/...speculator.eagle3``: the verifier named in the
    head's config is served, the head drafting its ``speculative_tokens``; the same
    outputs and drafts as the explicit --speculative-config."""
    from tests.v1.spec_decode.test_draft_model import counting
    from vllm import LLM

    served = _speculators_model(checkpoints, tmp_path / "head")
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * len(PROMPTS)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    results = []
    for llm in (
        lambda: _engine(checkpoints / "target", checkpoints / "eagle3-speculators", "eagle3"),
        lambda: LLM(
            model=str(served),
            skip_tokenizer_init=True,
            dtype="float32",
            kv_cache_memory="8MiB",
            max_model_len=256,
        ),  # fmt: skip
    ):
        engine = llm()
        try:
            with counting(engine) as counts:
                outs = engine.generate(prompts, params)
            results.append(([list(o.outputs[0].token_ids) for o in outs], dict(counts)))
            config = engine.vllm_config
        finally:
            engine.shutdown()
    assert config.model_config.model == str(checkpoints / "target")
    assert config.speculative_config.speculative_config == {
        "method": "eagle3", "model": str(served), "num_speculative_tokens": K,
    }  # fmt: skip
    assert results[0] == results[1] and results[1][1]["accepted"] > 0


def test_a_speculators_model_takes_a_draft_count_and_refuses_another_method(checkpoints, tmp_path):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.cli.main import make_parser
    from vllm.entrypoints.cli.serve import build_config

    served = _speculators_model(checkpoints, tmp_path / "head")
    args = make_parser().parse_args(
        ["serve", str(served), "--speculative-config", '{"num_speculative_tokens": 2}']
    )
    config = build_config(args)
    assert config.model_config.model == str(checkpoints / "target")
    assert config.speculative_config.speculative_config["num_speculative_tokens"] == 2
    assert config.speculative_config.speculative_config["model"] == str(served)
    short = build_config(make_parser().parse_args(["serve", str(served), "--spec-tokens", "2"]))
    assert short.speculative_config == config.speculative_config  # vLLM's shortcut flag
    for given in ({"method": "ngram"}, {"model": str(checkpoints / "eagle3")}):
        key = next(iter(given))
        with pytest.raises(ValueError, match=rf"speculative_config\.{key}: .*speculators eagle3"):
            EngineArgs(model=str(served), speculative_config=given).serve_speculators_head()
    broken = _speculators_model(checkpoints, tmp_path / "broken", proposal_methods=[])
    with pytest.raises(ValueError, match=r"model: .*speculators_config without"):
        EngineArgs(model=str(broken)).serve_speculators_head()
    plain = EngineArgs(model=str(checkpoints / "target"))
    plain.serve_speculators_head()  # not a speculators model: nothing changes
    assert plain.model == str(checkpoints / "target") and plain.speculative_config is None


# -- what is refused ------------------------------------------------------------------------------
def test_a_head_of_another_hidden_size_is_refused_naming_the_model(checkpoints, tmp_path):
    config = json.loads((checkpoints / "eagle3" / "config.json").read_text())
    head = tmp_path / "wide"
    head.mkdir()
    (head / "model.safetensors").symlink_to(checkpoints / "eagle3" / "model.safetensors")
    (head / "config.json").write_text(json.dumps({**config, "target_hidden_size": 256}))
    with pytest.raises(ValueError, match=r"speculative_config\.model: the head reads hidden"):
        _engine(checkpoints / "target", head, "eagle3", load_format="dummy")


def test_eagle3_over_a_model_without_auxiliary_states_is_refused():
    # Every family here keeps them; a model class that does not is refused by name.
    from vllm.v1.spec_decode.eagle import eagle_head_class

    class NoAux(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens, self.lm_head = torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8)

    with pytest.raises(ValueError, match=r"speculative_config\.method: eagle3 reads .*NoAux"):
        eagle_head_class("eagle3", NoAux())
    assert eagle_head_class("eagle", NoAux()).__name__ == "EagleLlamaForCausalLM"


@pytest.mark.parametrize("variant", ["eagle", "eagle3"])
def test_the_memory_profile_runs_the_heads_catch_up(checkpoints, variant):
    """The runner's profile run (CUDA's memory sizing) ends with the head's catch-up over
    the largest step, its hidden-state input of the target's width."""
    llm = _engine(checkpoints / "target", checkpoints / variant, VARIANTS[variant][0])
    try:
        runner = llm.engine_core.model_runner
        calls = []
        forward = runner.drafter.model.forward

        def recorded(*args, hidden_states, **kwargs):
            calls.append(tuple(hidden_states.shape))
            return forward(*args, hidden_states=hidden_states, **kwargs)

        runner.drafter.model.forward = recorded
        probs = runner.profile_run()
        budget = llm.engine_core.vllm_config.scheduler_config.max_num_batched_tokens
        assert calls == [(budget, runner.drafter.model.arch.hidden_size)]
        assert torch.isfinite(probs).all()
    finally:
        llm.shutdown()


# -- over a mixture of experts with sliding windows and sinks --------------------------------
def save_random_eagle3(path: Path, target_config, aux_layer_ids: list[int], seed: int = 0):
    """A random EAGLE-3 head (upstream's names) for ``target_config``'s shapes."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    c = target_config
    h, heads, kv, d = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    inter, vocab = 2 * h, c.vocab_size

    def rand(*shape, scale=0.15):
        return torch.randn(*shape, generator=g) * scale

    def norm():
        return 1 + rand(h, scale=0.1)

    tensors = {
        "midlayer.self_attn.q_proj.weight": rand(heads * d, 2 * h),
        "midlayer.self_attn.k_proj.weight": rand(kv * d, 2 * h),
        "midlayer.self_attn.v_proj.weight": rand(kv * d, 2 * h),
        "midlayer.self_attn.o_proj.weight": rand(h, heads * d),
        "midlayer.mlp.gate_proj.weight": rand(inter, h),
        "midlayer.mlp.up_proj.weight": rand(inter, h),
        "midlayer.mlp.down_proj.weight": rand(h, inter),
        "midlayer.input_layernorm.weight": norm(),
        "midlayer.hidden_norm.weight": norm(),
        "midlayer.post_attention_layernorm.weight": norm(),
        "fc.weight": rand(h, 3 * h, scale=0.1),
        "norm.weight": norm(),
        "lm_head.weight": rand(vocab, h, scale=0.5),
    }
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": h, "intermediate_size": inter, "num_attention_heads": heads,
        "num_key_value_heads": kv, "head_dim": d, "num_hidden_layers": 1,
        "vocab_size": vocab, "draft_vocab_size": vocab, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "max_position_embeddings": 128, "tie_word_embeddings": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux_layer_ids},
    }  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))


def test_eagle3_over_gpt_oss_proposes_as_the_reference(tmp_path):
    """gpt-oss (a mixture of experts, sliding-window layers in their own KV cache group,
    attention sinks) exposes its residual stream like the Llama family: a random EAGLE-3
    head over it proposes exactly the reference's drafts, the outputs are transformers'
    greedy tokens, and the head caches in the full-attention group's blocks."""
    from tests.model_executor.test_gpt_oss import hf_model

    hf = hf_model(sliding_window=12)
    hf.save_pretrained(tmp_path / "target")
    save_random_eagle3(tmp_path / "head", hf.config, [0, 1, 2])
    ref = RefHead(tmp_path / "head", hf, "eagle3")
    prompts = [[3 + (5 * i) % 90 for i in range(30)], [7, 8, 9, 10] * 5]
    expected = [ref_spec_decode(ref, p, 20, K) for p in prompts]
    llm = _engine(tmp_path / "target", tmp_path / "head", "eagle3", max_model_len=128)
    assert llm.engine_core.model_runner.kv_cache_windows == (None, 12)  # hybrid KV stays on
    generate_as_the_reference(llm, prompts, (20, 20), expected)


def _save_family(family: str, path: Path):
    """A tiny transformers model of ``family``, saved at ``path``; returns it."""
    if family == "gemma3":  # sliding-window layers in their own group, embeddings scaled
        from tests.model_executor.test_gemma import save_checkpoint

        return save_checkpoint("Gemma3ForCausalLM", path)
    if family == "cohere2":  # parallel attention and MLP, layer norms, sliding layers
        from tests.model_executor.test_cohere import save

        return save("Cohere2", path)
    from tests.model_executor.test_deepseek import save  # MLA, experts, yarn

    return save("v3", path)


@pytest.mark.parametrize("family", ["gemma3", "cohere2", "deepseek_v3"])
def test_eagle3_over_other_families_proposes_as_the_reference(tmp_path, family):
    """Gemma 3, Cohere 2 and DeepSeek-V3 expose their residual stream (the embeddings as
    the model scales them, then the stream after each layer) as the Llama family does: a
    random EAGLE-3 head over each proposes exactly the reference's drafts and the outputs
    are transformers' greedy tokens."""
    from types import SimpleNamespace

    hf = _save_family(family, tmp_path / "target")
    h = hf.config.hidden_size
    shape = SimpleNamespace(hidden_size=h, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=h // 4, vocab_size=hf.config.vocab_size)  # fmt: skip
    save_random_eagle3(tmp_path / "head", shape, [0, 1, 2])
    ref = RefHead(tmp_path / "head", hf, "eagle3")
    prompts = [[3 + (5 * i) % 90 for i in range(30)], [7, 8, 9, 10] * 5]
    expected = [ref_spec_decode(ref, p, 20, K) for p in prompts]
    llm = _engine(tmp_path / "target", tmp_path / "head", "eagle3", max_model_len=128)
    generate_as_the_reference(llm, prompts, (20, 20), expected)
