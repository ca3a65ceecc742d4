"""Prefill GEMM with on-the-fly dequantization: ``Y[M, N] = X[M, K] @ W[N, K]^T``.

The weights stay in their ggml blocks (or planes, ``QuantWeight.aligned``); each program
decodes a tile of them into registers once per K step and multiplies it with tensor cores
(``tl.dot``: Hopper's ``wgmma`` with the weights as the register operand, ``mma`` on older
GPUs), accumulating in float32. The product is computed transposed, ``Y^T = W @ X^T``: a
program owns BLOCK_N weight rows by BLOCK_M activation rows, the weights are the A operand
(from registers: decoded there, never written to global memory as floats; Triton passes
the decoded tile once through shared memory to reach wgmma's operand layout) and the
activations the B operand (from shared memory, loads pipelined by Triton over
:data:`NUM_STAGES` stages). A decoded weight is reused by the BLOCK_M (128) activation rows
of the tile, an activation by its BLOCK_N (128) weight rows. Where those tiles would leave
the GPU's last wave mostly idle, K is split in two (a float32 result) or the weight tiles
halved (:func:`gemm_config`).

Decoding (:mod:`.gemm_decode`): the types with a chunk decoder (every quant type, from the
layout a loaded model keeps it in) read 32 weights of a row from 32-bit words, build each
weight's float16 from its byte with one byte permute per two weights and scale them with
one float16 FMA per two weights (``HFMA2``). Other weights (F16, BF16, F32, and quant types
in a layout without a chunk decoder) are decoded weight by weight (:func:`.decode.decode`)
in float32. With ``BF16`` (Gemma's activations, beyond float16's range) the decoded weights
are rounded to bfloat16 from float32 instead.

Static profile (``bench/kernel_profile.py``): sm_90 SASS with ``HGMMA`` in the main loop, no
spills; an estimate of the share of the H100's dense float16 peak on Llama-3-8B's
matrices at 512 rows, from the compiled loop.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._jit import device_fn, kernel
from .decode import decode_tile
from .gemm_decode import MAX_STEP, MIN_STEP, chunks_tile, has_chunks, step_shared
from .gemv import TARGET_SMS, check_operands

# Software-pipeline depth of the main loop (2 for K steps of 128: shared memory for two CTAs
# an SM).
NUM_STAGES = 3


@device_fn
def _mma(acc, w, xt, BF16: tl.constexpr, EMULATE: tl.constexpr):
    """acc + w @ xt with w and xt rounded to float16 (bfloat16 with ``BF16``), float32 sums.
    ``EMULATE``: bfloat16 rounding, then float32 products (exact for bfloat16 values), for
    Triton's interpreter, which has no bfloat16 arithmetic."""
    if BF16:
        if EMULATE:
            return acc + tl.dot(w.to(tl.bfloat16).to(tl.float32),
                                xt.to(tl.bfloat16).to(tl.float32), input_precision="ieee")
        return tl.dot(w.to(tl.bfloat16), xt.to(tl.bfloat16), acc)
    return tl.dot(w.to(tl.float16), xt.to(tl.float16), acc)


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
    BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CHUNKS: tl.constexpr,
    EMULATE: tl.constexpr,
    ASM: tl.constexpr,
    PLANES: tl.constexpr = False,
    SPLIT_K: tl.constexpr = 1,
):
    # Program (activation rows pid 0, weight rows pid 1): the programs of one weight tile
    # are launched together, so that its bytes come from DRAM once.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    # SPLIT_K > 1: program_id(2) takes 1 / SPLIT_K of K (a multiple of BLOCK_K) and adds its
    # sums into a zeroed Y
    k_lo = tl.program_id(2) * (K // SPLIT_K)
    k_hi = k_lo + K // SPLIT_K
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rm < M
    x_rows = x + rm.to(tl.int64) * stride_xm
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if CHUNKS:
        # BLOCK_K / 32 chunks a step, sharing their scales' loads, multiplied 64 weights
        # (DOT_K) at a time. Rows past N read row N-1 (no masks on the weight loads) and are
        # not stored.
        DOT_K: tl.constexpr = min(BLOCK_K, 64)
        wp = w.to(tl.pointer_type(tl.int32))
        nb = K // BS
        blk_row = (tl.minimum(rn, N - 1).to(tl.int64) * nb)[:, None]
        rk = tl.arange(0, DOT_K)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            blk0 = blk_row + k0 // BS
            shared = step_shared(wp, N * nb, blk0, k0 % BS, QTYPE)
            for d in tl.static_range(BLOCK_K // DOT_K):
                wt = chunks_tile(wp, N * nb, blk0, k0 % BS, shared, d * (DOT_K // 32),
                                 DOT_K // 32, BLOCK_K, QTYPE, BLOCK_N, ASM, BF16)  # fmt: skip
                xt = tl.load(x_rows[:, None] + (k0 + d * DOT_K + rk)[None, :],
                             mask=m_mask[:, None], other=0.0)  # fmt: skip
                acc = _mma(acc, wt, tl.trans(xt), BF16, EMULATE)
    else:
        n_mask = rn < N
        row = w + rn.to(tl.int64) * ((K // BS) * TS)  # first byte of each row of W
        for k0 in range(k_lo, k_hi, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            k_mask = rk < K
            wmask = n_mask[:, None] & k_mask[None, :]
            wt = decode_tile(w, row, rn, rk, wmask, N, K, BS, TS, QTYPE, PLANES)
            xt = tl.load(x_rows[:, None] + rk[None, :], mask=m_mask[:, None] & k_mask[None, :],
                         other=0.0)  # fmt: skip
            acc = _mma(acc, wt, tl.trans(xt), BF16, EMULATE)
    ymask = (rn < N)[:, None] & m_mask[None, :]
    y_ptrs = y + rm.to(tl.int64)[None, :] * stride_ym + rn[:, None]
    if SPLIT_K > 1:  # two halves into zeros: 0 + a + b in either order, the same float32
        tl.atomic_add(y_ptrs, acc, mask=ymask, sem="relaxed")
    else:
        tl.store(y_ptrs, acc.to(y.dtype.element_ty), mask=ymask)


def _wave_efficiency(ctas: int, sms: int = TARGET_SMS) -> float:
    """Share of the SMs busy over the waves of ``ctas`` programs (one at a time an SM)."""
    return ctas / (triton.cdiv(ctas, sms) * sms)


def gemm_config(m: int, k: int, qtype, layout: str = "blocks", *, n: int | None = None,
                block_m: int | None = None, block_n: int | None = None, block_k: int = 128,
                grouped: bool = True, split_k: bool | int = False) -> dict:  # fmt: skip
    """Launch shape of :func:`gemm` for ``m`` activation rows, K = ``k`` (and N = ``n``):
    BLOCK_M (128 for more than 64 rows, else 64); BLOCK_N 128 (8 warps: two warpgroups of
    64 rows), or 64 (4 warps) where 128-row tiles would leave more than a fifth of the GPU
    idle in their last wave and 64-row ones would not; BLOCK_K (on the chunk path a multiple
    of 32 dividing K, within the type's :data:`.gemm_decode.MIN_STEP` .. ``MAX_STEP``; else
    the given one); CHUNKS (whether the chunk decoders run); warps and pipeline stages;
    SPLIT_K: ``split_k`` if an int (> 1: K must split into whole steps), else with
    ``split_k`` True (a float32 result the launcher zeroes) 2 where 128 x 128
    tiles would leave the last wave more than a fifth idle and twice as many programs,
    each over half of K, would not (Llama-3-8B's 6144 x 4096 QKV at 512 rows: 192 programs
    on 132 SMs, 384 in halves), rather than 64-row weight tiles (which read the activations
    twice as often)."""
    if block_m is None:
        block_m = 128 if m > 64 else 64
    chunks = grouped and has_chunks(qtype, layout) and k % 32 == 0
    if chunks:
        block_k = min(MAX_STEP, max(MIN_STEP.get(int(qtype), 32), block_k // 32 * 32))
        while k % block_k:
            block_k //= 2
    split = split_k if type(split_k) is int else 1
    if split > 1 and k % (split * block_k):
        raise ValueError(f"gemm: K={k} does not split into {split} x {block_k}-weight steps")
    if block_n is None:
        block_n = 128
        if n is not None and type(split_k) is not int:
            tiles = triton.cdiv(m, block_m) * triton.cdiv(n, 128)
            if _wave_efficiency(tiles) < 0.8:
                if split_k and k % (2 * block_k) == 0 and _wave_efficiency(2 * tiles) >= 0.8:
                    split = 2
                elif _wave_efficiency(triton.cdiv(m, block_m) * triton.cdiv(n, 64)) >= 0.8:
                    block_n = 64
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "CHUNKS": chunks,
            "SPLIT_K": split, "num_warps": 8 if block_n >= 128 else 4,
            "num_stages": NUM_STAGES if block_k <= 64 else 2}


def gemm(
    w_data: torch.Tensor,
    qtype,
    n_out: int,
    x: torch.Tensor,
    *,
    out_dtype: torch.dtype | None = None,
    bf16: bool = False,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int = 128,
    grouped: bool = True,
    layout: str = "blocks",
    split_k: int | None = None,
) -> torch.Tensor:
    """``x @ W.T`` with ``W`` decoded tile by tile on tensor cores (see the module docstring).

    Args:
        w_data: uint8 blocks of ``W`` (n_out, K), row by row (or their planes, ``layout``).
        qtype: ggml type of ``W`` (see :data:`.decode.KERNEL_TYPES`).
        n_out: N.
        x: (M, K) float16/float32/bfloat16 on ``w_data``'s device.
        out_dtype: dtype of the result (default ``x.dtype``).
        bf16: multiply in bfloat16 instead of float16 (for activations beyond fp16's range).
        block_m, block_n, block_k: tile sizes (powers of two, >= 16; see :func:`gemm_config`):
            activation rows (default 128 for more than 64 rows, else 64), weight rows, K.
        grouped: decode 32-weight chunks from words where the type has a chunk decoder in
            ``layout`` (:func:`.gemm_decode.has_chunks`), rather than weight by weight.
        layout: "blocks" (file order) or "planes" (``localllm.kernels.PLANES``).
        split_k: programs along K (their sums added into a zeroed float32 result); default:
            2 where that fills the GPU better (:func:`gemm_config`) and the result is
            float32, else 1.

    Returns:
        (M, N) ``out_dtype``: float16 (or bfloat16) products, float32 accumulation.

    Raises:
        ValueError: shapes do not agree, or K does not split into ``split_k`` whole steps.
    """
    if split_k is not None and split_k > 1 and (out_dtype or x.dtype) != torch.float32:
        raise ValueError("gemm: split_k adds float32 partial sums: out_dtype must be float32")
    fmt, x = check_operands("gemm", w_data, qtype, n_out, x, rows="M", layout=layout)
    m, k = x.shape
    out_dtype = out_dtype or x.dtype
    cfg = gemm_config(m, k, qtype, layout, n=n_out, block_m=block_m, block_n=block_n,
                      block_k=block_k, grouped=grouped,
                      split_k=split_k or out_dtype == torch.float32)  # fmt: skip
    alloc = torch.zeros if cfg["SPLIT_K"] > 1 else torch.empty
    y = alloc((m, n_out), dtype=out_dtype, device=x.device)
    if m == 0 or n_out == 0:
        return y
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n_out, cfg["BLOCK_N"]), cfg["SPLIT_K"])
    _gemm_kernel[grid](
        x, w_data, y, m, n_out, k, x.stride(0), y.stride(0),
        BS=fmt.block_size, TS=fmt.type_size, QTYPE=int(qtype), BF16=bf16,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
        CHUNKS=cfg["CHUNKS"], EMULATE=bf16 and not x.is_cuda, ASM=x.is_cuda,
        PLANES=layout == "planes", SPLIT_K=cfg["SPLIT_K"], num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        enable_fp_fusion=True,
    )  # fmt: skip
    return y
