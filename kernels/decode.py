"""Per-element decoding of ggml blocks inside Triton kernels.

:func:`decode` turns (pointer to a block, index of a weight in that block) into the weight's
float32 value, for tensors of any shape: the dequantize, GEMV and GEMM kernels all call it on
their tiles, so the bit layouts live in one place. The layouts and the float operation order
are those of the torch reference, ``localllm/gguf/quants.py`` (diagrams there), which
follows llama.cpp's ``dequantize_row_q*`` (``ggml/src/ggml-quants.c``); with fp contraction
disabled the result is bit-exact with it.

Type codes are ``gguf.GGMLQuantizationType``'s, bound below as constexpr globals (``F32``,
``Q4_K``, ...: the only globals a kernel may read), so that kernels test ``QTYPE == Q4_K``.
"""

from __future__ import annotations

import triton.language as tl
from gguf import GGMLQuantizationType as T

from ._jit import device_fn

# The ggml types decode() handles.
KERNEL_TYPES = (
    T.F32, T.F16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K,
    T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS, T.BF16, T.MXFP4,
)

# Their codes as constexpr globals, for the kernels' QTYPE tests.
F32: tl.constexpr = tl.constexpr(T.F32.value)
F16: tl.constexpr = tl.constexpr(T.F16.value)
BF16: tl.constexpr = tl.constexpr(T.BF16.value)
Q4_0: tl.constexpr = tl.constexpr(T.Q4_0.value)
Q4_1: tl.constexpr = tl.constexpr(T.Q4_1.value)
Q5_0: tl.constexpr = tl.constexpr(T.Q5_0.value)
Q5_1: tl.constexpr = tl.constexpr(T.Q5_1.value)
Q8_0: tl.constexpr = tl.constexpr(T.Q8_0.value)
Q2_K: tl.constexpr = tl.constexpr(T.Q2_K.value)
Q3_K: tl.constexpr = tl.constexpr(T.Q3_K.value)
Q4_K: tl.constexpr = tl.constexpr(T.Q4_K.value)
Q5_K: tl.constexpr = tl.constexpr(T.Q5_K.value)
Q6_K: tl.constexpr = tl.constexpr(T.Q6_K.value)
IQ4_NL: tl.constexpr = tl.constexpr(T.IQ4_NL.value)
IQ4_XS: tl.constexpr = tl.constexpr(T.IQ4_XS.value)
MXFP4: tl.constexpr = tl.constexpr(T.MXFP4.value)


@device_fn
def _u8(p, mask):
    """Byte at ``p`` as int32 (0 where masked)."""
    return tl.load(p, mask=mask, other=0).to(tl.int32)


@device_fn
def _i8(p, mask):
    """Signed byte at ``p`` as int32."""
    v = tl.load(p, mask=mask, other=0).to(tl.int32)
    return v - ((v >> 7) << 8)


@device_fn
def _f16(p, mask):
    """Little-endian fp16 at ``p`` (2 bytes, any alignment) widened to float32."""
    lo = tl.load(p, mask=mask, other=0).to(tl.int32)
    hi = tl.load(p + 1, mask=mask, other=0).to(tl.int32)
    return (lo | (hi << 8)).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@device_fn
def _scale_min_k4(b, s, mask):
    """Scale and min of sub-block ``s`` (0..7) of a Q4_K/Q5_K block at ``b``, as float32:
    ``d * scale`` and ``dmin * min`` from the block's fp16 d, dmin and six-bit packing."""
    s4 = s % 4
    a = _u8(b + 4 + s4, mask)
    m = _u8(b + 8 + s4, mask)
    md = _u8(b + 12 + s4, mask)
    lo = s < 4
    sc = tl.where(lo, a & 63, (md & 15) | ((a >> 2) & 48))
    mn = tl.where(lo, m & 63, (md >> 4) | ((m >> 2) & 48))
    return _f16(b, mask) * sc.to(tl.float32), _f16(b + 2, mask) * mn.to(tl.float32)


