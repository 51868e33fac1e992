"""Kimi Delta Attention (KDA: Kimi-Linear's linear-attention layers): Gated DeltaNet
(``gated_delta_net.py``) whose decay is per key channel rather than per head, over a
step's sequences, each reading and writing its states in the recurrent pools
(``layers/recurrent.py``).

Per head, with l2-normalised keys and queries (queries scaled by ``head_dim ** -0.5``), a
decay per key channel ``g_t = -exp(A_log) * softplus(f_t + dt_bias)`` (log space, a
``(head_dim,)`` vector: ``A_log`` one a head, ``f_t`` and ``dt_bias`` one a channel) and
a write strength ``beta_t = sigmoid(b_t)``, the state ``S`` (k_dim, v_dim) evolves as::

    S_t = D_t S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - (D_t S_{t-1})^T k_t)
    o_t = S_t^T q_t,                 D_t = diag(exp(g_t))

(the delta rule over a state whose rows, the key channels, each decay at their own
rate). Every head has its own q, k and v (no grouping). Everything past the convolution
runs in fp32, as transformers' torch reference does.

A prefill chunk runs the rule a chunk of tokens at a time (``chunk_kda``); a decode
applies it once (``recurrent_kda``), for every decoding sequence of the step in one
batched update (``RecurrentStep``). ``KimiDeltaMixer`` holds a layer's parameters past
its projections and serves a step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from vllm.model_executor.layers.gated_delta_net import DeltaRuleMixer, l2norm

# Tokens a chunk: each holds a (heads, chunk, chunk, head_dim) fp32 table of pairwise
# decays (32 heads of 128: 64 MiB), so chunks run one after another.
CHUNK_SIZE = 64


@dataclass(frozen=True)
class KDAShape:
    num_heads: int
    head_dim: int  # q's, k's and v's alike
    conv_kernel: int  # the short convolutions' width

    @property
    def qkv_dim(self) -> int:
        """One of q, k, v over every head (the decay's width too: a channel each)."""
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """The convolved channels: q, k and v."""
        return 3 * self.qkv_dim


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The KDA rule over one sequence's T tokens, in chunks: q, k, v (H, T, D) fp32 (q, k
    normalised and q scaled), g (H, T, Dk) the log decays, beta (H, T); ``state`` (H, Dk,
    Dv) fp32 or None (zeros) -> (o (H, T, Dv), the state after the last token)."""
    heads, length, dk = k.shape
    s = q.new_zeros(heads, dk, v.shape[-1]) if state is None else state
    out = []
    for start in range(0, length, chunk_size):
        rows = slice(start, min(start + chunk_size, length))
        o, s = _chunk(q[:, rows], k[:, rows], v[:, rows], g[:, rows].cumsum(1), beta[:, rows], s)
        out.append(o)
    return torch.cat(out, dim=1), s


def _chunk(q, k, v, gamma, beta, s) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of L tokens from state ``s`` (H, Dk, Dv); ``gamma`` (H, L, Dk) the decays
    summed from the chunk's start (token t's included).

    Unrolled from ``s``, token t's state is ``exp(gamma_t) * s + sum_{j <= t} exp(gamma_t -
    gamma_j) * k_j u_j^T`` (the exponentials per key channel, scaling rows), so the writes
    solve ``(I + A) U = beta V - beta (K * exp(gamma)) s`` with ``A`` strictly lower
    triangular, ``A[t, j] = beta_t sum_c k_t[c] k_j[c] exp(gamma_t[c] - gamma_j[c])``; then
    ``o_t = s^T (q_t * exp(gamma_t)) + sum_{j <= t} (sum_c q_t[c] k_j[c] exp(gamma_t[c] -
    gamma_j[c])) u_j`` and the last state ``exp(gamma_L) * s + sum_j (k_j * exp(gamma_L -
    gamma_j)) u_j^T``. The pairwise decays are taken whole, never as a ratio of two
    exponentials (``exp(-gamma_j)`` overflows where decays are strong)."""
    length = k.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=k.device).tril()
    # decay[h, t, j, c] = exp(gamma_t[c] - gamma_j[c]) for j <= t, else 0 (masked before
    # the exponential: above the diagonal the difference is positive, unbounded)
    decay = gamma[:, :, None, :] - gamma[:, None, :, :]
    decay = decay.masked_fill_(~causal[:, :, None], float("-inf")).exp_()
    # (H, t, j, Dk): k_j[c] exp(gamma_t[c] - gamma_j[c]), in place: one such table at a time
    k_decayed = decay.mul_(k[:, None, :, :])
    kk = torch.einsum("htjc,htc->htj", k_decayed, k)
    qk = torch.einsum("htjc,htc->htj", k_decayed, q)  # lower triangular, the diagonal kept
    a = (beta[..., None] * kk).tril(-1)
    growth = gamma.exp()
    u_v = torch.linalg.solve_triangular(a, beta[..., None] * v, upper=False, unitriangular=True)
    u_k = torch.linalg.solve_triangular(
        a, beta[..., None] * k * growth, upper=False, unitriangular=True
    )
    u = u_v - u_k @ s  # (H, L, Dv): the writes
    o = (q * growth) @ s + qk @ u
    last = gamma[:, -1:]  # (H, 1, Dk)
    s = s * last.transpose(1, 2).exp() + (k * (last - gamma).exp()).transpose(1, 2) @ u
    return o, s


def recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B sequences: q, k, v (B, H, D) fp32, g (B, H, Dk), beta (B,
    H); ``state`` (B, H, Dk, Dv) fp32 -> (o (B, H, Dv), the new states)."""
    state = state * g.exp()[..., None]
    predicted = (k[:, :, None, :] @ state)[:, :, 0]  # S^T k: (B, H, Dv)
    u = beta[..., None] * (v - predicted)
    state = state + k[..., :, None] * u[..., None, :]
    return (q[:, :, None, :] @ state)[:, :, 0], state


class KimiDeltaMixer(DeltaRuleMixer):
    """A KDA layer's token mixing over a step (``gated_delta_net.DeltaRuleMixer``; its two
    per-token inputs ``f`` (T, qkv_dim), the decay's projection before ``dt_bias``, and
    ``b`` (T, heads), the write strength's), with its parameters: the short convolutions'
    ``conv_weight`` (conv_dim, kernel: q's, k's, v's), ``A_log`` (heads) and ``dt_bias``
    (qkv_dim, a channel each). The model's layer adds the projections around it (``mix``'s
    inputs, its output's gated norm)."""

    chunk_rule = staticmethod(chunk_kda)
    step_rule = staticmethod(recurrent_kda)

    def __init__(self, shape: KDAShape) -> None:
        super().__init__()
        self.shape = shape
        self.conv_weight = nn.Parameter(torch.empty(shape.conv_dim, shape.conv_kernel))
        self.dt_bias = nn.Parameter(torch.zeros(shape.qkv_dim))
        self.A_log = nn.Parameter(torch.zeros(shape.num_heads))

    @property
    def out_heads(self) -> tuple[int, int]:
        return self.shape.num_heads, self.shape.head_dim

    def _heads(self, x, f, b) -> tuple[torch.Tensor, ...]:
        """Convolved (N, conv_dim) rows and their f (N, qkv_dim), b (N, heads) -> fp32 q,
        k, v (N, heads, head_dim) (q, k normalised, q scaled), g (N, heads, head_dim) the
        log decays, beta (N, heads)."""
        s = self.shape
        rows = x.shape[0]
        q, k, v = (t.reshape(rows, s.num_heads, s.head_dim) for t in x.float().chunk(3, dim=-1))
        q = l2norm(q) * s.head_dim**-0.5
        k = l2norm(k)
        f = (f.float() + self.dt_bias.float()).view(rows, s.num_heads, s.head_dim)
        g = -self.A_log.float().exp()[:, None] * F.softplus(f)
        return q, k, v, g, torch.sigmoid(b.float())
