"""The Mamba2 mixer (selective state space with scalar decay per head, "SSD"), as
transformers' ``GraniteMoeHybridMambaLayer``, ``NemotronHMamba2Mixer``, ``BambaMixer`` and
``FalconH1Mixer`` compute it, over a step's sequences, each reading and writing its states
in the recurrent pools (``layers/recurrent.py``).

One projection gives the output gate ``z`` (intermediate), ``xBC`` (conv_dim =
intermediate + 2 * n_groups * state) and ``dt`` (heads). ``xBC`` goes through a depthwise
causal convolution (with bias) and SiLU, then splits into ``x`` (heads, head_dim) and
``B``, ``C`` (n_groups, state), each group shared by ``heads / n_groups`` consecutive
heads. Per head, with ``A = -exp(A_log)`` and ``dt_t = clamp(softplus(dt_t + dt_bias),
*dt_limit)``, the state ``S`` (head_dim, state) evolves as::

    S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T
    y_t = S_t C_t + D x_t

Then ``y`` is RMS-normalised in ``n_groups`` groups and gated by ``silu(z)`` (the gate
before the norm, as Granite, Nemotron-H and Bamba; ``norm_before_gate`` the other order;
without ``rms_norm`` only gated, as Falcon-H1's checkpoints), and projected back
(``out_proj``). Everything past the convolution runs in fp32. Falcon-H1's muP scalings:
the input times ``in_multiplier`` before ``in_proj``, the projection's z, x, B, C and dt
parts each times its own of ``zxbcdt_multipliers`` (transformers' ``mup_vector``).

A prefill chunk runs the recurrence a chunk of tokens at a time (``ssd_chunk_scan``,
one sequence); decodes apply it once (``ssd_step``) for every decoding sequence of the
step in one batched update, their states gathered by slot and scattered back
(``RecurrentStep``, shared with Gated DeltaNet). States per sequence: the convolution's
last ``conv_kernel - 1`` inputs ``(conv_dim, conv_kernel - 1)`` in the model's dtype,
``S`` per head ``(heads, head_dim, state)`` in the SSM state dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from vllm.model_executor.layers.gated_delta_net import causal_conv1d, causal_conv1d_step
from vllm.model_executor.layers.recurrent import RecurrentStep, StateSpec


@dataclass(frozen=True)
class Mamba2Shape:
    hidden_size: int
    num_heads: int
    head_dim: int
    n_groups: int  # B and C's groups; each shared by num_heads // n_groups heads
    state_size: int
    conv_kernel: int
    chunk_size: int  # the prefill scan's chunk (the config's: transformers' numerics)
    rms_norm_eps: float
    dt_limit: tuple[float, float] = (0.0, math.inf)  # dt clamped to it after softplus
    norm_before_gate: bool = False  # False: rms_norm(y * silu(z)) (Granite, Nemotron-H)
    rms_norm: bool = True  # False: y * silu(z), no norm (Falcon-H1's mamba_rms_norm)
    proj_bias: bool = False  # in_proj's (and out_proj's unless out_proj_bias says)
    out_proj_bias: bool | None = None  # None: proj_bias (Falcon-H1: its projectors_bias)
    conv_bias: bool = True
    in_multiplier: float = 1.0  # the input's scale before in_proj (Falcon-H1's)
    # the z, x, B, C and dt parts of in_proj's output scaled (Falcon-H1's ssm_multipliers)
    zxbcdt_multipliers: tuple[float, float, float, float, float] | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.n_groups:
            raise ValueError(
                f"mamba heads {self.num_heads} are not a multiple of n_groups {self.n_groups}"
            )
        m = self.zxbcdt_multipliers
        if m is not None and len(m) != 5:
            raise ValueError(f"zxbcdt_multipliers {m}: five, of z, x, B, C and dt")

    @property
    def intermediate(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """The convolved channels: x, B and C."""
        return self.intermediate + 2 * self.n_groups * self.state_size

    def mup_vector(self) -> torch.Tensor:
        """fp32 (intermediate + conv_dim + heads,): each of in_proj's outputs' multiplier."""
        sizes = (self.intermediate, self.intermediate, self.n_groups * self.state_size,
                 self.n_groups * self.state_size, self.num_heads)  # fmt: skip
        m = self.zxbcdt_multipliers or (1.0,) * 5
        return torch.cat([torch.full((n,), float(v)) for n, v in zip(sizes, m, strict=True)])

    def state_specs(self, conv_dtype: torch.dtype, ssm_dtype: torch.dtype) -> tuple[StateSpec, ...]:
        """(the convolution's last inputs, the SSM state) of one sequence."""
        return (
            StateSpec((self.conv_dim, self.conv_kernel - 1), conv_dtype),
            StateSpec((self.num_heads, self.head_dim, self.state_size), ssm_dtype),
        )


def _segment_sums(a: torch.Tensor) -> torch.Tensor:
    """a (H, L) log decays -> (H, L, L): ``[t, s] = a_{s+1} + ... + a_t`` for s <= t (0 on
    the diagonal), -inf above it. Summed per pair, not as differences of a long cumulative
    sum, which would cancel catastrophically after many strong decays."""
    length = a.shape[-1]
    ones = torch.ones(length, length, dtype=torch.bool, device=a.device)
    sums = a[..., :, None].expand(*a.shape, length).masked_fill(~ones.tril(-1), 0).cumsum(-2)
    return sums.masked_fill(~ones.tril(), -math.inf)


def ssd_chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    state: torch.Tensor | None,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence over one sequence's T tokens, in chunks, fp32: x (T, H, P), dt (T, H)
    (softplus'd and clamped), a (H,) = A, b, c (T, H, N) (the groups repeated over their
    heads), ``state`` (H, P, N) or None (zeros) -> (y (T, H, P) without the D skip, the
    state after the last token).

    Within a chunk, with ``gamma`` the cumulative log decay from its start: ``y_t =
    exp(gamma_t) S0 c_t + sum_{s <= t} exp(gamma_t - gamma_s) (c_t . b_s) dt_s x_s``, and
    the chunk's last state ``exp(gamma_L) S0 + sum_s exp(gamma_L - gamma_s) dt_s x_s
    b_s^T``: a few batched matmuls a chunk, the chunks in order."""
    heads, p, n = x.shape[1], x.shape[2], b.shape[2]
    s = x.new_zeros(heads, p, n) if state is None else state
    out = []
    for start in range(0, x.shape[0], chunk_size):
        rows = slice(start, start + chunk_size)
        log_decay = (dt[rows] * a).t()  # (H, L)
        gamma = log_decay.cumsum(dim=-1)
        xdt = (x[rows] * dt[rows, :, None]).transpose(0, 1)  # (H, L, P)
        bh, ch = b[rows].transpose(0, 1), c[rows].transpose(0, 1)  # (H, L, N)
        scores = (ch @ bh.transpose(1, 2)) * _segment_sums(log_decay).exp()  # (H, L, L)
        y = scores @ xdt + gamma.exp()[..., None] * (ch @ s.transpose(1, 2))
        to_end = (gamma[:, -1:] - gamma).exp()[..., None]  # (H, L, 1)
        s = s * gamma[:, -1].exp()[:, None, None] + (xdt * to_end).transpose(1, 2) @ bh
        out.append(y.transpose(0, 1))
    return torch.cat(out), s


def ssd_step(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B sequences, fp32: x (B, H, P), dt (B, H), a (H,), b, c (B, H,
    N), ``state`` (B, H, P, N) -> (y (B, H, P) without the D skip, the new states)."""
    decay = (dt * a).exp()[..., None, None]
    state = state * decay + (x * dt[..., None])[..., None] * b[:, :, None, :]
    return (state @ c[..., None])[..., 0], state


class Mamba2Mixer(nn.Module):
    """A Mamba2 layer: (num_tokens, hidden) -> (num_tokens, hidden), reading and writing
    each sequence's states in the layer's pools (module docstring). Parameters as the
    checkpoints name them: ``in_proj`` (rows [z | xBC | dt]), the convolution's
    ``conv_weight`` (conv_dim, kernel) and ``conv_bias``, ``dt_bias``, ``A_log``, ``D``
    (heads), the gated norm's ``norm_weight`` (intermediate; none without ``rms_norm``),
    ``out_proj``; with ``zxbcdt_multipliers`` the computed buffer ``mup_vector``
    (``init_buffers``: the model's calls it)."""

    def __init__(self, shape: Mamba2Shape) -> None:
        super().__init__()
        s = self.shape = shape
        width = s.intermediate + s.conv_dim + s.num_heads
        self.in_proj = nn.Linear(s.hidden_size, width, bias=s.proj_bias)
        self.conv_weight = nn.Parameter(torch.empty(s.conv_dim, s.conv_kernel))
        self.conv_bias = nn.Parameter(torch.zeros(s.conv_dim)) if s.conv_bias else None
        self.dt_bias = nn.Parameter(torch.ones(s.num_heads))
        self.A_log = nn.Parameter(torch.zeros(s.num_heads))
        self.D = nn.Parameter(torch.ones(s.num_heads))
        self.norm_weight = nn.Parameter(torch.ones(s.intermediate)) if s.rms_norm else None
        out_bias = s.proj_bias if s.out_proj_bias is None else s.out_proj_bias
        self.out_proj = nn.Linear(s.intermediate, s.hidden_size, bias=out_bias)
        if s.zxbcdt_multipliers is not None:
            self.register_buffer("mup_vector", s.mup_vector(), persistent=False)

    def init_buffers(self) -> None:
        """Make ``mup_vector`` (if any) in place, in its dtype and on its device."""
        if self.shape.zxbcdt_multipliers is not None:
            self.mup_vector.copy_(self.shape.mup_vector())

    def forward(
        self, h: torch.Tensor, states: tuple[torch.Tensor, torch.Tensor], step: RecurrentStep
    ) -> torch.Tensor:
        """``states``: the layer's (conv pool, ssm pool); each sequence's slot is read
        (unless fresh) and written with its states after its last token."""
        s = self.shape
        zxbcdt = self.in_proj(h * s.in_multiplier if s.in_multiplier != 1.0 else h)
        if s.zxbcdt_multipliers is not None:
            zxbcdt = zxbcdt * self.mup_vector
        z, xbc, dt = zxbcdt.split([s.intermediate, s.conv_dim, s.num_heads], dim=-1)
        y = self._scan(xbc, dt, states, step)  # (num_tokens, intermediate) fp32
        return self.out_proj(self._gated_norm(y, z).to(h.dtype))

    def _scan(self, xbc, dt, states, step: RecurrentStep) -> torch.Tensor:
        if step.decode_only:
            return self._decode(xbc, dt, states, step.groups[0].slots)
        out = xbc.new_empty(xbc.shape[0], self.shape.intermediate, dtype=torch.float32)
        for group in step.groups:
            picked = (t.index_select(0, group.rows) for t in (xbc, dt))
            out.index_copy_(0, group.rows, self._decode(*picked, states, group.slots))
            step.after(group, *states)
        for chunk in step.prefills:
            rows = slice(chunk.start, chunk.start + chunk.n)
            out[rows] = self._prefill(xbc[rows], dt[rows], states, chunk.slot, chunk.fresh)
        return out

    def _prefill(self, xbc, dt, states, slot: int, fresh: bool) -> torch.Tensor:
        """One sequence's tokens from its slot's states (zeros when ``fresh``) -> (T,
        intermediate) fp32; its states after them written to the slot."""
        conv_pool, ssm_pool = states
        conv_state = None if fresh else conv_pool[slot]
        xbc, conv_pool[slot] = causal_conv1d(xbc, self.conv_weight, conv_state, self.conv_bias)
        x, dt, b, c = self._heads(xbc, dt)
        state = None if fresh else ssm_pool[slot].float()
        y, ssm_pool[slot] = ssd_chunk_scan(x, dt, self._a(), b, c, state, self.shape.chunk_size)
        return self._skip(y, x)

    def _decode(self, xbc, dt, states, slots: torch.Tensor) -> torch.Tensor:
        """One token of each decoding sequence (row i's in ``slots[i]``): their states
        gathered, updated in one batch, written back -> (B, intermediate) fp32."""
        conv_pool, ssm_pool = states
        xbc, conv = causal_conv1d_step(
            xbc, self.conv_weight, conv_pool.index_select(0, slots), self.conv_bias
        )
        conv_pool.index_copy_(0, slots, conv)
        x, dt, b, c = self._heads(xbc, dt)
        y, ssm = ssd_step(x, dt, self._a(), b, c, ssm_pool.index_select(0, slots).float())
        ssm_pool.index_copy_(0, slots, ssm.to(ssm_pool.dtype))
        return self._skip(y, x)

    def _a(self) -> torch.Tensor:
        return -self.A_log.float().exp()

    def _heads(self, xbc, dt) -> tuple[torch.Tensor, ...]:
        """Convolved (N, conv_dim) rows and their dt (N, heads) -> fp32 x (N, heads,
        head_dim), dt (N, heads) (softplus of dt + dt_bias, clamped), b, c (N, heads,
        state) (each group's repeated over its heads)."""
        s = self.shape
        rows = xbc.shape[0]
        groups = s.n_groups * s.state_size
        x, b, c = xbc.float().split([s.intermediate, groups, groups], dim=-1)
        per_group = s.num_heads // s.n_groups
        b, c = (t.reshape(rows, s.n_groups, s.state_size) for t in (b, c))
        if per_group > 1:
            b, c = (t.repeat_interleave(per_group, dim=1) for t in (b, c))
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(*s.dt_limit)
        return x.reshape(rows, s.num_heads, s.head_dim), dt, b, c

    def _skip(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y + D x, flattened to (N, intermediate)."""
        return (y + self.D.float()[:, None] * x).flatten(1)

    def _gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """y (N, intermediate) fp32 RMS-normalised in n_groups groups, times the weight,
        gated by silu(z) before the norm (or after, ``norm_before_gate``; only gated without
        ``rms_norm``); fp32."""
        s = self.shape
        gate = F.silu(z.float())
        if not s.rms_norm:
            return y * gate
        if not s.norm_before_gate:
            y = y * gate
        g = y.view(y.shape[0], s.n_groups, -1)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + s.rms_norm_eps)
        y = self.norm_weight.float() * g.view_as(y)
        return y * gate if s.norm_before_gate else y

    def load(self, sd: dict[str, torch.Tensor], p: str) -> None:
        """From the checkpoint tensors of ``p`` (``layers.N.mamba.``, ``layers.N.mixer.``)."""
        s = self.shape
        for proj in ("in_proj", "out_proj"):
            layer = getattr(self, proj)
            layer.weight.copy_(sd[f"{p}{proj}.weight"])
            if layer.bias is not None:
                layer.bias.copy_(sd[f"{p}{proj}.bias"])
        self.conv_weight.copy_(sd[p + "conv1d.weight"].reshape(s.conv_dim, s.conv_kernel))
        if s.conv_bias:
            self.conv_bias.copy_(sd[p + "conv1d.bias"])
        for name in ("dt_bias", "A_log", "D"):
            getattr(self, name).copy_(sd[p + name])
        if s.rms_norm:
            self.norm_weight.copy_(sd[p + "norm.weight"])
