"""Block geometry of the ggml tensor types and the torch reference dequantizer.

A ggml tensor row is a sequence of fixed-size blocks; each block stores ``block_size``
weights in ``type_size`` bytes (scales first or last, then packed integers). The layouts
follow ggml's ``block_q*`` structs (llama.cpp ``ggml/src/ggml-common.h``) and the
dequantizers follow ``dequantize_row_q*`` (``ggml/src/ggml-quants.c``).

Every function here is bit-exact with ``gguf.quants.dequantize`` (numpy): fp16 scales are
widened to float32 exactly, integer parts are exact, and the float32 operations (products
of scales, then ``d * q`` and ``- m``) happen in the same order with one rounding each.

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
from gguf import GGMLQuantizationType as T

from ..errors import UnsupportedError

QK_K = 256  # weights per K-quant super-block
QK = 32  # weights per legacy (Q4_0 .. Q8_0) block


@dataclass(frozen=True)
class BlockFormat:
    """``block_size`` weights are stored in ``type_size`` bytes."""

    block_size: int
    type_size: int


# The one table of block geometry. Byte sizes are written as the sum of the struct's fields,
# in storage order ("d" = fp16 scale, "dmin"/"m" = fp16 minimum, "qs" = packed low bits,
# "qh" = packed high bits, "scales" = packed sub-block scales).
BLOCK_FORMATS: dict[T, BlockFormat] = {
    T.F32: BlockFormat(1, 4),
    T.F16: BlockFormat(1, 2),
    T.BF16: BlockFormat(1, 2),
    T.Q4_0: BlockFormat(QK, 2 + QK // 2),  # d, qs
    T.Q4_1: BlockFormat(QK, 2 + 2 + QK // 2),  # d, m, qs
    T.Q5_0: BlockFormat(QK, 2 + 4 + QK // 2),  # d, qh, qs
    T.Q5_1: BlockFormat(QK, 2 + 2 + 4 + QK // 2),  # d, m, qh, qs
    T.Q8_0: BlockFormat(QK, 2 + QK),  # d, qs (int8)
    T.Q2_K: BlockFormat(QK_K, QK_K // 16 + QK_K // 4 + 2 + 2),  # scales, qs, d, dmin
    T.Q3_K: BlockFormat(QK_K, QK_K // 8 + QK_K // 4 + 12 + 2),  # hmask, qs, scales, d
    T.Q4_K: BlockFormat(QK_K, 2 + 2 + 12 + QK_K // 2),  # d, dmin, scales, qs
    T.Q5_K: BlockFormat(QK_K, 2 + 2 + 12 + QK_K // 8 + QK_K // 2),  # d, dmin, scales, qh, qs
    T.Q6_K: BlockFormat(QK_K, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2),  # ql, qh, scales, d
}


def block_format(qtype: T) -> BlockFormat:
    """Geometry of ``qtype``.

    Raises:
        UnsupportedError: the type is not in :data:`BLOCK_FORMATS`.
    """
    try:
        return BLOCK_FORMATS[T(qtype)]
    except (KeyError, ValueError):
        raise UnsupportedError(f"tensor type {_type_name(qtype)} is not supported") from None


def bits_per_weight(qtype: T) -> float:
    """Storage cost of ``qtype`` in bits per weight, scales included (Q4_K -> 4.5).

    Raises:
        UnsupportedError: the type is not supported.
    """
    fmt = block_format(qtype)
    return 8 * fmt.type_size / fmt.block_size


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
    fmt = block_format(qtype)
    if blocks.dtype != torch.uint8 or blocks.ndim != 2 or blocks.shape[1] != fmt.type_size:
        raise ValueError(
            f"expected uint8 blocks of shape (n, {fmt.type_size}), got {tuple(blocks.shape)} "
            f"{blocks.dtype}"
        )
    return BLOCK_DEQUANTIZERS[T(qtype)](blocks)


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
    fmt = BLOCK_FORMATS[qtype]
    fn = BLOCK_DEQUANTIZERS[qtype]
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
        UnsupportedError: the type is not supported ("tensor type IQ2_XS is not supported";
            callers add the tensor name).
        ValueError: the byte count does not match ``shape`` or the row length is not a
            multiple of the block size; an unknown backend name.
    """
    fmt = block_format(qtype)
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
