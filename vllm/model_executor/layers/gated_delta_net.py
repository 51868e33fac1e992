"""Gated DeltaNet (Qwen3-Next, Qwen3.5's linear-attention layers): the causal convolution
and the gated delta rule over a step's sequences, each reading and writing its states in
the recurrent pools (``layers/recurrent.py``).

Per value head, with l2-normalised keys and queries (queries scaled by ``head_k_dim **
-0.5``), a decay ``g_t = -exp(A_log) * softplus(a_t + dt_bias)`` (log space) and a write
strength ``beta_t = sigmoid(b_t)``, the state ``S`` (k_dim, v_dim) evolves as::

    S_t = exp(g_t) S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t)
    o_t = S_t^T q_t

(the delta rule: each token writes the part of its value the decayed state does not
already predict for its key). Several value heads share a key head (``num_v_heads //
num_k_heads`` consecutive ones). Everything past the convolution runs in fp32, as
transformers' torch reference does.

A prefill chunk runs the rule a chunk of tokens at a time (``chunk_gated_delta_rule``);
a decode applies it once (``recurrent_gated_delta_rule``), for every decoding sequence of
the step in one batched update (``RecurrentStep``). ``GatedDeltaNetMixer`` holds a layer's
parameters and serves a step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from torch.nn import functional as F

from vllm.model_executor.layers.recurrent import RecurrentStep

CHUNK_SIZE = 64


@dataclass(frozen=True)
class GatedDeltaNetShape:
    num_k_heads: int
    num_v_heads: int  # a multiple of num_k_heads
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int  # the causal convolution's width

    def __post_init__(self) -> None:
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(
                f"linear_num_value_heads {self.num_v_heads} is not a multiple of "
                f"linear_num_key_heads {self.num_k_heads}"
            )

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """The convolved channels: q, k and v."""
        return 2 * self.key_dim + self.value_dim


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dimension (the FLA library's form)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    state: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    silu: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's depthwise causal convolution (plus ``bias``: Mamba2's) and SiLU
    (unless ``silu`` is False: LFM2's): x (T, C) after ``state`` (C, kernel - 1), the
    inputs before it (None: zeros) -> (silu(conv) (T, C) in x's dtype, the new state: the
    last kernel - 1 inputs, zeros on the left of a short sequence)."""
    width = weight.shape[1] - 1
    if state is None:
        state = x.new_zeros(x.shape[1], width)
    window = torch.cat([state.to(x.dtype), x.t()], dim=1)  # (C, kernel - 1 + T)
    b = None if bias is None else bias.float()
    out = F.conv1d(window.float()[None], weight.float()[:, None, :], b, groups=x.shape[1])[0]
    out = F.silu(out) if silu else out
    return out.t().to(x.dtype), window[:, window.shape[1] - width :]


