"""Block quantizers of the non-linear 4-bit types IQ4_NL and IQ4_XS.

They follow llama.cpp's ``quantize_iq4_nl`` / ``quantize_iq4_xs`` (``ggml-quants.c``,
``quantize_row_iq4_nl_impl`` without an importance matrix, which is what ``llama-quantize``
does without ``--imatrix``): each block of 32 weights gets the scale that maximises the
weighted fit (weights ``x²``) over 16 candidate scales, its values the nearest of the 16
``kvalues_iq4nl`` levels. IQ4_XS then stores the 8 block scales of a 256-weight super-block
as 6-bit multiples of one fp16 scale and re-picks the levels for the rounded scales.

The float32 operations are those of the C code in the same order (the sums over a block are
accumulated element by element), so the bytes are llama.cpp's. All functions take ``x``:
float32 torch tensor (n_blocks, block_size) and return uint8 numpy (n_blocks, type_size),
byte-compatible with ``gguf.quants.dequantize``.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from ..gguf.quants import IQ4NL_VALUES
from .legacy import fp16_bytes

GROUP_MAX_EPS = 1e-15  # blocks whose largest magnitude is below this are all zero
NTRY = 7  # candidate scales (itry - 127) / max for itry in -NTRY..NTRY

_VALUES = torch.tensor(IQ4NL_VALUES, dtype=torch.float32)
# best_index_int8: level i is taken once 2x reaches the integer val[i-1] + val[i]. As the
# midpoints are integers, the level is a function of floor(2x): a table over the integers
# from just below the first midpoint to the last one.
_MIDS = [a + b for a, b in itertools.pairwise(IQ4NL_VALUES)]
_LO, _HI = _MIDS[0] - 1, _MIDS[-1]
_LEVEL = torch.tensor([sum(m <= k for m in _MIDS) for k in range(_LO, _HI + 1)])
_LEVEL_VALUE = _VALUES[_LEVEL]


def _lookup(table: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    """``table`` at row floor(x2) - _LO (clamped) for each doubled value ``x2`` (overwritten).
    Floor comes first: x2 - _LO would round a value just below a midpoint up onto it. NaN
    (from NaN weights) reads row 0 rather than out of the table."""
    k = x2.nan_to_num_(nan=_LO).clamp_(_LO, _HI).floor_().sub_(_LO).to(torch.int32)
    return torch.index_select(table, 0, k.reshape(-1)).reshape(k.shape)  # faster than table[k]


def best_index(x: torch.Tensor) -> torch.Tensor:
    """Index of the nearest IQ4_NL level to each value (ties to the upper level): int64."""
    return _lookup(_LEVEL, x + x)


def _fit(xt: torch.Tensor, w: torch.Tensor, inv: torch.Tensor
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """For each candidate inverse scale, the levels of ``inv * x`` and the sums of the C loop,
    ``sumqx += w*q*x`` and ``sumq2 += w*q*q``, accumulated in float32 position by position.
    xt, w: (32, n); inv: (c, n) -> sumqx, sumq2: (c, n)."""
    # 2 * (inv * x), exactly (a power-of-two factor), in one product
    q = _lookup(_LEVEL_VALUE, (inv + inv).unsqueeze(1) * xt)  # (c, 32, n)
    wq = w * q
    a, b = wq * xt, wq * q
    sqx, sq2 = torch.zeros_like(inv), torch.zeros_like(inv)
    for j in range(xt.shape[0]):
        sqx += a[:, j]
        sq2 += b[:, j]
    return sqx, sq2


def block_scales(x: torch.Tensor) -> torch.Tensor:
    """The fitted scale of each block of 32: x float32 (n, 32) -> (n,) float32 (0 for blocks
    below ``GROUP_MAX_EPS``)."""
    xt = x.t().contiguous()  # (32, n): one row per position, so the sums run per position
    w = xt * xt
    ax = xt.abs()
    first = ax.argmax(dim=0, keepdim=True)  # the first largest magnitude, with its sign
    amax = ax.gather(0, first)[0]
    zero = amax < GROUP_MAX_EPS
    mx = torch.where(zero, 1.0, xt.gather(0, first)[0])
    # Candidates: 1/d for d = max/127, then (itry - 127)/max for itry = -NTRY..NTRY.
    tries = torch.arange(-NTRY, NTRY + 1, dtype=torch.float32) + IQ4NL_VALUES[0]
    inv = torch.cat([(1 / (-mx / IQ4NL_VALUES[0])).unsqueeze(0),
                     tries.unsqueeze(1) / mx.unsqueeze(0)])
    sqx, sq2 = _fit(xt, w, inv)
    # The C loop keeps candidate c when sumqx^2 > best * sumq2 with best = d * sumqx of the
    # one kept so far (the first always, with d = 0 when sumq2 = 0). Everything but the
    # running comparison is computed for all candidates at once.
    ok = sq2 > 0
    d_all = torch.where(ok, sqx / sq2, 0.0)
    best_all = d_all * sqx
    sqx2 = sqx * sqx
    pick = torch.zeros(x.shape[0], dtype=torch.int64)
    best = best_all[0]
    for c in range(1, inv.shape[0]):
        better = ok[c] & (sqx2[c] > best * sq2[c])
        pick = torch.where(better, c, pick)
        best = torch.where(better, best_all[c], best)
    d = d_all.gather(0, pick.unsqueeze(0))[0]
    return torch.where(zero, 0.0, d)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    """``d ? 1/d : 0`` elementwise."""
    return torch.where(d != 0, 1 / torch.where(d != 0, d, 1.0), 0.0)


def _pack(idx: torch.Tensor) -> torch.Tensor:
    """Levels (n, k*32) -> (n, k*16) bytes: in each 32, j low nibble, j + 16 high nibble."""
    n = idx.shape[0]
    q = idx.to(torch.uint8).reshape(n, -1, 2, 16)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, -1)


def quantize_iq4_nl(x: torch.Tensor) -> np.ndarray:
    """IQ4_NL blocks (18 bytes: fp16 d, 16 bytes of nibbles) of x float32 (n, 32)."""
    d = block_scales(x)
    idx = best_index(_inverse(d).unsqueeze(1) * x)
    return torch.cat([fp16_bytes(d), _pack(idx)], dim=1).numpy()


def quantize_iq4_xs(x: torch.Tensor) -> np.ndarray:
    """IQ4_XS blocks (136 bytes: fp16 d, uint16 scales_h, 4 bytes scales_l, 128 bytes of
    nibbles) of x float32 (n, 256)."""
    n = x.shape[0]
    scales = block_scales(x.reshape(n * 8, 32)).reshape(n, 8)
    first = scales.abs().argmax(dim=1, keepdim=True)
    max_scale = scales.gather(1, first)[:, 0]  # the scale of largest magnitude, signed
    d = -max_scale / 32
    ls = torch.round(_inverse(d).unsqueeze(1) * scales).clamp(-32, 31)  # nearest_int
    dl = d.unsqueeze(1) * ls
    idx = best_index(_inverse(dl).unsqueeze(2) * x.reshape(n, 8, 32)).reshape(n, 256)
    u = (ls + 32).to(torch.int64)  # 6-bit scales
    lo = (u[:, 0::2] & 0xF) | ((u[:, 1::2] & 0xF) << 4)
    hi = ((u >> 4) << torch.arange(0, 16, 2)).sum(dim=1, keepdim=True)
    hi_bytes = torch.cat([hi & 0xFF, hi >> 8], dim=1)
    return torch.cat([fp16_bytes(d), hi_bytes.to(torch.uint8), lo.to(torch.uint8), _pack(idx)],
                     dim=1).numpy()
