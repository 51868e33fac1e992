"""The Mamba1 mixer (selective state space "S6", a decay per channel and state), as
transformers' ``MambaMixer``, ``FalconMambaMixer`` and ``JambaMambaMixer`` compute it,
over a step's sequences, each reading and writing its states in the recurrent pools
(``layers/recurrent.py``), as the Mamba2 mixer does (``layers/mamba2.py``).

One projection gives ``x`` and the output gate ``z`` (intermediate each). ``x`` goes
through a depthwise causal convolution (with bias) and SiLU; ``x_proj`` of it gives the
low-rank ``dt`` (dt_rank) and ``B``, ``C`` (state). FalconMamba RMS-normalises each of
``dt``, ``B`` and ``C`` without a weight (``mixer_rms_eps``), Jamba with one each
(``dt_layernorm``, ``b_layernorm``, ``c_layernorm``). Then ``dt = softplus(dt_proj(dt))``
(its bias inside the softplus) per channel and, with ``A = -exp(A_log)`` (intermediate,
state), the state ``S`` (intermediate, state) evolves as::

    S_t = exp(dt_t A) * S_{t-1} + (dt_t x_t) B_t^T
    y_t = S_t C_t + D x_t

then ``y * silu(z)`` is projected back (``out_proj``). Everything past the convolution
runs in fp32.

A prefill chunk runs the recurrence token by token (``selective_scan``: one sequence, a
loop over its tokens, each step vectorised over channels and states; the discretised
decays and inputs are made ``SCAN_BLOCK`` tokens at a time to bound their memory);
decodes apply it once (``selective_step``) for every decoding sequence of the step in
one batched update, their states gathered by slot and scattered back. States per
sequence: the convolution's last ``conv_kernel - 1`` inputs ``(intermediate, conv_kernel
- 1)`` in the model's dtype, ``S`` ``(intermediate, state)`` in the SSM state dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from vllm.model_executor.layers.gated_delta_net import causal_conv1d, causal_conv1d_step
from vllm.model_executor.layers.recurrent import RecurrentStep, StateSpec

SCAN_BLOCK = 256  # tokens whose decays and inputs selective_scan makes at once

# The norms on dt, B and C: none (Mamba), weightless (FalconMamba), weighted (Jamba).
NO_NORM, WEIGHTLESS, WEIGHTED = "none", "weightless", "weighted"


@dataclass(frozen=True)
class Mamba1Shape:
    hidden_size: int
    intermediate: int
    state_size: int
    conv_kernel: int
    dt_rank: int
    proj_bias: bool = False  # in_proj's and out_proj's
    conv_bias: bool = True
    bcdt_norm: str = NO_NORM  # NO_NORM, WEIGHTLESS or WEIGHTED
    bcdt_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.bcdt_norm not in (NO_NORM, WEIGHTLESS, WEIGHTED):
            raise ValueError(f"bcdt_norm {self.bcdt_norm!r}: one of none, weightless, weighted")

    def state_specs(self, conv_dtype: torch.dtype, ssm_dtype: torch.dtype) -> tuple[StateSpec, ...]:
        """(the convolution's last inputs, the SSM state) of one sequence."""
        return (
            StateSpec((self.intermediate, self.conv_kernel - 1), conv_dtype),
            StateSpec((self.intermediate, self.state_size), ssm_dtype),
        )


def selective_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence over one sequence's T tokens, fp32: x, dt (T, D) (dt softplus'd),
    a (D, N) = A, b, c (T, N), ``state`` (D, N) or None (zeros) -> (y (T, D) without the
    D skip, the state after the last token). A token at a time, in order: each token's
    state made in place over its input (one fused multiply-add), the outputs of a block's
    states in one contraction."""
    s = x.new_zeros(a.shape) if state is None else state
    out = x.new_empty(x.shape)
    for start in range(0, x.shape[0], SCAN_BLOCK):
        rows = slice(start, start + SCAN_BLOCK)
        decay = (dt[rows, :, None] * a).exp()  # (L, D, N)
        states = (dt[rows] * x[rows])[:, :, None] * b[rows, None, :]  # inputs, then states
        states[0].addcmul_(decay[0], s)
        for t in range(1, states.shape[0]):
            states[t].addcmul_(decay[t], states[t - 1])
        out[rows] = torch.einsum("ldn,ln->ld", states, c[rows])
        s = states[-1].clone()
    return out, s


def selective_step(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B sequences, fp32: x, dt (B, D), a (D, N), b, c (B, N),
    ``state`` (B, D, N) -> (y (B, D) without the D skip, the new states)."""
    state = state * (dt[..., None] * a).exp() + (dt * x)[..., None] * b[:, None, :]
    return (state @ c[..., None])[..., 0], state


def _rms(t: torch.Tensor, eps: float) -> torch.Tensor:
    t = t.float()
    return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps)