@device_fn
def _iq4xs_scale(h, ib, mask):
    """Scale of sub-block ``ib`` (0..7) of an IQ4_XS block whose d, scales_h (u16) and
    scales_l[4] start at byte pointer ``h``, as float32: ``d * (ls - 32)`` with the six-bit
    ``ls`` from a nibble of scales_l and two bits of scales_h (ggml's block_iq4_xs)."""
    hi = ((_u8(h + 2 + ib // 4, mask) >> ((ib % 4) * 2)) & 3) << 4
    ls = ((_u8(h + 4 + ib // 2, mask) >> ((ib % 2) * 4)) & 15) | hi
    return _f16(h, mask) * (ls - 32).to(tl.float32)


# kvalues_iq4nl (ggml-common.h), four int8 per int32, little-endian.
IQ4NL_W0: tl.constexpr = tl.constexpr(-1079142271)  # -127, -104, -83, -65
IQ4NL_W1: tl.constexpr = tl.constexpr(-152379953)  # -49, -35, -22, -10
IQ4NL_W2: tl.constexpr = tl.constexpr(639175937)  # 1, 13, 25, 38
IQ4NL_W3: tl.constexpr = tl.constexpr(1901675829)  # 53, 69, 89, 113


@device_fn
def _iq4nl(n):
    """``kvalues_iq4nl[n]`` (int32) for int32 ``n`` in 0..15."""
    w = tl.where(n < 8, tl.where(n < 4, IQ4NL_W0, IQ4NL_W1), tl.where(n < 12, IQ4NL_W2, IQ4NL_W3))
    return ((w >> ((n % 4) * 8)) << 24) >> 24


@device_fn
def _e2m1x2(n):
    """Twice the FP4 (E2M1) value of nibble ``n`` (int32): MXFP4's ``kvalues_mxfp4``."""
    c = n & 7
    mag = tl.where(c < 4, c, (2 + (c & 1)) << tl.maximum((c >> 1) - 1, 0))
    return tl.where((n & 8) != 0, -mag, mag)


@device_fn
def _e8m0_half(e):
    """Half of the E8M0 scale ``2**(e - 127)`` as float32 (ggml_e8m0_to_fp32_half)."""
    bits = tl.where(e < 2, 0x00200000 << tl.minimum(e, 1), (e - 1) << 23)
    return bits.to(tl.float32, bitcast=True)


@device_fn
def decode(b, j, mask, QTYPE: tl.constexpr):
    """Weight ``j`` of the ``QTYPE`` block starting at byte pointer ``b``, as float32.

    ``b``, ``j`` and ``mask`` broadcast together; masked elements read nothing.
    """
    if QTYPE == F32:
        u = _u8(b, mask) | (_u8(b + 1, mask) << 8) | (_u8(b + 2, mask) << 16)
        u = u | (_u8(b + 3, mask) << 24)
        v = u.to(tl.float32, bitcast=True)
    elif QTYPE == F16:
        v = _f16(b, mask)
    elif QTYPE == BF16:  # the high half of a float32
        u = (_u8(b, mask) << 16) | (_u8(b + 1, mask) << 24)
        v = u.to(tl.float32, bitcast=True)
    elif QTYPE == Q4_0:  # d, qs[16]
        d = _f16(b, mask)
        q = (_u8(b + 2 + j % 16, mask) >> ((j // 16) * 4)) & 15
        v = d * (q - 8).to(tl.float32)
    elif QTYPE == Q4_1:  # d, m, qs[16]
        d = _f16(b, mask)
        m = _f16(b + 2, mask)
        q = (_u8(b + 4 + j % 16, mask) >> ((j // 16) * 4)) & 15
        v = d * q.to(tl.float32) + m
    elif QTYPE == Q5_0:  # d, qh[4], qs[16]
        d = _f16(b, mask)
        h = (_u8(b + 2 + j // 8, mask) >> (j % 8)) & 1
        q = ((_u8(b + 6 + j % 16, mask) >> ((j // 16) * 4)) & 15) | (h << 4)
        v = d * (q - 16).to(tl.float32)
    elif QTYPE == Q5_1:  # d, m, qh[4], qs[16]
        d = _f16(b, mask)
        m = _f16(b + 2, mask)
        h = (_u8(b + 4 + j // 8, mask) >> (j % 8)) & 1
        q = ((_u8(b + 8 + j % 16, mask) >> ((j // 16) * 4)) & 15) | (h << 4)
        v = d * q.to(tl.float32) + m
    elif QTYPE == Q8_0:  # d, qs[32] int8
        d = _f16(b, mask)
        v = _i8(b + 2 + j, mask).to(tl.float32) * d
    elif QTYPE == Q2_K:  # scales[16], qs[64], d, dmin
        d = _f16(b + 80, mask)
        dmin = _f16(b + 82, mask)
        sc = _u8(b + j // 16, mask)
        dl = d * (sc & 15).to(tl.float32)
        ml = dmin * (sc >> 4).to(tl.float32)
        r = j % 128
        q = (_u8(b + 16 + (j // 128) * 32 + r % 32, mask) >> ((r // 32) * 2)) & 3
        v = dl * q.to(tl.float32) - ml
    elif QTYPE == Q3_K:  # hmask[32], qs[64], scales[12], d
        d = _f16(b + 108, mask)
        s = j // 16
        lo4 = (_u8(b + 96 + s % 8, mask) >> ((s // 8) * 4)) & 15
        hi2 = (_u8(b + 104 + s % 4, mask) >> ((s // 4) * 2)) & 3
        dl = d * ((lo4 | (hi2 << 4)) - 32).to(tl.float32)
        r = j % 128
        low = (_u8(b + 32 + (j // 128) * 32 + r % 32, mask) >> ((r // 32) * 2)) & 3
        high = (_u8(b + j % 32, mask) >> (j // 32)) & 1
        v = dl * (low - ((1 - high) << 2)).to(tl.float32)
    elif QTYPE == Q4_K:  # d, dmin, scales[12], qs[128]
        dl, ml = _scale_min_k4(b, j // 32, mask)
        r = j % 64
        q = (_u8(b + 16 + (j // 64) * 32 + r % 32, mask) >> ((r // 32) * 4)) & 15
        v = dl * q.to(tl.float32) - ml
    elif QTYPE == Q5_K:  # d, dmin, scales[12], qh[32], qs[128]
        dl, ml = _scale_min_k4(b, j // 32, mask)
        r = j % 64
        lo = (_u8(b + 48 + (j // 64) * 32 + r % 32, mask) >> ((r // 32) * 4)) & 15
        hi = (_u8(b + 16 + j % 32, mask) >> (j // 32)) & 1
        v = dl * (lo | (hi << 4)).to(tl.float32) - ml
    elif QTYPE == Q6_K:  # ql[128], qh[64], scales[16] int8, d
        d = _f16(b + 208, mask)
        dl = d * _i8(b + 192 + j // 16, mask).to(tl.float32)
        h = j // 128
        r = j % 128
        lo = (_u8(b + h * 64 + r % 64, mask) >> ((r // 64) * 4)) & 15
        hi = (_u8(b + 128 + h * 32 + r % 32, mask) >> ((r // 32) * 2)) & 3
        v = dl * ((lo | (hi << 4)) - 32).to(tl.float32)
    elif QTYPE == IQ4_NL:  # d, qs[16]; non-linear 4-bit values
        d = _f16(b, mask)
        q = (_u8(b + 2 + j % 16, mask) >> ((j // 16) * 4)) & 15
        v = d * _iq4nl(q).to(tl.float32)
    elif QTYPE == IQ4_XS:  # d, scales_h (u16), scales_l[4], qs[128]
        ib = j // 32
        dl = _iq4xs_scale(b, ib, mask)
        r = j % 32
        q = (_u8(b + 8 + ib * 16 + r % 16, mask) >> ((r // 16) * 4)) & 15
        v = dl * _iq4nl(q).to(tl.float32)
    elif QTYPE == MXFP4:  # e (E8M0), qs[16]; FP4 E2M1 values
        d = _e8m0_half(_u8(b, mask))
        q = (_u8(b + 1 + j % 16, mask) >> ((j // 16) * 4)) & 15
        v = d * _e2m1x2(q).to(tl.float32)
    else:
        tl.static_assert(False, "decode: unsupported ggml type")
        v = tl.zeros_like(j).to(tl.float32)
    return v


# Weights per scale group ("G") of each quantized type: the grouped decoder below loads the
# scales once per group instead of once per weight.
GROUP_SIZES = {
    T.Q4_0: 32,
    T.Q4_1: 32,
    T.Q5_0: 32,
    T.Q5_1: 32,
    T.Q8_0: 32,
    T.Q2_K: 16,
    T.Q3_K: 16,
    T.Q4_K: 32,
    T.Q5_K: 32,
    T.Q6_K: 16,
}


@device_fn
def decode_grouped(b, s, e, mask, QTYPE: tl.constexpr):
    """Weight ``j = s * G + e`` of the ``QTYPE`` block at ``b``, as float32 (G: GROUP_SIZES).

    The same values as :func:`decode`, for tiles shaped (rows, groups, G): ``b`` and ``s``
    vary along the first two axes only, ``e`` along the last, so fp16 scales and sub-block
    scales are loaded per group and only the packed bits per weight. ``mask`` should also be
    per group.
    """
    if QTYPE == Q4_0:  # Q4_0 (G = block): s == 0
        d = _f16(b, mask)
        q = (_u8(b + 2 + e % 16, mask) >> ((e // 16) * 4)) & 15
        v = d * (q - 8).to(tl.float32)
    elif QTYPE == Q4_1:
        d = _f16(b, mask)
        m = _f16(b + 2, mask)
        q = (_u8(b + 4 + e % 16, mask) >> ((e // 16) * 4)) & 15
        v = d * q.to(tl.float32) + m
    elif QTYPE == Q5_0:
        d = _f16(b, mask)
        h = (_u8(b + 2 + e // 8, mask) >> (e % 8)) & 1
        q = ((_u8(b + 6 + e % 16, mask) >> ((e // 16) * 4)) & 15) | (h << 4)
        v = d * (q - 16).to(tl.float32)
    elif QTYPE == Q5_1:
        d = _f16(b, mask)
        m = _f16(b + 2, mask)
        h = (_u8(b + 4 + e // 8, mask) >> (e % 8)) & 1
        q = ((_u8(b + 8 + e % 16, mask) >> ((e // 16) * 4)) & 15) | (h << 4)
        v = d * q.to(tl.float32) + m
    elif QTYPE == Q8_0:
        d = _f16(b, mask)
        v = _i8(b + 2 + e, mask).to(tl.float32) * d
    elif QTYPE == Q2_K:  # G = 16: j // 128 = s // 8, j % 32 = 16 * (s % 2) + e
        d = _f16(b + 80, mask)
        dmin = _f16(b + 82, mask)
        sc = _u8(b + s, mask)
        dl = d * (sc & 15).to(tl.float32)
        ml = dmin * (sc >> 4).to(tl.float32)
        qb = b + 16 + (s // 8) * 32 + (s % 2) * 16
        q = (_u8(qb + e, mask) >> (((s % 8) // 2) * 2)) & 3
        v = dl * q.to(tl.float32) - ml
    elif QTYPE == Q3_K:  # G = 16
        d = _f16(b + 108, mask)
        lo4 = (_u8(b + 96 + s % 8, mask) >> ((s // 8) * 4)) & 15
        hi2 = (_u8(b + 104 + s % 4, mask) >> ((s // 4) * 2)) & 3
        dl = d * ((lo4 | (hi2 << 4)) - 32).to(tl.float32)
        qb = b + 32 + (s // 8) * 32 + (s % 2) * 16
        low = (_u8(qb + e, mask) >> (((s % 8) // 2) * 2)) & 3
        high = (_u8(b + (s % 2) * 16 + e, mask) >> (s // 2)) & 1
        v = dl * (low - ((1 - high) << 2)).to(tl.float32)
    elif QTYPE == Q4_K:  # G = 32: j // 64 = s // 2, (j % 64) // 32 = s % 2, j % 32 = e
        dl, ml = _scale_min_k4(b, s, mask)
        q = (_u8(b + 16 + (s // 2) * 32 + e, mask) >> ((s % 2) * 4)) & 15
        v = dl * q.to(tl.float32) - ml
    elif QTYPE == Q5_K:  # G = 32
        dl, ml = _scale_min_k4(b, s, mask)
        lo = (_u8(b + 48 + (s // 2) * 32 + e, mask) >> ((s % 2) * 4)) & 15
        hi = (_u8(b + 16 + e, mask) >> s) & 1
        v = dl * (lo | (hi << 4)).to(tl.float32) - ml
    elif QTYPE == Q6_K:  # G = 16: h = s // 8, ql at 64h + 16 (s % 4), qh at 32h + 16 (s % 2)
        d = _f16(b + 208, mask)
        dl = d * _i8(b + 192 + s, mask).to(tl.float32)
        h = s // 8
        lo = (_u8(b + h * 64 + (s % 4) * 16 + e, mask) >> (((s % 8) // 4) * 4)) & 15
        hi = (_u8(b + 128 + h * 32 + (s % 2) * 16 + e, mask) >> (((s % 8) // 2) * 2)) & 3
        v = dl * ((lo | (hi << 4)) - 32).to(tl.float32)
    else:
        tl.static_assert(False, "decode_grouped: unsupported ggml type")
        v = tl.zeros_like(e).to(tl.float32)
    return v


# ---- word decoding for the integer-dot GEMV (llama.cpp's mul_mat_vec_q) ----------------------
#
# The integer-dot GEMV (``gemv._mmvq_kernel``) works on groups of 16 weights, four 32-bit words
# of four weights each. For each (row, group) :func:`decode_words` returns the four words
# holding the quantized weights as bytes (signed or unsigned 8-bit integers, ready for a
# ``dp4a`` against four int8 activations), the group's scale and min as float32 and an
# integer offset OFF (constexpr), so that the group's contribution is
#
#     sum_j w_j x_j = dx * (scale * (sum_j q_j qx_j - OFF * sum_j qx_j) - min * sum_j qx_j)
#
# with x_j ~ dx * qx_j (the activations quantized to 8 bits per 32 values). The block bytes
# are read as 32-bit words where the block size is a multiple of 4 (Q4_1, Q5_1, Q4_K, Q5_K:
# the weight bits come in 16-byte loads) and as 16-bit halves otherwise (Q4_0, Q5_0, Q8_0,
# Q6_K: their blocks are only 2-byte aligned in the GGUF layout). A loaded model keeps those
# types as aligned planes instead (``localllm.kernels.PLANES``, decoded by the functions at
# the end of this module), read with 16-byte loads.

# Types the integer-dot GEMV handles: code -> (word unit in bytes: 4 or 2, OFF).
MMVQ_TYPES = {
    T.IQ4_NL: (2, 0),
    T.IQ4_XS: (4, 0),
    T.Q4_0: (2, 8),
    T.Q4_1: (4, 0),
    T.Q5_0: (2, 16),
    T.Q5_1: (4, 0),
    T.Q8_0: (2, 0),
    T.Q4_K: (4, 0),
    T.Q5_K: (4, 0),
    T.Q6_K: (2, 32),
}


@device_fn
def _h2f(h):
    """The low 16 bits of int32 ``h`` as an fp16 value, widened to float32."""
    return (h & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@device_fn
def _w16(p):
    """The 32-bit word at 16-bit pointer ``p`` (two halves, little-endian), as int32."""
    lo = tl.load(p).to(tl.int32) & 0xFFFF
    hi = tl.load(p + 1).to(tl.int32) & 0xFFFF
    return lo | (hi << 16)


@device_fn
def _spread4(nib):
    """Bits 0..3 of ``nib`` moved to bit 0 of bytes 0..3 (0x01010101 pattern)."""
    return ((nib & 15) * 0x00204081) & 0x01010101


@device_fn
def _prmt(a, b, c):
    """CUDA ``prmt.b32``: bytes of the 8-byte {b, a} picked by the nibbles of ``c``."""
    return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                     dtype=tl.int32, is_pure=True, pack=1)  # fmt: skip


@device_fn
def iq4nl_word(q, ASM: tl.constexpr):
    """``kvalues_iq4nl`` of the four nibble values (bytes 0..15) of int32 ``q``, as four
    int8 in an int32 (llama.cpp's ``get_int_from_table_16``: two byte permutes and a
    blend on CUDA; byte by byte in portable code)."""
    if ASM:
        # the four nibbles side by side in the low 16 bits; bits 0-2 pick from each half of
        # the table, bit 3 picks the half
        y = q | (q >> 4)
        s16 = _prmt(y, y, tl.zeros_like(q) + 0x0020)
        zero = tl.zeros_like(q)
        lo = _prmt(zero + IQ4NL_W0, zero + IQ4NL_W1, s16 & 0x7777)
        hi = _prmt(zero + IQ4NL_W2, zero + IQ4NL_W3, s16 & 0x7777)
        r = _prmt(lo, hi, ((s16 >> 1) & 0x4444) | 0x3210)
    else:
        r = _iq4nl(q & 15) & 255
        r |= (_iq4nl((q >> 8) & 15) & 255) << 8
        r |= (_iq4nl((q >> 16) & 15) & 255) << 16
        r |= _iq4nl((q >> 24) & 15) << 24
    return r


@device_fn
def kq_scale_min(h0, b1, b2, b3, s):
    """Q4_K / Q5_K: (d * scale, dmin * min) of sub-block ``s`` (0..7) from the block's words
    0-3 (int32): d|dmin (two halves), then the 12 bytes of packed 6-bit scales and mins
    (llama.cpp's ``get_scale_min_k4``)."""
    sh = (s % 4) * 8
    b1 = (b1 >> sh) & 255
    b2 = (b2 >> sh) & 255
    b3 = (b3 >> sh) & 255
    lo = s < 4
    sc = tl.where(lo, b1 & 63, (b3 & 15) | ((b1 >> 6) << 4))
    mn = tl.where(lo, b2 & 63, (b3 >> 4) | ((b2 >> 6) << 4))
    return _h2f(h0) * sc.to(tl.float32), _h2f(h0 >> 16) * mn.to(tl.float32)


@device_fn
def _kquant_scale_min_words(wp, blk, s):
    """:func:`kq_scale_min` of the block whose words start at ``wp + blk``."""
    return kq_scale_min(tl.load(wp + blk), tl.load(wp + blk + 1), tl.load(wp + blk + 2),
                        tl.load(wp + blk + 3), s)


@device_fn
def decode_words(wp, blk, gb, t, QTYPE: tl.constexpr):
    """For the word types (``MMVQ_TYPES[q][0] == 4``): see below."""
    return _decode_words(wp, blk, gb, t, QTYPE)


@device_fn
def _decode_words(wp, blk, gb, t, QTYPE: tl.constexpr):
    """(words, scale, min) of weight group ``gb`` (16 weights) of the blocks at ``blk``.

    Args:
        wp: the weight pointer as int32 (word types) or int16 (half-word types), see
            ``MMVQ_TYPES``.
        blk: (R, G, 1) int offset of each block, in units of ``wp``'s element.
        gb: (1, G, 1) index of the 16-weight group inside its block.
        t: (1, 1, 4) index of the word inside the group.

    Returns:
        int32 (R, G, 4) packed weight bytes, float32 (R, G, 1) scale and min.
    """
    if QTYPE == Q4_K:  # 36 words; d|dmin, scales[12], qs[128] at word 4
        s = gb // 2
        q = tl.load(wp + blk + 4 + (s // 2) * 8 + (gb % 2) * 4 + t)
        wq = (q >> ((s % 2) * 4)) & 0x0F0F0F0F
        scale, vmin = _kquant_scale_min_words(wp, blk, s)
    elif QTYPE == Q5_K:  # 44 words; d|dmin, scales[12], qh[32] at word 4, qs at word 12
        s = gb // 2
        q = tl.load(wp + blk + 12 + (s // 2) * 8 + (gb % 2) * 4 + t)
        qh = tl.load(wp + blk + 4 + (gb % 2) * 4 + t)
        wq = ((q >> ((s % 2) * 4)) & 0x0F0F0F0F) | (((qh >> s) & 0x01010101) << 4)
        scale, vmin = _kquant_scale_min_words(wp, blk, s)
    elif QTYPE == IQ4_XS:  # 34 words; d|scales_h, scales_l[4], qs[128] at word 2 (raw
        # nibbles: the caller maps them through kvalues_iq4nl)
        ib = gb // 2
        q = tl.load(wp + blk + 2 + ib * 4 + t)
        wq = (q >> ((gb % 2) * 4)) & 0x0F0F0F0F
        h0 = tl.load(wp + blk)
        ls = ((tl.load(wp + blk + 1) >> ((ib // 2) * 8 + (ib % 2) * 4)) & 15)
        ls = ls | (((h0 >> (16 + ib * 2)) & 3) << 4)
        scale = _h2f(h0) * (ls - 32).to(tl.float32)
        vmin = tl.zeros_like(scale)
    elif QTYPE == Q4_1:  # 5 words; d|m, qs[16]
        q = tl.load(wp + blk + 1 + t)
        wq = (q >> (gb * 4)) & 0x0F0F0F0F
        h0 = tl.load(wp + blk)
        scale = _h2f(h0)
        vmin = -_h2f(h0 >> 16)
    elif QTYPE == Q5_1:  # 6 words; d|m, qh, qs[16]
        q = tl.load(wp + blk + 2 + t)
        qh = tl.load(wp + blk + 1)
        hb = _spread4(qh >> (gb * 16 + t * 4))
        wq = ((q >> (gb * 4)) & 0x0F0F0F0F) | (hb << 4)
        h0 = tl.load(wp + blk)
        scale = _h2f(h0)
        vmin = -_h2f(h0 >> 16)
    else:
        tl.static_assert(False, "decode_words: unsupported ggml type")
        wq = t
        scale = tl.zeros_like(blk).to(tl.float32)
        vmin = scale
    return wq, scale, vmin


@device_fn
def scale_min16(hp, blk, gb, QTYPE: tl.constexpr):
    """Scale and min (float32, shaped like ``blk``) of group ``gb`` of the half-word types."""
    if QTYPE == Q6_K:  # scales[16] int8 at half 96, d at half 104
        sc = tl.load(hp + blk + 96 + gb // 2).to(tl.int32) >> ((gb % 2) * 8)
        sc = ((sc & 255) ^ 128) - 128  # the signed byte
        scale = _h2f(tl.load(hp + blk + 104).to(tl.int32)) * sc.to(tl.float32)
    else:  # Q4_0, Q5_0, Q8_0, IQ4_NL: d first
        scale = _h2f(tl.load(hp + blk).to(tl.int32))
    return scale, tl.zeros_like(scale)


@device_fn
def decode_word16(hp, blk, gb, j: tl.constexpr, QTYPE: tl.constexpr):
    """Word ``j`` (0..3: weights 4j..4j+3) of group ``gb`` of the half-word types (blocks only
    2-byte aligned: Q4_0, Q5_0, Q8_0, Q6_K), from 16-bit loads; ``blk`` in halves.

    One word at a time rather than a (..., 4) tile: the compiler spreads a tile of 16-bit
    loads across threads, which then needs shuffles to sum it.
    """
    if QTYPE == Q8_0:  # 17 halves; d, qs[32] int8
        wq = _w16(hp + blk + 1 + gb * 8 + 2 * j)
    elif QTYPE == Q4_0 or QTYPE == IQ4_NL:  # Q4_0 (q - 8), IQ4_NL (raw nibbles): 9 halves; d, qs[16]
        wq = (_w16(hp + blk + 1 + 2 * j) >> (gb * 4)) & 0x0F0F0F0F
    elif QTYPE == Q5_0:  # 11 halves; d, qh (32 bits), qs[16]; q - 16
        q = _w16(hp + blk + 3 + 2 * j)
        hb = _spread4(_w16(hp + blk + 1) >> (gb * 16 + j * 4))
        wq = ((q >> (gb * 4)) & 0x0F0F0F0F) | (hb << 4)
    elif QTYPE == Q6_K:  # 105 halves; ql[128], qh[64], scales[16] int8, d; q - 32
        h = gb // 8
        r = gb % 8
        ql = _w16(hp + blk + h * 32 + (r % 4) * 8 + 2 * j)
        qh = _w16(hp + blk + 64 + h * 16 + (r % 2) * 8 + 2 * j)
        wq = ((ql >> ((r // 4) * 4)) & 0x0F0F0F0F) | (((qh >> ((r // 2) * 2)) & 0x03030303) << 4)
    else:
        tl.static_assert(False, "decode_word16: unsupported ggml type")
        wq = blk
    return wq


# ---- the "planes" layout (``localllm.kernels.PLANES``): each field of the blocks in its own
# 16-byte aligned plane, blocks in file order -----------------------------------------------------


@device_fn
def plane(nblk, I: tl.constexpr, QTYPE: tl.constexpr):
    """Byte offset (int64) of plane ``I`` of a ``QTYPE`` matrix of ``nblk`` blocks, as
    ``localllm.kernels.plane_offsets`` computes it (a multiple of 16)."""
    n = nblk.to(tl.int64)
    if I == 0:
        off = n * 0
    elif QTYPE == Q5_0 and I == 2:  # d after qs[16] and qh[4]
        off = (n * 20 + 15) // 16 * 16
    elif QTYPE == Q6_K:  # ql[128] | qh[64] | scales[16] | d
        if I == 1:
            off = n * 128
        elif I == 2:
            off = n * 192
        else:
            off = n * 208
    elif QTYPE == Q8_0:  # qs[0:16] | qs[16:32] | d
        off = n * (16 * I)
    elif QTYPE == IQ4_XS:  # qs[128] | d, scales_h, scales_l
        off = n * 128
    elif QTYPE == 10:  # Q2_K: qs[64] | scales[16] | d, dmin
        off = n * (64 + 16 * (I - 1))
    elif QTYPE == 11:  # Q3_K: qs[64] | hmask[32] | scales[12] | d
        if I == 1:
            off = n * 64
        elif I == 2:
            off = n * 96
        else:
            off = (n * 108 + 15) // 16 * 16
    else:  # Q4_0, IQ4_NL, MXFP4: qs[16] | d (or e); Q5_0: qs[16] | qh[4] | d
        off = n * 16
    return off


@device_fn
def decode_planes(w, nblk, blk, j, mask, QTYPE: tl.constexpr):
    """Weight ``j`` of block ``blk`` (int64 index) of a ``QTYPE`` matrix of ``nblk`` blocks
    stored as planes at byte pointer ``w``, as float32: the same values (and float operations)
    as :func:`decode`. ``blk``, ``j`` and ``mask`` broadcast together."""
    if QTYPE == Q4_0 or QTYPE == IQ4_NL:  # Q4_0, IQ4_NL: qs[16] | d
        d = _f16(w + plane(nblk, 1, QTYPE) + blk * 2, mask)
        q = (_u8(w + blk * 16 + j % 16, mask) >> ((j // 16) * 4)) & 15
        if QTYPE == Q4_0:
            v = d * (q - 8).to(tl.float32)
        else:
            v = d * _iq4nl(q).to(tl.float32)
    elif QTYPE == Q5_0:  # qs[16] | qh[4] | d
        d = _f16(w + plane(nblk, 2, QTYPE) + blk * 2, mask)
        h = (_u8(w + plane(nblk, 1, QTYPE) + blk * 4 + j // 8, mask) >> (j % 8)) & 1
        q = ((_u8(w + blk * 16 + j % 16, mask) >> ((j // 16) * 4)) & 15) | (h << 4)
        v = d * (q - 16).to(tl.float32)
    elif QTYPE == Q8_0:  # qs[0:16] | qs[16:32] | d
        d = _f16(w + plane(nblk, 2, QTYPE) + blk * 2, mask)
        v = _i8(w + (j // 16) * (nblk.to(tl.int64) * 16) + blk * 16 + j % 16, mask)
        v = v.to(tl.float32) * d
    elif QTYPE == Q6_K:  # ql[128] | qh[64] | scales[16] | d
        d = _f16(w + plane(nblk, 3, QTYPE) + blk * 2, mask)
        dl = d * _i8(w + plane(nblk, 2, QTYPE) + blk * 16 + j // 16, mask).to(tl.float32)
        h = j // 128
        r = j % 128
        lo = (_u8(w + blk * 128 + h * 64 + r % 64, mask) >> ((r // 64) * 4)) & 15
        qh = w + plane(nblk, 1, QTYPE) + blk * 64 + h * 32 + r % 32
        hi = (_u8(qh, mask) >> ((r // 32) * 2)) & 3
        v = dl * ((lo | (hi << 4)) - 32).to(tl.float32)
    elif QTYPE == IQ4_XS:  # qs[128] | d, scales_h (u16), scales_l[4]
        ib = j // 32
        dl = _iq4xs_scale(w + plane(nblk, 1, QTYPE) + blk * 8, ib, mask)
        r = j % 32
        q = (_u8(w + blk * 128 + ib * 16 + r % 16, mask) >> ((r // 16) * 4)) & 15
        v = dl * _iq4nl(q).to(tl.float32)
    elif QTYPE == 10:  # Q2_K: qs[64] | scales[16] | d, dmin
        dd = w + plane(nblk, 2, QTYPE) + blk * 4
        sc = _u8(w + plane(nblk, 1, QTYPE) + blk * 16 + j // 16, mask)
        dl = _f16(dd, mask) * (sc & 15).to(tl.float32)
        ml = _f16(dd + 2, mask) * (sc >> 4).to(tl.float32)
        r = j % 128
        q = (_u8(w + blk * 64 + (j // 128) * 32 + r % 32, mask) >> ((r // 32) * 2)) & 3
        v = dl * q.to(tl.float32) - ml
    elif QTYPE == 11:  # Q3_K: qs[64] | hmask[32] | scales[12] | d
        d = _f16(w + plane(nblk, 3, QTYPE) + blk * 2, mask)
        s = j // 16
        sp = w + plane(nblk, 2, QTYPE) + blk * 12
        lo4 = (_u8(sp + s % 8, mask) >> ((s // 8) * 4)) & 15
        hi2 = (_u8(sp + 8 + s % 4, mask) >> ((s // 4) * 2)) & 3
        dl = d * ((lo4 | (hi2 << 4)) - 32).to(tl.float32)
        r = j % 128
        low = (_u8(w + blk * 64 + (j // 128) * 32 + r % 32, mask) >> ((r // 32) * 2)) & 3
        hm = w + plane(nblk, 1, QTYPE) + blk * 32 + j % 32
        high = (_u8(hm, mask) >> (j // 32)) & 1
        v = dl * (low - ((1 - high) << 2)).to(tl.float32)
    elif QTYPE == 39:  # MXFP4: qs[16] | e
        d = _e8m0_half(_u8(w + plane(nblk, 1, QTYPE) + blk, mask))
        q = (_u8(w + blk * 16 + j % 16, mask) >> ((j // 16) * 4)) & 15
        v = d * _e2m1x2(q).to(tl.float32)
    else:
        tl.static_assert(False, "decode_planes: no planes layout for this ggml type")
        v = tl.zeros_like(j).to(tl.float32)
    return v


@device_fn
def prmt(a, b, c, ASM: tl.constexpr):
    """CUDA ``prmt.b32`` (default mode): byte ``i`` of the result is byte ``c[i] & 7`` of the
    8-byte value {b, a} (``c[i]``: nibble ``i`` of ``c``), sign-replicated where ``c[i] & 8``.
    ``ASM`` False: the same in portable integer code (the interpreter runs what the GPU runs)."""
    if ASM:
        r = _prmt(a, b, c)
    else:
        r = tl.zeros_like(a)
        for i in tl.static_range(4):
            s = (c >> (4 * i)) & 15
            k = s & 7
            src = tl.where(k < 4, a, b)
            byte = (src >> ((k & 3) * 8)) & 255
            byte = tl.where((s & 8) != 0, tl.where((byte & 128) != 0, 255, 0), byte)
            r = r | (byte << (8 * i))
    return r


@device_fn
def table_pair(q, W0, W1, W2, W3, ASM: tl.constexpr):
    """The 16-entry int8 table ``W0..W3`` (four int8 per int32, little-endian) looked up with
    the eight nibbles of int32 ``q`` (four bytes of a block's ``qs``), as two words of four
    int8: the low nibbles (weights i..i+3 of a 32-weight sub-block) and the high nibbles
    (weights 16+i..19+i). llama.cpp's ``get_int_from_table_16`` (``ggml-cuda/vecdotq.cuh``):
    eight byte permutes for 8 weights."""
    zero = tl.zeros_like(q)
    qa = q & 0x77777777  # table index within a half (bit 3 of a prmt nibble: sign mode)
    sel = ((q >> 1) & 0x44444444) | 0x32103210  # per nibble: take the upper half's byte
    v3 = prmt(prmt(zero + W0, zero + W1, qa, ASM), prmt(zero + W2, zero + W3, qa, ASM), sel,
              ASM)  # fmt: skip
    qb = qa >> 16
    sb = (sel >> 16) & 0xFFFF
    v4 = prmt(prmt(zero + W0, zero + W1, qb, ASM), prmt(zero + W2, zero + W3, qb, ASM), sb,
              ASM)  # fmt: skip
    return prmt(v3, v4, zero + 0x6420, ASM), prmt(v3, v4, zero + 0x7531, ASM)


@device_fn
def iq4nl_pair(q, ASM: tl.constexpr):
    """:func:`table_pair` of ``kvalues_iq4nl``."""
    return table_pair(q, IQ4NL_W0, IQ4NL_W1, IQ4NL_W2, IQ4NL_W3, ASM)


# kvalues_mxfp4 (ggml-common.h: the E2M1 values doubled), four int8 per int32, little-endian.
MXFP4_W0: tl.constexpr = tl.constexpr(50462976)  # 0, 1, 2, 3
MXFP4_W1: tl.constexpr = tl.constexpr(201852420)  # 4, 6, 8, 12
MXFP4_W2: tl.constexpr = tl.constexpr(-33620224)  # 0, -1, -2, -3
MXFP4_W3: tl.constexpr = tl.constexpr(-185009412)  # -4, -6, -8, -12


# Types the sub-block GEMV (``gemv._mmvq32_kernel``) reads from planes, 32 weights (one
# scale) per group: code -> OFF (the weights' integer offset, see above).
MMVQ32_TYPES = {T.Q4_0: 8, T.Q5_0: 16, T.Q8_0: 0, T.IQ4_NL: 0, T.IQ4_XS: 0, T.MXFP4: 0}


@device_fn
def _half_at(wp, h):
    """The fp16 at half index ``h`` (int64) of int32 pointer ``wp``, widened to float32, read
    from its 32-bit word (a 16-bit load tile makes Triton 3.6 exchange the loop's dot
    products through shared memory to match its layout)."""
    return _h2f(tl.load(wp + h // 2) >> ((h % 2) * 16).to(tl.int32))


@device_fn
def decode_unit32(wp, nblk, u, t, QTYPE: tl.constexpr, ASM: tl.constexpr):
    """(low words, high words, scale) of 32-weight sub-block ``u`` (int64 (R, G, 1): global
    index, row-major over the matrix) of a planes matrix at int32 pointer ``wp``.

    Returns int32 (R, G, 4): word ``t`` of weights 4t..4t+3 and of weights 16+4t..19+4t as
    int8 (before the OFF offset), float32 (R, G, 1) scale.
    """
    if QTYPE == Q8_0:  # int8 weights 0-15 and 16-31 of a sub-block (= block) in two planes
        lo = tl.load(wp + u * 4 + t)
        hi = tl.load(wp + plane(nblk, 1, QTYPE) // 4 + u * 4 + t)
        scale = _half_at(wp, plane(nblk, 2, QTYPE) // 2 + u)
    else:  # nibble types: 16 bytes of qs a sub-block
        q = tl.load(wp + u * 4 + t)
        if QTYPE == Q4_0:
            lo = q & 0x0F0F0F0F
            hi = (q >> 4) & 0x0F0F0F0F
            scale = _half_at(wp, plane(nblk, 1, QTYPE) // 2 + u)
        elif QTYPE == Q5_0:  # fifth bits of weight j at bit j of qh
            # qh as a tile of its 4 bytes (the words' layout), assembled by an in-thread sum
            # (a (R, G, 1) word load makes Triton 3.6 exchange the dot products every step)
            bp = wp.to(tl.pointer_type(tl.uint8))
            qb = tl.load(bp + plane(nblk, 1, QTYPE) + u * 4 + t).to(tl.int32) & 255
            qh = tl.sum(qb << (t * 8), axis=2, keep_dims=True)
            lo = (q & 0x0F0F0F0F) | (_spread4(qh >> (t * 4)) << 4)
            hi = ((q >> 4) & 0x0F0F0F0F) | (_spread4(qh >> (16 + t * 4)) << 4)
            scale = _half_at(wp, plane(nblk, 2, QTYPE) // 2 + u)
        elif QTYPE == IQ4_NL:
            lo, hi = iq4nl_pair(q, ASM)
            scale = _half_at(wp, plane(nblk, 1, QTYPE) // 2 + u)
        elif QTYPE == IQ4_XS:  # 8 sub-blocks a block; d|scales_h, scales_l words
            lo, hi = iq4nl_pair(q, ASM)
            ib = (u % 8).to(tl.int32)
            hd = plane(nblk, 1, QTYPE) // 4 + (u // 8) * 2
            h0 = tl.load(wp + hd)
            ls = (tl.load(wp + hd + 1) >> (ib * 4)) & 15
            ls = ls | (((h0 >> (16 + ib * 2)) & 3) << 4)
            scale = _h2f(h0) * (ls - 32).to(tl.float32)
        elif QTYPE == 39:  # MXFP4: one E8M0 byte a block (= sub-block) in its plane, read
            # from its 32-bit word (a byte-load tile makes Triton 3.6 exchange the loop's dot
            # products through shared memory, as a 16-bit one: see _half_at)
            lo, hi = table_pair(q, MXFP4_W0, MXFP4_W1, MXFP4_W2, MXFP4_W3, ASM)
            e = tl.load(wp + plane(nblk, 1, QTYPE) // 4 + u // 4) >> ((u % 4) * 8).to(tl.int32)
            scale = _e8m0_half(e & 255)
        else:
            tl.static_assert(False, "decode_unit32: unsupported ggml type")
            lo = q
            hi = q
            scale = tl.zeros_like(u).to(tl.float32)
    return lo, hi, scale


@device_fn
def decode_words_planes(wp, nblk, blk, gb, t, QTYPE: tl.constexpr):
    """Q6_K from planes: (words, scale, min) of 16-weight group ``gb`` of blocks ``blk``
    (int64 (R, G, 1) block indices), as :func:`decode_words` for the 16-byte types."""
    if QTYPE == Q6_K:  # ql (32 words a block) | qh (16) | scales (4) | d (halves)
        h = gb // 8
        r = gb % 8
        ql = tl.load(wp + blk * 32 + h * 16 + (r % 4) * 4 + t)
        qh = tl.load(wp + plane(nblk, 1, QTYPE) // 4 + blk * 16 + h * 8 + (r % 2) * 4 + t)
        wq = ((ql >> ((r // 4) * 4)) & 0x0F0F0F0F) | (((qh >> ((r // 2) * 2)) & 0x03030303) << 4)
        sc = tl.load(wp + plane(nblk, 2, QTYPE) // 4 + blk * 4 + gb // 4)
        sc = (sc << (24 - (gb % 4) * 8)) >> 24  # the signed byte gb
        hp = wp.to(tl.pointer_type(tl.int16))
        d = _h2f(tl.load(hp + plane(nblk, 3, QTYPE) // 2 + blk).to(tl.int32))
        scale = d * sc.to(tl.float32)
    else:
        tl.static_assert(False, "decode_words_planes: unsupported ggml type")
        wq = t
        scale = tl.zeros_like(blk).to(tl.float32)
    return wq, scale, tl.zeros_like(scale)


@device_fn
def decode_tile(w, row, rn, rk, mask, N, K, BS: tl.constexpr, TS: tl.constexpr,
                QTYPE: tl.constexpr, PLANES: tl.constexpr):
    """The (len(rn), len(rk)) tile W[rn, rk] of a ``QTYPE`` matrix W (N, K) at byte pointer
    ``w``, as float32: from its planes (``PLANES``, :func:`decode_planes`) or its blocks of BS
    weights in TS bytes, row by row (:func:`decode`; ``row``: the first byte of each row rn,
    ``w + rn * (K // BS) * TS``, computed once by the caller, outside its K loop)."""
    if PLANES:
        blk = rn.to(tl.int64)[:, None] * (K // BS) + (rk // BS)[None, :]
        tile = decode_planes(w, N * (K // BS), blk, (rk % BS)[None, :], mask, QTYPE)
    else:
        tile = decode(row[:, None] + ((rk // BS) * TS)[None, :], (rk % BS)[None, :], mask, QTYPE)
    return tile
