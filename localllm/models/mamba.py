"""The Mamba2 mixer shared by ``mamba2``, ``granitehybrid``, ``falcon-h1`` and ``nemotron_h``
(llama.cpp's ``build_mamba2_layer``, ``src/models/mamba-base.cpp``; Dao & Gu 2024).

One mixer, on a normed input x (T, d)::

    z, xBC, dt = split(ssm_in(x), [d_inner, d_inner + 2 G N, H])
    xBC        = silu(conv1d(xBC) + conv_bias)          # causal, d_conv taps, per channel
    x, B, C    = split(xBC, [d_inner, G N, G N])        # x: H heads of P = d_inner / H
    y          = SSD(x, dt + dt_bias, A, B, C) + D x    # ops.ssm_scan
    y          = silu(z) * y, then RMSNorm per group of d_inner / G (when ssm_norm is there)
    out        = ssm_out(y)

Its state (:class:`~localllm.memory.RecurrentSpec`): ``conv`` (d_conv - 1, d_inner + 2 G N)
and ``ssm`` (H, P, N) float32. Hyperparameters: ``{arch}.ssm.conv_kernel`` (d_conv),
``ssm.inner_size`` (d_inner), ``ssm.state_size`` (N), ``ssm.time_step_rank`` (H: llama.cpp
reuses Mamba1's key for Mamba2's head count), ``ssm.group_count`` (G).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..memory import RecurrentSpec
from .base import MAX_HEADS, REQUIRED, HParams, TensorSpec
from .common import Linear

MAX_CONV = 64  # taps of the short convolution (Mamba uses 4, LFM2 3)
MAX_STATE = 1024  # SSM state size N (Mamba2 uses 128)


@dataclass(frozen=True)
class SSMArgs:
    """The Mamba2 mixer's hyperparameters (validated by :func:`ssm_hparams`)."""

    d_conv: int  # ssm.conv_kernel
    d_inner: int  # ssm.inner_size
    d_state: int  # ssm.state_size
    n_heads: int  # ssm.time_step_rank
    n_groups: int  # ssm.group_count

    @property
    def head_dim(self) -> int:
        return self.d_inner // self.n_heads

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: x, B and C."""
        return self.d_inner + 2 * self.n_groups * self.d_state

    @property
    def in_proj(self) -> int:
        """Rows of ``ssm_in``: z, x, B, C and dt."""
        return self.d_inner + self.conv_dim + self.n_heads


def ssm_hparams(hp: HParams) -> SSMArgs:
    """The ``ssm.*`` keys, consistent with each other.

    Raises:
        GGUFError: a key missing, out of range, or heads that do not divide ``inner_size``,
            groups that do not divide the heads (named).
    """
    a = SSMArgs(d_conv=hp.int("ssm.conv_kernel", REQUIRED, lo=2, hi=MAX_CONV),
                d_inner=hp.int("ssm.inner_size", REQUIRED),
                d_state=hp.int("ssm.state_size", REQUIRED, hi=MAX_STATE),
                n_heads=hp.int("ssm.time_step_rank", REQUIRED, hi=MAX_HEADS),
                n_groups=hp.int("ssm.group_count", REQUIRED, hi=MAX_HEADS))
    hp.require(a.d_inner % a.n_heads == 0, "ssm.time_step_rank",
               f"{a.n_heads} heads do not divide ssm.inner_size {a.d_inner}")
    hp.require(a.n_heads % a.n_groups == 0, "ssm.group_count",
               f"{a.n_groups} groups do not divide {a.n_heads} heads (ssm.time_step_rank)")
    return a


def ssm_specs(prefix: str, a: SSMArgs, d_model: int, *, conv_bias: bool = True,
              norm: bool = True) -> list[TensorSpec]:
    """The tensors of one mixer (``blk.{i}.``), torch shapes; ``conv_bias`` / ``norm``:
    whether ``ssm_conv1d.bias`` / ``ssm_norm.weight`` are required (else optional)."""
    p = prefix
    return [TensorSpec(p + "ssm_in.weight", (a.in_proj, d_model)),
            TensorSpec(p + "ssm_conv1d.weight", (a.conv_dim, a.d_conv)),
            TensorSpec(p + "ssm_conv1d.bias", (a.conv_dim,), optional=not conv_bias),
            TensorSpec(p + "ssm_dt.bias", (a.n_heads,)),
            TensorSpec(p + "ssm_a", (a.n_heads, 1)),
            TensorSpec(p + "ssm_d", (a.n_heads, 1)),
            TensorSpec(p + "ssm_norm.weight", (a.n_groups, a.d_inner // a.n_groups),
                       optional=not norm),
            TensorSpec(p + "ssm_out.weight", (d_model, a.d_inner))]


def ssm_memory(a: SSMArgs) -> RecurrentSpec:
    """The mixer's recurrent state: the convolution's last inputs and the SSM state."""
    return RecurrentSpec((("conv", (a.d_conv - 1, a.conv_dim)),
                          ("ssm", (a.n_heads, a.head_dim, a.d_state))))


@dataclass
class MixerWeights:
    """A layer's Mamba2 tensors (``blk.{i}.ssm_*``); None in the layers without a mixer."""

    ssm_in: Linear | None = None
    ssm_conv1d: torch.Tensor | None = None  # (conv_dim, d_conv)
    ssm_conv1d_bias: torch.Tensor | None = None  # (conv_dim,)
    ssm_dt_bias: torch.Tensor | None = None  # (H,)
    ssm_a: torch.Tensor | None = None  # (H, 1): A = -exp(A_log)
    ssm_d: torch.Tensor | None = None  # (H, 1)
    ssm_norm: torch.Tensor | None = None  # (G, d_inner / G)
    ssm_out: Linear | None = None


def mamba2_mixer(w: MixerWeights, x: torch.Tensor, state, a: SSMArgs, eps: float,
                 ops) -> torch.Tensor:
    """The mixer (module docstring) on x (T, d_model) float32, normed; ``state`` the layer's
    :class:`~localllm.memory.RecurrentState` (read, written, advanced by T) -> (T, d_model)
    float32."""
    t = x.shape[0]
    h, p, g, n = a.n_heads, a.head_dim, a.n_groups, a.d_state
    z, xbc, dt = w.ssm_in(x).split([a.d_inner, a.conv_dim, h], dim=-1)
    xbc = ops.short_conv(xbc, w.ssm_conv1d, w.ssm_conv1d_bias, state["conv"], silu=True)
    xs, b, c = xbc.split([a.d_inner, g * n, g * n], dim=-1)
    y = ops.ssm_scan(xs.reshape(t, h, p), dt, w.ssm_dt_bias, w.ssm_a.view(h),
                     b.reshape(t, g, n), c.reshape(t, g, n),
                     w.ssm_d.view(h), state["ssm"])
    del xbc, xs, b, c, dt
    y = ops.gated(z.contiguous(), y.view(t, a.d_inner), "silu", overwrite=True)
    if w.ssm_norm is not None:
        if g == 1:
            y = ops.rms_norm(y, w.ssm_norm.view(-1), eps)
        else:
            y = ops.rms_norm(y.view(t, g, a.d_inner // g), w.ssm_norm, eps).view(t, -1)
    state.advance(t)
    return w.ssm_out(y)