def causal_conv1d_step(
    x: torch.Tensor,
    weight: torch.Tensor,
    states: torch.Tensor,
    bias: torch.Tensor | None = None,
    silu: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The convolution (plus ``bias``, then SiLU unless ``silu`` is False) of one new token
    per sequence: x (B, C) after ``states`` (B, C, kernel - 1) -> (silu(conv) (B, C) in x's
    dtype, the new states)."""
    window = torch.cat([states, x.to(states.dtype)[:, :, None]], dim=2)  # (B, C, kernel)
    out = (window.float() * weight.float()).sum(dim=2)
    if bias is not None:
        out = out + bias.float()
    out = F.silu(out) if silu else out
    return out.to(x.dtype), window[:, :, 1:]


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over one sequence's T tokens, in chunks: q, k (H, T, Dk) and v
    (H, T, Dv) fp32 (q, k normalised and q scaled), g, beta (H, T); ``state`` (H, Dk, Dv)
    fp32 or None (zeros) -> (o (H, T, Dv), the state after the last token).

    Within a chunk, with gamma the cumulative decay from its start, the writes are
    ``U = (I + A)^-1 (beta V - beta exp(gamma) K S0)``, A strictly lower triangular with
    ``A[t, s] = beta_t exp(gamma_t - gamma_s) k_t . k_s``; then ``o_t = exp(gamma_t) S0^T
    q_t + sum_{s <= t} exp(gamma_t - gamma_s) (q_t . k_s) u_s`` and the chunk's last state
    ``exp(gamma_L) S0 + sum_s exp(gamma_L - gamma_s) k_s u_s^T``: two triangular solves
    and a few matmuls a chunk."""
    heads, length, dk = k.shape
    chunk = min(chunk_size, length)
    pad = -length % chunk  # padded tokens: no decay (g 0), no write (beta 0)
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    n = (length + pad) // chunk
    q, k, v = (t.reshape(heads, n, chunk, -1) for t in (q, k, v))
    gamma = g.reshape(heads, n, chunk).cumsum(dim=-1)
    beta = beta.reshape(heads, n, chunk, 1)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    # decay[t, s] = exp(gamma_t - gamma_s) for s <= t, 0 above the diagonal
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(upper, float("-inf")).exp()
    a = (beta * k @ k.transpose(-1, -2) * decay).tril(-1)
    u_v = torch.linalg.solve_triangular(a, beta * v, upper=False, unitriangular=True)
    u_k = torch.linalg.solve_triangular(
        a, beta * gamma.exp()[..., None] * k, upper=False, unitriangular=True
    )  # U = u_v - u_k @ S0
    qk = q @ k.transpose(-1, -2) * decay
    q_decayed = q * gamma.exp()[..., None]
    last = gamma[..., -1:]  # (H, n, 1)
    k_to_end = k * (last - gamma).exp()[..., None]
    s = q.new_zeros(heads, dk, v.shape[-1]) if state is None else state
    out = []
    for i in range(n):
        u = u_v[:, i] - u_k[:, i] @ s
        out.append(q_decayed[:, i] @ s + qk[:, i] @ u)
        s = s * last[:, i, :, None].exp() + k_to_end[:, i].transpose(-1, -2) @ u
    return torch.cat(out, dim=1)[:, :length], s


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B sequences: q, k (B, H, Dk), v (B, H, Dv) fp32, g, beta (B,
    H); ``state`` (B, H, Dk, Dv) fp32 -> (o (B, H, Dv), the new states)."""
    state = state * g.exp()[..., None, None]
    predicted = (k[:, :, None, :] @ state)[:, :, 0]  # S^T k: (B, H, Dv)
    u = beta[..., None] * (v - predicted)
    state = state + k[..., :, None] * u[..., None, :]
    return (q[:, :, None, :] @ state)[:, :, 0], state


class DeltaRuleMixer(nn.Module):
    """A delta-rule layer's token mixing over a step (Gated DeltaNet here, KDA in
    ``kda.py``): the short convolution of q, k and v, then the rule, a step's decode
    groups (``RecurrentStep.groups``) each in one batched update (``step_rule``) and its
    prefill chunks in the chunked form (``chunk_rule``). A subclass gives ``_heads`` (the
    convolved rows and its two per-token inputs -> fp32 q, k, v, the log decays g, beta),
    ``out_heads`` (its output's heads and their width) and the two rules; its parameters
    include ``conv_weight`` (conv_dim, kernel)."""

    chunk_rule: ClassVar[Callable[..., tuple[torch.Tensor, torch.Tensor]]]
    step_rule: ClassVar[Callable[..., tuple[torch.Tensor, torch.Tensor]]]

    @property
    def out_heads(self) -> tuple[int, int]:
        raise NotImplementedError

    def _heads(self, x, in1, in2) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def mix(
        self,
        mixed_qkv: torch.Tensor,
        in1: torch.Tensor,
        in2: torch.Tensor,
        states: tuple[torch.Tensor, torch.Tensor],
        step: RecurrentStep,
    ) -> torch.Tensor:
        """``mixed_qkv`` (T, conv_dim) the projected q, k, v before the convolution, ``in1``
        and ``in2`` (T, ...) the subclass's per-token inputs -> (T, *out_heads) in
        ``mixed_qkv``'s dtype. ``states``: the layer's (conv pool, ssm pool); each
        sequence's slot is read (unless fresh) and written with its states after its last
        token."""
        if step.decode_only:
            return self._decode(mixed_qkv, in1, in2, states, step.groups[0].slots)
        out = mixed_qkv.new_empty(mixed_qkv.shape[0], *self.out_heads)
        for group in step.groups:
            picked = (t.index_select(0, group.rows) for t in (mixed_qkv, in1, in2))
            out.index_copy_(0, group.rows, self._decode(*picked, states, group.slots))
            step.after(group, *states)
        for chunk in step.prefills:
            rows = slice(chunk.start, chunk.start + chunk.n)
            out[rows] = self._prefill(mixed_qkv[rows], in1[rows], in2[rows], states, chunk.slot,
                                      chunk.fresh)  # fmt: skip
        return out

    def _prefill(self, x, in1, in2, states, slot: int, fresh: bool) -> torch.Tensor:
        """One sequence's tokens from its slot's states (zeros when ``fresh``) -> (T,
        *out_heads) fp32; its states after them written to the slot."""
        conv_pool, ssm_pool = states
        x, conv_pool[slot] = causal_conv1d(x, self.conv_weight, None if fresh else conv_pool[slot])
        q, k, v, g, beta = (t.transpose(0, 1) for t in self._heads(x, in1, in2))
        state = None if fresh else ssm_pool[slot].float()
        o, ssm_pool[slot] = type(self).chunk_rule(q, k, v, g, beta, state)
        return o.transpose(0, 1)

    def _decode(self, x, in1, in2, states, slots: torch.Tensor) -> torch.Tensor:
        """One token of each decoding sequence (row i's in ``slots[i]``): their states
        gathered, updated in one batch, written back -> (B, *out_heads)."""
        conv_pool, ssm_pool = states
        x, conv = causal_conv1d_step(x, self.conv_weight, conv_pool.index_select(0, slots))
        conv_pool.index_copy_(0, slots, conv)
        q, k, v, g, beta = self._heads(x, in1, in2)
        o, ssm = type(self).step_rule(q, k, v, g, beta, ssm_pool.index_select(0, slots).float())
        ssm_pool.index_copy_(0, slots, ssm.to(ssm_pool.dtype))
        return o.to(x.dtype)


class GatedDeltaNetMixer(DeltaRuleMixer):
    """A Gated DeltaNet layer's token mixing over a step (``DeltaRuleMixer``; its two
    per-token inputs ``b`` and ``a``, (T, v_heads) each), with its parameters: the
    convolution's ``conv_weight`` (conv_dim, kernel), ``A_log`` and ``dt_bias`` (v_heads).
    The model's layer adds the projections around it (``mix``'s inputs, its output's norm).
    """

    chunk_rule = staticmethod(chunk_gated_delta_rule)
    step_rule = staticmethod(recurrent_gated_delta_rule)

    def __init__(self, shape: GatedDeltaNetShape) -> None:
        super().__init__()
        self.shape = shape
        self.conv_weight = nn.Parameter(torch.empty(shape.conv_dim, shape.conv_kernel))
        self.dt_bias = nn.Parameter(torch.ones(shape.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(shape.num_v_heads))

    @property
    def out_heads(self) -> tuple[int, int]:
        return self.shape.num_v_heads, self.shape.head_v_dim

    def _heads(self, x, b, a) -> tuple[torch.Tensor, ...]:
        """Convolved (N, conv_dim) rows and their b, a (N, v_heads) -> fp32 q, k (N,
        v_heads, Dk) (normalised, q scaled, repeated over the value heads), v (N, v_heads,
        Dv), g, beta (N, v_heads)."""
        s = self.shape
        rows = x.shape[0]
        q, k, v = x.float().split([s.key_dim, s.key_dim, s.value_dim], dim=-1)
        group = s.num_v_heads // s.num_k_heads
        q = l2norm(q.reshape(rows, s.num_k_heads, s.head_k_dim)) * s.head_k_dim**-0.5
        k = l2norm(k.reshape(rows, s.num_k_heads, s.head_k_dim))
        if group > 1:
            q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        return q, k, v.reshape(rows, s.num_v_heads, s.head_v_dim), g, torch.sigmoid(b.float())
