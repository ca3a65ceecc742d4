"""Prefill attention: a chunk of query positions over the KV cache, flash-attention style.

FlashAttention-2's design (Dao 2023, "FlashAttention-2: Faster Attention with Better
Parallelism and Work Partitioning"): a program owns BLOCK_M query rows and walks the cache's
keys BLOCK_N at a time, with the scores ``Q K^T`` and the weighted values ``P V`` as tensor-core
products (``tl.dot``) and an online softmax (running maximum and sum, the accumulator rescaled
when the maximum grows), so the (T, S) score matrix never exists in memory. The softmax runs
on ``exp2`` with the scale (and log2 e) folded into the queries once.

Grouped-query attention as llama.cpp and :func:`localllm.models.common.attend` do it: the query
heads of a KV group are stacked into one longer sequence of rows (row ``r`` = head ``r // T``
of the group, position ``t = r % T``), so a K/V tile is loaded once for the group's rows.

Which keys a program reads: with slot j holding position j (a full cache, or a ring before it
wraps) only the slots from the block's lowest visible position (its smallest query position
minus the window, without one 0) to its highest query position: the causal and sliding-window
masks skip whole key blocks. With explicit key positions (a wrapped ring,
:class:`localllm.models.cache.RingKVCache`: empty slots -1) every slot, masked per key.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._jit import kernel
from .flash import block_scores, check_attention, online_softmax_start, online_softmax_step

LOG2E = 1.4426950408889634
NUM_STAGES = 2


@kernel
def _prefill_attention_kernel(
    q,
    k_cache,
    v_cache,
    q_pos,
    k_pos,
    out,
    T,
    S,
    window,
    stride_qh,
    stride_qt,
    stride_kh,
    stride_ks,
    stride_vh,
    stride_vs,
    stride_ot,
    qk_scale,
    softcap,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_KPOS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_m = tl.program_id(0)  # block of the KV group's rows (head in group, position)
    kvh = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < GROUP * T
    t = rows % T
    head = kvh * GROUP + rows // T
    rd = tl.arange(0, D_PAD)
    d_ok = rd < D
    qp = tl.load(q_pos + t, mask=row_ok, other=0).to(tl.int32)
    qv = tl.load(q + head.to(tl.int64)[:, None] * stride_qh + t[:, None] * stride_qt + rd[None, :],
                 mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
    # The scale (and log2(e) without soft-capping) folded into q once: the softmax runs on exp2.
    qv = (qv.to(tl.float32) * qk_scale).to(k_cache.dtype.element_ty)

    # The positions any row of the block can see: p_lo .. p_hi.
    p_hi = tl.max(tl.where(row_ok, qp, -1))
    p_lo = 0
    if HAS_WINDOW:
        p_lo = tl.maximum(tl.min(tl.where(row_ok, qp, 2147483647)) - window + 1, 0)
    if HAS_KPOS:  # positions per slot: every slot, masked per key
        lo = 0
        hi = S
        u_lo = 0
        u_hi = 0
    else:  # slot j holds position j: the blocks of slots p_lo .. p_hi only
        hi = tl.minimum(p_hi + 1, S)
        lo = p_lo // BLOCK_N * BLOCK_N
        # FlashAttention-2's split: the key blocks every row sees in full (u_lo .. u_hi) take
        # no masks; those at the causal diagonal and the window's edge do.
        p_min = tl.min(tl.where(row_ok, qp, 2147483647))
        u_hi = tl.maximum(tl.minimum(p_min + 1, hi) // BLOCK_N * BLOCK_N, lo)
        u_lo = lo
        if HAS_WINDOW:
            u_lo = tl.maximum(tl.minimum(tl.cdiv(p_hi - window + 1, BLOCK_N) * BLOCK_N, u_hi),
                              lo)  # fmt: skip
    m_i, l_i, acc = online_softmax_start(BLOCK_M, D_PAD)
    k_base = k_cache + kvh.to(tl.int64) * stride_kh
    v_base = v_cache + kvh.to(tl.int64) * stride_vh
    for j in range(lo, hi, BLOCK_N):
        cols = j + tl.arange(0, BLOCK_N)
        col_ok = cols < hi
        if HAS_KPOS:
            kp = tl.load(k_pos + cols, mask=col_ok, other=-1).to(tl.int32)
            # slots no row sees are not read: an empty or stale slot's bytes never reach the
            # products (0 * NaN would poison a row)
            seen = col_ok & (kp >= p_lo) & (kp <= p_hi)
        else:
            kp = cols
            seen = col_ok & (cols >= p_lo)
        kv_off = cols.to(tl.int64)[:, None]
        ld_mask = seen[:, None] & d_ok[None, :]
        kb = tl.load(k_base + kv_off * stride_ks + rd[None, :], mask=ld_mask, other=0.0)
        vb = tl.load(v_base + kv_off * stride_vs + rd[None, :], mask=ld_mask, other=0.0)
        s = block_scores(qv, kb, softcap, SOFTCAP, IEEE)
        if (j < u_lo) | (j + BLOCK_N > u_hi):  # a block some row does not see in full
            visible = seen[None, :] & (kp[None, :] <= qp[:, None])
            if HAS_WINDOW:
                visible = visible & (qp[:, None] - kp[None, :] < window)
            s = tl.where(visible, s, float("-inf"))
        m_i, l_i, acc = online_softmax_step(s, vb, m_i, l_i, acc, IEEE)
    res = tl.where(l_i[:, None] > 0.0, acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None], 0.0)
    o_ptrs = out + t.to(tl.int64)[:, None] * stride_ot + (head * D)[:, None] + rd[None, :]
    tl.store(o_ptrs, res, mask=row_ok[:, None] & d_ok[None, :])


def prefill_config(d: int, dtype: torch.dtype) -> dict:
    """Tile shape for head_dim ``d`` and a cache of ``dtype``: BLOCK_M query rows, BLOCK_N
    keys a step and warps, that compile for sm_90 without spilling registers
    (tests/test_kernel_compile.py). float16 (CUDA's caches): 64 x 64, one warpgroup (two
    programs an SM; 64-row programs also spread a causal prompt's uneven work over the SMs
    better than 128-row ones: bench/kernel_profile.py estimates 58% against 43% of the
    H100's peak on Llama-3-8B at 512 tokens), 64 x 16 with 8 warps from head_dim 256 on;
    float32 (products in float32 arithmetic, the interpreter's) smaller."""
    d_pad = max(16, triton.next_power_of_2(d))
    if dtype == torch.float16:
        bm, bn, warps = (64, 64, 4) if d_pad <= 128 else (64, 16, 8)
    else:
        bm, bn, warps = (32, 32, 4) if d_pad <= 128 else (16, 16, 4)
    return {"D_PAD": d_pad, "BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps}


def prefill_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor | None,
    *,
    window: int | None,
    scale: float,
    softcap: float | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Attention of a chunk of query positions over the KV cache (flash attention, GQA).

    The same result as :func:`localllm.models.common.attend`: query head h reads KV head
    ``h // (n_heads // n_kv_heads)``, scores ``q . k * scale`` (then ``softcap *
    tanh(score / softcap)`` with ``softcap``: Gemma 2), key j visible for a query at p iff
    ``0 <= k_pos[j] <= p`` and, with a window, ``p - k_pos[j] < window``; softmax over the
    visible keys, then the weighted sum of the values. The products run in the cache's dtype
    (float16 on CUDA: q and the softmax weights rounded to float16), softmax and accumulation
    in float32. Design: FlashAttention-2 (Dao 2023); llama.cpp's ggml-cuda ``fattn`` kernels.

    Args:
        q: (n_heads, T, head_dim) float32/float16, the last dimension contiguous.
        keys, values: (n_kv_heads, S, head_dim) float32/float16, one dtype, on q's device,
            the last dimension contiguous (as ``KVCache.update`` returns them).
        q_positions: (T,) int64, the queries' absolute positions.
        k_positions: (S,) int64 position of each slot (-1: empty), or None when slot j
            holds position j (then only the slots a query block can see are read).
        window: sliding-window size in positions, or None.
        scale: score scale (usually 1/sqrt(head_dim)).
        softcap: attention logit soft-capping, or None.
        block_m, block_n: tile sizes (powers of two >= 16; default :func:`prefill_config`).

    Returns:
        (T, n_heads * head_dim) float32, heads in order. A query with no visible key gives
        zeros (``attend`` would give NaN).

    Raises:
        ValueError: bad shapes, dtypes, head_dim, window, softcap or tile sizes.
    """
    if q.ndim != 3 or keys.ndim != 3 or values.shape != keys.shape:
        raise ValueError(
            f"prefill_attention: want q (H, T, D) and K/V (Hkv, S, D), got {tuple(q.shape)}, "
            f"{tuple(keys.shape)}, {tuple(values.shape)}"
        )
    check_attention("prefill_attention", q, keys, values, q_positions, k_positions, window,
                    softcap, ("q", "keys", "values", "q_positions"))
    n_heads, t, d = q.shape
    n_kv, s, _ = keys.shape
    cfg = prefill_config(d, keys.dtype)
    for name, b in (("block_m", block_m), ("block_n", block_n)):
        if b is not None and (b < 16 or b & (b - 1)):
            raise ValueError(f"prefill_attention: {name} {b} is not a power of two >= 16")
    bm = block_m or cfg["BLOCK_M"]
    bn = block_n or cfg["BLOCK_N"]
    group = n_heads // n_kv
    out = torch.empty((t, n_heads * d), dtype=torch.float32, device=q.device)
    if t == 0:
        return out
    q = q if q.stride(2) == 1 else q.contiguous()
    keys = keys if keys.stride(2) == 1 else keys.contiguous()
    values = values if values.stride(2) == 1 else values.contiguous()
    qk_scale = scale if softcap is not None else scale * LOG2E
    grid = (triton.cdiv(group * t, bm), n_kv)
    _prefill_attention_kernel[grid](
        q, keys, values, q_positions, k_positions if k_positions is not None else q_positions,
        out, t, s, window if window is not None else 0, q.stride(0), q.stride(1),
        keys.stride(0), keys.stride(1), values.stride(0), values.stride(1), out.stride(0),
        qk_scale, softcap if softcap is not None else 1.0,
        GROUP=group, D=d, D_PAD=cfg["D_PAD"], BLOCK_M=bm, BLOCK_N=bn,
        HAS_KPOS=k_positions is not None, HAS_WINDOW=window is not None,
        SOFTCAP=softcap is not None, IEEE=keys.dtype == torch.float32,
        num_warps=cfg["num_warps"] if bm == cfg["BLOCK_M"] else 4,
        num_stages=NUM_STAGES,
    )  # fmt: skip
    return out


def prefill_case(group: int, d: int, *, window: bool = False, kpos: bool = False,
                 softcap: bool = False, kv: str = "*fp16", arch: int = 90):
    """The kernel's specialization as :func:`prefill_attention` launches it, for
    ahead-of-time compilation without a GPU (:mod:`._aot`; tests/test_kernel_compile.py,
    bench/kernel_profile.py): ``group`` query heads per KV head, head_dim ``d``, a window,
    explicit key positions (a wrapped ring), soft-capping, K/V of Triton type ``kv``."""
    from ._aot import Case

    dtype = torch.float32 if kv == "*fp32" else torch.float16
    cfg = prefill_config(d, dtype)
    types = {"q": "*fp32", "k_cache": kv, "v_cache": kv, "q_pos": "*i64", "k_pos": "*i64",
             "out": "*fp32", "T": "i32", "S": "i32", "window": "i32", "stride_qh": "i32",
             "stride_qt": "i32", "stride_kh": "i32", "stride_ks": "i32", "stride_vh": "i32",
             "stride_vs": "i32", "stride_ot": "i32", "qk_scale": "fp32", "softcap": "fp32"}
    constexprs = {"GROUP": group, "D": d, "D_PAD": cfg["D_PAD"], "BLOCK_M": cfg["BLOCK_M"],
                  "BLOCK_N": cfg["BLOCK_N"], "HAS_KPOS": kpos, "HAS_WINDOW": window,
                  "SOFTCAP": softcap, "IEEE": kv == "*fp32"}
    # Pointers and model dimensions are 16-byte multiples; lengths and windows are not.
    aligned = ("q", "k_cache", "v_cache", "q_pos", "k_pos", "out", "stride_qh", "stride_qt",
               "stride_kh", "stride_ks", "stride_vh", "stride_vs", "stride_ot")
    return Case(_prefill_attention_kernel, types, constexprs, num_warps=cfg["num_warps"],
                num_stages=NUM_STAGES, arch=arch, aligned=aligned)
