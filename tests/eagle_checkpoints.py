"""Tiny EAGLE-1 / EAGLE-3 draft checkpoints in the formats upstream vLLM 0.32 loads, over a
tiny random Llama target.

Importable from both virtualenvs (ours and ``.venv-upstream``): only torch, safetensors,
transformers, json and pathlib; nothing here imports ``vllm``. Building is deterministic
(fixed seeds, fp32); the two virtualenvs produce the same target weights, but compare
engines on the SAME checkpoint folders (``scripts/upstream_eagle_parity.py`` writes each
file's sha256 next to its results).

Format: what upstream vLLM 0.32 reads (paths under its ``vllm/`` package)
---------------------------------------------------------------------

* Architecture. ``config/speculative.py`` (``SpeculativeConfig.__post_init__``) wraps the
  draft's HF config in ``transformers_utils/configs/eagle.py::EAGLEConfig`` for methods
  "eagle"/"eagle3"; ``EAGLEConfig.__init__`` renames each architecture ``X`` to ``EagleX``
  (eagle; unless it starts with "Eagle") or ``Eagle3X`` (eagle3; unless it starts or ends
  with "Eagle3"). ``model_executor/models/registry.py`` maps ``EagleLlamaForCausalLM`` to
  ``llama_eagle.py`` and both ``Eagle3LlamaForCausalLM`` and ``LlamaForCausalLMEagle3`` to
  ``llama_eagle3.py::Eagle3LlamaForCausalLM``. We write ``LlamaForCausalLM`` (eagle) and
  ``LlamaForCausalLMEagle3`` (eagle3), as the public yuhuili/EAGLE-LLaMA3-Instruct-8B and
  yuhuili/EAGLE3-LLaMA3.1-Instruct-8B configs do (``architecture=`` overrides). The draft
  config is otherwise the target's Llama config with ``num_hidden_layers`` 1.
* Names. No ``model.`` prefix in the file: ``load_weights`` of ``EagleLlamaForCausalLM`` /
  ``Eagle3LlamaForCausalLM`` prepend it (except to ``lm_head``).
* EAGLE-1 (``llama_eagle.py::LlamaModel``): ``fc.weight`` (H, 2H), no bias, applied to
  ``cat(embed_tokens(ids), hidden)``; ``layers.0.{self_attn.{q,k,v,o}_proj,
  mlp.{gate,up,down}_proj, post_attention_layernorm}.weight``: layer 0's
  ``input_layernorm`` is ``nn.Identity`` (``LlamaDecoderLayer.__init__``,
  ``disable_input_layernorm``), so there is no ``layers.0.input_layernorm.weight``; no
  final norm (``LlamaModel.forward`` returns ``hidden + residual`` un-normed as both
  outputs, and the inherited ``LlamaForCausalLM.compute_logits`` applies ``lm_head`` to
  it); no ``lm_head`` (the class has none; the target's is always shared:
  ``v1/spec_decode/llm_base_proposer.py::_maybe_share_lm_head``); ``embed_tokens.weight``
  optional (absent, or equal to the target's: the target's is shared,
  ``_maybe_share_embeddings``; different: the draft keeps its own).
* EAGLE-3 (``llama_eagle3.py``): ``midlayer.*`` (renamed ``layers.0.*`` by
  ``LlamaModel.hf_to_vllm_mapper``): ``input_layernorm`` (applied to the embeddings),
  ``hidden_norm`` (to the hidden state), ``self_attn.{q,k,v}_proj`` of input width 2H over
  ``cat(input_layernorm(embeds), hidden_norm(hidden))`` (``LlamaDecoderLayer.forward``,
  ``layer_idx == 0``), ``o_proj``, ``post_attention_layernorm``, ``mlp.*``; ``fc.weight``
  (H, 3H) over the target's auxiliary hidden states (``combine_hidden_states``, applied to
  the target's states only, not to the draft's own in later steps); ``norm.weight`` (the
  final norm before the draft's ``lm_head``); ``lm_head.weight`` (draft_vocab_size, H;
  equal to the target's: upstream shares the target's); ``d2t`` (int64, draft_vocab_size;
  loaded as ``draft_id_to_target_id``; target id = draft id + d2t[draft id];
  ``compute_logits`` scatters the draft logits into a -inf row of the target vocab) written
  only when draft_vocab_size < the target vocab (with equal sizes upstream has no such
  parameter and loading it fails); ``t2d`` (bool, target vocab) is skipped by upstream but
  written like the public checkpoints; ``embed_tokens.weight`` optional, as for EAGLE-1.
* EAGLE-3 config keys: ``draft_vocab_size`` (``Eagle3LlamaForCausalLM.__init__``; default
  vocab_size); ``norm_before_residual`` (llama_eagle3 ``LlamaDecoderLayer.__init__``:
  residual = hidden_norm(hidden) instead of the raw hidden);
  ``eagle_config.eagle_aux_hidden_state_layer_ids`` (``v1/worker/gpu_model_runner.py::
  _get_eagle3_aux_layers_from_config`` reads a top-level key of that name first, then
  this one; the fc width, ``llama_eagle3.py::LlamaModel.__init__``, counts only this one,
  3 when absent). Layer id L is the target's residual stream (hidden + residual, pre-norm)
  after L decoder layers (``model_executor/models/interfaces.py::EagleModelMixin.
  _maybe_add_hidden_state``: 0 = the embeddings, num_layers = after the last layer, before
  the final norm). Ids are sorted and de-duplicated (``_set_aux_hidden_state_layers``), so
  fc's chunks are in ascending layer order. Without the key:
  ``get_eagle3_default_aux_hidden_state_layers`` = (2, n // 2, n - 3); for n = 6 that is
  (2, 3, 3) -> two states for a 3H fc, so the default target has 8 layers: (2, 4, 5).
* What the draft is fed (``gpu_model_runner.py::propose_draft_token_ids`` and
  ``llm_base_proposer.py::propose``): draft position p gets token p + 1 (the last position
  the token just sampled) with the target's hidden state at p: for EAGLE-1 the target
  model's output, AFTER its final norm; for EAGLE-3 ``fc(cat(aux states))``. Later draft
  steps feed the draft's own second output (EAGLE-1 ``hidden + residual``; EAGLE-3 the
  pre-norm ``hidden + residual``) and its argmax token. Drafts are argmax
  (``_greedy_sample``) unless ``draft_sample_method="probabilistic"`` is asked for.

Weights: made from the target's, so drafts agree with it part of the time
------------------------------------------------------------------------

The head passes a target state through to the draft's logits; ``noise`` sizes every other
branch (calibrated on the target's states over a probe corpus, see ``_corpus``: each
perturbing branch's output has about ``noise`` times the rms of the residual stream it is
added to).

* EAGLE-1: fc = [R | I] (R random, the embeddings' share, of size ``noise``); the layer
  copies the target's last layer (q/k/v/gate/up/post_attention_layernorm) with o_proj and
  down_proj rescaled to size ``noise``. Its logits are ``lm_head`` of the target's final
  normed state plus the perturbations.
* EAGLE-3: when the highest aux id is n (default [1, n // 2, n]), fc passes that chunk
  (the state before the final norm) through, plus random maps of size ``noise`` of the
  others; when it is below n (upstream's default ids), fc is the least-squares map from the
  aux states to the pre-norm final state at the same position, fitted on the corpus
  (passing the n - 3 state through agrees with the target too rarely). midlayer q/k/v =
  [W | W] from the target's last layer, o_proj/down_proj rescaled as above, hidden_norm
  and input_layernorm = that layer's input_layernorm, norm = the target's final norm,
  lm_head = the target's rows for the draft vocabulary (all, or with ``draft_vocab_size=N``
  a seeded random sorted subset of N ids, with d2t/t2d).

Since position p is fed token p + 1 with the state at p, such a head mostly predicts the
token it was given again ("repeat the last token", right where the target repeats
itself); ``noise`` decides how often the draft's own computation (its attention over its KV
cache, the embedding share of fc, ...) changes a draft token.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

TARGET_DEFAULTS = dict(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=8,  # 6 would make upstream's default EAGLE-3 aux ids (2, 3, 3)
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    initializer_range=0.06,  # HF's 0.02: greedy outputs soon repeat one token forever
    rms_norm_eps=1e-6,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)

DEFAULT_NOISE = {"eagle": 0.1, "eagle3": 0.1}
SPREAD = "spread"  # aux_layer_ids default: [1, n // 2, n]
CHECKPOINT_FILES = ("config.json", "model.safetensors")


def save_tiny_target(path, seed: int = 0, **overrides) -> dict:
    """A random tiny Llama (``torch.manual_seed(seed)``, ``TARGET_DEFAULTS`` updated with
    ``overrides``) saved by transformers in fp32 into ``path``; returns its config.json."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**{**TARGET_DEFAULTS, **overrides})
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(str(path))
    return json.loads((Path(path) / "config.json").read_text())


