"""K-quant block quantizers (256-element super-blocks): Q2_K, Q3_K, Q4_K, Q5_K, Q6_K.

Vectorized re-implementations of the reference (no importance matrix) algorithms of llama.cpp's
``ggml/src/ggml-quants.c``: ``make_qkx2_quants`` (scale + min search, Q2_K/Q4_K/Q5_K),
``make_q3_quants`` (iterative weighted refinement, Q3_K), ``make_qx_quants`` with
``rmse_type=1`` (scale search, Q6_K), followed by ``quantize_row_q*_K_ref``'s quantization of
the sub-block scales and its final re-rounding of the values against those stored scales.
All sub-blocks are processed at once as rows of a tensor; the per-element loops of the C code
become elementwise tensor operations, and only loops over *candidate scales* remain.

Every function takes ``x``: float32 torch tensor (n_blocks, 256) and returns a uint8 numpy
array (n_blocks, type_size) laid out as ggml's ``block_q*_K`` structs (readable by
``gguf.quants.dequantize``).
"""

from __future__ import annotations

import numpy as np
import torch

from .legacy import fp16_bytes, fp16_round, signed_absmax

QK_K = 256
GROUP_MAX_EPS = 1e-15


def _f32(v: float) -> float:
    """A constant computed in float32 as the C code does (``0.1f * is`` ...)."""
    return float(np.float32(v))


def _div_or(num: torch.Tensor, den: torch.Tensor, fallback: float = 0.0) -> torch.Tensor:
    ok = den != 0
    return torch.where(ok, num / torch.where(ok, den, 1.0), fallback)


