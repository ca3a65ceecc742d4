"""Prefill GEMM with on-the-fly dequantization: ``Y[M, N] = X[M, K] @ W[N, K]^T``.

Each program owns a (BLOCK_M, BLOCK_N) tile of ``Y``. Per K step it loads a (BLOCK_M, BLOCK_K)
tile of ``X``, decodes the matching (BLOCK_K, BLOCK_N) tile of ``W`` from its quantized blocks
(:mod:`.decode`), rounds both to float16 (or bfloat16) and multiplies them with ``tl.dot``
(tensor cores), accumulating in float32. The classic tiled-GEMM structure of the Triton
matmul tutorial, with the ``W`` load replaced by block decoding.

Q4_K and Q5_K (most of a Q4_K_M / Q5_K_M model) take a word path: a K step of 64 weights is
one sub-block pair of a 256-weight block, read as 32-bit words (d|dmin, the packed 6-bit
scales, 8 words of nibbles, Q5_K's high bits), each nibble word decoded once into its low
half (the first sub-block) and its high half (the second), multiplied as two ``tl.dot`` of
K = 32. The default tile is 128 x 64 with 8 warps for prompts of more than 64 rows (the
weight decode shared by twice the rows of the 64-row tile), loads pipelined by Triton over
:data:`NUM_STAGES` stages.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._jit import device_fn, kernel
from .decode import (
    GROUP_SIZES,
    Q4_K,
    Q5_K,
    _kquant_scale_min_words,
    decode,
    decode_grouped,
    decode_planes,
)
from .gemv import check_operands

# Types of the word path: code -> words per block (Q4_K: 144 bytes, Q5_K: 176).
WORD_TYPES = {12: 36, 13: 44}
# Software-pipeline depth of the main loop.
NUM_STAGES = 3


@device_fn
def _kq_pair(wp, blkw, pair, QTYPE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Q4_K / Q5_K: the 64 weights of sub-block pair ``pair`` (0..3) of the blocks at word
    offsets ``blkw`` (1, BLOCK_N), as two (32, BLOCK_N) float32 tiles: the first sub-block
    from the low nibbles, the second from the high nibbles of the same words."""
    s0 = 2 * pair
    sc0, m0 = _kquant_scale_min_words(wp, blkw, s0)
    sc1, m1 = _kquant_scale_min_words(wp, blkw, s0 + 1)
    w = tl.arange(0, 8)[:, None, None]
    t = tl.arange(0, 4)[None, :, None] * 8
    if QTYPE == Q4_K:  # 36 words: d|dmin, scales[12], qs[128] at word 4
        q = tl.load(wp + blkw[None, :, :] + 4 + pair * 8 + w)
    else:  # Q5_K, 44 words: d|dmin, scales[12], qh[32] at word 4, qs[128] at word 12
        q = tl.load(wp + blkw[None, :, :] + 12 + pair * 8 + w)
    b = (q >> t) & 255  # (8, 4, BLOCK_N): byte 4w + t of the pair's 32 bytes
    lo = b & 15
    hi = b >> 4
    if QTYPE == Q5_K:
        qh = tl.load(wp + blkw[None, :, :] + 4 + w)
        hb = (qh >> t) & 255
        lo = lo | (((hb >> s0) & 1) << 4)
        hi = hi | (((hb >> (s0 + 1)) & 1) << 4)
    lo = tl.reshape(lo, (32, BLOCK_N)).to(tl.float32)
    hi = tl.reshape(hi, (32, BLOCK_N)).to(tl.float32)
    return sc0 * lo - m0, sc1 * hi - m1