class Mamba1Mixer(nn.Module):
    """A Mamba1 layer: (num_tokens, hidden) -> (num_tokens, hidden), reading and writing
    each sequence's states in the layer's pools (module docstring). Parameters as the
    checkpoints name them: ``in_proj`` (rows [x | z]), the convolution's ``conv_weight``
    (intermediate, kernel) and ``conv_bias``, ``x_proj`` (rows [dt | B | C]), ``dt_proj``
    (with its bias), ``A_log`` (intermediate, state), ``D`` (intermediate), ``out_proj``;
    Jamba's ``dt_layernorm``, ``b_layernorm``, ``c_layernorm`` weights."""

    def __init__(self, shape: Mamba1Shape) -> None:
        super().__init__()
        s = self.shape = shape
        self.in_proj = nn.Linear(s.hidden_size, 2 * s.intermediate, bias=s.proj_bias)
        self.conv_weight = nn.Parameter(torch.empty(s.intermediate, s.conv_kernel))
        self.conv_bias = nn.Parameter(torch.zeros(s.intermediate)) if s.conv_bias else None
        self.x_proj = nn.Linear(s.intermediate, s.dt_rank + 2 * s.state_size, bias=False)
        self.dt_proj = nn.Linear(s.dt_rank, s.intermediate, bias=True)
        self.A_log = nn.Parameter(torch.zeros(s.intermediate, s.state_size))
        self.D = nn.Parameter(torch.ones(s.intermediate))
        self.out_proj = nn.Linear(s.intermediate, s.hidden_size, bias=s.proj_bias)
        if s.bcdt_norm == WEIGHTED:
            self.dt_layernorm = nn.Parameter(torch.ones(s.dt_rank))
            self.b_layernorm = nn.Parameter(torch.ones(s.state_size))
            self.c_layernorm = nn.Parameter(torch.ones(s.state_size))

    def forward(
        self, h: torch.Tensor, states: tuple[torch.Tensor, torch.Tensor], step: RecurrentStep
    ) -> torch.Tensor:
        """``states``: the layer's (conv pool, ssm pool); each sequence's slot is read
        (unless fresh) and written with its states after its last token."""
        x, z = self.in_proj(h).chunk(2, dim=-1)
        y = self._scan(x, states, step)  # (num_tokens, intermediate) fp32
        return self.out_proj((y * F.silu(z.float())).to(h.dtype))

    def _scan(self, x, states, step: RecurrentStep) -> torch.Tensor:
        if step.decode_only:
            return self._decode(x, states, step.groups[0].slots)
        out = x.new_empty(x.shape[0], self.shape.intermediate, dtype=torch.float32)
        for group in step.groups:
            picked = x.index_select(0, group.rows)
            out.index_copy_(0, group.rows, self._decode(picked, states, group.slots))
            step.after(group, *states)
        for chunk in step.prefills:
            rows = slice(chunk.start, chunk.start + chunk.n)
            out[rows] = self._prefill(x[rows], states, chunk.slot, chunk.fresh)
        return out

    def _prefill(self, x, states, slot: int, fresh: bool) -> torch.Tensor:
        """One sequence's tokens from its slot's states (zeros when ``fresh``) -> (T,
        intermediate) fp32; its states after them written to the slot."""
        conv_pool, ssm_pool = states
        conv_state = None if fresh else conv_pool[slot]
        x, conv_pool[slot] = causal_conv1d(x, self.conv_weight, conv_state, self.conv_bias)
        dt, b, c = self._selection(x)
        x = x.float()
        state = None if fresh else ssm_pool[slot].float()
        y, ssm_pool[slot] = selective_scan(x, dt, self._a(), b, c, state)
        return y + self.D.float() * x

    def _decode(self, x, states, slots: torch.Tensor) -> torch.Tensor:
        """One token of each decoding sequence (row i's in ``slots[i]``): their states
        gathered, updated in one batch, written back -> (B, intermediate) fp32."""
        conv_pool, ssm_pool = states
        x, conv = causal_conv1d_step(
            x, self.conv_weight, conv_pool.index_select(0, slots), self.conv_bias
        )
        conv_pool.index_copy_(0, slots, conv)
        dt, b, c = self._selection(x)
        x = x.float()
        y, ssm = selective_step(x, dt, self._a(), b, c, ssm_pool.index_select(0, slots).float())
        ssm_pool.index_copy_(0, slots, ssm.to(ssm_pool.dtype))
        return y + self.D.float() * x

    def _a(self) -> torch.Tensor:
        return -self.A_log.float().exp()

    def _selection(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Convolved (N, intermediate) rows -> fp32 dt (N, intermediate) (softplus of
        dt_proj's output and bias), b, c (N, state), normed as the shape says."""
        s = self.shape
        dt, b, c = self.x_proj(x).split([s.dt_rank, s.state_size, s.state_size], dim=-1)
        if s.bcdt_norm != NO_NORM:  # in fp32, back to the model's dtype (transformers')
            dt, b, c = (_rms(t, s.bcdt_eps) for t in (dt, b, c))
            if s.bcdt_norm == WEIGHTED:
                dt, b, c = (n.float() * t for n, t in zip(
                    (self.dt_layernorm, self.b_layernorm, self.c_layernorm), (dt, b, c),
                    strict=True))  # fmt: skip
            dt, b, c = (t.to(x.dtype) for t in (dt, b, c))
        dt = F.linear(dt, self.dt_proj.weight).float() + self.dt_proj.bias.float()
        return F.softplus(dt), b.float(), c.float()

    def load(self, sd: dict[str, torch.Tensor], p: str) -> None:
        """From the checkpoint tensors of ``p`` (``layers.N.mixer.``, ``layers.N.mamba.``)."""
        s = self.shape
        for proj in ("in_proj", "out_proj", "x_proj", "dt_proj"):
            layer = getattr(self, proj)
            layer.weight.copy_(sd[f"{p}{proj}.weight"])
            if layer.bias is not None:
                layer.bias.copy_(sd[f"{p}{proj}.bias"])
        self.conv_weight.copy_(sd[p + "conv1d.weight"].reshape(s.intermediate, s.conv_kernel))
        if s.conv_bias:
            self.conv_bias.copy_(sd[p + "conv1d.bias"])
        self.A_log.copy_(sd[p + "A_log"])
        self.D.copy_(sd[p + "D"])
        if s.bcdt_norm == WEIGHTED:
            for name in ("dt_layernorm", "b_layernorm", "c_layernorm"):
                getattr(self, name).copy_(sd[f"{p}{name}.weight"])
