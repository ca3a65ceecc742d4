"""Block quantizers of the 32-element ggml types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4.

Each follows the reference (non-imatrix) rounding of llama.cpp's ``ggml-quants.c``
(``quantize_row_q4_0_ref`` ...), which is what ``llama-quantize`` uses without an importance
matrix. All functions take ``x``: float32 torch tensor (n_blocks, 32) and return the packed
blocks as a uint8 numpy array (n_blocks, type_size), byte-compatible with
``gguf.quants.dequantize``.
"""

from __future__ import annotations

import numpy as np
import torch


def fp16_bytes(v: torch.Tensor) -> torch.Tensor:
    """(n,) float32 -> (n, 2) uint8: IEEE half, round-to-nearest-even (GGML_FP32_TO_FP16)."""
    return v.to(torch.float16).contiguous().view(torch.uint8).reshape(-1, 2)


def fp16_round(v: torch.Tensor) -> torch.Tensor:
    """The float32 value a scale has after being stored as fp16."""
    return v.to(torch.float16).to(torch.float32)


def roundf(v: torch.Tensor) -> torch.Tensor:
    """C ``roundf``: nearest integer, ties away from zero (torch.round rounds ties to even)."""
    t = torch.trunc(v)
    tie = (v - t).abs() == 0.5
    return torch.where(tie, t + torch.sign(v), torch.round(v))


def signed_absmax(x: torch.Tensor) -> torch.Tensor:
    """(..., n) -> (...): the element of largest magnitude, with its sign (first one on ties)."""
    idx = x.abs().argmax(dim=-1, keepdim=True)
    return x.gather(-1, idx)[..., 0]


def _safe_inv(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d != 0, 1.0 / torch.where(d != 0, d, 1.0), 0.0)


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """(nb, 32) values 0..15 -> (nb, 16): element j in the low nibble, j+16 in the high one."""
    q = q.to(torch.uint8)
    return (q[:, :16] & 0xF) | ((q[:, 16:] & 0xF) << 4)


def _pack_high_bits(q: torch.Tensor) -> torch.Tensor:
    """(nb, 32) 5-bit values -> (nb, 4) little-endian uint32 of their bit 4 (element j -> bit j)."""
    bits = ((q.to(torch.int64) >> 4) & 1).reshape(-1, 4, 8)
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.int64)
    return (bits * weights).sum(-1).to(torch.uint8)


def _cat(parts: list[torch.Tensor]) -> np.ndarray:
    return torch.cat(parts, dim=1).numpy()


def quantize_q8_0(x: torch.Tensor) -> np.ndarray:
    """Q8_0: d = absmax/127, q = roundf(x/d) (int8). Layout: d fp16, 32 x int8."""
    d = x.abs().amax(-1) / 127
    q = roundf(x * _safe_inv(d)[:, None]).to(torch.int8).view(torch.uint8)
    return _cat([fp16_bytes(d), q])


def quantize_q4_0(x: torch.Tensor) -> np.ndarray:
    """Q4_0: d = max/-8 (max: signed absmax), q = min(15, trunc(x/d + 8.5)). Layout: d, 16 B."""
    d = signed_absmax(x) / -8
    q = torch.trunc(x * _safe_inv(d)[:, None] + 8.5).clamp(0, 15)
    return _cat([fp16_bytes(d), _pack_nibbles(q)])


def quantize_q4_1(x: torch.Tensor) -> np.ndarray:
    """Q4_1: d = (max-min)/15, m = min, q = trunc((x-m)/d + 0.5). Layout: d, m, 16 B."""
    mn, mx = x.amin(-1), x.amax(-1)
    d = (mx - mn) / 15
    q = torch.trunc((x - mn[:, None]) * _safe_inv(d)[:, None] + 0.5).clamp(0, 15)
    return _cat([fp16_bytes(d), fp16_bytes(mn), _pack_nibbles(q)])


def quantize_q5_0(x: torch.Tensor) -> np.ndarray:
    """Q5_0: d = max/-16, q = min(31, trunc(x/d + 16.5)). Layout: d, qh (u32), 16 B."""
    d = signed_absmax(x) / -16
    q = torch.trunc(x * _safe_inv(d)[:, None] + 16.5).clamp(0, 31)
    return _cat([fp16_bytes(d), _pack_high_bits(q), _pack_nibbles(q)])


def quantize_q5_1(x: torch.Tensor) -> np.ndarray:
    """Q5_1: d = (max-min)/31, m = min, q = trunc((x-m)/d + 0.5). Layout: d, m, qh, 16 B."""
    mn, mx = x.amin(-1), x.amax(-1)
    d = (mx - mn) / 31
    q = torch.trunc((x - mn[:, None]) * _safe_inv(d)[:, None] + 0.5).clamp(0, 31)
    return _cat([fp16_bytes(d), fp16_bytes(mn), _pack_high_bits(q), _pack_nibbles(q)])


# MXFP4's E2M1 values, doubled (ggml's kvalues_mxfp4; the E8M0 scale is halved to match).
_MXFP4_VALUES = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12],
                             dtype=torch.float32)


def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """ggml's ``GGML_E8M0_TO_FP32_HALF``: 2^(e - 128) for E8M0 bytes ``e`` (int tensor),
    built from float32 bits (subnormal for e < 2) -> float32."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    return bits.view(torch.float32)


def quantize_mxfp4(x: torch.Tensor) -> np.ndarray:
    """MXFP4 (OCP microscaling FP4, gpt-oss's experts; ``quantize_row_mxfp4_ref``):
    e = floor(log2(absmax)) - 2 + 127 (0 for an all-zero block), d = 2^(e - 128), each value
    the nearest of d x kvalues_mxfp4 (the first on ties). Layout: e (1 byte), 16 bytes of
    nibbles (element j low, j + 16 high)."""
    amax = x.abs().amax(-1)
    e = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2 + 127,
                    torch.zeros_like(amax)).clamp(0, 255).to(torch.int32)
    d = e8m0_half(e)
    err = (_MXFP4_VALUES * d[:, None, None] - x[:, :, None]).abs()  # (nb, 32, 16)
    q = err.argmin(-1)
    return _cat([e.to(torch.uint8)[:, None], _pack_nibbles(q)])
