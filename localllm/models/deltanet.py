"""The gated delta-net mixer of the Qwen3-Next / Qwen3.5 hybrids (``qwen3next``, ``qwen35``,
``qwen35moe``), as llama.cpp builds it (``src/models/qwen35.cpp`` and ``qwen3next.cpp``,
``build_layer_attn_linear``; ``src/models/delta-net-base.cpp``).

On a layer's normalized input ``x`` (T, d)::

    qkv  = attn_qkv(x)                       # (T, 2 Hk S + Hv S): queries, keys, values
    z    = attn_gate(x)                      # (T, Hv S): the output gate
    qkv  = silu(conv(qkv))                   # causal depthwise conv of d_conv taps (ssm_conv1d)
    o    = delta_rule(l2(q), l2(k), v,       # backends/deltanet.py
                      g = softplus(alpha(x) + ssm_dt.bias) * ssm_a,  beta = sigmoid(beta(x)))
    out  = ssm_out(rmsnorm(o, ssm_norm) * silu(z))    # per value head

``alpha`` and ``beta`` come from ``ssm_alpha`` / ``ssm_beta`` (Qwen3.5), or from Qwen3-Next's
``ssm_ba``, which holds per key head ``Hv/Hk`` betas then ``Hv/Hk`` alphas; older Qwen3-Next
files hold q, k, v and z in one ``ssm_in`` (per key head: S queries, S keys, Hv/Hk x S values,
Hv/Hk x S gates) instead of ``attn_qkv`` + ``attn_gate``.

The layer remembers (``RecurrentSpec``): ``conv``, the last ``d_conv - 1`` inputs of the
convolution (d_conv - 1, 2 Hk S + Hv S), and ``ssm``, the delta-rule state (Hv, S, S) —
llama.cpp's ``r`` and ``s`` tensors of ``llama_memory_recurrent``.

Hyperparameters (llama.cpp's names): ``ssm.conv_kernel`` (d_conv), ``ssm.state_size`` (S,
the key and value head size), ``ssm.group_count`` (Hk), ``ssm.time_step_rank`` (Hv, a
multiple of Hk), ``ssm.inner_size`` (Hv x S).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..memory import RecurrentSpec
from .base import MAX_HEADS, REQUIRED, HParams, TensorSpec

MAX_CONV = 64  # taps of the short convolution (real files: 4)
MAX_STATE = 1024  # head size of the delta rule (real files: 128)


@dataclass(frozen=True)
class DeltaNetArgs:
    """A delta-net layer's geometry (module docstring)."""

    d_conv: int  # ssm.conv_kernel
    head_dim: int  # ssm.state_size: S, keys and values
    n_k_heads: int  # ssm.group_count: Hk
    n_v_heads: int  # ssm.time_step_rank: Hv
    interleave: bool = False  # value head h reads key head h // (Hv/Hk) (Qwen3-Next), else h % Hk

    @property
    def key_dim(self) -> int:
        return self.n_k_heads * self.head_dim

    @property
    def value_dim(self) -> int:
        return self.n_v_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def state_shapes(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        return (("conv", (self.d_conv - 1, self.conv_dim)),
                ("ssm", (self.n_v_heads, self.head_dim, self.head_dim)))


def deltanet_hparams(hp: HParams, *, interleave: bool) -> DeltaNetArgs:
    """The ``ssm.*`` keys, validated against each other.

    Raises:
        GGUFError: a key missing, zero or out of range, ``ssm.time_step_rank`` not a multiple
            of ``ssm.group_count``, ``ssm.inner_size`` other than ``time_step_rank x
            state_size`` (the delta rule needs key and value heads of one size), naming the key.
    """
    d_conv = hp.int("ssm.conv_kernel", REQUIRED, lo=2, hi=MAX_CONV)
    s = hp.int("ssm.state_size", REQUIRED, hi=MAX_STATE)
    hk = hp.int("ssm.group_count", REQUIRED, hi=MAX_HEADS)
    hv = hp.int("ssm.time_step_rank", REQUIRED, hi=MAX_HEADS)
    inner = hp.int("ssm.inner_size", REQUIRED)
    hp.require(hv % hk == 0, "ssm.time_step_rank",
               f"{hv} value heads are not a multiple of ssm.group_count = {hk} key heads")
    hp.require(inner == hv * s, "ssm.inner_size",
               f"{inner} is not ssm.time_step_rank x ssm.state_size = {hv} x {s} (the value "
               "heads must have the key heads' size)")
    return DeltaNetArgs(d_conv, s, hk, hv, interleave)


def deltanet_specs(prefix: str, d_model: int, a: DeltaNetArgs, *,
                   fused_ba: bool) -> list[TensorSpec]:
    """The tensors of one delta-net sublayer (llama.cpp's ``load_arch_tensors``, torch
    shapes). ``fused_ba``: Qwen3-Next's ``ssm_ba`` instead of ``ssm_beta`` + ``ssm_alpha``,
    and its legacy ``ssm_in`` accepted instead of ``attn_qkv`` + ``attn_gate``."""
    p, d, hv = prefix, d_model, a.n_v_heads
    legacy = p + "ssm_in.weight" if fused_ba else None
    specs = [TensorSpec(p + "attn_qkv.weight", (a.conv_dim, d), unless=legacy),
             TensorSpec(p + "attn_gate.weight", (a.value_dim, d), unless=legacy),
             TensorSpec(p + "ssm_conv1d.weight", (a.conv_dim, a.d_conv)),
             TensorSpec(p + "ssm_dt.bias", (hv,)),
             TensorSpec(p + "ssm_a", (hv,))]
    if fused_ba:
        specs += [TensorSpec(p + "ssm_in.weight", (a.conv_dim + a.value_dim, d), True),
                  TensorSpec(p + "ssm_ba.weight", (2 * hv, d))]
    else:
        specs += [TensorSpec(p + "ssm_beta.weight", (hv, d)),
                  TensorSpec(p + "ssm_alpha.weight", (hv, d))]
    specs += [TensorSpec(p + "ssm_norm.weight", (a.head_dim,)),
              TensorSpec(p + "ssm_out.weight", (d, a.value_dim))]
    return specs


def memory_spec(a: DeltaNetArgs) -> RecurrentSpec:
    """What a delta-net layer remembers (module docstring)."""
    return RecurrentSpec(a.state_shapes)


def projections(layer, x: torch.Tensor, a: DeltaNetArgs):
    """(qkv (T, conv_dim), z (T, Hv S), beta_logit (T, Hv), alpha (T, Hv)) of a delta-net
    layer's input ``x`` (T, d), from whichever projections the file has (module docstring)."""
    t, hk, r = x.shape[0], a.n_k_heads, a.n_v_heads // a.n_k_heads
    if layer.attn_qkv is not None:
        qkv, z = layer.attn_qkv(x), layer.attn_gate(x)
    else:  # legacy Qwen3-Next: q, k, v, z grouped per key head
        s = a.head_dim
        mixed = layer.ssm_in(x).view(t, hk, 2 * s + 2 * r * s)
        q, k, v, z = mixed.split([s, s, r * s, r * s], -1)
        qkv = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], -1)
        z = z.reshape(t, -1)
    if layer.ssm_ba is not None:  # per key head: r betas, then r alphas
        ba = layer.ssm_ba(x).view(t, hk, 2, r)
        return qkv, z, ba[:, :, 0].reshape(t, -1), ba[:, :, 1].reshape(t, -1)
    return qkv, z, layer.ssm_beta(x), layer.ssm_alpha(x)


def delta_net(layer, x: torch.Tensor, state, ops, a: DeltaNetArgs, eps: float) -> torch.Tensor:
    """The mixer on a layer's normalized input ``x`` (T, d) float32 -> (T, d) float32,
    continuing from the layer's :class:`~localllm.memory.RecurrentState` (``conv``, ``ssm``;
    advanced by T positions). ``eps``: the file's RMS epsilon (the L2 norms of q and k and the
    gated output norm use it, as llama.cpp does)."""
    t = x.shape[0]
    qkv, z, beta_logit, alpha = projections(layer, x, a)
    qkv = ops.short_conv(qkv, layer.ssm_conv1d, None, state["conv"], silu=True)
    o = ops.gated_delta_net(qkv, alpha, beta_logit, layer.ssm_dt_bias, layer.ssm_a,
                            state["ssm"], n_k_heads=a.n_k_heads, eps=eps,
                            interleave=a.interleave)  # (T, Hv, S)
    state.advance(t)
    o = ops.rms_norm(o, layer.ssm_norm, eps).view(t, -1)
    return layer.ssm_out(ops.gated(z.contiguous(), o, "silu", overwrite=True))

