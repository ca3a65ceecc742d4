"""Fused dequantize x vector for decode: ``Y[b, n] = sum_k W[n, k] * X[b, k]``.

The kernel reads the quantized blocks of ``W`` directly (no float16 copy of the weights ever
exists), decodes a (BLOCK_N, BLOCK_K) tile in registers (:mod:`.decode`) and accumulates in
float32 against up to 8 input vectors at once (a small decode batch). A single vector (the
common decode step) takes a kernel whose tile is (rows, scale groups, group size), so that
each scale is loaded once per group rather than once per weight. Matrices that share
the input (Q/K/V, gate/up) are fused by concatenating their rows (``QuantWeight.cat``): one
launch covers the concatenated row range.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from localllm.gguf.quants import block_format

from ._jit import kernel
from .decode import GROUP_SIZES, decode, decode_grouped

MAX_BATCH = 8


@kernel
def _gemv1_kernel(w, x, y, N, K, BS: tl.constexpr, TS: tl.constexpr, QTYPE: tl.constexpr,
                  G: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr):  # fmt: skip
    # One vector: the tile is (rows, scale groups, weights of a group), so the scales are
    # loaded once per group and only the packed bits once per weight.
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    row = w + rn.to(tl.int64) * ((K // BS) * TS)
    e = tl.arange(0, G)[None, None, :]
    n_groups = K // G
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for g0 in range(0, n_groups, GROUPS):
        g = g0 + tl.arange(0, GROUPS)
        gmask = n_mask[:, None, None] & (g < n_groups)[None, :, None]
        blk = row[:, None, None] + ((g // (BS // G)) * TS)[None, :, None]
        wv = decode_grouped(blk, (g % (BS // G))[None, :, None], e, gmask, QTYPE)
        xv = tl.load(x + (g * G)[None, :, None] + e, mask=(g < n_groups)[None, :, None], other=0.0)
        acc += tl.sum(tl.sum(wv * xv.to(tl.float32), axis=2), axis=1)
    tl.store(y + rn, acc.to(y.dtype.element_ty), mask=n_mask)


@kernel
def _gemv_kernel(
    w,
    x,
    y,
    N,
    K,
    B,
    stride_xb,
    stride_yb,
    BS: tl.constexpr,
    TS: tl.constexpr,
    QTYPE: tl.constexpr,
    B_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rb = tl.arange(0, B_PAD)
    n_mask = rn < N
    b_mask = rb < B
    row = w + rn.to(tl.int64) * ((K // BS) * TS)  # first byte of each row
    acc = tl.zeros((B_PAD, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_mask = rk < K
        wmask = n_mask[:, None] & k_mask[None, :]
        wv = decode(row[:, None] + ((rk // BS) * TS)[None, :], (rk % BS)[None, :], wmask, QTYPE)
        xv = tl.load(
            x + rb[:, None] * stride_xb + rk[None, :],
            mask=b_mask[:, None] & k_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(wv[None, :, :] * xv[:, None, :], axis=2)
    ymask = b_mask[:, None] & n_mask[None, :]
    tl.store(y + rb[:, None] * stride_yb + rn[None, :], acc.to(y.dtype.element_ty), mask=ymask)


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def check_operands(
    name: str, w_data: torch.Tensor, qtype, n_out: int, x: torch.Tensor, rows: str = "B"
):
    """The block format of ``qtype`` and ``x`` with contiguous rows, for ``x @ W.T`` with
    ``W`` (n_out, K) in ``w_data``'s blocks (shared by the GEMV and GEMM launchers).

    Raises:
        ValueError: ``x`` is not 2-D, or K and the weight bytes disagree.
    """
    fmt = block_format(qtype)
    if x.ndim != 2:
        raise ValueError(f"{name}: x must be ({rows}, K), got {tuple(x.shape)}")
    k = x.shape[1]
    if k % fmt.block_size or w_data.numel() != n_out * (k // fmt.block_size) * fmt.type_size:
        raise ValueError(f"{name}: {w_data.numel()} weight bytes do not hold ({n_out}, {k})")
    return fmt, x if x.stride(1) == 1 else x.contiguous()


def gemv(
    w_data: torch.Tensor,
    qtype,
    n_out: int,
    x: torch.Tensor,
    *,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``x @ W.T`` for a few rows, reading ``W`` quantized.

    Args:
        w_data: uint8 (n_out, row_bytes) or flat; the blocks of ``W`` (n_out, K) row by row.
        qtype: ggml type of ``W`` (see :data:`.decode.KERNEL_TYPES`).
        n_out: N, the number of rows of ``W``.
        x: (B, K) float16/float32/bfloat16, B <= 8, same device as ``w_data``; rows contiguous.
        out_dtype: dtype of the result (default ``x.dtype``).

    Returns:
        (B, N) ``out_dtype``; accumulated in float32.

    Raises:
        ValueError: shapes do not agree or B > 8.
    """
    fmt, x = check_operands("gemv", w_data, qtype, n_out, x)
    nb, k = x.shape
    if nb > MAX_BATCH:
        raise ValueError(f"gemv: at most {MAX_BATCH} vectors, got {nb}")
    y = torch.empty((nb, n_out), dtype=out_dtype or x.dtype, device=x.device)
    if nb == 0 or n_out == 0:
        return y
    if nb == 1 and qtype in GROUP_SIZES:
        g = GROUP_SIZES[qtype]
        block_n = 16
        groups = max(1, min(256, _pow2_at_least(k)) // g)  # up to 256 weights per row per step
        _gemv1_kernel[(triton.cdiv(n_out, block_n),)](
            w_data, x, y, n_out, k, BS=fmt.block_size, TS=fmt.type_size, QTYPE=int(qtype),
            G=g, BLOCK_N=block_n, GROUPS=groups, num_warps=4, enable_fp_fusion=True,
        )  # fmt: skip
        return y
    b_pad = _pow2_at_least(nb)
    block_k = min(256, _pow2_at_least(k))
    # Keep the (B_PAD, BLOCK_N, BLOCK_K) product at 4096 values: registers, not local memory.
    block_n = max(1, min(16, 4096 // (b_pad * block_k)))
    grid = (triton.cdiv(n_out, block_n),)
    _gemv_kernel[grid](
        w_data,
        x,
        y,
        n_out,
        k,
        nb,
        x.stride(0),
        y.stride(0),
        BS=fmt.block_size,
        TS=fmt.type_size,
        QTYPE=int(qtype),
        B_PAD=b_pad,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=4,
        enable_fp_fusion=True,
    )
    return y