def make_qkx2_quants(x: torch.Tensor, w: torch.Tensor, nmax: int, rmin: float, rdelta: float,
                     nstep: int, use_mad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric quantization x ~ scale * L - the_min of each row, searching nstep+1 scales.

    x, w: (G, n) float32 values and weights -> scale (G,), the_min (G,) (>= 0).
    (llama.cpp ``make_qkx2_quants``.) The levels L themselves are not returned: the caller
    re-rounds every value against the stored 6/4-bit scales, and where such a scale is 0 the
    levels do not affect the dequantized value. Squared errors are evaluated in closed form
    from the weighted sums (the C code sums them element by element; same quantity).
    """
    mn = x.amin(-1).clamp(max=0.0)
    mx = x.amax(-1)
    flat = mx == mn
    sum_w = w.sum(-1)
    sum_x = (w * x).sum(-1)
    sum_x2 = (w * x * x).sum(-1).double()

    def levels(iscale, m):
        return (x - m[:, None]).mul_(iscale[:, None]).round_().clamp_(0, nmax)

    def error(scale, m, q, sums):
        if use_mad:
            return (w * (scale[:, None] * q + m[:, None] - x).abs_()).sum(-1)
        s_l, s_l2, s_xl = (t.double() for t in sums)
        s, m64 = scale.double(), m.double()
        return (s * s * s_l2 + m64 * m64 * sum_w.double() + sum_x2 + 2 * s * m64 * s_l
                - 2 * s * s_xl - 2 * m64 * sum_x.double())

    def sums(q):
        wl = w * q
        return wl.sum(-1), (wl * q).sum(-1), (wl * x).sum(-1)

    rng = torch.where(flat, 1.0, mx - mn)
    iscale = nmax / rng
    scale = 1.0 / iscale
    q = levels(iscale, mn)
    best = error(scale, mn, q, None if use_mad else sums(q))
    for step in range(nstep + 1):
        # the C loop reuses the improved min of earlier steps in both x - min and max - min
        rng = torch.where(flat, 1.0, mx - mn)
        iscale = _f32(_f32(rmin + _f32(rdelta * step)) + nmax) / rng
        q = levels(iscale, mn)
        sum_l, sum_l2, sum_xl = sums(q)
        D = sum_w * sum_l2 - sum_l * sum_l
        ok = (D > 0) & ~flat
        this_scale = _div_or(sum_w * sum_xl - sum_x * sum_l, D)
        this_min = _div_or(sum_l2 * sum_x - sum_l * sum_xl, D)
        pos = this_min > 0
        this_min = torch.where(pos, 0.0, this_min)
        this_scale = torch.where(pos, _div_or(sum_xl, sum_l2), this_scale)
        cur = error(this_scale, this_min, q, (sum_l, sum_l2, sum_xl))
        take = ok & (cur < best)
        best = torch.where(take, cur, best)
        scale = torch.where(take, this_scale, scale)
        mn = torch.where(take, this_min, mn)
    return torch.where(flat, 0.0, scale), -mn


def make_qx_quants_rmse1(x: torch.Tensor, nmax: int) -> torch.Tensor:
    """Symmetric quantization x ~ scale * l, l in -nmax..nmax-1, weights x^2, 19 candidate
    scales. x: (G, n) -> scale (G,). (llama.cpp ``make_qx_quants`` with rmse_type 1 and no
    importance weights; levels are not returned, see :func:`make_qkx2_quants`.)
    """
    mx = signed_absmax(x)
    zero = mx.abs() < GROUP_MAX_EPS
    mx_safe = torch.where(zero, 1.0, mx)
    w = x * x
    wx = w * x

    def attempt(c: float):
        q = (x * (-c / mx_safe)[:, None]).round_().clamp_(-nmax, nmax - 1)
        return (wx * q).sum(-1), (w * q).mul_(q).sum(-1)

    sumlx, suml2 = attempt(float(nmax))
    scale = _div_or(sumlx, suml2)
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        slx, sl2 = attempt(_f32(nmax + _f32(0.1 * step)))
        take = (sl2 > 0) & (slx * slx > best * sl2)
        new_scale = _div_or(slx, sl2)
        scale = torch.where(take, new_scale, scale)
        best = torch.where(take, new_scale * slx, best)
    return torch.where(zero, 0.0, scale)


def make_q3_quants(x: torch.Tensor, nmax: int = 4) -> torch.Tensor:
    """Symmetric quantization with llama.cpp's element-wise refinement (``make_q3_quants``).

    Up to 5 passes over the elements of each row; an element's level is changed when that
    raises sum(w x l)^2 / sum(w l^2) (w = x^2). x: (G, n) -> scale (G,).
    The passes run for every row: a row without change in a pass is at a fixed point, so the
    extra passes leave it as the C code's early exit does.
    """
    mx = signed_absmax(x)
    zero = mx.abs() < GROUP_MAX_EPS
    iscale = -nmax / torch.where(zero, 1.0, mx)
    xt = x.t().contiguous()  # (n, G): one contiguous row per element position
    Lt = (iscale[None, :] * xt).round_().clamp_(-nmax, nmax - 1)
    wt = xt * xt
    wxt = wt * xt
    sumlx = (wxt * Lt).sum(0)
    suml2 = (wt * Lt * Lt).sum(0)
    for _ in range(5):
        for i in range(xt.shape[0]):
            li, wi, wxi, xi = Lt[i], wt[i], wxt[i], xt[i]
            slx = sumlx - wxi * li
            sl2 = suml2 - wi * li * li
            cand = slx > 0
            new_l = (xi * sl2 / torch.where(cand, slx, 1.0)).round_().clamp_(-nmax, nmax - 1)
            cand &= new_l != li
            slx = slx + wxi * new_l
            sl2 = sl2 + wi * new_l * new_l
            take = cand & (sl2 > 0) & (slx * slx * suml2 > sumlx * sumlx * sl2)
            Lt[i] = torch.where(take, new_l, li)
            sumlx = torch.where(take, slx, sumlx)
            suml2 = torch.where(take, sl2, suml2)
    return torch.where(zero, 0.0, _div_or(sumlx, suml2))


def _requant(x: torch.Tensor, d: torch.Tensor, dm: torch.Tensor | None, lo: int, hi: int
             ) -> torch.Tensor:
    """Re-round x (G, n) against the stored sub-block scale d (G,) (and min dm): the final
    pass of ``quantize_row_q*_K_ref``; levels offset to start at 0. Where d is 0 the levels
    do not affect the dequantized value; they are set to the zero point."""
    num = x + dm[:, None] if dm is not None else x
    q = (num / torch.where(d == 0, 1.0, d)[:, None]).round_().clamp_(lo, hi)
    q = torch.where((d == 0)[:, None], 0.0, q)
    return q - lo if lo < 0 else q


def _pack_2bit(L: torch.Tensor) -> torch.Tensor:
    """(nb, 256) values 0..3 -> (nb, 64): byte 32*h + l holds L[128h + l + 32k] at bits 2k."""
    q = L.to(torch.uint8).reshape(-1, 2, 4, 32)
    out = q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)
    return out.reshape(-1, 64)


def _pack_scales_k4(ls: torch.Tensor, lm: torch.Tensor) -> torch.Tensor:
    """Eight 6-bit scales and mins (nb, 8) -> ggml's 12-byte ``get_scale_min_k4`` packing."""
    ls = ls.to(torch.uint8)
    lm = lm.to(torch.uint8)
    lo = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    mid = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    hi = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)
    return torch.cat([lo, mid, hi], dim=1)


