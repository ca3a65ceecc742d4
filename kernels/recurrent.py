"""The gated delta rule of Qwen3-Next / Qwen3.5's delta-net layers, float32 (their short
convolution is :func:`localllm.kernels.ssm.short_conv`).

Same semantics as the torch reference (:func:`localllm.backends.deltanet.gated_delta_net`,
llama.cpp's ``ggml_gated_delta_net``), state updated in place: one program per (value head,
block of ``BV`` value rows) holds its rows of the head's (S, S) state in registers across the
tokens (a decode step or a whole prompt, token by token: flash-linear-attention's "fused
recurrent" form), normalizing the query and key of each token itself.

The launcher reads nothing back to the host and sizes its grid from shapes only (CUDA graphs
can capture it); it also runs on CPU tensors in Triton's interpreter (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._jit import kernel


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
    bv = _value_rows(s)
    _delta_net_kernel[(hv, triton.cdiv(s, bv))](
        qkv, alpha.contiguous(), beta_logit.contiguous(), dt_bias, a, state, out, t,
        qkv.stride(0), hv, n_k_heads * s, hv // n_k_heads, n_k_heads, float(eps),
        s ** -0.5, S=s, BLOCK_S=triton.next_power_of_2(s), BV=bv, INTERLEAVE=interleave,
        num_warps=4,
    )  # fmt: skip
    return out


def _value_rows(s: int) -> int:
    """Value rows of a head's state per program: 16 rows of 128 keep the block in registers."""
    return min(16, triton.next_power_of_2(s))


def delta_case(v_heads: int, k_heads: int, head_dim: int, *, interleave: bool = True,
               arch: int = 90):
    """:func:`gated_delta_net`'s kernel as it launches for ``v_heads`` value heads over
    ``k_heads`` key heads of size ``head_dim`` (the state is (v_heads, head_dim, head_dim)),
    for ahead-of-time compilation (:mod:`._aot`: tests/test_kernel_compile.py,
    bench/kernel_profile.py); and its launch figures: grid, bytes one program reads per
    token (q, k, its rows of v, alpha and beta; the state stays in registers)."""
    from ._aot import Case

    bv, block = _value_rows(head_dim), triton.next_power_of_2(head_dim)
    ints = {"HV": v_heads, "RATIO": v_heads // k_heads, "HK": k_heads}
    # the JIT makes an int argument of 1 a constexpr and marks multiples of 16 aligned
    constexprs = {"S": head_dim, "BLOCK_S": block, "BV": bv, "INTERLEAVE": interleave,
                  **{k: 1 for k, v in ints.items() if v == 1}}
    types = {"qkv": "*fp32", "alpha": "*fp32", "beta": "*fp32", "dt_bias": "*fp32",
             "a": "*fp32", "state": "*fp32", "out": "*fp32", "T": "i32", "stride_qkv": "i32",
             "KD": "i32", "eps": "fp32", "scale": "fp32",
             **{k: "i32" for k, v in ints.items() if v != 1}}
    aligned = ("qkv", "alpha", "beta", "dt_bias", "a", "state", "out", "stride_qkv", "KD",
               *(k for k, v in ints.items() if v % 16 == 0))
    case = Case(_delta_net_kernel, types, constexprs, arch=arch, aligned=aligned)
    return case, {"grid": (v_heads, triton.cdiv(head_dim, bv)),
                  "bytes_per_step": 4 * (2 * block + bv + 2), "marker": None,
                  "variant": f"S{block}BV{bv}R{ints['RATIO']}"}