@device_fn
def _mma(acc, a, b, BF16: tl.constexpr, EMULATE: tl.constexpr):
    """acc + a @ b with a and b rounded to float16 (bfloat16 with ``BF16``), float32 sums.
    ``EMULATE``: bfloat16 rounding, then float32 products (exact for bfloat16 values), for
    Triton's interpreter, which has no bfloat16 arithmetic."""
    if BF16:
        if EMULATE:
            return acc + tl.dot(a.to(tl.bfloat16).to(tl.float32), b.to(tl.bfloat16).to(tl.float32),
                                input_precision="ieee")  # fmt: skip
        return acc + tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    return acc + tl.dot(a.to(tl.float16), b.to(tl.float16))


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
    WORDS: tl.constexpr,
    EMULATE: tl.constexpr,
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
    if WORDS > 0:
        # BLOCK_K == 64: one sub-block pair a step, both halves from one load of the words.
        # Rows past N read row N-1 (no masks on the weight loads) and are not stored.
        wp = w.to(tl.pointer_type(tl.int32))
        row_w = (tl.minimum(rn, N - 1).to(tl.int64) * ((K // BS) * WORDS))[None, :]
        rk = tl.arange(0, 32)
        xm = m_mask[:, None]
        for k0 in range(0, K, 64):
            w_lo, w_hi = _kq_pair(wp, row_w + (k0 // 256) * WORDS, (k0 % 256) // 64, QTYPE,
                                  BLOCK_N)
            x_lo = tl.load(x_rows[:, None] + (k0 + rk)[None, :], mask=xm, other=0.0)
            x_hi = tl.load(x_rows[:, None] + (k0 + 32 + rk)[None, :], mask=xm, other=0.0)
            acc = _mma(acc, x_lo, w_lo, BF16, EMULATE)
            acc = _mma(acc, x_hi, w_hi, BF16, EMULATE)
    else:
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            k_mask = rk < K
            xt = tl.load(x_rows[:, None] + rk[None, :], mask=m_mask[:, None] & k_mask[None, :],
                         other=0.0)  # fmt: skip
            if G > 0:
                # Decode as (groups, G, BLOCK_N): scales once per group, then flatten.
                g = k0 // G + tl.arange(0, BLOCK_K // G)
                gmask = (g < K // G)[:, None, None] & n_mask[None, None, :]
                e = tl.arange(0, G)[None, :, None]
                if PLANES:  # block indices; scales per group, weight bits per weight
                    bi = (rn.to(tl.int64)[None, None, :] * (K // BS)
                          + (g // (BS // G))[:, None, None])
                    j = (g % (BS // G))[:, None, None] * G + e
                    wt3 = decode_planes(w, N * (K // BS), bi, j, gmask, QTYPE)
                else:
                    blk = row[None, None, :] + ((g // (BS // G)) * TS)[:, None, None]
                    wt3 = decode_grouped(blk, (g % (BS // G))[:, None, None], e, gmask, QTYPE)
                wt = tl.reshape(wt3, (BLOCK_K, BLOCK_N))
            else:
                wmask = k_mask[:, None] & n_mask[None, :]
                if PLANES:
                    bi = rn.to(tl.int64)[None, :] * (K // BS) + (rk // BS)[:, None]
                    wt = decode_planes(w, N * (K // BS), bi, (rk % BS)[:, None], wmask, QTYPE)
                else:
                    wt = decode(row[None, :] + ((rk // BS) * TS)[:, None], (rk % BS)[:, None],
                                wmask, QTYPE)  # fmt: skip
            acc = _mma(acc, xt, wt, BF16, EMULATE)
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
    block_m: int | None = None,
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
        block_m, block_n, block_k: tile sizes (powers of two, >= 16); ``block_m`` by default
            128 (8 warps) for more than 64 rows, else 64 (4 warps).
        grouped: decode weight tiles group by group (scales loaded once per group; needs
            ``block_k`` >= the type's group size) rather than weight by weight; Q4_K and Q5_K
            with ``block_k`` 64 take the word path (see the module docstring).
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
    if block_m is None:
        block_m = 128 if m > 64 else 64
    g = GROUP_SIZES.get(qtype, 0) if grouped else 0
    if block_k % max(g, 1):
        g = 0
    words = WORD_TYPES.get(int(qtype), 0) if grouped and block_k == 64 and layout == "blocks" else 0
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
        WORDS=words,
        EMULATE=bf16 and not x.is_cuda,
        PLANES=layout == "planes",
        num_warps=8 if block_m >= 128 else 4,
        num_stages=NUM_STAGES,
        enable_fp_fusion=True,
    )
    return y
