"""The recurrent operations of state-space and hybrid models (float32): the causal short
convolution and Mamba2's selective scan, each one launch for any number of tokens, reading
and writing the layer's state in place.

Same math as the torch references (``localllm/backends/ssm.py``; llama.cpp's
``ggml_ssm_conv`` and ``ggml_ssm_scan``, Dao & Gu 2024):

- :func:`short_conv`: ``y[t, c] = sum_j w[c, j] u[t + j, c]`` (+ bias, SiLU), ``u`` the
  ``d_conv - 1`` remembered rows then the inputs; a program owns ``BLOCK_C`` channels for
  every token, so it can shift their state in place at the end;
- :func:`ssm_scan`: per token ``S_h = exp(dt' A_h) S_h + dt' x (outer) B``,
  ``y = S_h C + D x``, ``dt' = softplus(dt + dt_bias)``; a program owns ``BLOCK_P`` rows of
  one head's state (P x N) and keeps them in registers across the tokens.

Both walk the tokens in order inside the program (a decode step is one token; a prompt runs
the same recurrence, in parallel over channels or heads x rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._jit import kernel


@kernel
def _short_conv_kernel(x, w, bias, state, y, T, C, stride_x, K: tl.constexpr,
                       HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_C: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    if HAS_BIAS:
        b = tl.load(bias + cols, mask=cmask, other=0.0)
    for t in range(T):
        acc = tl.zeros([BLOCK_C], dtype=tl.float32)
        for j in tl.static_range(K):
            i = cols * 0 + (t + j)  # row of u: the state below K - 1, the inputs from there
            from_state = tl.load(state + i * C + cols, mask=cmask & (i < K - 1), other=0.0)
            from_x = tl.load(x + (i - (K - 1)) * stride_x + cols,
                             mask=cmask & (i >= K - 1), other=0.0)
            acc += (from_state + from_x) * tl.load(w + cols * K + j, mask=cmask, other=0.0)
        if HAS_BIAS:
            acc += b
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc))
        tl.store(y + t * C + cols, acc, mask=cmask)
    # the new state, rows T .. T + K - 2 of u; a row is read before any write reaches it
    for r in tl.static_range(K - 1):
        i = cols * 0 + (T + r)
        from_state = tl.load(state + i * C + cols, mask=cmask & (i < K - 1), other=0.0)
        from_x = tl.load(x + (i - (K - 1)) * stride_x + cols, mask=cmask & (i >= K - 1),
                         other=0.0)
        tl.store(state + r * C + cols, from_state + from_x, mask=cmask)


@kernel
def _ssm_scan_kernel(x, dt, dt_bias, a, b, c, d, state, y, T, P, N, stride_xt, stride_xh,
                     stride_dt, stride_bt, HPG, HAS_D: tl.constexpr, BLOCK_P: tl.constexpr,
                     BLOCK_N: tl.constexpr):
    h = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    cols = tl.arange(0, BLOCK_N)
    pmask, nmask = rows < P, cols < N
    mask = pmask[:, None] & nmask[None, :]
    g = h // HPG
    s_ptr = state + h * P * N + rows[:, None] * N + cols[None, :]
    s = tl.load(s_ptr, mask=mask, other=0.0)
    bias = tl.load(dt_bias + h)
    a_h = tl.load(a + h)
    if HAS_D:
        d_h = tl.load(d + h)
    H = tl.num_programs(0)
    for t in range(T):
        v = tl.load(dt + t * stride_dt + h) + bias
        dts = tl.where(v > 20.0, v, tl.log(1.0 + tl.exp(v)))
        decay = tl.exp(dts * a_h)
        xr = tl.load(x + t * stride_xt + h * stride_xh + rows, mask=pmask, other=0.0)
        br = tl.load(b + t * stride_bt + g * N + cols, mask=nmask, other=0.0)
        cr = tl.load(c + t * stride_bt + g * N + cols, mask=nmask, other=0.0)
        s = s * decay + (xr * dts)[:, None] * br[None, :]
        out = tl.sum(s * cr[None, :], axis=1)
        if HAS_D:
            out += d_h * xr
        tl.store(y + (t * H + h) * P + rows, out, mask=pmask)
    tl.store(s_ptr, s, mask=mask)


def short_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               state: torch.Tensor, *, silu: bool) -> torch.Tensor:
    """Causal depthwise convolution continuing from ``state`` (updated in place).

    Args:
        x: (T, C) float32, unit column stride (a column slice of a projection is fine).
        weight: (C, d_conv) float32 contiguous.
        bias: (C,) float32 or None.
        state: (d_conv - 1, C) float32 contiguous.
    Returns:
        (T, C) float32 (SiLU applied when ``silu``).
    """
    t, ch = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty(t, ch, dtype=torch.float32, device=x.device)
    block = min(256, triton.next_power_of_2(ch))
    _short_conv_kernel[(triton.cdiv(ch, block),)](
        x, weight, bias if bias is not None else weight, state, y, t, ch, x.stride(0),
        K=weight.shape[1], HAS_BIAS=bias is not None, SILU=silu, BLOCK_C=block,
    )  # fmt: skip
    return y


def ssm_scan(x: torch.Tensor, dt: torch.Tensor, dt_bias: torch.Tensor, a: torch.Tensor,
             b: torch.Tensor, c: torch.Tensor, d: torch.Tensor | None,
             state: torch.Tensor) -> torch.Tensor:
    """Mamba2's selective scan continuing from ``state`` (updated in place).

    Args:
        x: (T, H, P) float32, unit last stride; dt: (T, H), unit last stride.
        dt_bias, a: (H,) float32; d: (H,) float32 or None.
        b, c: (T, G, N) float32, the same strides, rows of G * N contiguous values.
        state: (H, P, N) float32 contiguous.
    Returns:
        y (T, H, P) float32.
    """
    t, h, p = x.shape
    g, n = b.shape[1], b.shape[2]
    if x.stride(-1) != 1:
        x = x.contiguous()
    if dt.stride(-1) != 1:
        dt = dt.contiguous()
    if b.stride(-1) != 1 or b.stride(1) != n or c.stride() != b.stride():
        b, c = b.contiguous(), c.contiguous()
    y = torch.empty(t, h, p, dtype=torch.float32, device=x.device)
    block_n = triton.next_power_of_2(n)
    block_p = max(1, min(triton.next_power_of_2(p), 4096 // block_n))
    _ssm_scan_kernel[(h, triton.cdiv(p, block_p))](
        x, dt, dt_bias, a, b, c, d if d is not None else a, state, y, t, p, n, x.stride(0),
        x.stride(1), dt.stride(0), b.stride(0), h // g, HAS_D=d is not None,
        BLOCK_P=block_p, BLOCK_N=block_n,
    )  # fmt: skip
    return y


def conv_case(channels: int, d_conv: int, *, bias: bool = True, silu: bool = True,
              arch: int = 90):
    """:func:`short_conv`'s kernel as it launches for ``channels`` channels of ``d_conv`` taps,
    for ahead-of-time compilation (:mod:`._aot`: tests/test_kernel_compile.py,
    bench/kernel_profile.py); and its launch figures: grid, bytes one program reads per
    token (``d_conv`` rows of its channels, the taps and the bias from cache)."""
    from ._aot import Case

    block = min(256, triton.next_power_of_2(channels))
    case = Case(_short_conv_kernel,
                {"x": "*fp32", "w": "*fp32", "bias": "*fp32", "state": "*fp32", "y": "*fp32",
                 "T": "i32", "C": "i32", "stride_x": "i32"},
                {"K": d_conv, "HAS_BIAS": bias, "SILU": silu, "BLOCK_C": block}, arch=arch,
                aligned=("x", "w", "bias", "state", "y", "C", "stride_x"))
    return case, {"grid": (triton.cdiv(channels, block), 1), "bytes_per_step": 4 * d_conv * block,
                  "marker": None, "variant": f"C{block}K{d_conv}"}


def scan_case(heads: int, head_dim: int, d_state: int, *, with_d: bool = True,
              arch: int = 90):
    """:func:`ssm_scan`'s kernel as it launches for ``heads`` heads of ``head_dim`` rows and
    state size ``d_state`` (see :func:`conv_case`); bytes per token: a program's rows of x,
    and B and C."""
    from ._aot import Case

    block_n = triton.next_power_of_2(d_state)
    block_p = max(1, min(triton.next_power_of_2(head_dim), 4096 // block_n))
    case = Case(_ssm_scan_kernel,
                {"x": "*fp32", "dt": "*fp32", "dt_bias": "*fp32", "a": "*fp32", "b": "*fp32",
                 "c": "*fp32", "d": "*fp32", "state": "*fp32", "y": "*fp32", "T": "i32",
                 "P": "i32", "N": "i32", "stride_xt": "i32", "stride_xh": "i32",
                 "stride_dt": "i32", "stride_bt": "i32", "HPG": "i32"},
                {"HAS_D": with_d, "BLOCK_P": block_p, "BLOCK_N": block_n}, arch=arch,
                aligned=("x", "dt", "dt_bias", "a", "b", "c", "d", "state", "y", "P", "N",
                         "stride_xt", "stride_xh", "stride_bt"))
    return case, {"grid": (heads, triton.cdiv(head_dim, block_p)),
                  "bytes_per_step": 4 * (block_p + 2 * d_state), "marker": None,
                  "variant": f"P{block_p}N{block_n}"}
