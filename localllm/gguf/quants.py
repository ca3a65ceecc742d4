"""Block geometry of the ggml tensor types and the torch reference dequantizer.

A ggml tensor row is a sequence of fixed-size blocks; each block stores ``block_size``
weights in ``type_size`` bytes (scales first or last, then packed integers). The geometry of
every type comes from one table, :data:`BLOCK_FORMATS`. The layouts follow ggml's
``block_*`` structs (llama.cpp ``ggml/src/ggml-common.h``) and the dequantizers follow
``dequantize_row_*`` (``ggml/src/ggml-quants.c``): the legacy types (Q4_0 .. Q8_0), the
K-quants (Q2_K .. Q6_K), the non-linear IQ4_NL / IQ4_XS, the microscaling MXFP4 / NVFP4, the
ternary TQ1_0 / TQ2_0 and the lattice types IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS,
IQ3_S, whose grids are taken from gguf-py.

Every function here is bit-exact with ``gguf.quants.dequantize`` (numpy): fp16 scales are
widened to float32 exactly, integer parts and table lookups are exact, and the float32
operations (products of scales, then ``d * q`` and ``- m``) happen in the same order with
one rounding each.

Dispatch is open: :func:`register_backend` adds another implementation (the Triton kernels
register one for CUDA tensors); ``backend="auto"`` picks a registered backend for the
tensor's device when it supports the type, else the torch reference here.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from ..errors import UnsupportedError

QK_K = 256  # weights per K-quant super-block
QK = 32  # weights per legacy (Q4_0 .. Q8_0) block


@dataclass(frozen=True)
class BlockFormat:
    """``block_size`` weights are stored in ``type_size`` bytes."""

    block_size: int
    type_size: int


# The one table of block geometry, for every type ggml defines (supported or not, so that a
# file can be validated and described before anything is dequantized). It is gguf-py's copy of
# ggml's ``type_traits`` (``ggml/src/ggml.c``); the struct layout of each supported type is
# spelled out next to its dequantizer below, and the tests check that each dequantizer reads
# exactly ``type_size`` bytes per block.
BLOCK_FORMATS: dict[T, BlockFormat] = {
    T(qtype): BlockFormat(block_size, type_size)
    for qtype, (block_size, type_size) in GGML_QUANT_SIZES.items()
}


def block_format(qtype: T) -> BlockFormat:
    """Geometry of ``qtype`` (any type ggml defines, whether or not it can be dequantized).

    Raises:
        UnsupportedError: ``qtype`` is not a ggml type id.
    """
    try:
        return BLOCK_FORMATS[T(qtype)]
    except (KeyError, ValueError):
        raise UnsupportedError(f"tensor type {_type_name(qtype)} is not supported") from None


def row_bytes(qtype: T, n_cols: int) -> int:
    """Bytes of one row of ``n_cols`` weights stored as ``qtype``.

    Raises:
        UnsupportedError: unknown type id.
        ValueError: ``n_cols`` is not a multiple of the block size.
    """
    fmt = block_format(qtype)
    if n_cols % fmt.block_size:
        raise ValueError(
            f"row length {n_cols} is not a multiple of the {T(qtype).name} block size "
            f"{fmt.block_size}"
        )
    return n_cols // fmt.block_size * fmt.type_size


def bits_per_weight(qtype: T) -> float:
    """Storage cost of ``qtype`` in bits per weight, scales included (Q4_K -> 4.5,
    IQ4_XS -> 4.25).

    Raises:
        UnsupportedError: ``qtype`` is not a ggml type id.
    """
    fmt = block_format(qtype)
    return 8 * fmt.type_size / fmt.block_size


def is_supported(qtype: T) -> bool:
    """Whether :func:`dequantize` handles ``qtype``."""
    try:
        return T(qtype) in BLOCK_DEQUANTIZERS
    except ValueError:
        return False


def _type_name(qtype) -> str:
    try:
        return T(qtype).name
    except ValueError:
        return str(qtype)


# ---------------------------------------------------------------------------------------------
# Per-format block dequantizers: uint8 (n, type_size) -> float32 (n, block_size).
# ---------------------------------------------------------------------------------------------


def _f16(b: torch.Tensor) -> torch.Tensor:
    """(n, 2) uint8 little-endian fp16 -> (n, 1) float32 (exact widening)."""
    return b.contiguous().view(torch.float16).float()


def _shifts(values: list[int], ndim: int, axis: int, device) -> torch.Tensor:
    """A uint8 shift vector shaped to broadcast along ``axis`` of an ``ndim`` tensor."""
    shape = [1] * ndim
    shape[axis] = len(values)
    return torch.tensor(values, dtype=torch.uint8, device=device).view(shape)


def _nibbles(qs: torch.Tensor, width: int) -> torch.Tensor:
    """Split bytes into 4-bit values: (n, k*width) -> (n, k, 2, width), low nibbles first.

    Byte j of a group of ``width`` bytes gives weight j (low nibble) and j + width (high).
    """
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, width) >> _shifts([0, 4], 4, 2, qs.device)
    return q & 0x0F


def _bits(qh: torch.Tensor, width: int, n_bits: int, step: int) -> torch.Tensor:
    """Extract ``n_bits // step`` fields of ``step`` bits: (n, k*width) -> (n, k, fields, width)."""
    n = qh.shape[0]
    q = qh.reshape(n, -1, 1, width) >> _shifts(list(range(0, n_bits, step)), 4, 2, qh.device)
    return q & ((1 << step) - 1)


