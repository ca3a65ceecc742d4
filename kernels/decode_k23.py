"""Word decoding of the 2- and 3-bit K-quants (Q2_K, Q3_K) from their planes, for the
integer-dot GEMV (``gemv._mmvq64_kernel``, llama.cpp's ``vec_dot_q2_K_q8_1`` /
``vec_dot_q3_K_q8_1`` in ``ggml-cuda/vecdotq.cuh``).

Both types keep their 2-bit fields as ggml's ``qs[64]``: byte ``32 h + l`` (h = 0, 1; l =
0..31) holds weights ``128 h + l + 32 i`` at bits ``2 i`` (i = 0..3). So 16 bytes of ``qs``
(``l`` = 16 p .. 16 p + 15, p = 0, 1) are one 16-byte load holding a *unit* of 64 weights:
four 16-weight groups ``s = 8 h + p + 2 i`` (one scale each), 32 weights apart along K.
Q3_K's third bit of those weights is bit ``4 h + i`` of ``hmask[16 p .. 16 p + 15]``: one
more 16-byte load. A unit's group i contributes, with the activations ``x ~ dx * qx`` (8 bits
per 32 values, ``gemv.quantize_q8``):

- Q2_K: ``dx * (d * (sc & 15) * sum(q qx) - dmin * (sc >> 4) * sum(qx))``;
- Q3_K: ``dx * d * (scale - 32) * (sum(u qx) - 4 sum(qx))`` with u = low | high << 2.

The integer products ``(sc & 15) * dot`` stay integers until the group's float multiply;
``d`` and ``dmin`` (one per block, so one per unit) multiply the unit's sum once. Layouts:
``localllm.kernels.PLANES`` (Q2_K: qs | scales[16] | d, dmin; Q3_K: qs | hmask | scales[12] |
d), block formats as ``localllm/gguf/quants.py`` (ggml's ``block_q2_K`` / ``block_q3_K``).
"""

from __future__ import annotations

import triton.language as tl
from gguf import GGMLQuantizationType as T

from ._jit import device_fn
from .decode import _h2f, plane

# Types the 64-weight-unit GEMV reads from planes: code -> OFF (the offset of the values it
# multiplies: Q3_K's u - 4; Q2_K's min is a term of its own).
MMVQ64_TYPES = {T.Q2_K: 0, T.Q3_K: 4}


@device_fn
def unit64_pointers(wp, nblk, u, t, par, QTYPE: tl.constexpr):
    """Pointers to the fields of unit ``u`` (int64 (R, G, 1), global: 4 units a block, blocks
    row-major) of a Q2_K / Q3_K planes matrix of ``nblk`` blocks at int32 pointer ``wp``,
    for :func:`unit64_head`: (qs words (R, G, 4), hmask words (Q3_K), scale words, d).
    ``t``: (1, 1, 4) word index; ``par``: (1, G, 1) ``u % 2`` (which 16 bytes of a half)."""
    blk = u // 4
    q_p = wp + u * 4 + t
    if QTYPE == 10:  # Q2_K: 16 scale bytes a block, a half's 8 in two words; d|dmin a word
        hm_p = q_p
        s_p = wp + plane(nblk, 1, QTYPE) // 4 + blk * 4 + ((u % 4) // 2) * 2
        d_p = wp + plane(nblk, 2, QTYPE) // 4 + blk
    else:  # Q3_K: 32 hmask bytes a block; 12 scale bytes (3 words); d a half
        hm_p = wp + plane(nblk, 1, QTYPE) // 4 + blk * 8 + par * 4 + t
        s_p = wp + plane(nblk, 2, QTYPE) // 4 + blk * 3
        d_p = wp.to(tl.pointer_type(tl.int16)) + plane(nblk, 3, QTYPE) // 2 + blk
    return q_p, hm_p, s_p, d_p


@device_fn
def unit64_head(heads, b, QTYPE: tl.constexpr):
    """The loads of a unit ``b`` blocks past the one :func:`unit64_pointers` gave ``heads``
    for.

    Returns:
        ``q`` int32 (R, G, 4): the unit's 16 bytes of ``qs``; ``hm`` (Q3_K: the 16 bytes of
        ``hmask`` with its third bits; Q2_K: ``q``); scale words ``s0, s1, s2`` (R, G, 1)
        (Q2_K: the two words of the unit's half of ``scales``, s2 unused; Q3_K: ``scales``'
        three words); ``d``, ``dmin`` float32 (R, G, 1) (Q3_K: dmin unused).
    """
    q_p, hm_p, s_p, d_p = heads
    q = tl.load(q_p + b * 16)
    if QTYPE == 10:
        s0 = tl.load(s_p + b * 4)
        s1 = tl.load(s_p + b * 4 + 1)
        s2 = s0
        dw = tl.load(d_p + b)
        d = _h2f(dw)
        dmin = _h2f(dw >> 16)
        hm = q
    else:
        hm = tl.load(hm_p + b * 8)
        s0 = tl.load(s_p + b * 3)
        s1 = tl.load(s_p + b * 3 + 1)
        s2 = tl.load(s_p + b * 3 + 2)
        d = _h2f(tl.load(d_p + b).to(tl.int32))
        dmin = d
    return q, hm, s0, s1, s2, d, dmin


@device_fn
def unit64_group(q, hm, s0, s1, s2, h, par, i: tl.constexpr, QTYPE: tl.constexpr):
    """Group ``i`` (0..3) of a unit: (words, a, b) with ``words`` int32 (R, G, 4) the 16
    weights' unsigned values as bytes and int32 (R, G, 1) ``a``, ``b``: Q2_K the scale and
    the min (4 bits each), Q3_K the signed 6-bit scale (``b`` unused). ``h``: (1, G, 1) the
    unit's half of the block; ``hm``: :func:`unit64_head`'s, shifted right by ``4 h``."""
    sh = par * 8 + (i % 2) * 16  # the group's scale byte within its word
    if i < 2:
        sw = s0
    else:
        sw = s1
    if QTYPE == 10:  # Q2_K: scales[8 h + p + 2 i]
        words = (q >> (2 * i)) & 0x03030303
        sc = (sw >> sh) & 255
        a = sc & 15
        b = sc >> 4
    else:  # Q3_K: 4 low bits of the scale in scales[0..7], 2 high bits in scales[8..11];
        # hm pre-shifted by 4 h (the caller), so the third bit's shift is a constant
        if i <= 2:
            hb = (hm << (2 - i)) & 0x04040404
        else:
            hb = (hm >> 1) & 0x04040404
        words = ((q >> (2 * i)) & 0x03030303) | hb
        lo4 = (sw >> (sh + h * 4)) & 15
        hi2 = (s2 >> (sh + h * 4 + 2 * (i // 2))) & 3
        a = (lo4 | (hi2 << 4)) - 32
        b = a
    return words, a, b
