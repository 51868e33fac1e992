"""DeepSeek Sparse Attention (DSA): DeepSeek-V3.2 (``DeepseekV32ForCausalLM``, transformers'
``deepseek_v32``) and GLM-5 (``GlmMoeDsaForCausalLM``, ``glm_moe_dsa``).

Both are DeepSeek-V3 (``models/deepseek_v2.py``: latent attention, absorbed, over a latent
cache; noaux_tc sigmoid routing) plus a **lightning indexer** per layer that picks, for each
query, the ``index_topk`` context tokens the attention may see:

- index query: ``wq_b`` of the query's low-rank residual (``q_a_layernorm``'s output),
  ``index_n_heads`` heads of ``index_head_dim``; index key: one per token, ``k_norm``
  (a LayerNorm with bias) of ``wk`` of the hidden state. Their first ``qk_rope_head_dim``
  dims rotate with the model's rotary table: Neox halves in DeepSeek-V3.2, adjacent pairs
  in GLM-5 (the main attention pairs adjacent dims in both);
- score of key t for query s: ``sum_h w_h(s) * relu(q_h(s) . k(t))`` times
  ``index_head_dim ** -0.5 * index_n_heads ** -0.5``, ``w = weights_proj(hidden)`` in
  fp32; over the causal context, the ``index_topk`` best are kept (all of them when the
  context is no longer).

**Cache.** Past hidden states are not kept, so each token's index key is cached, per
layer, in the latent row: a key row is ``[c_kv (kv_lora_rank) | k_pe (rope) | index key
(index_head_dim)]`` (``arch.head_dim``; values stay the first ``kv_lora_rank`` dims,
``latent_value_size``). The CPU tier, prefix caching and sleep mode move whole rows and
need nothing else. A query row carries zeros in the index-key part, so the backend's dense
latent attention over these rows is unchanged.

**Dense when exact.** A step in which every query's context (cached prefix plus its own
chunk, up to itself) is at most ``index_topk`` tokens selects every causal token: the
backend attends as for V3 (``DsaStep.sparse`` False). Otherwise every layer writes its rows
at the slot mapping itself (``reshape_and_cache``, as the backend would), scores the index
keys of each query's context (TORCH_SDPA's metadata: the decodes' block tables, each
prefill chunk's context slots: cached prefix plus chunk), keeps the top-k context indices
per query, gathers those rows only and attends over them (``DsaStep.attend``), a block of
queries at a time so that no score tensor passes ``SCORE_BUDGET`` elements. Only
TORCH_SDPA's metadata is read: the model asks for the ``indexed_reads`` feature, which only
TORCH_SDPA lists, so the selector picks it on every device, and ``set_attention_backend``
refuses another (forced) backend with a ``ValueError``; TORCH_SDPA captures no CUDA graphs,
so no captured dense step can replay a long context.

**GLM-5** differs in its indexer's rotation (adjacent pairs), its ``indexer_types`` (a
``"shared"`` layer has no indexer and attends over the top-k of the last ``"full"`` layer
before it; its rows' index-key part stays zero) and its config's defaults.
``mlp_layer_types`` (both) says which layers are the routed experts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vllm._custom_ops import reshape_and_cache
from vllm.model_executor.layers.rotary_embedding import rotary_dim
from vllm.model_executor.models.deepseek_v2 import (
    DeepseekV2Arch,
    DeepseekV2ForCausalLM,
    DeepseekV2Layer,
    MLAttention,
)
from vllm.model_executor.models.llama import RotaryEmbedding
from vllm.v1.attention.backends.torch_sdpa import AttentionMetadata, TorchSDPABackend

# transformers' k_norm: nn.LayerNorm(index_head_dim, eps=1e-6).
INDEX_NORM_EPS = 1e-6
# Config fields of the indexer this module reads (GLM-5's schedule fields become
# ``indexer_types`` in its config; ``indexer_rope_interleave`` must agree with the family's
# pairing, which transformers fixes; ``index_share_for_mtp_iteration`` concerns the MTP
# layer, not served); any other ``index*`` field (GLM's key pooling...) is refused.
INDEX_FIELDS = frozenset(
    {"index_topk", "index_head_dim", "index_n_heads", "indexer_types", "index_topk_freq",
     "index_skip_topk_offset", "index_topk_pattern", "indexer_rope_interleave",
     "index_share_for_mtp_iteration"}
)  # fmt: skip
# Score elements (query rows x heads x context) computed at once by the sparse path.
SCORE_BUDGET = 1 << 24


@dataclass(frozen=True)
class DeepseekDsaArch(DeepseekV2Arch):
    index_n_heads: int = 1
    index_head_dim: int = 0
    index_topk: int = 1
    index_rope_interleave: bool = False  # GLM-5: adjacent pairs; DeepSeek-V3.2: Neox halves
    indexer_layers: tuple[int, ...] = ()  # layers with their own indexer ("full")

    @property
    def head_dim(self) -> int:
        """The cache row: the latent, the rotated key, the index key (module docstring)."""
        return self.kv_lora_rank + self.qk_rope_head_dim + self.index_head_dim

    @classmethod
    def from_hf(cls, config: Any) -> DeepseekDsaArch:
        n = config.num_hidden_layers
        if config.q_lora_rank is None:
            raise ValueError(
                f"q_lora_rank None is not supported for {config.model_type}: its indexer "
                "reads the query's low-rank residual"
            )
        unknown = sorted(
            k for k in config.to_dict() if k.startswith("index") and k not in INDEX_FIELDS
        )
        if unknown:
            raise ValueError(f"indexer option(s) {', '.join(unknown)} are not supported")
        base = DeepseekV2Arch.from_hf(config)
        glm = config.model_type == "glm_moe_dsa"
        for field, value in (("rope_interleave", True), ("indexer_rope_interleave", glm)):
            if getattr(config, field, value) != value:
                raise ValueError(
                    f"{field} {getattr(config, field)!r} is not supported for "
                    f"{config.model_type} (transformers pairs its dims as {value!r} says)"
                )
        rope = base.rope_parameters
        if rotary_dim(base.qk_rope_head_dim, rope) != base.qk_rope_head_dim:
            raise ValueError(
                f"rope_parameters partial_rotary_factor {rope.get('partial_rotary_factor')} "
                f"is not supported for {config.model_type} (the whole qk_rope_head_dim rotates)"
            )
        mlp_types = list(getattr(config, "mlp_layer_types", None) or [])
        if len(mlp_types) != n or set(mlp_types) - {"dense", "sparse"}:
            raise ValueError(f"mlp_layer_types {mlp_types!r}: 'dense' or 'sparse' per layer")
        sparse = tuple(i for i, t in enumerate(mlp_types) if t == "sparse")
        experts = DeepseekV2Arch.experts_from_hf(config, v3=True) if sparse else {}
        if experts and experts["topk_method"] != "noaux_tc":
            raise ValueError(
                f"topk_method {experts['topk_method']!r} is not supported for "
                f"{config.model_type} (its router is noaux_tc with sigmoid scores)"
            )
        kinds = list(getattr(config, "indexer_types", None) or ["full"] * n)
        if len(kinds) != n or set(kinds) - {"full", "shared"} or kinds[0] != "full":
            raise ValueError(
                f"indexer_types {kinds!r}: 'full' or 'shared' per layer, the first 'full'"
            )
        head_dim, topk = config.index_head_dim, config.index_topk
        if head_dim < base.qk_rope_head_dim or topk < 1 or config.index_n_heads < 1:
            raise ValueError(
                f"index_head_dim {head_dim} (at least qk_rope_head_dim "
                f"{base.qk_rope_head_dim}), index_topk {topk}, index_n_heads "
                f"{config.index_n_heads}: positive"
            )
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(DeepseekV2Arch)}
        fields |= dict(sparse_layers=sparse, **experts)
        return cls(
            **fields,
            index_n_heads=config.index_n_heads,
            index_head_dim=head_dim,
            index_topk=topk,
            index_rope_interleave=glm,
            indexer_layers=tuple(i for i, k in enumerate(kinds) if k == "full"),
        )


def index_rope(a: DeepseekDsaArch) -> RotaryEmbedding:
    """The rotation of the index queries' and keys' first ``qk_rope_head_dim`` dims: the
    model's table, paired as the model's indexer pairs them."""
    return RotaryEmbedding(
        a.qk_rope_head_dim, a.max_position_embeddings, a.rope_parameters,
        neox=not a.index_rope_interleave,
    )  # fmt: skip


class HeadWeights(nn.Module):
    """The indexer's ``weights_proj``, ``(n, hidden) -> (n, heads)`` in fp32 (transformers
    keeps it in fp32). Not an ``nn.Linear``: ``--quantization fp8`` leaves it dense."""

    def __init__(self, hidden_size: int, heads: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(heads, hidden_size))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h.float(), self.weight.float())


class Indexer(nn.Module):
    """``(positions, hidden, q_resid) -> (index queries (n, heads, dim), index keys
    (n, dim), head weights (n, heads) fp32 with both scales folded in)``."""

    def __init__(self, a: DeepseekDsaArch) -> None:
        super().__init__()
        self.a = a
        heads, dim = a.index_n_heads, a.index_head_dim
        self.wq_b = nn.Linear(a.q_lora_rank, heads * dim, bias=False)
        self.wk = nn.Linear(a.hidden_size, dim, bias=False)
        self.k_norm = nn.LayerNorm(dim, eps=INDEX_NORM_EPS)
        self.weights_proj = HeadWeights(a.hidden_size, heads)

    def forward(self, positions, h, q_resid, rope: RotaryEmbedding):
        a = self.a
        n, heads, dim, r = h.shape[0], a.index_n_heads, a.index_head_dim, a.qk_rope_head_dim
        q = self.wq_b(q_resid).view(n, heads, dim)
        k = self.k_norm(self.wk(h))
        q_rot, k_rot = q[..., :r].reshape(n, heads * r), k[:, :r].contiguous()
        rope(positions, q_rot, k_rot)  # in place
        q = torch.cat((q_rot.view(n, heads, r), q[..., r:]), dim=-1)
        k = torch.cat((k_rot, k[:, r:]), dim=-1)
        # Scores in fp32, as transformers computes them; both scales fold into w.
        return q, k, self.weights_proj(h) * (heads**-0.5 * dim**-0.5)

    @torch.no_grad()
    def load(self, sd: dict[str, torch.Tensor], prefix: str) -> None:
        for name in ("wq_b", "wk", "weights_proj"):
            getattr(self, name).weight.copy_(sd[f"{prefix}{name}.weight"])
        self.k_norm.weight.copy_(sd[prefix + "k_norm.weight"])
        self.k_norm.bias.copy_(sd[prefix + "k_norm.bias"])


@dataclass
class _Group:
    """Query rows ``[start, end)`` of the flat batch as ``(g, t)``: ``g`` contexts (a
    decode each, or one prefill chunk) of ``t`` queries; the contexts' ``slots`` (g, c),
    each query's position in its context ``q_pos`` (g, t) (it sees keys 0..q_pos)."""

    start: int
    end: int
    slots: torch.Tensor
    q_pos: torch.Tensor
    # (g, t, k) context indices, the last full layer's top-k (may include keys past a
    # query, where its context is shorter than k: masked when attending).
    selected: torch.Tensor | None = None

    def blocks(self, per_query: int):
        """(contexts, queries) slices covering the group, each of at most
        ``SCORE_BUDGET // per_query`` queries (at least one)."""
        g, t = self.q_pos.shape
        n = max(1, SCORE_BUDGET // max(1, per_query))
        if t == 1:  # decodes: slice the contexts
            for a in range(0, g, n):
                yield slice(a, min(g, a + n)), slice(0, 1)
            return
        for i in range(g):
            for a in range(0, t, n):
                yield slice(i, i + 1), slice(a, min(t, a + n))


class DsaStep:
    """One forward's DSA state: whether some query's context exceeds ``index_topk`` (then
    every layer attends sparsely) and the step's contexts, read from TORCH_SDPA's
    metadata (module docstring)."""

    def __init__(self, meta: Any, index_topk: int) -> None:
        self.index_topk = index_topk
        self.groups: list[_Group] = []
        if not isinstance(meta, AttentionMetadata):
            raise ValueError(
                f"DeepSeek sparse attention reads TORCH_SDPA's metadata, not "
                f"{type(meta).__name__}: serve with --attention-backend TORCH_SDPA"
            )
        lens = [meta.decode_max_len if meta.num_decodes else 0]
        lens += [c.num_computed + c.num_tokens for c in meta.prefills]
        self.sparse = max(lens) > index_topk
        if not self.sparse:
            return
        if meta.num_decodes:
            n = meta.num_decodes
            q_pos = (meta.decode_seq_lens - 1).view(n, 1)
            self.groups.append(_Group(0, n, meta.decode_slots, q_pos))
        for c in meta.prefills:
            s, e = c.start, c.start + c.num_tokens
            slots = meta.slot_mapping[s:e] if c.context_slots is None else c.context_slots
            ctx = slots.shape[0]
            q_pos = torch.arange(ctx - c.num_tokens, ctx, device=slots.device)
            self.groups.append(_Group(s, e, slots[None], q_pos[None]))

    def attend(
        self,
        query: torch.Tensor,  # (n, heads, rank + r)
        kv_cache: torch.Tensor,  # (1, blocks, block_size, 1, rank + r + index dim)
        indexed: tuple[torch.Tensor, torch.Tensor] | None,  # (index queries, weights)
        value_size: int,
        scale: float,
    ) -> torch.Tensor:
        """(n, heads, value_size): each query over its top-k context rows, gathered a
        block of queries at a time. ``indexed`` None: a shared layer, the last full
        layer's selection."""
        n, heads, width = query.shape
        row = kv_cache.shape[-1]
        flat = kv_cache[0].view(-1, row)
        out = query.new_empty(n, heads, value_size)
        for grp in self.groups:
            if indexed is not None:
                grp.selected = self._select(grp, flat, *indexed, width)
            elif grp.selected is None:
                raise RuntimeError("a shared DSA layer before any full one")
            g, t = grp.q_pos.shape
            q = query[grp.start : grp.end].view(g, t, heads, width)
            o = out[grp.start : grp.end].view(g, t, heads, value_size)
            for gs, ts in grp.blocks(grp.selected.shape[-1] * (heads + row)):
                idx = grp.selected[gs, ts]  # (g', t', k)
                slots = grp.slots[gs].gather(1, idx.flatten(1)).view(idx.shape)
                picked = flat[slots]  # (g', t', k, row)
                picked = picked if picked.dtype == query.dtype else picked.to(query.dtype)
                logits = torch.einsum("gthw,gtkw->gthk", q[gs, ts], picked[..., :width])
                seen = idx <= grp.q_pos[gs, ts, None]  # causal
                logits = logits.float().mul_(scale).masked_fill_(~seen[:, :, None], -torch.inf)
                probs = logits.softmax(dim=-1).to(picked.dtype)
                o[gs, ts] = torch.einsum("gthk,gtkv->gthv", probs, picked[..., :value_size])
        return out

    def _select(self, grp: _Group, flat, index_q, weights, width: int) -> torch.Tensor:
        """(g, t, min(index_topk, c)) context indices: each query's best-scored keys among
        0..q_pos (every one of them where they are no more than ``index_topk``)."""
        g, t = grp.q_pos.shape
        c = grp.slots.shape[1]
        device = grp.slots.device
        if c <= self.index_topk:  # all kept: the causal mask does the rest
            return torch.arange(c, device=device).expand(g, t, c)
        heads, dim = index_q.shape[1], index_q.shape[2]
        index_keys = flat[:, width:]  # every slot's index key (a view)
        q = index_q[grp.start : grp.end].float().view(g, t, heads, dim)
        w = weights[grp.start : grp.end].view(g, t, heads)
        selected = torch.empty(g, t, self.index_topk, dtype=torch.long, device=device)
        positions = torch.arange(c, device=device)
        for gs, ts in grp.blocks(c * (heads + dim)):
            keys = index_keys[grp.slots[gs]].float()  # (g', c, dim)
            scores = torch.einsum("gthd,gcd->gthc", q[gs, ts], keys).relu_()
            index = torch.einsum("gthc,gth->gtc", scores, w[gs, ts])
            index.masked_fill_(positions > grp.q_pos[gs, ts, None], -torch.inf)
            selected[gs, ts] = index.topk(self.index_topk, dim=-1).indices
        return selected


class DsaAttention(MLAttention):
    """MLA with DSA (module docstring); ``full``: the layer runs its own indexer."""

    # Sparse-path layer calls, for tests (reset by nobody: a count since import).
    sparse_calls = 0

    def __init__(self, a: DeepseekDsaArch, full: bool) -> None:
        super().__init__(a)
        self.indexer = Indexer(a) if full else None

    def forward(self, positions, h, rope, meta, kv_cache, index_rope=None, step=None):
        a = self.a
        query, key, q_resid = self.query_key(positions, h, rope)
        n, heads = query.shape[:2]
        indexed = None
        if self.indexer is None:
            index_k = key.new_zeros(n, 1, a.index_head_dim)
        else:
            index_q, index_k, weights = self.indexer(positions, h, q_resid, index_rope)
            index_k, indexed = index_k.to(key.dtype).unsqueeze(1), (index_q, weights)
        key = torch.cat((key, index_k), dim=-1)  # (n, 1, head_dim): the cache row
        if step is None or not step.sparse:  # every causal token selected: dense
            query = F.pad(query, (0, a.index_head_dim))
            out = self.attn_forward(query, key, None, kv_cache, meta, a.softmax_scale)
            return self.output(out)
        DsaAttention.sparse_calls += 1
        reshape_and_cache(key, None, kv_cache, meta.slot_mapping)
        out = step.attend(query, kv_cache, indexed, a.kv_lora_rank, a.softmax_scale)
        return self.output(out)


class DsaLayer(DeepseekV2Layer):
    def __init__(self, a: DeepseekDsaArch, i: int) -> None:
        super().__init__(a, i in a.sparse_layers, DsaAttention(a, i in a.indexer_layers))

    def forward(self, positions, x, residual, rope, meta, kv_cache, index_rope=None, step=None):
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(positions, h, rope, meta, kv_cache, index_rope, step)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class DeepseekV32ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3.2: DeepSeek-V3 with the lightning indexer (module docstring)."""

    @staticmethod
    def arch_from_hf(hf_config: Any) -> DeepseekDsaArch:
        return DeepseekDsaArch.from_hf(hf_config)

    @staticmethod
    def make_layer(arch: DeepseekDsaArch, i: int) -> nn.Module:
        return DsaLayer(arch, i)

    def __init__(self, arch: DeepseekDsaArch) -> None:
        super().__init__(arch)
        self.index_rope = index_rope(arch)

    @property
    def attention_features(self) -> frozenset[str]:
        """V3's, and the sparse path's reads of the cache through the step's metadata:
        the selector picks TORCH_SDPA, the one backend whose metadata it reads."""
        return super().attention_features | {"indexed_reads"}

    def set_attention_backend(self, backend: Any) -> None:
        """As V3's, TORCH_SDPA only: the sparse path reads its metadata (ValueError for
        another backend, whose steps it cannot read)."""
        if not isinstance(backend, TorchSDPABackend):
            raise ValueError(
                f"{type(self).__name__} (DeepSeek sparse attention) reads the KV cache "
                f"through TORCH_SDPA's metadata, not {backend.name}'s: serve it with "
                "--attention-backend TORCH_SDPA"
            )
        super().set_attention_backend(backend)

    @torch.inference_mode()
    def forward(
        self, input_ids, positions, meta: Any, kv_caches, inputs_embeds: torch.Tensor | None = None
    ) -> torch.Tensor:
        """As V3's; each layer attends densely, or sparsely when some query's context
        exceeds ``index_topk`` (``DsaStep``)."""
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        step = DsaStep(meta, self.arch.index_topk)
        residual = None
        aux = [x.clone()] if 0 in self.aux_hidden_layers else []
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            x, residual = layer(
                positions, x, residual, self.rope, meta, kv_cache, self.index_rope, step
            )
            if i + 1 in self.aux_hidden_layers:
                aux.append(x + residual)
        if aux:
            self.aux_hidden = torch.cat(aux, dim=-1)
        return self.norm(x, residual)[0]

    def init_buffers(self) -> None:
        super().init_buffers()
        weight = self.embed_tokens.weight
        self.index_rope = index_rope(self.arch).to(weight.dtype).to(weight.device)

    def load_weights(self, sd: dict[str, torch.Tensor]) -> None:
        """V3's tensors, then each full layer's ``self_attn.indexer.*``."""
        super().load_weights(sd)
        sd = {k.removeprefix("model."): v for k, v in sd.items()}
        for i, layer in enumerate(self.layers):
            if layer.self_attn.indexer is not None:
                layer.self_attn.indexer.load(sd, f"layers.{i}.self_attn.indexer.")


class GlmMoeDsaForCausalLM(DeepseekV32ForCausalLM):
    """GLM-5: DeepSeek-V3.2's model, its indexer's rotation pairing adjacent dims and its
    ``"shared"`` layers reusing the last full layer's top-k (module docstring), read by
    ``DeepseekDsaArch``."""