def _deq_q4_0(b: torch.Tensor) -> torch.Tensor:
    # block_q4_0, 18 bytes, 32 weights:
    #   [ d: fp16 ][ qs[0..15]: byte j = (w[j+16] << 4) | w[j] ]
    #   weight = d * (nibble - 8)
    n = b.shape[0]
    d = _f16(b[:, 0:2])
    q = _nibbles(b[:, 2:], 16).reshape(n, QK).to(torch.int8) - 8
    return d * q.float()


def _deq_q4_1(b: torch.Tensor) -> torch.Tensor:
    # block_q4_1, 20 bytes, 32 weights:
    #   [ d: fp16 ][ m: fp16 ][ qs[0..15]: byte j = (w[j+16] << 4) | w[j] ]
    #   weight = d * nibble + m
    n = b.shape[0]
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    q = _nibbles(b[:, 4:], 16).reshape(n, QK).float()
    return d * q + m


def _q5_high(qh: torch.Tensor) -> torch.Tensor:
    """(n, 4) bytes of a little-endian uint32 -> (n, 32) bit i = high bit of weight i."""
    return _bits(qh, 1, 8, 1).reshape(qh.shape[0], QK)


def _deq_q5_0(b: torch.Tensor) -> torch.Tensor:
    # block_q5_0, 22 bytes, 32 weights:
    #   [ d: fp16 ][ qh: uint32, bit i = bit 4 of w[i] ][ qs[0..15]: (w[j+16]&15) << 4 | w[j]&15 ]
    #   weight = d * (5-bit value - 16)
    n = b.shape[0]
    d = _f16(b[:, 0:2])
    lo = _nibbles(b[:, 6:], 16).reshape(n, QK)
    q = (lo | (_q5_high(b[:, 2:6]) << 4)).to(torch.int8) - 16
    return d * q.float()


def _deq_q5_1(b: torch.Tensor) -> torch.Tensor:
    # block_q5_1, 24 bytes, 32 weights:
    #   [ d: fp16 ][ m: fp16 ][ qh: uint32 ][ qs[0..15] ]   (packing as Q5_0)
    #   weight = d * (5-bit value) + m
    n = b.shape[0]
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    lo = _nibbles(b[:, 8:], 16).reshape(n, QK)
    q = (lo | (_q5_high(b[:, 4:8]) << 4)).float()
    return d * q + m


def _deq_q8_0(b: torch.Tensor) -> torch.Tensor:
    # block_q8_0, 34 bytes, 32 weights:  [ d: fp16 ][ qs[0..31]: int8 ]   weight = qs * d
    d = _f16(b[:, 0:2])
    return b[:, 2:].view(torch.int8).float() * d


def _deq_q2_k(b: torch.Tensor) -> torch.Tensor:
    # block_q2_K, 84 bytes, 256 weights in 16 sub-blocks of 16:
    #   [ scales[16]: byte s = (min4 << 4) | scale4 ][ qs[64] ][ d: fp16 ][ dmin: fp16 ]
    #   qs: two halves of 32 bytes; in half h, byte j holds 4 crumbs (2 bits) for
    #       weights h*128 + 32*c + j, c = 0..3 at bits 2c..2c+1.
    #   weight = (d * scale4) * q - (dmin * min4)
    n = b.shape[0]
    sc = b[:, 0:16]
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    dl = (d * (sc & 0x0F).float()).reshape(n, 16, 1)
    ml = (dmin * (sc >> 4).float()).reshape(n, 16, 1)
    q = _bits(b[:, 16:80], 32, 8, 2).reshape(n, 16, 16).float()
    return (dl * q - ml).reshape(n, QK_K)


def _deq_q3_k(b: torch.Tensor) -> torch.Tensor:
    # block_q3_K, 110 bytes, 256 weights in 16 sub-blocks of 16:
    #   [ hmask[32] ][ qs[64] ][ scales[12] ][ d: fp16 ]
    #   qs: 2 low bits per weight, laid out as Q2_K's qs.
    #   hmask: byte j, bit k -> weight 32*k + j; the 3-bit value is low2 - (4 if bit == 0 else 0).
    #   scales: sixteen 6-bit values (s - 32 is the signed scale):
    #     byte 0..7 : low nibble = low 4 bits of s[i],  high nibble = low 4 bits of s[i+8]
    #     byte 8..11: bits 2c..2c+1 = high 2 bits of s[(byte-8) + 4c], c = 0..3
    #   weight = (d * (s - 32)) * q
    n = b.shape[0]
    d = _f16(b[:, 108:110])
    scb = b[:, 96:108]
    lo = _bits(scb[:, 0:8], 8, 8, 4).reshape(n, 16)
    hi = _bits(scb[:, 8:12], 4, 8, 2).reshape(n, 16)
    scales = ((lo | (hi << 4)).to(torch.int8) - 32).float()
    dl = (d * scales).reshape(n, 16, 1)
    low = _bits(b[:, 32:96], 32, 8, 2).reshape(n, 16, 16).to(torch.int8)
    high = _bits(b[:, 0:32], 32, 8, 1).reshape(n, 16, 16).to(torch.int8)
    q = (low - ((1 - high) << 2)).float()
    return (dl * q).reshape(n, QK_K)