def _unpack_scales_k4(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    p = packed.to(torch.int64)
    sc = torch.cat([p[:, 0:4] & 63, (p[:, 8:12] & 0xF) | ((p[:, 0:4] >> 6) << 4)], dim=1)
    m = torch.cat([p[:, 4:8] & 63, (p[:, 8:12] >> 4) | ((p[:, 4:8] >> 6) << 4)], dim=1)
    return sc.to(torch.float32), m.to(torch.float32)


def _qkx_superblock(x: torch.Tensor, sub: int, nmax: int, scale_bits_max: int, weights,
                    rmin: float, rdelta: float, nstep: int, use_mad: bool):
    """Shared part of Q2_K/Q4_K/Q5_K: per-sub-block scale/min search, then the two super-block
    fp16 factors d, dmin. Returns (sub-blocks (G, sub), ls, lm, d, dmin) with ls, lm (nb, k)."""
    nb = x.shape[0]
    xs = x.reshape(-1, sub)
    scale, the_min = make_qkx2_quants(xs, weights(xs), nmax, rmin, rdelta, nstep, use_mad)
    scale = scale.reshape(nb, -1)
    the_min = the_min.reshape(nb, -1)
    max_scale = scale.amax(-1).clamp(min=0.0)
    max_min = the_min.amax(-1).clamp(min=0.0)
    inv_s = _div_or(torch.full_like(max_scale, float(scale_bits_max)), max_scale)
    inv_m = _div_or(torch.full_like(max_min, float(scale_bits_max)), max_min)
    ls = (inv_s[:, None] * scale).round().clamp(0, scale_bits_max)
    lm = (inv_m[:, None] * the_min).round().clamp(0, scale_bits_max)
    d = max_scale / scale_bits_max
    dmin = max_min / scale_bits_max
    return xs, ls, lm, d, dmin


def quantize_q4_k(x: torch.Tensor) -> np.ndarray:
    """Q4_K: 8 sub-blocks of 32, 4-bit levels, 6-bit scales and mins. 144 bytes per block."""
    return _q45_k(x, nmax=15, rmin=-1.0, nstep=20)


def quantize_q5_k(x: torch.Tensor) -> np.ndarray:
    """Q5_K: 8 sub-blocks of 32, 5-bit levels, 6-bit scales and mins. 176 bytes per block."""
    return _q45_k(x, nmax=31, rmin=-0.5, nstep=15)


def _q45_k(x: torch.Tensor, nmax: int, rmin: float, nstep: int) -> np.ndarray:
    def weights(xs):  # av_x + |x|: llama.cpp's weighting for the reference Q4_K/Q5_K
        return (xs * xs).mean(-1, keepdim=True).sqrt() + xs.abs()

    nb = x.shape[0]
    xs, ls, lm, d, dmin = _qkx_superblock(x, 32, nmax, 63, weights, rmin, 0.1, nstep, False)
    scales = _pack_scales_k4(ls, lm)
    sc, m = _unpack_scales_k4(scales)
    dj = (fp16_round(d)[:, None] * sc).reshape(-1)
    dmj = (fp16_round(dmin)[:, None] * m).reshape(-1)
    L = _requant(xs, dj, dmj, 0, nmax).to(torch.uint8).reshape(nb, 4, 2, 32)
    low = (L[:, :, 0] & 0xF) | ((L[:, :, 1] & 0xF) << 4)  # (nb, 4, 32)
    parts = [fp16_bytes(d), fp16_bytes(dmin), scales]
    if nmax == 31:
        hb = (L >> 4) & 1  # bit 2c of qh[l] for L[64c + l], bit 2c+1 for L[64c + 32 + l]
        shifts = torch.arange(8, dtype=torch.uint8).reshape(1, 4, 2, 1)
        qh = (hb << shifts).sum((1, 2), dtype=torch.int64).to(torch.uint8)
        parts.append(qh)
    parts.append(low.reshape(nb, 128))
    return torch.cat(parts, dim=1).numpy()


def quantize_q2_k(x: torch.Tensor) -> np.ndarray:
    """Q2_K: 16 sub-blocks of 16, 2-bit levels, 4-bit scales and mins. 84 bytes per block."""
    nb = x.shape[0]
    xs, ls, lm, d, dmin = _qkx_superblock(x, 16, 3, 15, torch.abs, -0.5, 0.1, 15, True)
    dj = (fp16_round(d)[:, None] * ls).reshape(-1)
    dmj = (fp16_round(dmin)[:, None] * lm).reshape(-1)
    L = _requant(xs, dj, dmj, 0, 3).reshape(nb, 256)
    scales = (ls.to(torch.uint8) & 0xF) | (lm.to(torch.uint8) << 4)
    return torch.cat([scales, _pack_2bit(L), fp16_bytes(d), fp16_bytes(dmin)], dim=1).numpy()


def quantize_q3_k(x: torch.Tensor) -> np.ndarray:
    """Q3_K: 16 sub-blocks of 16, 3-bit levels (2 bits + high-bit mask), 6-bit signed scales.

    110 bytes per block: hmask[32], qs[64], scales[12], d (fp16)."""
    nb = x.shape[0]
    xs = x.reshape(-1, 16)
    scale = make_q3_quants(xs, 4)
    scale = scale.reshape(nb, 16)
    max_scale = signed_absmax(scale)
    has = max_scale != 0
    iscale = _div_or(torch.full_like(max_scale, -32.0), max_scale)
    lsc = (iscale[:, None] * scale).round().clamp(-32, 31) + 32
    lsc = torch.where(has[:, None], lsc, 0.0).to(torch.uint8)  # (nb, 16) 6-bit, offset 32
    d = torch.where(has, _div_or(torch.ones_like(iscale), iscale), 0.0)
    dj = (fp16_round(d)[:, None] * (lsc.to(torch.float32) - 32)).reshape(-1)
    L = _requant(xs, dj, None, -4, 3).to(torch.uint8).reshape(nb, 256)
    # high bit of element j goes to hmask[j % 32], bit j // 32
    high = (L >> 2).reshape(nb, 8, 32)
    hmask = (high << torch.arange(8, dtype=torch.uint8).reshape(1, 8, 1)).sum(
        1, dtype=torch.int64).to(torch.uint8)
    qs = _pack_2bit(L & 3)
    packed = torch.cat([(lsc[:, :8] & 0xF) | ((lsc[:, 8:] & 0xF) << 4),
                        ((lsc >> 4).reshape(nb, 4, 4) << torch.tensor([0, 2, 4, 6],
                         dtype=torch.uint8).reshape(1, 4, 1)).sum(1, dtype=torch.int64)
                        .to(torch.uint8)], dim=1)
    return torch.cat([hmask, qs, packed, fp16_bytes(d)], dim=1).numpy()


def quantize_q6_k(x: torch.Tensor) -> np.ndarray:
    """Q6_K: 16 sub-blocks of 16, 6-bit levels, int8 scales. 210 bytes per block:
    ql[128], qh[64], scales[16], d (fp16)."""
    nb = x.shape[0]
    xs = x.reshape(-1, 16)
    scale = make_qx_quants_rmse1(xs, 32)
    scale = scale.reshape(nb, 16)
    max_scale = signed_absmax(scale)
    zero = max_scale.abs() < GROUP_MAX_EPS
    iscale = -128.0 / torch.where(zero, 1.0, max_scale)
    d = torch.where(zero, 0.0, 1.0 / iscale)
    sc = (iscale[:, None] * scale).round().clamp(-128, 127)
    sc = torch.where(zero[:, None], 0.0, sc)
    dj = (fp16_round(d)[:, None] * sc).reshape(-1)
    L = _requant(xs, dj, None, -32, 31)
    L = torch.where(zero.repeat_interleave(16)[:, None], 0.0, L).to(torch.uint8)
    q = L.reshape(nb, 2, 4, 32)  # [half, quarter, l] -> L[128 h + 32 k + l]
    ql = torch.cat([(q[:, :, 0] & 0xF) | ((q[:, :, 2] & 0xF) << 4),
                    (q[:, :, 1] & 0xF) | ((q[:, :, 3] & 0xF) << 4)], dim=2)  # (nb, 2, 64)
    qh = ((q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4)
          | ((q[:, :, 3] >> 4) << 6))  # (nb, 2, 32)
    scales = sc.to(torch.int8).view(torch.uint8)
    return torch.cat([ql.reshape(nb, 128), qh.reshape(nb, 64), scales, fp16_bytes(d)],
                     dim=1).numpy()
