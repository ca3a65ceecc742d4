"""Recurrent mixers: the causal short convolution (Mamba2, the gated delta-net, LFM2) and the
gated delta rule (Qwen3-Next / Qwen3.5), float32.

Same semantics as the torch references (:func:`localllm.backends.ssm.short_conv`,
:func:`localllm.backends.deltanet.gated_delta_net`, llama.cpp's ``ggml_ssm_conv`` and
``ggml_gated_delta_net``), state updated in place:

- :func:`short_conv`: one program per block of channels runs every token, reading the
  ``d_conv`` rows of [state; x] each output needs, then writes the new state;
- :func:`gated_delta_net`: one program per (value head, block of ``BV`` value rows) holds its
  rows of the head's (S, S) state in registers across the tokens (a decode step or a whole
  prompt, token by token: flash-linear-attention's "fused recurrent" form), normalizing the
  query and key of each token itself.

The launchers read nothing back to the host and size their grids from shapes only (CUDA
graphs can capture them); they also run on CPU tensors in Triton's interpreter (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._jit import kernel


@kernel
def _short_conv_kernel(x, w, bias, state, y, T, C, stride_x, K: tl.constexpr,
                       HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_C: tl.constexpr):
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < C
    c64 = c.to(tl.int64)
    zero = tl.zeros([BLOCK_C], dtype=tl.int32)  # a row index as a vector: masks of its lanes
    b = tl.load(bias + c, mask=cm, other=0.0) if HAS_BIAS else 0.0
    for t in range(T):
        acc = tl.zeros([BLOCK_C], dtype=tl.float32)
        for j in tl.static_range(K):
            r = zero + t + j  # row of u = [state; x]
            from_state = tl.load(state + r * C + c64, mask=cm & (r < K - 1), other=0.0)
            from_x = tl.load(x + (r - (K - 1)).to(tl.int64) * stride_x + c64,
                             mask=cm & (r >= K - 1), other=0.0)
            acc += (from_state + from_x) * tl.load(w + c64 * K + j, mask=cm, other=0.0)
        acc += b
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc))
        tl.store(y + (zero + t).to(tl.int64) * C + c64, acc, mask=cm)
    # The new state, rows u[T .. T + K - 2]: ascending, so that an old state row (T < K - 1)
    # is read before it is overwritten.
    for r in tl.static_range(K - 1):
        src = zero + T + r
        from_state = tl.load(state + src * C + c64, mask=cm & (src < K - 1), other=0.0)
        from_x = tl.load(x + (src - (K - 1)).to(tl.int64) * stride_x + c64,
                         mask=cm & (src >= K - 1), other=0.0)
        tl.store(state + r * C + c64, from_state + from_x, mask=cm)


def short_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               state: torch.Tensor, *, silu: bool) -> torch.Tensor:
    """Causal depthwise convolution continuing from ``state`` (updated in place).

    Args:
        x: (T, C) float32 with unit column stride; weight: (C, K) float32 (tap j of channel
            c at [c, j], oldest first); bias: (C,) float32 or None; state: (K - 1, C) float32
            contiguous.
    Returns:
        (T, C) float32 (SiLU applied when ``silu``).
    """
    t, c = x.shape
    k = weight.shape[1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    if state.shape != (k - 1, c) or not state.is_contiguous():
        raise ValueError(f"short_conv: state must be ({k - 1}, {c}) contiguous")
    y = torch.empty(t, c, dtype=torch.float32, device=x.device)
    block = 256
    _short_conv_kernel[(triton.cdiv(c, block),)](
        x, weight.contiguous(), bias if bias is not None else weight, state, y, t, c,
        x.stride(0), K=k, HAS_BIAS=bias is not None, SILU=silu, BLOCK_C=block, num_warps=4,
    )  # fmt: skip
    return y


@kernel
def _delta_net_kernel(qkv, alpha, beta, dt_bias, a, state, out, T, stride_qkv, HV, KD, RATIO,
                      HK, eps, scale, S: tl.constexpr, BLOCK_S: tl.constexpr,
                      BV: tl.constexpr, INTERLEAVE: tl.constexpr):
    h = tl.program_id(0)
    rows = tl.program_id(1) * BV + tl.arange(0, BV)  # value channels of this program
    cols = tl.arange(0, BLOCK_S)  # key channels
    rm, cm = rows < S, cols < S
    kh = h // RATIO if INTERLEAVE else h % HK
    m_ptr = state + h.to(tl.int64) * S * S + rows[:, None] * S + cols[None, :]
    mask = rm[:, None] & cm[None, :]
    m = tl.load(m_ptr, mask=mask, other=0.0)
    a_h = tl.load(a + h)
    dt_h = tl.load(dt_bias + h)
    for t in range(T):
        row = qkv + t * stride_qkv  # offsets in int32: < 2^31 for any prompt that fits
        q = tl.load(row + kh * S + cols, mask=cm, other=0.0)
        k = tl.load(row + KD + kh * S + cols, mask=cm, other=0.0)
        v = tl.load(row + 2 * KD + h * S + rows, mask=rm, other=0.0)
        q = q * (scale / tl.sqrt(tl.sum(q * q, axis=0) + eps))
        k = k / tl.sqrt(tl.sum(k * k, axis=0) + eps)
        x = tl.load(alpha + t * HV + h) + dt_h
        decay = tl.exp(tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x))) * a_h)
        b = 1.0 / (1.0 + tl.exp(-tl.load(beta + t * HV + h)))
        delta = (v - decay * tl.sum(m * k[None, :], axis=1)) * b
        m = m * decay + delta[:, None] * k[None, :]
        o = tl.sum(m * q[None, :], axis=1)
        tl.store(out + (t * HV + h) * S + rows, o, mask=rm)
    tl.store(m_ptr, m, mask=mask)


def gated_delta_net(qkv: torch.Tensor, alpha: torch.Tensor, beta_logit: torch.Tensor,
                    dt_bias: torch.Tensor, a: torch.Tensor, state: torch.Tensor, *,
                    n_k_heads: int, eps: float, interleave: bool) -> torch.Tensor:
    """A gated delta-net layer's recurrence from its convolved projections.

    Args:
        qkv: (T, 2 Hk S + Hv S) float32, unit column stride; alpha, beta_logit: (T, Hv)
            float32; dt_bias, a: (Hv,) float32; state: (Hv, S, S) float32 contiguous,
            updated in place; ``interleave``: value head h reads key head h // (Hv/Hk),
            else h % Hk; ``eps``: of the L2 norms of q and k.
    Returns:
        (T, Hv, S) float32.
    """
    t = qkv.shape[0]
    hv, s = state.shape[0], state.shape[1]
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    if qkv.shape[1] != 2 * n_k_heads * s + hv * s or hv % n_k_heads:
        raise ValueError("gated_delta_net: qkv, state and n_k_heads disagree")
    out = torch.empty(t, hv, s, dtype=torch.float32, device=qkv.device)
    bv = min(16, triton.next_power_of_2(s))
    _delta_net_kernel[(hv, triton.cdiv(s, bv))](
        qkv, alpha.contiguous(), beta_logit.contiguous(), dt_bias, a, state, out, t,
        qkv.stride(0), hv, n_k_heads * s, hv // n_k_heads, n_k_heads, float(eps),
        s ** -0.5, S=s, BLOCK_S=triton.next_power_of_2(s), BV=bv, INTERLEAVE=interleave,
        num_warps=4,
    )  # fmt: skip
    return out