def _scale_min_k4(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 sub-block scales ``d * scale`` and mins ``dmin * min`` of Q4_K/Q5_K blocks
    (n, type_size), float32 (n, 8, 1): fp16 d and dmin, then 12 bytes of six-bit scales
    and mins packed as

    ::

        byte 0..3 : MMssssss   s = scale[i]  (low 6 bits), M = high 2 bits of scale[i+4]
        byte 4..7 : MMmmmmmm   m = min[i]    (low 6 bits), M = high 2 bits of min[i+4]
        byte 8..11: mmmmssss   low 4 bits of scale[i+4] and of min[i+4]
    """
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    s = b[:, 4:16].reshape(-1, 3, 4)
    a, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([a & 0x3F, (md & 0x0F) | ((a >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return (d * sc.float()).reshape(n, 8, 1), (dmin * mn.float()).reshape(n, 8, 1)


def _deq_q4_k(b: torch.Tensor) -> torch.Tensor:
    # block_q4_K, 144 bytes, 256 weights in 8 sub-blocks of 32:
    #   [ d: fp16 ][ dmin: fp16 ][ scales[12] (see _scale_min_k4) ][ qs[128] ]
    #   qs: four chunks of 32 bytes; chunk c, byte j: low nibble -> weight 64c + j,
    #       high nibble -> weight 64c + 32 + j.
    #   weight = (d * scale) * q - (dmin * min)
    n = b.shape[0]
    dl, ml = _scale_min_k4(b)
    q = _nibbles(b[:, 16:144], 32).reshape(n, 8, 32).float()
    return (dl * q - ml).reshape(n, QK_K)


def _deq_q5_k(b: torch.Tensor) -> torch.Tensor:
    # block_q5_K, 176 bytes, 256 weights in 8 sub-blocks of 32:
    #   [ d: fp16 ][ dmin: fp16 ][ scales[12] ][ qh[32] ][ qs[128] ]
    #   qs as Q4_K; qh byte j, bit k = bit 4 of weight 32*k + j.
    #   weight = (d * scale) * q - (dmin * min)
    n = b.shape[0]
    dl, ml = _scale_min_k4(b)
    lo = _nibbles(b[:, 48:176], 32).reshape(n, 8, 32)
    hi = _bits(b[:, 16:48], 32, 8, 1).reshape(n, 8, 32)
    q = (lo | (hi << 4)).float()
    return (dl * q - ml).reshape(n, QK_K)


def _deq_q6_k(b: torch.Tensor) -> torch.Tensor:
    # block_q6_K, 210 bytes, 256 weights in 16 sub-blocks of 16:
    #   [ ql[128] ][ qh[64] ][ scales[16]: int8 ][ d: fp16 ]
    #   Two halves of 128 weights; half h uses ql[64h..64h+63] and qh[32h..32h+31]:
    #     ql byte j (0..63): low nibble -> weight j, high nibble -> weight 64 + j
    #     qh byte j (0..31): bits 2c..2c+1 = bits 4..5 of weight 32c + j
    #   weight = (d * scale) * (6-bit value - 32)
    n = b.shape[0]
    d = _f16(b[:, 208:210])
    dl = (d * b[:, 192:208].view(torch.int8).float()).reshape(n, 16, 1)
    lo = _nibbles(b[:, 0:128], 64).reshape(n, 8, 32)
    hi = _bits(b[:, 128:192], 32, 8, 2).reshape(n, 8, 32)
    q = ((lo | (hi << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
    return (dl * q).reshape(n, QK_K)


# ---------------------------------------------------------------------------------------------
# Non-linear and lattice types: IQ4_NL / IQ4_XS (a 16-entry non-uniform codebook), MXFP4 and
# NVFP4 (e2m1 values with power-of-two / e4m3 scales), TQ1_0 / TQ2_0 (ternary), and the
# IQ1/IQ2/IQ3 families (indices into grids of 4 or 8 weights, with sign bits).
# Layouts: ``block_iq*``/``block_mxfp4``/``block_nvfp4``/``block_tq*`` in ggml-common.h;
# dequantizers: ``dequantize_row_iq*`` etc. in ggml-quants.c.
# ---------------------------------------------------------------------------------------------

# kvalues_iq4nl: the IQ4_NL / IQ4_XS codebook (int8).
IQ4NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# kvalues_mxfp4: the e2m1 values times two (the scales below carry the factor 1/2).
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)

_IQ_GRIDS = {  # type -> the gguf.quants class whose unpacked grid it uses
    T.IQ2_XXS: "IQ2_XXS",
    T.IQ2_XS: "IQ2_XS",
    T.IQ2_S: "IQ2_S",
    T.IQ3_XXS: "IQ3_XXS",
    T.IQ3_S: "IQ3_S",
    T.IQ1_S: "IQ1_S",
    T.IQ1_M: "IQ1_S",  # IQ1_M shares iq1s_grid
}

_tables: dict[tuple, torch.Tensor] = {}


def _table(key: tuple, device, build: Callable[[], torch.Tensor]) -> torch.Tensor:
    """A constant lookup table, built once per device."""
    k = (*key, str(device))
    t = _tables.get(k)
    if t is None:
        t = _tables[k] = build().to(device)
    return t


def _grid(qtype: T, device) -> torch.Tensor:
    """The lattice of an IQ1/IQ2/IQ3 type: float32 (entries, 4 or 8), e.g. iq2xxs_grid's bytes
    (0x08, 0x19, 0x2b) as numbers, iq1s_grid's as -1/0/1. Taken from gguf-py (which unpacks
    llama.cpp's tables) rather than copied here."""

    def build() -> torch.Tensor:
        import gguf.quants

        cls = getattr(gguf.quants, _IQ_GRIDS[qtype])
        cls.init_grid()
        return torch.from_numpy(np.asarray(cls.grid, dtype=np.float32).reshape(cls.grid_shape))

    return _table(("grid", _IQ_GRIDS[qtype]), device, build)


def _ksigns(device) -> torch.Tensor:
    """ksigns_iq2xs as float32 (128, 8) of +-1: a 7-bit index gives the signs of 7 weights
    (bit k set = negative) and the 8th sign makes the count of negatives even."""

    def build() -> torch.Tensor:
        i = torch.arange(128)
        bits = (i.view(-1, 1) >> torch.arange(7)) & 1
        bits = torch.cat([bits, bits.sum(dim=1, keepdim=True) & 1], dim=1)
        return 1.0 - 2.0 * bits.float()

    return _table(("ksigns",), device, build)


def _sign_bits(b: torch.Tensor) -> torch.Tensor:
    """Bytes of explicit sign bits (n, k) -> float32 (n, k, 8) of +-1 (bit j set = negative)."""
    bits = _bits(b, 1, 8, 1).reshape(b.shape[0], b.shape[1], 8)
    return 1.0 - 2.0 * bits.float()


def _rows(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``table[idx]`` (rows of a lookup table for integer indices of any shape), via
    index_select: several times faster than advanced indexing on the CPU."""
    return torch.index_select(table, 0, idx.reshape(-1)).reshape(*idx.shape, *table.shape[1:])


def _u32(b: torch.Tensor) -> torch.Tensor:
    """Little-endian bytes (n, 4k) -> int64 (n, k) of their uint32 values."""
    b = b.long().reshape(b.shape[0], -1, 4)
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


def _u16(b: torch.Tensor) -> torch.Tensor:
    """Little-endian bytes (n, 2k) -> int64 (n, k) of their uint16 values."""
    b = b.long().reshape(b.shape[0], -1, 2)
    return b[..., 0] | (b[..., 1] << 8)


def _codebook(values: tuple[int, ...], device) -> torch.Tensor:
    return _table(("codebook", values), device, lambda: torch.tensor(values, dtype=torch.float32))


def _deq_iq4_nl(b: torch.Tensor) -> torch.Tensor:
    # block_iq4_nl, 18 bytes, 32 weights:
    #   [ d: fp16 ][ qs[16]: low nibble -> weight j, high nibble -> weight j + 16 ]
    #   weight = d * kvalues_iq4nl[nibble]
    n = b.shape[0]
    d = _f16(b[:, 0:2])
    q = _nibbles(b[:, 2:], 16).reshape(n, QK).long()
    return d * _rows(_codebook(IQ4NL_VALUES, b.device), q)


def _deq_iq4_xs(b: torch.Tensor) -> torch.Tensor:
    # block_iq4_xs, 136 bytes, 256 weights in 8 sub-blocks of 32:
    #   [ d: fp16 ][ scales_h: uint16, bits 2i..2i+1 = high 2 bits of scale i ]
    #   [ scales_l[4]: byte j low nibble = low 4 bits of scale 2j, high nibble of scale 2j+1 ]
    #   [ qs[128]: 16 bytes per sub-block, packed as IQ4_NL ]
    #   weight = (d * (scale - 32)) * kvalues_iq4nl[nibble]
    n = b.shape[0]
    d = _f16(b[:, 0:2])
    hi = _bits(b[:, 2:4], 1, 8, 2).reshape(n, 8)
    lo = _bits(b[:, 4:8], 1, 8, 4).reshape(n, 8)
    scales = ((lo | (hi << 4)).to(torch.int8) - 32).float()
    dl = (d * scales).reshape(n, 8, 1)
    q = _nibbles(b[:, 8:], 16).reshape(n, 8, 32).long()
    return (dl * _rows(_codebook(IQ4NL_VALUES, b.device), q)).reshape(n, QK_K)


def _deq_mxfp4(b: torch.Tensor) -> torch.Tensor:
    # block_mxfp4, 17 bytes, 32 weights (OCP Microscaling MXFP4, as in gpt-oss):
    #   [ e: uint8, an e8m0 power of two ][ qs[16]: packed as IQ4_NL ]
    #   weight = ggml_e8m0_to_fp32_half(e) * kvalues_mxfp4[nibble]
    #   where e8m0_half(e) = 2^(e - 128), built from its float32 bits (subnormal for e < 2).
    n = b.shape[0]
    e = b[:, 0:1].int()
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    d = bits.view(torch.float32)
    q = _nibbles(b[:, 1:], 16).reshape(n, QK).long()
    return d * _rows(_codebook(MXFP4_VALUES, b.device), q)


def _ue4m3_half_values() -> torch.Tensor:
    """ggml's ``ggml_ue4m3_to_fp32`` times 1/2 for the 256 byte values, float32 (256,):
    unsigned e4m3 (bias 7, bit 7 ignored), 0 for the codes 0x00 and 0x7F. Every value is a
    float32 exactly, so the table is exact."""
    vals = []
    for x in range(256):
        exp, man = (x >> 3) & 0xF, x & 7
        v = man * 2.0**-9 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7)
        vals.append(0.0 if x in (0, 0x7F) else v * 0.5)
    return torch.tensor(vals, dtype=torch.float32)


def _deq_nvfp4(b: torch.Tensor) -> torch.Tensor:
    # block_nvfp4, 36 bytes, 64 weights in 4 sub-blocks of 16:
    #   [ d[4]: ue4m3 scale per sub-block ][ qs[32]: 8 bytes per sub-block, byte j: low nibble
    #     -> weight j, high nibble -> weight j + 8 ]
    #   weight = (ue4m3(d) / 2) * kvalues_mxfp4[nibble]
    n = b.shape[0]
    d = _rows(_table(("ue4m3",), b.device, _ue4m3_half_values), b[:, 0:4].long()).reshape(n, 4, 1)
    q = _nibbles(b[:, 4:], 8).reshape(n, 4, 16).long()
    return (d * _rows(_codebook(MXFP4_VALUES, b.device), q)).reshape(n, 64)


def _deq_tq1_0(b: torch.Tensor) -> torch.Tensor:
    # block_tq1_0, 54 bytes, 256 ternary weights:
    #   [ qs[48]: 5 trits per byte ][ qh[4]: 4 trits per byte ][ d: fp16 ]
    #   A byte holds trits as a fixed-point fraction of 3^5 (3^4 for qh): trit k of byte x is
    #   ((x * 3^k mod 256) * 3) >> 8. qs[0..31] give weights 32k + j, qs[32..47] weights
    #   160 + 16k + j, qh weights 240 + 4k + j.   weight = d * (trit - 1)
    n = b.shape[0]
    d = _f16(b[:, 52:54])
    p5 = torch.tensor([1, 3, 9, 27, 81], dtype=torch.uint8, device=b.device).view(1, 5, 1)
    parts = [
        (b[:, 0:32].unsqueeze(1) * p5).reshape(n, 160),
        (b[:, 32:48].unsqueeze(1) * p5).reshape(n, 80),
        (b[:, 48:52].unsqueeze(1) * p5[:, :4]).reshape(n, 16),
    ]
    q = ((torch.cat(parts, dim=1).int() * 3) >> 8) - 1
    return d * q.float()


def _deq_tq2_0(b: torch.Tensor) -> torch.Tensor:
    # block_tq2_0, 66 bytes, 256 ternary weights:
    #   [ qs[64]: two halves of 32 bytes; byte j, bits 2c..2c+1 -> weight 128h + 32c + j ][ d ]
    #   weight = d * (crumb - 1)
    n = b.shape[0]
    d = _f16(b[:, 64:66])
    q = _bits(b[:, 0:64], 32, 8, 2).reshape(n, QK_K).int() - 1
    return d * q.float()


def _deq_iq2_xxs(b: torch.Tensor) -> torch.Tensor:
    # block_iq2_xxs, 66 bytes, 256 weights in 8 sub-blocks of 32 (4 groups of 8):
    #   [ d: fp16 ][ qs: 8 x (aux0: uint32, aux1: uint32) ]
    #   aux0 bytes: iq2xxs_grid index of each group; aux1 bits 7k..7k+6: ksigns index of
    #   group k; aux1 bits 28..31: the sub-block scale ls.
    #   weight = ((d * (0.5 + ls)) * 0.25) * grid * sign
    n = b.shape[0]
    d = _f16(b[:, 0:2])
    q = b[:, 2:].reshape(n, 8, 2, 4)
    aux1 = _u32(q[:, :, 1].reshape(n, 32))
    db = (d * (0.5 + (aux1 >> 28).float()) * 0.25).reshape(n, 8, 1, 1)
    grid = _rows(_grid(T.IQ2_XXS, b.device), q[:, :, 0].long())  # (n, 8, 4, 8)
    sidx = (aux1.unsqueeze(-1) >> torch.tensor([0, 7, 14, 21], device=b.device)) & 127
    signs = _rows(_ksigns(b.device), sidx)  # (n, 8, 4, 8)
    return (db * grid * signs).reshape(n, QK_K)


def _iq2_scales(d: torch.Tensor, sc: torch.Tensor) -> torch.Tensor:
    """IQ2_XS / IQ2_S sub-block scales: 4-bit values, byte j = (s[2j+1] << 4) | s[2j], as
    ``(d * (0.5 + s)) * 0.25``, float32 (n, 16, 1, 1)."""
    n = sc.shape[0]
    s = _bits(sc, 1, 8, 4).reshape(n, 16).float()
    return (d * (0.5 + s) * 0.25).reshape(n, 16, 1, 1)


def _deq_iq2_xs(b: torch.Tensor) -> torch.Tensor:
    # block_iq2_xs, 74 bytes, 256 weights in 16 sub-blocks of 16 (2 groups of 8):
    #   [ d: fp16 ][ qs[32]: uint16, bits 0..8 = iq2xs_grid index, 9..15 = ksigns index ]
    #   [ scales[8]: two 4-bit scales per byte ]
    #   weight = ((d * (0.5 + s)) * 0.25) * grid * sign
    n = b.shape[0]
    d = _f16(b[:, 0:2])
    qs = _u16(b[:, 2:66])
    db = _iq2_scales(d, b[:, 66:74])
    grid = _rows(_grid(T.IQ2_XS, b.device), qs & 511).reshape(n, 16, 2, 8)
    signs = _rows(_ksigns(b.device), qs >> 9).reshape(n, 16, 2, 8)
    return (db * grid * signs).reshape(n, QK_K)


def _deq_iq2_s(b: torch.Tensor) -> torch.Tensor:
    # block_iq2_s, 82 bytes, 256 weights in 16 sub-blocks of 16 (2 groups of 8):
    #   [ d: fp16 ][ qs[32]: low 8 bits of the iq2s_grid index of each group ]
    #   [ signs[32]: one byte of sign bits per group ][ qh[8]: byte j, bits 2c..2c+1 = bits
    #     8..9 of the index of group 4j + c ][ scales[8]: two 4-bit scales per byte ]
    #   weight = ((d * (0.5 + s)) * 0.25) * grid * sign
    n = b.shape[0]
    d = _f16(b[:, 0:2])
    hi = _bits(b[:, 66:74], 1, 8, 2).reshape(n, 32).long()
    idx = b[:, 2:34].long() | (hi << 8)
    db = _iq2_scales(d, b[:, 74:82])
    grid = _rows(_grid(T.IQ2_S, b.device), idx).reshape(n, 16, 2, 8)
    signs = _sign_bits(b[:, 34:66]).reshape(n, 16, 2, 8)
    return (db * grid * signs).reshape(n, QK_K)


def _deq_iq3_xxs(b: torch.Tensor) -> torch.Tensor:
    # block_iq3_xxs, 98 bytes, 256 weights in 8 sub-blocks of 32 (4 groups of 8):
    #   [ d: fp16 ][ qs[64]: iq3xxs_grid index of each 4 weights ]
    #   [ scales_and_signs: 8 x uint32, bits 7k..7k+6 = ksigns index of group k, 28..31 = ls ]
    #   weight = ((d * (0.5 + ls)) * 0.5) * grid * sign
    n = b.shape[0]
    d = _f16(b[:, 0:2])
    aux = _u32(b[:, 66:98])
    db = (d * (0.5 + (aux >> 28).float()) * 0.5).reshape(n, 8, 1, 1)
    grid = _rows(_grid(T.IQ3_XXS, b.device), b[:, 2:66].long()).reshape(n, 8, 4, 8)
    sidx = (aux.unsqueeze(-1) >> torch.tensor([0, 7, 14, 21], device=b.device)) & 127
    signs = _rows(_ksigns(b.device), sidx)
    return (db * grid * signs).reshape(n, QK_K)


def _deq_iq3_s(b: torch.Tensor) -> torch.Tensor:
    # block_iq3_s, 110 bytes, 256 weights in 8 sub-blocks of 32 (4 groups of 8):
    #   [ d: fp16 ][ qs[64]: low 8 bits of the iq3s_grid index of each 4 weights ]
    #   [ qh[8]: byte j, bit k = bit 8 of index 8j + k ][ signs[32]: sign bits per group ]
    #   [ scales[4]: two 4-bit scales per byte ]
    #   weight = (d * (1 + 2 * s)) * grid * sign
    n = b.shape[0]
    d = _f16(b[:, 0:2])
    hi = _bits(b[:, 66:74], 1, 8, 1).reshape(n, 64).long()
    idx = b[:, 2:66].long() | (hi << 8)
    s = _bits(b[:, 106:110], 1, 8, 4).reshape(n, 8).float()
    db = (d * (1 + 2 * s)).reshape(n, 8, 1, 1)
    grid = _rows(_grid(T.IQ3_S, b.device), idx).reshape(n, 8, 4, 8)
    signs = _sign_bits(b[:, 74:106]).reshape(n, 8, 4, 8)
    return (db * grid * signs).reshape(n, QK_K)


IQ1_DELTA = 0.125


def _deq_iq1_s(b: torch.Tensor) -> torch.Tensor:
    # block_iq1_s, 50 bytes, 256 weights in 8 sub-blocks of 32 (4 groups of 8):
    #   [ d: fp16 ][ qs[32]: low 8 bits of the iq1s_grid index of each group ]
    #   [ qh[8]: uint16 per sub-block: bits 3k..3k+2 = bits 8..10 of group k's index,
    #     12..14 = scale s, 15 = sign of the shift delta ]
    #   weight = (d * (2s + 1)) * (grid + delta), grid in {-1, 0, 1}, delta = +-1/8
    n = b.shape[0]
    d = _f16(b[:, 0:2])
    qh = _u16(b[:, 34:50])  # (n, 8)
    dl = (d * (2 * ((qh >> 12) & 7) + 1).float()).reshape(n, 8, 1, 1)
    delta = torch.where((qh & 0x8000) == 0, IQ1_DELTA, -IQ1_DELTA).reshape(n, 8, 1, 1)
    hi = (qh.unsqueeze(-1) >> torch.tensor([0, 3, 6, 9], device=b.device)) & 7
    idx = b[:, 2:34].long() | (hi.reshape(n, 32) << 8)
    grid = _rows(_grid(T.IQ1_S, b.device), idx).reshape(n, 8, 4, 8)
    return (dl * (grid + delta)).reshape(n, QK_K)


def _deq_iq1_m(b: torch.Tensor) -> torch.Tensor:
    # block_iq1_m, 56 bytes, 256 weights in 16 halves of 16 (2 groups of 8):
    #   [ qs[32]: low 8 bits of the iq1s_grid index of each group ]
    #   [ qh[16]: byte j, low nibble for group 2j, high nibble for 2j + 1: bits 0..2 = bits
    #     8..10 of the index, bit 3 = sign of the shift delta ]
    #   [ scales: 4 x uint16: bits 3k..3k+2 of word w = 3-bit scale s of half 4w + k;
    #     bits 12..15 of word w = bits 4w..4w+3 of the fp16 super-block scale d ]
    #   weight = (d * (2s + 1)) * (grid + delta), grid in {-1, 0, 1}, delta = +-1/8
    n = b.shape[0]
    sc = _u16(b[:, 48:56])  # (n, 4)
    d_bits = ((sc >> 12) << torch.tensor([0, 4, 8, 12], device=b.device)).sum(dim=1)
    d = ((d_bits ^ 0x8000) - 0x8000).to(torch.int16).view(torch.float16).float().reshape(n, 1)
    s = (sc.unsqueeze(-1) >> torch.tensor([0, 3, 6, 9], device=b.device)) & 7
    dl = (d * (2 * s.reshape(n, 16) + 1).float()).reshape(n, 16, 1, 1)
    qh = _bits(b[:, 32:48], 1, 8, 4).reshape(n, 32)
    delta = torch.where((qh & 8) == 0, IQ1_DELTA, -IQ1_DELTA).reshape(n, 16, 2, 1)
    idx = b[:, 0:32].long() | ((qh & 7).long() << 8)
    grid = _rows(_grid(T.IQ1_M, b.device), idx).reshape(n, 16, 2, 8)
    return (dl * (grid + delta)).reshape(n, QK_K)


def _deq_f32(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float32)


def _deq_f16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).float()


def _deq_bf16(b: torch.Tensor) -> torch.Tensor:
    # bf16 is the top half of a float32: widening is exact.
    return b.contiguous().view(torch.bfloat16).float()


BLOCK_DEQUANTIZERS: dict[T, Callable[[torch.Tensor], torch.Tensor]] = {
    T.F32: _deq_f32,
    T.F16: _deq_f16,
    T.BF16: _deq_bf16,
    T.Q4_0: _deq_q4_0,
    T.Q4_1: _deq_q4_1,
    T.Q5_0: _deq_q5_0,
    T.Q5_1: _deq_q5_1,
    T.Q8_0: _deq_q8_0,
    T.Q2_K: _deq_q2_k,
    T.Q3_K: _deq_q3_k,
    T.Q4_K: _deq_q4_k,
    T.Q5_K: _deq_q5_k,
    T.Q6_K: _deq_q6_k,
    T.IQ4_NL: _deq_iq4_nl,
    T.IQ4_XS: _deq_iq4_xs,
    T.MXFP4: _deq_mxfp4,
    T.NVFP4: _deq_nvfp4,
    T.TQ1_0: _deq_tq1_0,
    T.TQ2_0: _deq_tq2_0,
    T.IQ2_XXS: _deq_iq2_xxs,
    T.IQ2_XS: _deq_iq2_xs,
    T.IQ2_S: _deq_iq2_s,
    T.IQ3_XXS: _deq_iq3_xxs,
    T.IQ3_S: _deq_iq3_s,
    T.IQ1_S: _deq_iq1_s,
    T.IQ1_M: _deq_iq1_m,
}

# Elements per chunk of the CPU loop: the float32 temporaries of a chunk stay in cache.
_CHUNK_ELEMENTS = 1 << 17


def dequantize_blocks(blocks: torch.Tensor, qtype: T) -> torch.Tensor:
    """Reference dequantization of whole blocks.

    Args:
        blocks: uint8 (n_blocks, type_size).
        qtype: the ggml type.

    Returns:
        float32 (n_blocks, block_size), bit-exact with ``gguf.quants.dequantize``.

    Raises:
        UnsupportedError: the type is not supported.
    """
    fmt, fn = _dequantizer(qtype)
    if blocks.dtype != torch.uint8 or blocks.ndim != 2 or blocks.shape[1] != fmt.type_size:
        raise ValueError(
            f"expected uint8 blocks of shape (n, {fmt.type_size}), got {tuple(blocks.shape)} "
            f"{blocks.dtype}"
        )
    return fn(blocks)


def _dequantizer(qtype: T) -> tuple[BlockFormat, Callable[[torch.Tensor], torch.Tensor]]:
    fmt = block_format(qtype)
    fn = BLOCK_DEQUANTIZERS.get(T(qtype))
    if fn is None:
        raise UnsupportedError(f"tensor type {_type_name(qtype)} is not supported")
    return fmt, fn


# ---------------------------------------------------------------------------------------------
# Backends and the public entry points.
# ---------------------------------------------------------------------------------------------

# fn(data: uint8 1-D, qtype, shape, dtype) -> Tensor of `shape` and `dtype`, or None when the
# backend does not handle this type (the torch reference then does).
DequantFn = Callable[[torch.Tensor, T, tuple[int, ...], torch.dtype], "torch.Tensor | None"]

_BACKENDS: dict[str, tuple[DequantFn, frozenset[str]]] = {}


def register_backend(name: str, fn: DequantFn, device_types: tuple[str, ...] = ("cuda",)) -> None:
    """Register a dequantization backend used by ``backend="auto"`` for tensors on
    ``device_types`` (the latest registration wins); ``backend=name`` selects it explicitly.

    ``fn(data, qtype, shape, dtype)`` gets the flat uint8 bytes and returns the tensor, or
    ``None`` when it does not handle ``qtype``.
    """
    if name == "torch":
        raise ValueError("backend name 'torch' is reserved for the reference implementation")
    _BACKENDS.pop(name, None)
    _BACKENDS[name] = (fn, frozenset(device_types))


def backends() -> list[str]:
    """Names of the available backends, ``"torch"`` first."""
    return ["torch", *_BACKENDS]


def _as_bytes(data) -> torch.Tensor:
    if isinstance(data, np.ndarray):
        # GGUF tensors are views of a read-only memory map; nothing here writes through them.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            data = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8))
    if data.dtype != torch.uint8:
        data = data.contiguous().view(torch.uint8)
    return data.reshape(-1)


def _dequantize_torch(
    data: torch.Tensor, qtype: T, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    fmt, fn = _dequantizer(qtype)
    blocks = data.view(-1, fmt.type_size)
    n_blocks = blocks.shape[0]
    out = torch.empty((n_blocks, fmt.block_size), dtype=dtype, device=data.device)
    step = max(1, _CHUNK_ELEMENTS // fmt.block_size)
    # On the CPU this loop is memory-bound and its ops are small: intra-op threads gain little
    # and, when the cores are busy with other processes, their spin-waits slow it down 10-20x
    # (measured on a shared 2-core box). One thread is fast and predictable.
    threads = torch.get_num_threads()
    single = data.device.type == "cpu" and threads > 1
    if single:
        torch.set_num_threads(1)
    try:
        for i in range(0, n_blocks, step):
            out[i : i + step] = fn(blocks[i : i + step])  # the copy rounds to `dtype` once
    finally:
        if single:
            torch.set_num_threads(threads)
    return out.view(shape)


def dequantize(
    data: torch.Tensor | np.ndarray,
    qtype: T,
    shape: tuple[int, ...],
    *,
    dtype: torch.dtype = torch.float32,
    backend: str = "auto",
) -> torch.Tensor:
    """Dequantize the raw bytes of one tensor.

    Args:
        data: the tensor's bytes: uint8 (any shape; contiguous bytes in file order), on any
            device. A numpy array is accepted too.
        qtype: its ggml type.
        shape: logical shape in torch order (GGUF's ``ne`` reversed: rows x cols).
        dtype: output dtype; values are computed in float32 and rounded once.
        backend: ``"auto"`` (a registered backend for the data's device that handles the
            type, else ``"torch"``), ``"torch"`` or a registered name.

    Returns:
        ``dtype`` tensor of ``shape`` on the data's device; with float32 it is bit-exact with
        ``gguf.quants.dequantize``. Always a new tensor (never a view of ``data``).

    Raises:
        UnsupportedError: the type is not supported ("tensor type Q8_K is not supported";
            callers add the tensor name).
        ValueError: the byte count does not match ``shape`` or the row length is not a
            multiple of the block size; an unknown backend name.
    """
    fmt, _ = _dequantizer(qtype)
    qtype = T(qtype)
    shape = tuple(int(s) for s in shape)
    data = _as_bytes(data)
    n = 1
    for s in shape:
        n *= s
    if shape and shape[-1] % fmt.block_size:
        raise ValueError(
            f"row length {shape[-1]} is not a multiple of the {qtype.name} block size "
            f"{fmt.block_size}"
        )
    expected = n // fmt.block_size * fmt.type_size
    if data.numel() != expected:
        raise ValueError(
            f"{qtype.name} tensor of shape {list(shape)} needs {expected} bytes, got {data.numel()}"
        )
    if backend == "auto":
        for fn, devices in reversed(list(_BACKENDS.values())):
            if data.device.type in devices:
                out = fn(data, qtype, shape, dtype)
                if out is not None:
                    return out
    elif backend != "torch":
        if backend not in _BACKENDS:
            raise ValueError(f"unknown dequantization backend {backend!r}; have {backends()}")
        out = _BACKENDS[backend][0](data, qtype, shape, dtype)
        if out is not None:
            return out
    return _dequantize_torch(data, qtype, shape, dtype)


def dequantize_to(
    data: torch.Tensor | np.ndarray,
    qtype: T,
    shape: tuple[int, ...],
    dtype: torch.dtype = torch.float16,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """:func:`dequantize` with the result rounded to ``dtype`` (float16 by default)."""
    return dequantize(data, qtype, shape, dtype=dtype, backend=backend)
