"""Prefill GEMM with on-the-fly dequantization: ``Y[M, N] = X[M, K] @ W[N, K]^T``.

Each program owns a (BLOCK_M, BLOCK_N) tile of ``Y``. Per K step it loads a (BLOCK_M, BLOCK_K)
tile of ``X``, decodes the matching (BLOCK_K, BLOCK_N) tile of ``W`` from its quantized blocks
(:mod:`.decode`), rounds both to float16 (or bfloat16) and multiplies them with ``tl.dot``
(tensor cores), accumulating in float32. The classic tiled-GEMM structure of the Triton
matmul tutorial, with the ``W`` load replaced by block decoding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._jit import kernel
from .decode import GROUP_SIZES, decode, decode_grouped, decode_planes
from .gemv import check_operands


@kernel
def _gemm_kernel(
    x,
    w,
    y,
    M,
    N,
    K,
    stride_xm,
    stride_ym,
    BS: tl.constexpr,
    TS: tl.constexpr,
    QTYPE: tl.constexpr,
    G: tl.constexpr,
    BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PLANES: tl.constexpr = False,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rm < M
    n_mask = rn < N
    row = w + rn.to(tl.int64) * ((K // BS) * TS)  # first byte of each row of W
    x_rows = x + rm.to(tl.int64) * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_mask = rk < K
        xt = tl.load(
            x_rows[:, None] + rk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0
        )
        if G > 0:
            # Decode as (groups, G, BLOCK_N): scales once per group, then flatten to K rows.
            g = k0 // G + tl.arange(0, BLOCK_K // G)
            gmask = (g < K // G)[:, None, None] & n_mask[None, None, :]
            blk = row[None, None, :] + ((g // (BS // G)) * TS)[:, None, None]
            e = tl.arange(0, G)[None, :, None]
            if PLANES:  # block indices; scales per group, weight bits per weight
                bi = rn.to(tl.int64)[None, None, :] * (K // BS) + (g // (BS // G))[:, None, None]
                j = (g % (BS // G))[:, None, None] * G + e
                wt3 = decode_planes(w, N * (K // BS), bi, j, gmask, QTYPE)
            else:
                wt3 = decode_grouped(blk, (g % (BS // G))[:, None, None], e, gmask, QTYPE)
            wt = tl.reshape(wt3, (BLOCK_K, BLOCK_N))
        else:
            wmask = k_mask[:, None] & n_mask[None, :]
            if PLANES:
                bi = rn.to(tl.int64)[None, :] * (K // BS) + (rk // BS)[:, None]
                wt = decode_planes(w, N * (K // BS), bi, (rk % BS)[:, None], wmask, QTYPE)
            else:
                wt = decode(row[None, :] + ((rk // BS) * TS)[:, None], (rk % BS)[:, None], wmask,
                            QTYPE)  # fmt: skip
        if BF16:
            acc += tl.dot(xt.to(tl.bfloat16), wt.to(tl.bfloat16))
        else:
            acc += tl.dot(xt.to(tl.float16), wt.to(tl.float16))
    ymask = m_mask[:, None] & n_mask[None, :]
    y_ptrs = y + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
    tl.store(y_ptrs, acc.to(y.dtype.element_ty), mask=ymask)


def gemm(
    w_data: torch.Tensor,
    qtype,
    n_out: int,
    x: torch.Tensor,
    *,
    out_dtype: torch.dtype | None = None,
    bf16: bool = False,
    block_m: int = 64,
    block_n: int = 64,
    block_k: int = 64,
    grouped: bool = True,
    layout: str = "blocks",
) -> torch.Tensor:
    """``x @ W.T`` with ``W`` dequantized tile by tile.

    Args:
        w_data: uint8 blocks of ``W`` (n_out, K), row by row.
        qtype: ggml type of ``W`` (see :data:`.decode.KERNEL_TYPES`).
        n_out: N.
        x: (M, K) float16/float32/bfloat16 on ``w_data``'s device.
        out_dtype: dtype of the result (default ``x.dtype``).
        bf16: multiply in bfloat16 instead of float16 (for activations beyond fp16's range).
        block_m, block_n, block_k: tile sizes (powers of two, >= 16).
        grouped: decode weight tiles group by group (scales loaded once per group; needs
            ``block_k`` >= the type's group size) rather than weight by weight.
        layout: "blocks" (file order) or "planes" (``localllm.kernels.PLANES``).

    Returns:
        (M, N) ``out_dtype``: float16 (or bfloat16) products, float32 accumulation.

    Raises:
        ValueError: shapes do not agree.
    """
    fmt, x = check_operands("gemm", w_data, qtype, n_out, x, rows="M", layout=layout)
    m, k = x.shape
    y = torch.empty((m, n_out), dtype=out_dtype or x.dtype, device=x.device)
    if m == 0 or n_out == 0:
        return y
    g = GROUP_SIZES.get(qtype, 0) if grouped else 0
    if block_k % max(g, 1):
        g = 0
    grid = (triton.cdiv(m, block_m), triton.cdiv(n_out, block_n))
    _gemm_kernel[grid](
        x,
        w_data,
        y,
        m,
        n_out,
        k,
        x.stride(0),
        y.stride(0),
        BS=fmt.block_size,
        TS=fmt.type_size,
        QTYPE=int(qtype),
        G=g,
        BF16=bf16,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PLANES=layout == "planes",
        num_warps=4,
        enable_fp_fusion=True,
    )
    return y