def _rms(x: torch.Tensor) -> float:
    return x.float().pow(2).mean().sqrt().item()


def _rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _mlp(x, w: dict) -> torch.Tensor:
    gate = torch.nn.functional.silu(x @ w["mlp.gate_proj.weight"].T)
    return (gate * (x @ w["mlp.up_proj.weight"].T)) @ w["mlp.down_proj.weight"].T


@torch.no_grad()
def _corpus(model, vocab_size: int, batches=((32, 8), (32, 24)), new_tokens: int = 64):
    """The target's states over a probe corpus: seeded random prompts (``batches``: (count,
    length) pairs) continued greedily for ``new_tokens`` (the states the draft sees while
    decoding). Returns per-layer residual streams {L: (N, H)} (L = 0..n, pre-norm; n is
    the final norm's input), the final normed states (N, H) and the token ids (N,), over
    all positions of all sequences."""
    gen = torch.Generator().manual_seed(7)
    n = model.config.num_hidden_layers
    streams: dict[int, list] = {layer: [] for layer in range(n + 1)}
    normed, ids_all = [], []
    for count, length in batches:
        ids = torch.randint(0, vocab_size, (count, length), generator=gen)
        out = model(ids, use_cache=True)
        for _ in range(new_tokens):
            ids = torch.cat([ids, out.logits[:, -1].argmax(-1, keepdim=True)], dim=1)
            # transformers 5.24 renamed past_key_values (5.19) to cache
            key = "cache" if "cache" in out.keys() else "past_key_values"
            out = model(ids[:, -1:], use_cache=True, **{key: out[key]})
        captured: dict[str, torch.Tensor] = {}

        def keep(_module, args, out, captured=captured):
            captured.update(pre=args[0], normed=out)

        hook = model.model.norm.register_forward_hook(keep)
        try:
            out = model(ids, use_cache=False, output_hidden_states=True)
        finally:
            hook.remove()
        # transformers' last hidden_states entry is after the final norm: use the hook's.
        for layer in range(n):
            streams[layer].append(out.hidden_states[layer].flatten(0, 1))
        streams[n].append(captured["pre"].flatten(0, 1))
        normed.append(captured["normed"].flatten(0, 1))
        ids_all.append(ids.flatten())
    return (
        {layer: torch.cat(s) for layer, s in streams.items()},
        torch.cat(normed),
        torch.cat(ids_all),
    )


