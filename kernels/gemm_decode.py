"""Chunk decoding for the prefill GEMM (:mod:`.gemm`): 32 consecutive weights of each row of
a weight tile, from 32-bit words, to float16 in a few instructions per weight.

A chunk decoder (:func:`chunk`) returns, for the (BN, 1) block indices ``blk`` of the tile's
rows and a chunk of 32 weights starting at weight ``j0`` of their blocks:

- ``v``: int32 (BN, 8), byte ``e`` of word ``w`` the unsigned value ``u`` (0..255) of weight
  ``4 w + e`` of the chunk;
- ``sa, ma, sb, mb``: float32 (BN, 1) with ``weight = u * s - m``, (sa, ma) for the chunk's
  first 16 weights and (sb, mb) for the last 16 (the same for the types with one scale per
  32 weights or more). Offsets of signed values fold into ``m``: Q4_0 ``u = q + 8``,
  ``m = 8 d``; Q8_0 and the table types ``u = q + 128`` (``q ^ 0x80``), ``m = 128 d``.

:func:`to_half` then builds each weight's float16 from its byte with one byte permute per
two weights (``0x64``, ``u``: the float16 ``1024 + u``, exact), subtracts 1024 (exact) and
applies ``u * s - m`` as one float16 FMA per two weights (``HFMA2``): one rounding, from the
scales rounded to float16. The bit layouts are ggml's (``ggml-common.h``), as
``localllm/gguf/quants.py`` and :mod:`.decode` read them; the types stored as planes
(``localllm.kernels.PLANES``) are read from their planes.
"""

from __future__ import annotations

import triton.language as tl

from ._jit import device_fn
from .decode import (
    IQ4NL_W0,
    IQ4NL_W1,
    IQ4NL_W2,
    IQ4NL_W3,
    MXFP4_W0,
    MXFP4_W1,
    MXFP4_W2,
    MXFP4_W3,
    _e8m0_half,
    _h2f,
    _half_at,
    _spread4,
    kq_scale_min,
    plane,
    prmt,
)

# 0x80808080 as int32: the sign bit of each byte (the xor adds 128 to each int8).
BYTE_SIGNS: tl.constexpr = tl.constexpr(-2139062144)

# (layout, type code) pairs with a chunk decoder: the planes of the types whose blocks are not
# 4-byte aligned, the blocks of those that are.
CHUNK_PLANES = (2, 6, 8, 10, 11, 14, 20, 23, 39)  # Q4_0 Q5_0 Q8_0 Q2_K Q3_K Q6_K IQ4 MXFP4
CHUNK_BLOCKS = (3, 7, 12, 13)  # Q4_1 Q5_1 Q4_K Q5_K: words per block 5, 6, 36, 44


# Fewest weights a K step of the chunk path takes: Q4_K and Q5_K a sub-block pair (its two
# chunks' nibbles shift by constants); at most 128 (:func:`chunks_tile`).
MIN_STEP = {12: 64, 13: 64}
MAX_STEP = 128


def has_chunks(qtype, layout: str) -> bool:
    """Whether :func:`chunk` decodes ``qtype`` stored in ``layout``."""
    return int(qtype) in (CHUNK_PLANES if layout == "planes" else CHUNK_BLOCKS)


@device_fn
def table_word(q, W0, W1, W2, W3, ASM: tl.constexpr):
    """The 16-entry int8 table ``W0..W3`` (four int8 per int32, little-endian) at the four
    byte values (0..15) of int32 ``q``, as four int8 in an int32: the four nibbles packed
    into a byte-permute selector, then two permutes of table halves and a blend (as
    :func:`.decode.iq4nl_word`, any table)."""
    zero = tl.zeros_like(q)
    y = q | (q >> 4)
    s16 = prmt(y, y, zero + 0x0020, ASM)  # nibble i: byte i's value
    lo = prmt(zero + W0, zero + W1, s16 & 0x7777, ASM)
    hi = prmt(zero + W2, zero + W3, s16 & 0x7777, ASM)
    return prmt(lo, hi, ((s16 >> 1) & 0x4444) | 0x3210, ASM)


