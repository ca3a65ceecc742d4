"""Decode attention over the KV cache: one query position, split-K ("flash-decoding").

A decode step has a single query per head, so one program per head would leave most of the
GPU idle on a long context. Flash-decoding (Dao et al. 2023, "Flash-Decoding for long-context
inference") also splits the key axis: program (kv_head, split) runs an online softmax over its
slice of the cache for all query heads of its KV group (K/V are loaded once per group, the
point of GQA in decode) and writes a partial (max, sum, weighted values); a second kernel
merges the splits. llama.cpp's ggml-cuda ``fattn-vec`` kernels follow the same design.

Nothing is read on the host: the query position is a device tensor loaded inside the kernel,
grid and shapes depend on shapes only, so a decode step can be captured in a CUDA graph and
replayed at every position. For a full (non-ring) cache the kernel skips the blocks past the
query position (and before the sliding window), so the cost grows with the position, not with
the cache size.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._jit import kernel

LOG2E = 1.4426950408889634
# Programs the default split count aims for: two per SM of an H100 (132 SMs).
TARGET_PROGRAMS = 264
# A split covers at least this many slots, so loading q and writing the partial stay small
# next to the K/V it reads.
MIN_SPLIT_SLOTS = 64
# Budget of the (group, BLOCK_S, head_dim) float32 product per block. With 4 warps, 4096
# keeps ptxas (sm_90) at <= 128 registers and no spills for head_dim 64..256, group 1..8;
# 16384 reached 255 registers with spills. Not timed on a GPU yet.
PRODUCT_BUDGET = 4096


@kernel
def _partial_kernel(
    q,
    k_cache,
    v_cache,
    q_pos_ptr,
    k_pos,
    ws_m,
    ws_l,
    ws_acc,
    S,
    window,
    split_len,
    n_splits,
    stride_qh,
    stride_kh,
    stride_ks,
    stride_vh,
    stride_vs,
    qk_scale,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    RING: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    kvh = tl.program_id(0)
    split = tl.program_id(1)
    rg = tl.arange(0, GROUP_PAD)
    rd = tl.arange(0, D)
    rs = tl.arange(0, BLOCK_S)
    g_mask = rg < GROUP
    heads = kvh * GROUP + rg
    # scale * log2(e) folded into q once: the softmax then runs on exp2.
    qv = tl.load(q + heads[:, None] * stride_qh + rd[None, :], mask=g_mask[:, None], other=0.0)
    qv = qv.to(tl.float32) * qk_scale
    q_pos = tl.load(q_pos_ptr)

    lo = split * split_len
    hi = tl.minimum(lo + split_len, S)
    if not RING:
        # Slot j holds position j: blocks past the query (or before the window) are skipped
        # entirely, bounds from the loaded position.
        hi = tl.minimum(hi, q_pos + 1)
        if HAS_WINDOW:
            lo = tl.maximum(lo, q_pos - window + 1)

    m_i = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((GROUP_PAD,), tl.float32)
    acc = tl.zeros((GROUP_PAD, D), tl.float32)
    k_base = k_cache + kvh.to(tl.int64) * stride_kh
    v_base = v_cache + kvh.to(tl.int64) * stride_vh
    for start in range(lo, hi, BLOCK_S):
        offs = start + rs
        in_range = offs < hi
        if RING:
            kp = tl.load(k_pos + offs, mask=in_range, other=-1)
            visible = in_range & (kp >= 0) & (kp <= q_pos)
            if HAS_WINDOW:
                visible = visible & (q_pos - kp < window)
        else:
            visible = in_range
        kv_off = offs.to(tl.int64)
        kb = tl.load(k_base + kv_off[:, None] * stride_ks + rd[None, :], mask=visible[:, None],
                     other=0.0).to(tl.float32)  # fmt: skip
        s = tl.sum(qv[:, None, :] * kb[None, :, :], axis=2)  # (GROUP_PAD, BLOCK_S)
        s = tl.where(visible[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row with nothing visible yet keeps m = -inf; subtracting 0 instead avoids
        # exp2(-inf - -inf) = NaN, and exp2(-inf) = 0 leaves it empty.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        vb = tl.load(v_base + kv_off[:, None] * stride_vs + rd[None, :], mask=visible[:, None],
                     other=0.0).to(tl.float32)  # fmt: skip
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * vb[None, :, :], axis=1)
        m_i = m_new

    row = heads.to(tl.int64) * n_splits + split
    tl.store(ws_m + row, m_i, mask=g_mask)
    tl.store(ws_l + row, l_i, mask=g_mask)
    tl.store(ws_acc + row[:, None] * D + rd[None, :], acc, mask=g_mask[:, None])


@kernel
def _combine_kernel(
    ws_m,
    ws_l,
    ws_acc,
    out,
    n_splits,
    D: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
):
    h = tl.program_id(0)
    base = h.to(tl.int64) * n_splits
    rsp = tl.arange(0, SPLITS_PAD)
    m_all = tl.load(ws_m + base + rsp, mask=rsp < n_splits, other=float("-inf"))
    m_max = tl.max(m_all, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # nothing visible: weights all 0
    rc = tl.arange(0, CHUNK)
    rd = tl.arange(0, D)
    num = tl.zeros((D,), tl.float32)
    den = tl.zeros((CHUNK,), tl.float32)
    for c0 in range(0, n_splits, CHUNK):
        sp = c0 + rc
        sp_mask = sp < n_splits
        m_c = tl.load(ws_m + base + sp, mask=sp_mask, other=float("-inf"))
        l_c = tl.load(ws_l + base + sp, mask=sp_mask, other=0.0)
        w = tl.exp2(m_c - m_max)  # empty splits: exp2(-inf) = 0
        a_c = tl.load(ws_acc + (base + sp)[:, None] * D + rd[None, :], mask=sp_mask[:, None],
                      other=0.0)  # fmt: skip
        num += tl.sum(w[:, None] * a_c, axis=0)
        den += w * l_c
    total = tl.sum(den, axis=0)
    # No visible key at all (not a real decode state): zeros rather than NaN.
    res = tl.where(total > 0.0, num / tl.where(total > 0.0, total, 1.0), 0.0)
    tl.store(out + h.to(tl.int64) * D + rd, res)


def _pow2_at_most(n: int) -> int:
    return 1 << max(0, n.bit_length() - 1)


def default_block_s(group: int, head_dim: int) -> int:
    """Slots per block: the (group, BLOCK_S, head_dim) product within a register budget."""
    # Capped at 32: (1, 64, 64) compiled to 206 registers, (1, 32, 64) to 115.
    return max(
        1, min(32, _pow2_at_most(PRODUCT_BUDGET // (triton.next_power_of_2(group) * head_dim)))
    )


def default_n_splits(seq_len: int, n_kv_heads: int, block_s: int) -> int:
    """Splits of the key axis: about ``TARGET_PROGRAMS`` programs, each over >= 64 slots."""
    by_len = triton.cdiv(seq_len, max(MIN_SPLIT_SLOTS, block_s))
    return max(1, min(by_len, triton.cdiv(TARGET_PROGRAMS, n_kv_heads)))


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q_pos: torch.Tensor,
    *,
    k_positions: torch.Tensor | None = None,
    window: int | None = None,
    scale: float,
    n_splits: int | None = None,
    block_s: int | None = None,
) -> torch.Tensor:
    """Attention of one query position over the KV cache (flash-decoding, split-K).

    Same result as :func:`localllm.models.common.attend` for T=1: grouped-query attention
    (query head h reads KV head h // (n_heads // n_kv_heads)), scores ``q . k * scale``, key j
    visible iff ``0 <= k_pos[j] <= q_pos`` and, with a window, ``q_pos - k_pos[j] < window``;
    softmax over the visible keys, then the weighted sum of the values. Accumulates in float32.
    Design after Dao et al. 2023, "Flash-Decoding for long-context inference", and llama.cpp's
    ggml-cuda ``fattn-vec`` kernels.

    Never reads a value on the host (no synchronization): usable inside CUDA-graph capture.

    Args:
        q: (n_heads, head_dim) float32/float16; head_dim a power of two <= 256.
        k_cache, v_cache: (n_kv_heads, S, head_dim) float32/float16, on q's device; the last
            dimension contiguous (other strides free, e.g. one layer of a larger cache).
        q_pos: (1,) int64 on q's device: the query's absolute position.
        k_positions: (S,) int64, absolute position held by each slot (-1: empty) for a ring
            cache; None means slot j holds position j (blocks past ``q_pos`` are skipped).
        window: sliding-window size in positions, or None.
        scale: score scale (usually 1/sqrt(head_dim)).
        n_splits: splits of the key axis (default :func:`default_n_splits`, from shapes).
        block_s: slots per loop step, a power of two (default :func:`default_block_s`).

    Returns:
        (1, n_heads * head_dim) float32, heads in order. A query with no visible key gives
        zeros (``attend`` would give NaN).

    Raises:
        ValueError: bad shapes, dtypes, head_dim, window, n_splits or block_s.
    """
    if q.ndim != 2 or k_cache.ndim != 3 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"decode_attention: want q (H, D) and K/V (Hkv, S, D), got {tuple(q.shape)}, "
            f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    n_heads, d = q.shape
    n_kv, seq_len, d_kv = k_cache.shape
    if d != d_kv:
        raise ValueError(f"decode_attention: q head_dim {d} != cache head_dim {d_kv}")
    if d & (d - 1) or not 1 <= d <= 256:
        raise ValueError(f"decode_attention: head_dim {d} is not a power of two <= 256")
    if n_kv == 0 or n_heads % n_kv:
        raise ValueError(f"decode_attention: {n_heads} heads do not split into {n_kv} KV heads")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype not in (torch.float32, torch.float16):
            raise ValueError(f"decode_attention: {name} is {t.dtype}, want float32 or float16")
    if q_pos.shape != (1,) or q_pos.dtype != torch.int64:
        raise ValueError(f"decode_attention: q_pos must be (1,) int64, got {q_pos.dtype}")
    if k_positions is not None and (k_positions.shape != (seq_len,)
                                    or k_positions.dtype != torch.int64):  # fmt: skip
        raise ValueError(f"decode_attention: k_positions must be ({seq_len},) int64")
    if window is not None and window < 1:
        raise ValueError(f"decode_attention: window must be >= 1, got {window}")
    group = n_heads // n_kv
    if block_s is None:
        block_s = default_block_s(group, d)
    elif block_s < 1 or block_s & (block_s - 1):
        raise ValueError(f"decode_attention: block_s {block_s} is not a power of two")
    if n_splits is None:
        n_splits = default_n_splits(seq_len, n_kv, block_s)
    elif n_splits < 1:
        raise ValueError(f"decode_attention: n_splits must be >= 1, got {n_splits}")

    if q.stride(1) != 1:
        q = q.contiguous()
    if k_cache.stride(2) != 1:
        k_cache = k_cache.contiguous()
    if v_cache.stride(2) != 1:
        v_cache = v_cache.contiguous()
    dev = q.device
    # Each split a whole number of blocks, so only the last block of the cache is ragged.
    split_len = triton.cdiv(triton.cdiv(max(seq_len, 1), n_splits), block_s) * block_s
    ws_m = torch.empty((n_heads, n_splits), dtype=torch.float32, device=dev)
    ws_l = torch.empty((n_heads, n_splits), dtype=torch.float32, device=dev)
    ws_acc = torch.empty((n_heads, n_splits, d), dtype=torch.float32, device=dev)
    out = torch.empty((1, n_heads * d), dtype=torch.float32, device=dev)
    ring = k_positions is not None
    _partial_kernel[(n_kv, n_splits)](
        q, k_cache, v_cache, q_pos, k_positions if ring else q_pos, ws_m, ws_l, ws_acc,
        seq_len, window if window is not None else 0, split_len, n_splits,
        q.stride(0), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        scale * LOG2E,
        GROUP=group, GROUP_PAD=triton.next_power_of_2(group), D=d, BLOCK_S=block_s, RING=ring,
        HAS_WINDOW=window is not None, num_warps=4,
    )  # fmt: skip
    splits_pad = triton.next_power_of_2(n_splits)
    chunk = max(1, min(splits_pad, 4096 // d))
    _combine_kernel[(n_heads,)](
        ws_m, ws_l, ws_acc, out, n_splits, D=d, SPLITS_PAD=splits_pad, CHUNK=chunk, num_warps=4
    )
    return out