def _lstsq(x: torch.Tensor, y: torch.Tensor, ridge: float = 1e-3) -> torch.Tensor:
    """W (out, in) minimizing |x W^T - y|^2 + ridge * mean(x^2) * N * |W|^2."""
    x, y = x.double(), y.double()
    gram = x.T @ x + ridge * x.pow(2).mean() * x.shape[0] * torch.eye(x.shape[1], dtype=x.dtype)
    return torch.linalg.solve(gram, x.T @ y).T.float()


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def _save(path, config: dict, tensors: dict) -> dict:
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    # clone: safetensors refuses tensors that share storage (e.g. two norms of one weight)
    save_file(
        {k: v.detach().contiguous().clone() for k, v in tensors.items()},
        str(path / "model.safetensors"),
    )
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return config


def save_eagle(
    path,
    target_path,
    method: str,
    *,
    seed: int = 0,
    noise: float | None = None,
    draft_vocab_size: int | None = None,
    with_embed_tokens: bool = False,
    norm_before_residual: bool = False,
    aux_layer_ids=SPREAD,
    architecture: str | None = None,
) -> dict:
    """Write an EAGLE draft for the target at ``target_path`` into ``path``
    (``config.json`` + ``model.safetensors``); returns the config dict.

    ``method``: "eagle" (EAGLE-1) or "eagle3". Options:

    * ``noise``: the perturbation's relative size (default ``DEFAULT_NOISE[method]``).
    * ``draft_vocab_size`` (eagle3): N < vocab -> a draft vocabulary of N target ids (a
      seeded random sorted subset) with ``d2t``/``t2d``; None or vocab: all ids, no d2t.
    * ``with_embed_tokens``: write the target's embeddings as ``embed_tokens.weight``
      (equal to the target's, so upstream shares the target's anyway); False: leave them
      out (shared).
    * ``norm_before_residual`` (eagle3): the config flag of that name.
    * ``aux_layer_ids`` (eagle3): "spread" -> [1, n // 2, n]; a list -> those ids (written
      as given; upstream sorts and de-duplicates them); None -> no key, upstream's default
      (2, n // 2, n - 3).
    * ``architecture``: ``architectures[0]`` (default LlamaForCausalLM for eagle,
      LlamaForCausalLMEagle3 for eagle3).

    The arguments are recorded under the config key ``eagle_checkpoints`` (``options``;
    ``recorded_options`` gives what a call would record, to tell whether a folder is
    current).
    """
    import transformers

    if method not in ("eagle", "eagle3"):
        raise ValueError(f"method must be 'eagle' or 'eagle3', not {method!r}")
    noise = DEFAULT_NOISE[method] if noise is None else float(noise)
    target_config = json.loads((Path(target_path) / "config.json").read_text())
    model = transformers.LlamaForCausalLM.from_pretrained(
        str(target_path), dtype=torch.float32
    ).eval()
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    n = target_config["num_hidden_layers"]
    hidden = target_config["hidden_size"]
    vocab = target_config["vocab_size"]
    eps = target_config.get("rms_norm_eps", 1e-6)
    heads = target_config["num_attention_heads"]
    groups = heads // target_config.get("num_key_value_heads", heads)
    head_dim = target_config.get("head_dim") or hidden // heads
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only spin when CPUs are shared
    try:
        streams, final_normed, corpus_ids = _corpus(model, vocab)
    finally:
        torch.set_num_threads(threads)
    embeds = weights["model.embed_tokens.weight"]
    corpus_embeds = embeds[corpus_ids]
    gen = torch.Generator().manual_seed(seed)
    src = f"model.layers.{n - 1}."  # the draft layer copies the target's last layer
    w = {name[len(src) :]: t for name, t in weights.items() if name.startswith(src)}

    def random_map(in_rms: float, out_rms: float) -> torch.Tensor:
        r = torch.randn(hidden, hidden, generator=gen) / hidden**0.5
        return r * (out_rms / max(in_rms, 1e-12))

    def o_proj_for(attn_in: torch.Tensor, w_v: torch.Tensor, size: float) -> torch.Tensor:
        """o_proj rescaled so o_proj(v(attn_in)) (attention to one token) has rms size."""
        v = (attn_in @ w_v.T).view(attn_in.shape[0], -1, head_dim)
        v = v.repeat_interleave(groups, dim=1).reshape(attn_in.shape[0], -1)
        w_o = w["self_attn.o_proj.weight"]
        return w_o * (size / max(_rms(v @ w_o.T), 1e-12))

    def down_proj_for(residual: torch.Tensor, size: float) -> torch.Tensor:
        """down_proj rescaled so the MLP branch on post_attention_layernorm(residual) has
        rms size."""
        y = _rmsnorm(residual, w["post_attention_layernorm.weight"], eps)
        return w["mlp.down_proj.weight"] * (size / max(_rms(_mlp(y, w)), 1e-12))

    config = {
        k: v
        for k, v in target_config.items()
        if k not in ("architectures", "transformers_version", "dtype", "torch_dtype")
    }
    config.update(num_hidden_layers=1, dtype="float32")
    tensors: dict[str, torch.Tensor] = {}
    provenance = {
        "method": method,
        "seed": seed,
        "noise": noise,
        "with_embed_tokens": bool(with_embed_tokens),
        "source_layer": n - 1,
        "target_sha256": _sha256(Path(target_path) / "model.safetensors"),
        # the call's arguments, to tell whether a folder matches a later call
        "options": dict(
            seed=seed,
            noise=noise,
            draft_vocab_size=draft_vocab_size,
            with_embed_tokens=with_embed_tokens,
            norm_before_residual=norm_before_residual,
            aux_layer_ids=aux_layer_ids,
            architecture=architecture,
        ),
    }

    if method == "eagle":
        if draft_vocab_size not in (None, vocab) or norm_before_residual:
            raise ValueError("draft_vocab_size/norm_before_residual are EAGLE-3 options")
        config["architectures"] = [architecture or "LlamaForCausalLM"]
        h = final_normed  # what upstream feeds EAGLE-1: the target's output, after its norm
        size = noise * _rms(h)
        tensors["fc.weight"] = torch.cat(
            [random_map(_rms(corpus_embeds), size), torch.eye(hidden)], dim=1
        )
        layer = "layers.0."
        for name in ("q_proj", "k_proj", "v_proj"):
            tensors[f"{layer}self_attn.{name}.weight"] = w[f"self_attn.{name}.weight"]
        # no input_layernorm: attention sees fc's output (~ h) directly
        tensors[f"{layer}self_attn.o_proj.weight"] = o_proj_for(
            h, w["self_attn.v_proj.weight"], size
        )
        tensors[f"{layer}post_attention_layernorm.weight"] = w["post_attention_layernorm.weight"]
        tensors[f"{layer}mlp.gate_proj.weight"] = w["mlp.gate_proj.weight"]
        tensors[f"{layer}mlp.up_proj.weight"] = w["mlp.up_proj.weight"]
        tensors[f"{layer}mlp.down_proj.weight"] = down_proj_for(h, size)
    else:
        config["architectures"] = [architecture or "LlamaForCausalLMEagle3"]
        if isinstance(aux_layer_ids, str):
            if aux_layer_ids != SPREAD:
                raise ValueError(f"aux_layer_ids: {SPREAD!r}, a list of ints or None")
            aux_layer_ids = [1, n // 2, n]
        if aux_layer_ids is None:
            used = sorted({2, n // 2, n - 3})  # upstream's default, sorted and de-duplicated
        else:
            aux_layer_ids = [int(i) for i in aux_layer_ids]
            if not all(0 <= i <= n for i in aux_layer_ids):
                raise ValueError(f"aux layer ids must be in 0..{n}: {aux_layer_ids}")
            used = sorted(set(aux_layer_ids))
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layer_ids}
        if len(used) != 3:
            raise ValueError(f"upstream's fc is 3H wide but the distinct aux layers are {used}")
        chunks = [streams[i] for i in used]
        if used[-1] == n:  # pass the pre-norm final state through
            fc = torch.cat(
                [
                    *(random_map(_rms(c), noise * _rms(chunks[-1])) for c in chunks[:-1]),
                    torch.eye(hidden),
                ],
                dim=1,
            )
            provenance["fc"] = f"pass-through of layer {n} + noise"
        else:  # reconstruct it from the lower states
            fc = _lstsq(torch.cat(chunks, dim=-1), streams[n])
            provenance["fc"] = f"least squares {used} -> layer {n} at the same position"
        tensors["fc.weight"] = fc
        passed = torch.cat(chunks, dim=-1) @ fc.T  # the draft's hidden input over the corpus
        norm_w = w["input_layernorm.weight"]
        hn = _rmsnorm(passed, norm_w, eps)
        residual = hn if norm_before_residual else passed
        size = noise * _rms(residual)
        attn_in = torch.cat([_rmsnorm(corpus_embeds, norm_w, eps), hn], dim=-1)
        wide = {
            name: torch.cat([w[f"self_attn.{name}.weight"]] * 2, dim=1)
            for name in ("q_proj", "k_proj", "v_proj")
        }
        layer = "midlayer."
        for name, t in wide.items():
            tensors[f"{layer}self_attn.{name}.weight"] = t
        tensors[f"{layer}self_attn.o_proj.weight"] = o_proj_for(attn_in, wide["v_proj"], size)
        tensors[f"{layer}input_layernorm.weight"] = norm_w
        tensors[f"{layer}hidden_norm.weight"] = norm_w
        tensors[f"{layer}post_attention_layernorm.weight"] = w["post_attention_layernorm.weight"]
        tensors[f"{layer}mlp.gate_proj.weight"] = w["mlp.gate_proj.weight"]
        tensors[f"{layer}mlp.up_proj.weight"] = w["mlp.up_proj.weight"]
        tensors[f"{layer}mlp.down_proj.weight"] = down_proj_for(residual, size)
        tensors["norm.weight"] = weights["model.norm.weight"]
        lm_head = weights["lm_head.weight"]
        if draft_vocab_size is None or draft_vocab_size == vocab:
            config["draft_vocab_size"] = vocab
            tensors["lm_head.weight"] = lm_head
        else:
            if not 0 < draft_vocab_size < vocab:
                raise ValueError(f"draft_vocab_size must be in 1..{vocab}")
            ids = torch.randperm(vocab, generator=gen)[:draft_vocab_size].sort().values
            config["draft_vocab_size"] = int(draft_vocab_size)
            tensors["lm_head.weight"] = lm_head[ids]
            tensors["d2t"] = ids - torch.arange(draft_vocab_size)  # int64
            t2d = torch.zeros(vocab, dtype=torch.bool)
            t2d[ids] = True
            tensors["t2d"] = t2d
        if norm_before_residual:
            config["norm_before_residual"] = True
        provenance.update(
            aux_layer_ids=aux_layer_ids,
            aux_layers_used=used,
            draft_vocab_size=config["draft_vocab_size"],
            norm_before_residual=bool(norm_before_residual),
        )
    if with_embed_tokens:
        tensors["embed_tokens.weight"] = embeds
    config["eagle_checkpoints"] = provenance  # ignored by loaders
    return _save(path, config, tensors)


def add_qk_norms(head: Path, out: Path) -> None:
    """``head`` with per-head q and k norm weights away from 1 (a Qwen3 layer's), its
    config unchanged (only RefHead and save_as_speculators read this folder)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(head / "model.safetensors")
    cfg = json.loads((head / "config.json").read_text())
    d = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    g = torch.Generator().manual_seed(7)
    for name in ("q_norm", "k_norm"):
        tensors[f"midlayer.self_attn.{name}.weight"] = 1 + 0.5 * torch.randn(d, generator=g)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg))


def save_as_speculators(
    head: Path, out: Path, model_type: str = "llama", speculative_tokens: int = 3
) -> None:
    """``head`` (an EAGLE-3 head in the EAGLE repository's format) in the ``speculators``
    library's: the layer's config nested (of ``model_type``), the head's fields beside it
    (norm_before_residual written: its default there is true), ``layers.0.`` for
    ``midlayer.``; its verifier named "target" and ``speculative_tokens`` drafts."""
    from safetensors.torch import load_file, save_file

    config = json.loads((head / "config.json").read_text())
    aux = config.pop("eagle_config")["eagle_aux_hidden_state_layer_ids"]
    fields = {"draft_vocab_size": config.pop("draft_vocab_size")}
    layer = {k: v for k, v in config.items() if k not in ("architectures", "eagle_checkpoints")}
    layer["model_type"] = model_type
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
        "transformer_layer_config": layer, "eagle_aux_hidden_state_layer_ids": aux,
        "norm_before_residual": False, **fields,
        "speculators_config": {"proposal_methods": [{"speculative_tokens": speculative_tokens}],
                               "verifier": {"name_or_path": "target"}},
    }))  # fmt: skip
    tensors = load_file(head / "model.safetensors")
    save_file({k.replace("midlayer.", "layers.0."): v for k, v in tensors.items()},
              str(out / "model.safetensors"))  # fmt: skip


def checkpoint_ready(path) -> bool:
    """Whether ``path`` holds a saved checkpoint (config.json and model.safetensors)."""
    return all((Path(path) / name).is_file() for name in CHECKPOINT_FILES)


def recorded_options(method: str, **options) -> dict:
    """What ``save_eagle(..., method, **options)`` records as ``eagle_checkpoints.options``
    in the draft's config.json."""
    defaults = dict(
        seed=0,
        noise=None,
        draft_vocab_size=None,
        with_embed_tokens=False,
        norm_before_residual=False,
        aux_layer_ids=SPREAD,
        architecture=None,
    )
    unknown = set(options) - set(defaults)
    if unknown:
        raise TypeError(f"unknown options {sorted(unknown)}")
    out = {**defaults, **options}
    out["noise"] = DEFAULT_NOISE[method] if out["noise"] is None else float(out["noise"])
    return json.loads(json.dumps(out))  # as read back from config.json (tuples -> lists)