@device_fn
def _u8s(wp, off):
    """The byte at byte offset ``off`` (int64 tensor) of int32 pointer ``wp``, as int32."""
    return tl.load(wp.to(tl.pointer_type(tl.uint8)) + off).to(tl.int32) & 255


@device_fn
def _words4(wp, off):
    """The four int32 words at word offset ``off`` (int64 (BN, 1), 16-byte aligned) of
    ``wp``: one 128-bit load, split into four (BN, 1) tensors."""
    t4 = tl.load(wp + off + tl.arange(0, 4)[None, :])
    a, b = tl.split(tl.reshape(t4, (t4.shape[0], 2, 2)))  # words 0, 2 and 1, 3
    w0, w2 = tl.split(a)
    w1, w3 = tl.split(b)
    return w0[:, None], w1[:, None], w2[:, None], w3[:, None]


@device_fn
def step_shared(wp, nblk, blk0, jstep, QTYPE: tl.constexpr):
    """What the chunks of a K step share: the words of the step's block that hold scales (and
    Q5_K's fifth bits), loaded once a step. ``blk0``: (BN, 1) the step's first block;
    ``jstep``: the step's first weight in it."""
    if QTYPE == 12 or QTYPE == 13:  # Q4_K / Q5_K: d|dmin and the packed scales
        h0, b1, b2, b3 = _words4(wp, blk0 * (36 if QTYPE == 12 else 44))
    elif QTYPE == 14:  # Q6_K: the 16 int8 scales as 4 words, d
        h0, b1, b2, b3 = _words4(wp, plane(nblk, 2, QTYPE) // 4 + blk0 * 4)
    elif QTYPE == 10:  # Q2_K: 16 scale bytes (4 words)
        h0, b1, b2, b3 = _words4(wp, plane(nblk, 1, QTYPE) // 4 + blk0 * 4)
    elif QTYPE == 23:  # IQ4_XS: d|scales_h, scales_l
        hd = plane(nblk, 1, QTYPE) // 4 + blk0 * 2
        h0 = tl.load(wp + hd)
        b1 = tl.load(wp + hd + 1)
        b2 = b1
        b3 = b1
    else:  # nothing shared (blocks of 32 weights: a chunk is a block) or read per chunk
        h0 = tl.zeros_like(blk0).to(tl.int32)
        b1 = h0
        b2 = h0
        b3 = h0
    return h0, b1, b2, b3


@device_fn
def _half_chunk(jstep, C: tl.constexpr, BK: tl.constexpr):
    """(half, chunk of the half) of chunk ``C`` of a K step of ``BK`` weights starting at
    weight ``jstep`` of a 256-weight block: the chunk a constant where steps are halves."""
    if BK >= 128:
        h = jstep // 128 + C // 4
        c = C % 4
    else:
        h = jstep // 128
        c = (jstep % 128) // 32 + C
    return h, c


@device_fn
def chunk(wp, nblk, blk0, jstep, shared, C: tl.constexpr, BK: tl.constexpr,
          QTYPE: tl.constexpr, ASM: tl.constexpr):  # fmt: skip
    """Chunk ``C`` (weights ``jstep + 32 C ..``) of a K step of ``BK`` weights (a multiple of
    32, and of 64 for Q4_K and Q5_K: :data:`MIN_STEP`) starting at weight ``jstep`` of
    blocks ``blk0`` (int64 (BN, 1): block indices in the matrix of ``nblk`` blocks,
    row-major; blocks of 32 weights: chunk C is block ``blk0 + C``) of a ``QTYPE`` matrix at
    int32 pointer ``wp``, with :func:`step_shared`'s ``shared``: (v, sa, ma, sb, mb), see the
    module docstring."""
    w = tl.arange(0, 8)[None, :]  # word of the chunk: weights 4w .. 4w + 3
    h0, b1, b2, b3 = shared
    if QTYPE == 12 or QTYPE == 13:  # Q4_K (36 words), Q5_K (44): sub-block 2 pair + C % 2
        pair = jstep // 64 + C // 2
        wb = blk0 * (36 if QTYPE == 12 else 44)
        q = tl.load(wp + wb + (4 if QTYPE == 12 else 12) + pair * 8 + w)
        v = (q >> ((C % 2) * 4)) & 0x0F0F0F0F
        if QTYPE == 13:  # fifth bit of weight b of sub-block s: bit s of qh byte b
            v = v | (((tl.load(wp + wb + 4 + w) >> (pair * 2 + C % 2)) & 0x01010101) << 4)
        sa, ma = kq_scale_min(h0, b1, b2, b3, pair * 2 + C % 2)
        sb = sa
        mb = ma
    elif QTYPE == 3 or QTYPE == 7:  # Q4_1 (5 words: d|m, qs), Q5_1 (6: d|m, qh, qs)
        wb = (blk0 + C) * (5 if QTYPE == 3 else 6)
        q = tl.load(wp + wb + (1 if QTYPE == 3 else 2) + w % 4)  # weights 16+: high nibbles
        v = (q >> ((w // 4) * 4)) & 0x0F0F0F0F
        if QTYPE == 7:
            v = v | (_spread4(tl.load(wp + wb + 1) >> (w * 4)) << 4)
        hd = tl.load(wp + wb)
        sa = _h2f(hd)
        ma = -_h2f(hd >> 16)
        sb = sa
        mb = ma
    elif QTYPE == 2 or QTYPE == 6:  # Q4_0 (qs | d), Q5_0 (qs | qh | d) planes: u = q + 8/16
        blk = blk0 + C
        q = tl.load(wp + blk * 4 + w % 4)
        v = (q >> ((w // 4) * 4)) & 0x0F0F0F0F
        if QTYPE == 6:
            qh = tl.load(wp + plane(nblk, 1, QTYPE) // 4 + blk)
            v = v | (_spread4(qh >> (w * 4)) << 4)
            sa = _half_at(wp, plane(nblk, 2, QTYPE) // 2 + blk)
            ma = sa * 16.0
        else:
            sa = _half_at(wp, plane(nblk, 1, QTYPE) // 2 + blk)
            ma = sa * 8.0
        sb = sa
        mb = ma
    elif QTYPE == 8:  # Q8_0 planes: qs[0:16] | qs[16:32] | d; u = q + 128
        blk = blk0 + C
        q = tl.load(wp + (w // 4) * (plane(nblk, 1, QTYPE) // 4) + blk * 4 + w % 4)
        v = q ^ BYTE_SIGNS
        sa = _half_at(wp, plane(nblk, 2, QTYPE) // 2 + blk)
        ma = sa * 128.0
        sb = sa
        mb = ma
    elif QTYPE == 20 or QTYPE == 39:  # IQ4_NL, MXFP4 planes: qs | d (e); table values
        blk = blk0 + C
        nib = (tl.load(wp + blk * 4 + w % 4) >> ((w // 4) * 4)) & 0x0F0F0F0F
        if QTYPE == 39:
            v = table_word(nib, MXFP4_W0, MXFP4_W1, MXFP4_W2, MXFP4_W3, ASM) ^ BYTE_SIGNS
            sa = _e8m0_half(_u8s(wp, plane(nblk, 1, QTYPE) + blk))
        else:
            v = table_word(nib, IQ4NL_W0, IQ4NL_W1, IQ4NL_W2, IQ4NL_W3, ASM) ^ BYTE_SIGNS
            sa = _half_at(wp, plane(nblk, 1, QTYPE) // 2 + blk)
        ma = sa * 128.0
        sb = sa
        mb = ma
    elif QTYPE == 23:  # IQ4_XS planes: qs[128] | d, scales_h, scales_l; sub-block ib
        ib = jstep // 32 + C
        nib = (tl.load(wp + blk0 * 32 + ib * 4 + w % 4) >> ((w // 4) * 4)) & 0x0F0F0F0F
        v = table_word(nib, IQ4NL_W0, IQ4NL_W1, IQ4NL_W2, IQ4NL_W3, ASM) ^ BYTE_SIGNS
        ls = ((b1 >> (ib * 4)) & 15) | (((h0 >> (16 + ib * 2)) & 3) << 4)
        sa = _h2f(h0) * (ls - 32).to(tl.float32)
        ma = sa * 128.0
        sb = sa
        mb = ma
    elif QTYPE == 14:  # Q6_K planes: ql[128] | qh[64] | scales[16] int8 | d; u = q + 32
        h, cc = _half_chunk(jstep, C, BK)  # chunk cc of half h: weights 128 h + 32 cc ..
        ql = tl.load(wp + blk0 * 32 + h * 16 + (cc % 2) * 8 + w)
        qh = tl.load(wp + plane(nblk, 1, QTYPE) // 4 + blk0 * 16 + h * 8 + w)
        v = ((ql >> ((cc // 2) * 4)) & 0x0F0F0F0F) | (((qh >> (cc * 2)) & 0x03030303) << 4)
        d = _half_at(wp, plane(nblk, 3, QTYPE) // 2 + blk0)
        g = h * 8 + cc * 2  # the chunk's two 16-weight groups' scales: bytes g, g + 1
        sw = tl.where(g < 8, tl.where(g < 4, h0, b1), tl.where(g < 12, b2, b3))
        sa = d * ((sw << (24 - (g % 4) * 8)) >> 24).to(tl.float32)
        sb = d * ((sw << (16 - (g % 4) * 8)) >> 24).to(tl.float32)
        ma = sa * 32.0
        mb = sb * 32.0
    elif QTYPE == 10 or QTYPE == 11:  # Q2_K, Q3_K planes: 2-bit fields of qs at bits 2i
        h, i = _half_chunk(jstep, C, BK)  # weights 128 h + 32 i + l: qs byte 32 h + l, bits 2i
        q = tl.load(wp + blk0 * 16 + h * 8 + w)
        v = (q >> (i * 2)) & 0x03030303
        g = h * 8 + i * 2  # the chunk's 16-weight groups: g, g + 1
        if QTYPE == 10:  # scales[16] (scale | min << 4) | d, dmin
            dw = tl.load(wp + plane(nblk, 2, QTYPE) // 4 + blk0)
            sw = tl.where(g < 8, tl.where(g < 4, h0, b1), tl.where(g < 12, b2, b3))
            sc = (sw >> ((g % 4) * 8)) & 255
            sc2 = (sw >> ((g % 4) * 8 + 8)) & 255
            sa = _h2f(dw) * (sc & 15).to(tl.float32)
            ma = _h2f(dw >> 16) * (sc >> 4).to(tl.float32)
            sb = _h2f(dw) * (sc2 & 15).to(tl.float32)
            mb = _h2f(dw >> 16) * (sc2 >> 4).to(tl.float32)
        else:  # Q3_K: third bit at bit 4 h + i of hmask byte l; 6-bit scales - 32; u = q + 4
            hm = tl.load(wp + plane(nblk, 1, QTYPE) // 4 + blk0 * 8 + w)
            v = v | (((hm >> (h * 4 + i)) & 0x01010101) << 2)
            d = _half_at(wp, plane(nblk, 3, QTYPE) // 2 + blk0)
            sp = plane(nblk, 2, QTYPE) + blk0 * 12
            lo_a = (_u8s(wp, sp + g % 8) >> ((g // 8) * 4)) & 15
            hi_a = (_u8s(wp, sp + 8 + g % 4) >> ((g // 4) * 2)) & 3
            lo_b = (_u8s(wp, sp + (g + 1) % 8) >> (((g + 1) // 8) * 4)) & 15
            hi_b = (_u8s(wp, sp + 8 + (g + 1) % 4) >> (((g + 1) // 4) * 2)) & 3
            sa = d * ((lo_a | (hi_a << 4)) - 32).to(tl.float32)
            sb = d * ((lo_b | (hi_b << 4)) - 32).to(tl.float32)
            ma = sa * 4.0
            mb = sb * 4.0
    else:
        tl.static_assert(False, "gemm_decode.chunk: no chunk decoder for this ggml type")
        v = w
        sa = tl.zeros_like(blk0).to(tl.float32)
        ma = sa
        sb = sa
        mb = sa
    return v, sa, ma, sb, mb


@device_fn
def _cat(a, b, BN: tl.constexpr, W: tl.constexpr):
    """(BN, W) tiles ``a``, ``b`` side by side: (BN, 2 W)."""
    return tl.reshape(tl.permute(tl.join(a, b), (0, 2, 1)), (BN, 2 * W))


@device_fn
def _weights(wp, nblk, blk0, jstep, shared, C: tl.constexpr, BK: tl.constexpr,
             QTYPE: tl.constexpr, BN: tl.constexpr, ASM: tl.constexpr,
             BF16: tl.constexpr):  # fmt: skip
    v, sa, ma, sb, mb = chunk(wp, nblk, blk0, jstep, shared, C, BK, QTYPE, ASM)
    if BF16:
        t = to_float(v, sa, ma, sb, mb, BN)
    else:
        t = to_half(v, sa, ma, sb, mb, BN, ASM)
    return t


@device_fn
def chunks_tile(wp, nblk, blk0, jstep, shared, C0: tl.constexpr, NC: tl.constexpr,
                BK: tl.constexpr, QTYPE: tl.constexpr, BN: tl.constexpr, ASM: tl.constexpr,
                BF16: tl.constexpr):  # fmt: skip
    """The (BN, 32 NC) weights of chunks ``C0 .. C0 + NC - 1`` (NC = 1 or 2) of a K step of
    ``BK`` weights starting at weight ``jstep`` of blocks ``blk0`` (see :func:`chunk`; ``shared``:
    :func:`step_shared`'s): float16, or float32 for the bfloat16 GEMM (``BF16``)."""
    t = _weights(wp, nblk, blk0, jstep, shared, C0, BK, QTYPE, BN, ASM, BF16)
    if NC == 2:
        t = _cat(t, _weights(wp, nblk, blk0, jstep, shared, C0 + 1, BK, QTYPE, BN, ASM, BF16),
                 BN, 32)  # fmt: skip
    return t


@device_fn
def to_half(v, sa, ma, sb, mb, BN: tl.constexpr, ASM: tl.constexpr):
    """The chunk's weights ``u * s - m`` as float16 (BN, 32), from :func:`chunk`'s bytes."""
    zero = tl.zeros_like(v)
    magic = zero + 0x64646464
    p0 = prmt(v, magic, zero + 0x4140, ASM)  # float16 pair 1024 + (byte 0, byte 1)
    p1 = prmt(v, magic, zero + 0x4342, ASM)  # 1024 + (byte 2, byte 3)
    h = tl.join(tl.join(p0.to(tl.int16), p1.to(tl.int16)),
                tl.join((p0 >> 16).to(tl.int16), (p1 >> 16).to(tl.int16)))  # fmt: skip
    u = tl.reshape(h, (BN, 32)).to(tl.float16, bitcast=True) - 1024.0
    first = tl.arange(0, 32)[None, :] < 16
    s = tl.where(first, sa.to(tl.float16), sb.to(tl.float16))
    m = tl.where(first, ma.to(tl.float16), mb.to(tl.float16))
    return u * s - m


@device_fn
def to_float(v, sa, ma, sb, mb, BN: tl.constexpr):
    """The chunk's weights ``u * s - m`` as float32 (BN, 32) (rounded once from exact
    products: the bfloat16 GEMM rounds them to bfloat16 after)."""
    e = tl.arange(0, 4)[None, None, :] * 8
    u = tl.reshape((v[:, :, None] >> e) & 255, (BN, 32)).to(tl.float32)
    first = tl.arange(0, 32)[None, :] < 16
    return u * tl.where(first, sa, sb) - tl.where(first, ma, mb)
