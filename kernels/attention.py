"""Decode attention over the KV cache: one query position, split-K ("flash-decoding").

A decode step has a single query per head, so one program per head would leave most of the
GPU idle on a long context. Flash-decoding (Dao et al. 2023, "Flash-Decoding for long-context
inference") also splits the key axis: program (KV head, split) runs an online softmax over its
slice of the cache for all query heads of its KV group (K/V are loaded once per group, the
point of GQA in decode). llama.cpp's ggml-cuda ``fattn`` kernels follow the same design.

The products run on tensor cores: the query heads of a KV group are padded to
:data:`BLOCK_H` (16) rows, so the scores ``Q K^T`` (16 x ``BLOCK_S``) and ``P V``
(16 x head_dim) are each one ``tl.dot`` per step of ``BLOCK_S`` >= 32 cache slots, K and V
loaded together at the top of the step. The splits are sized so each program does one or two
steps (:func:`split_plan`), and the splits are merged by the program that finishes last (a
per-program-row ticket counter, reset by that program), not by a second kernel; with one
split the program writes the result itself. One launch per attention. Whichever program
writes a head's output also writes it quantized to 8 bits per 32 values (``gemv.store_q8``,
where the heads hold whole chunks: :func:`q8_output`), attached to the output: the output
projection's integer-dot GEMV needs no quantizing launch.

Which slots are read: a full cache (slot j holds position j) only the visible range
``max(0, q_pos - window + 1) .. q_pos``; a ring cache (sliding-window layers,
:class:`localllm.models.cache.RingKVCache`, slot ``p % S`` holds position p) only the
``window`` slots ending at slot ``q_pos % S`` (the live window), never the whole ring.

Nothing is read on the host: the query position is a device tensor loaded inside the kernel,
grid and shapes depend on shapes only, so a decode step can be captured in a CUDA graph and
replayed at every position.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _sync
from ._jit import device_fn, kernel
from .flash import block_scores, check_attention, online_softmax_start, online_softmax_step
from .gemv import attach_q8, q8_buffers, store_q8

LOG2E = 1.4426950408889634
# Query heads of a KV group handled by one program: tl.dot's smallest M. Larger groups
# (multi-query attention) take several programs per KV head.
BLOCK_H = 16
# Programs the split plan aims for: two per SM of an H100 (132 SMs).
TARGET_PROGRAMS = 264
# At most this many splits (then a program does more than two steps: very long contexts),
# which bounds the merge the last program does.
MAX_SPLITS = 256
# Elements of one K (or V) tile, BLOCK_S x head_dim: 8192 fp16 = 16 KB each.
TILE_ELEMENTS = 8192
# Elements of the (splits, heads, head_dim) float32 tile the merge loads per step.
MERGE_ELEMENTS = 4096
# Launch options. Two stages: a program does one or two steps, so a deeper pipeline only
# costs shared memory (sm_90, head_dim 128: 38 KB with 2 stages, 70 KB with 3).
NUM_WARPS = 4
NUM_STAGES = 2


@device_fn
def _store_out(out, xq, xd, xs, res, head0, n_valid, R: tl.constexpr, D: tl.constexpr,
               D_PAD: tl.constexpr, Q8: tl.constexpr):  # fmt: skip
    """Store the attention output ``res`` (R, D_PAD) float32 of query heads ``head0 ..``
    (the first ``n_valid`` rows) into ``out``, and with Q8 its 8-bit copy (``store_q8``: the
    output projection's GEMV input), in chunks of 32 values of ``out`` (:func:`q8_output`
    says when the program's heads hold whole chunks)."""
    rows = tl.arange(0, R)
    rd = tl.arange(0, D_PAD)
    o_rows = (head0 + rows).to(tl.int64) * D
    tl.store(out + o_rows[:, None] + rd[None, :], res,
             mask=(rows < n_valid)[:, None] & (rd < D)[None, :])  # fmt: skip
    if Q8:
        # Chunk i of the tile starts at row r, column c: a head's D / 32 chunks (D_PAD > D:
        # then padding chunks), or 32 / D heads (D = D_PAD < 32).
        i = tl.arange(0, R * D_PAD // 32) * 32
        r = i // D_PAD
        c = i % D_PAD
        store_q8(tl.reshape(res, (R * D_PAD,)), ((head0 + r) * D + c) // 32,
                 (r < n_valid) & (c < D), xq, xd, xs, R * D_PAD // 32)  # fmt: skip


def q8_output(group: int, d: int) -> bool:
    """Whether the kernel writes its output's 8-bit copy for ``group`` query heads per KV
    head of head_dim ``d``: each program's heads must hold whole chunks of 32 values, so
    ``d`` a multiple of 32, or a power of two (no padding) with ``group * d`` one."""
    d_pad = max(16, triton.next_power_of_2(d))
    return d % 32 == 0 or (d == d_pad and group * d % 32 == 0)


@kernel
def _decode_attention_kernel(
    q,
    k_cache,
    v_cache,
    q_pos_ptr,
    k_pos,
    out,
    xq,
    xd,
    xs,
    ws_m,
    ws_l,
    ws_acc,
    tickets,
    S,
    window,
    split_len,
    n_splits,
    n_hchunks,
    stride_qh,
    stride_kh,
    stride_ks,
    stride_vh,
    stride_vs,
    qk_scale,
    softcap,
    GROUP: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_S: tl.constexpr,
    RING: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINGLE: tl.constexpr,
    IEEE: tl.constexpr,
    BH: tl.constexpr,
    CHUNK: tl.constexpr,
    Q8: tl.constexpr,
):
    prow = tl.program_id(0)  # (KV head, chunk of BLOCK_H query heads)
    split = tl.program_id(1)
    kvh = prow // n_hchunks
    hc = prow % n_hchunks
    rh = tl.arange(0, BH)
    rd = tl.arange(0, D_PAD)
    rs = tl.arange(0, BLOCK_S)
    h_in = hc * BH + rh
    h_mask = h_in < GROUP
    d_mask = rd < D
    heads = kvh * GROUP + h_in
    qv = tl.load(q + heads[:, None] * stride_qh + rd[None, :],
                 mask=h_mask[:, None] & d_mask[None, :], other=0.0)  # fmt: skip
    # The scale (and log2(e) without soft-capping) folded into q once: the softmax runs on exp2.
    qv = (qv.to(tl.float32) * qk_scale).to(k_cache.dtype.element_ty)
    q_pos = tl.load(q_pos_ptr).to(tl.int32)

    # The live range as `n_live` logical slots from slot `start`, wrapping at S.
    if RING:
        if HAS_WINDOW:
            # RingKVCache: position p sits in slot p % S, so the window is the slots ending
            # at q_pos % S; the positions are still checked (empty, stale or future slots).
            n_live = tl.minimum(tl.minimum(S, q_pos + 1), window)
            start = (q_pos + 1 - n_live) % S
        else:
            n_live = S
            start = 0
    else:
        hi = tl.minimum(q_pos + 1, S)
        start = 0
        if HAS_WINDOW:
            start = tl.maximum(q_pos - window + 1, 0)
        n_live = tl.maximum(hi - start, 0)

    j0 = split * split_len
    j1 = tl.minimum(j0 + split_len, n_live)
    m_i, l_i, acc = online_softmax_start(BH, D_PAD)
    k_base = k_cache + kvh.to(tl.int64) * stride_kh
    v_base = v_cache + kvh.to(tl.int64) * stride_vh
    for j in range(j0, j1, BLOCK_S):
        offs = j + rs
        in_range = offs < j1
        slot = start + offs
        slot = tl.where(slot >= S, slot - S, slot)
        if RING:
            kp = tl.load(k_pos + slot, mask=in_range, other=-1).to(tl.int32)
            visible = in_range & (kp >= 0) & (kp <= q_pos)
            if HAS_WINDOW:
                visible = visible & (q_pos - kp < window)
        else:
            visible = in_range
        kv_off = slot.to(tl.int64)
        ld_mask = visible[:, None] & d_mask[None, :]
        kb = tl.load(k_base + kv_off[:, None] * stride_ks + rd[None, :], mask=ld_mask, other=0.0)
        vb = tl.load(v_base + kv_off[:, None] * stride_vs + rd[None, :], mask=ld_mask, other=0.0)
        s = block_scores(qv, kb, softcap, SOFTCAP, IEEE)  # (BH, BLOCK_S)
        s = tl.where(visible[None, :], s, float("-inf"))
        m_i, l_i, acc = online_softmax_step(s, vb, m_i, l_i, acc, IEEE)

    head0 = kvh * GROUP + hc * BH  # the first query head of this program row
    n_valid = GROUP - hc * BH  # its heads past that belong to the next KV head
    if SINGLE:
        res = tl.where(l_i[:, None] > 0.0, acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None], 0.0)
        _store_out(out, xq, xd, xs, res, head0, n_valid, BH, D, D_PAD, Q8)
    else:
        row = heads.to(tl.int64) * n_splits + split
        tl.store(ws_m + row, m_i, mask=h_mask)
        tl.store(ws_l + row, l_i, mask=h_mask)
        tl.store(ws_acc + row[:, None] * D_PAD + rd[None, :], acc, mask=h_mask[:, None])
        # Every thread's stores before the ticket; the ticket's acq_rel orders them for the
        # program that draws the last one, which then merges the splits.
        tl.debug_barrier()
        ticket = tl.atomic_add(tickets + prow, 1, sem="acq_rel")
        if ticket == n_splits - 1:
            tl.debug_barrier()
            tl.store(tickets + prow, 0)  # ready for the next launch (graph replay)
            n_used = tl.cdiv(n_live, split_len)  # splits past the live range hold nothing
            rg = tl.arange(0, GP)
            rc = tl.arange(0, CHUNK)
            g_in = hc * BH + rg
            g_mask = g_in < GROUP
            g_rows = (kvh * GROUP + g_in).to(tl.int64) * n_splits
            mm = tl.full((GP,), float("-inf"), tl.float32)
            ll = tl.zeros((GP,), tl.float32)
            aa = tl.zeros((GP, D_PAD), tl.float32)
            for c0 in range(0, n_used, CHUNK):
                sp = c0 + rc
                msk = (sp < n_used)[:, None] & g_mask[None, :]  # (CHUNK, GP)
                r2 = g_rows[None, :] + sp[:, None]
                m_c = tl.load(ws_m + r2, mask=msk, other=float("-inf"), cache_modifier=".cg")
                l_c = tl.load(ws_l + r2, mask=msk, other=0.0, cache_modifier=".cg")
                a_c = tl.load(ws_acc + r2[:, :, None] * D_PAD + rd[None, None, :],
                              mask=msk[:, :, None], other=0.0, cache_modifier=".cg")  # fmt: skip
                m_new = tl.maximum(mm, tl.max(m_c, axis=0))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(mm - m_safe)
                w = tl.exp2(m_c - m_safe[None, :])  # empty splits: exp2(-inf) = 0
                ll = ll * alpha + tl.sum(w * l_c, axis=0)
                aa = aa * alpha[:, None] + tl.sum(w[:, :, None] * a_c, axis=0)
                mm = m_new
            # No visible key at all (not a real decode state): zeros rather than NaN.
            res = tl.where(ll[:, None] > 0.0, aa / tl.where(ll > 0.0, ll, 1.0)[:, None], 0.0)
            _store_out(out, xq, xd, xs, res, head0, n_valid, GP, D, D_PAD, Q8)


def _pow2_at_most(n: int) -> int:
    return 1 << max(0, n.bit_length() - 1)


def default_block_s(head_dim: int) -> int:
    """Cache slots per loop step: a K (and a V) tile of :data:`TILE_ELEMENTS` elements,
    32..128 slots (head_dim 256: 32, 128: 64, 64 and less: 128)."""
    d_pad = max(16, triton.next_power_of_2(head_dim))
    return max(32, min(128, TILE_ELEMENTS // d_pad))


def split_plan(n_slots: int, n_rows: int, block_s: int) -> tuple[int, int]:
    """``(n_splits, split_len)`` for a live range of at most ``n_slots`` slots and ``n_rows``
    program rows (KV heads x head chunks): one step of ``block_s`` slots per program while
    that stays within :data:`TARGET_PROGRAMS` programs, else two, and more only beyond
    :data:`MAX_SPLITS` splits. From shapes only (the same at every position)."""
    blocks = triton.cdiv(max(n_slots, 1), block_s)
    per = 1 if blocks * n_rows <= TARGET_PROGRAMS else 2
    per = max(per, triton.cdiv(blocks, MAX_SPLITS))
    return triton.cdiv(blocks, per), per * block_s


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q_pos: torch.Tensor,
    *,
    k_positions: torch.Tensor | None = None,
    window: int | None = None,
    scale: float,
    softcap: float | None = None,
    n_splits: int | None = None,
    block_s: int | None = None,
) -> torch.Tensor:
    """Attention of one query position over the KV cache (flash-decoding, split-K, tl.dot).

    Same result as :func:`localllm.models.common.attend` for T=1: grouped-query attention
    (query head h reads KV head h // (n_heads // n_kv_heads)), scores ``q . k * scale``
    (then ``softcap * tanh(score / softcap)`` with ``softcap``), key j visible iff
    ``0 <= k_pos[j] <= q_pos`` and, with a window, ``q_pos - k_pos[j] < window``; softmax over
    the visible keys, then the weighted sum of the values. The products run in the cache's
    dtype (float16 on CUDA: q and the softmax weights rounded to float16, as llama.cpp's
    ``fattn`` kernels do), accumulation and softmax in float32. Design after Dao et al. 2023,
    "Flash-Decoding for long-context inference", and llama.cpp's ggml-cuda ``fattn`` kernels.

    One launch; never reads a value on the host (no synchronization): usable inside
    CUDA-graph capture. Launches on one device must not run concurrently on several
    streams (they share the split merge's ticket counters).

    Args:
        q: (n_heads, head_dim) float32/float16; head_dim 1..256.
        k_cache, v_cache: (n_kv_heads, S, head_dim) float32/float16, one dtype, on q's
            device; the last dimension contiguous (other strides free, e.g. one layer of a
            larger cache).
        q_pos: (1,) int64 on q's device: the query's absolute position.
        k_positions: (S,) int64, absolute position held by each slot (-1: empty) for a ring
            cache; None means slot j holds position j (only slots ``q_pos - window + 1 ..
            q_pos`` are read). With a ``window`` too, the ring's layout is assumed:
            position p can only be in slot ``p % S`` (:class:`~localllm.models.cache.RingKVCache`),
            and only the ``window`` slots ending at ``q_pos % S`` are read.
        window: sliding-window size in positions, or None.
        scale: score scale (usually 1/sqrt(head_dim)).
        softcap: Gemma 2's attention logit soft-capping, or None.
        n_splits: splits of the live range (default :func:`split_plan`, from shapes).
        block_s: slots per loop step, a power of two >= 16 (default :func:`default_block_s`).

    Returns:
        (1, n_heads * head_dim) float32, heads in order. A query with no visible key gives
        zeros (``attend`` would give NaN). Where :func:`q8_output` (head_dim a multiple
        of 32, as every model's) the same launch also writes it quantized to 8 bits per 32
        values (``gemv.quantize_q8``'s result, attached with ``gemv.attach_q8``), which the
        output projection's GEMV reads.

    Raises:
        ValueError: bad shapes, dtypes, head_dim, window, softcap, n_splits or block_s.
    """
    if q.ndim != 2 or k_cache.ndim != 3 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"decode_attention: want q (H, D) and K/V (Hkv, S, D), got {tuple(q.shape)}, "
            f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    check_attention("decode_attention", q, k_cache, v_cache, q_pos, k_positions, window, softcap,
                    ("q", "k_cache", "v_cache", "q_pos"))
    n_heads, d = q.shape
    n_kv, seq_len, _ = k_cache.shape
    group = n_heads // n_kv
    if block_s is None:
        block_s = default_block_s(d)
    elif block_s < 16 or block_s & (block_s - 1):
        raise ValueError(f"decode_attention: block_s {block_s} is not a power of two >= 16")
    n_hchunks = triton.cdiv(group, BLOCK_H)
    n_rows = n_kv * n_hchunks
    n_slots = min(seq_len, window) if window is not None else seq_len
    if n_splits is None:
        n_splits, split_len = split_plan(n_slots, n_rows, block_s)
    elif n_splits < 1:
        raise ValueError(f"decode_attention: n_splits must be >= 1, got {n_splits}")
    else:
        # Each split a whole number of steps, so only the last step of the range is ragged.
        split_len = triton.cdiv(triton.cdiv(max(n_slots, 1), n_splits), block_s) * block_s

    if q.stride(1) != 1:
        q = q.contiguous()
    if k_cache.stride(2) != 1:
        k_cache = k_cache.contiguous()
    if v_cache.stride(2) != 1:
        v_cache = v_cache.contiguous()
    dev = q.device
    d_pad = max(16, triton.next_power_of_2(d))
    out = torch.empty((1, n_heads * d), dtype=torch.float32, device=dev)
    single = n_splits == 1
    if single:  # unread: the program writes the result itself
        ws_m = ws_l = ws_acc = tickets = out
    else:
        ws_m = torch.empty((n_heads, n_splits), dtype=torch.float32, device=dev)
        ws_l = torch.empty((n_heads, n_splits), dtype=torch.float32, device=dev)
        ws_acc = torch.empty((n_heads, n_splits, d_pad), dtype=torch.float32, device=dev)
        tickets = _sync.tickets(dev, n_rows)
    gp = min(BLOCK_H, triton.next_power_of_2(group))
    chunk = max(1, _pow2_at_most(MERGE_ELEMENTS // (gp * d_pad)))
    ring = k_positions is not None
    qk_scale = scale if softcap is not None else scale * LOG2E
    q8 = q8_buffers(n_heads * d, dev) if q8_output(group, d) else None
    try:
        _decode_attention_kernel[(n_rows, n_splits)](
            q, k_cache, v_cache, q_pos, k_positions if ring else q_pos, out,
            *(q8 if q8 is not None else (out, out, out)), ws_m, ws_l, ws_acc, tickets, seq_len,
            window if window is not None else 0, split_len, n_splits, n_hchunks, q.stride(0),
            k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), qk_scale, softcap if softcap is not None else 1.0,
            GROUP=group, GP=gp, D=d, D_PAD=d_pad, BLOCK_S=block_s, RING=ring,
            HAS_WINDOW=window is not None, SOFTCAP=softcap is not None, SINGLE=single,
            IEEE=k_cache.dtype == torch.float32, BH=BLOCK_H, CHUNK=chunk, Q8=q8 is not None,
            num_warps=NUM_WARPS, num_stages=NUM_STAGES,
        )  # fmt: skip
    except BaseException:
        if not single:  # a launch cut short may leave tickets drawn: start again from zero
            tickets.zero_()
        raise
    if q8 is not None:
        attach_q8(out, q8)
    return out


def attention_case(group: int, d: int, *, ring: bool, kv: str = "*fp16", arch: int = 90,
                   single: bool = False, softcap: bool = False, q8: bool = True):
    """The kernel's specialization as :func:`decode_attention` launches it, for ahead-of-time
    compilation without a GPU (:mod:`._aot`; tests/test_kernel_compile.py,
    bench/kernel_profile.py): ``group`` query heads per KV head, head_dim ``d``, a ring
    cache with a window or a full one, K/V of Triton type ``kv``, for ``sm_<arch>``; ``q8``
    (the launcher's choice where :func:`q8_output` allows it): the output's 8-bit copy too."""
    from ._aot import Case

    d_pad = max(16, triton.next_power_of_2(d))
    gp = min(BLOCK_H, triton.next_power_of_2(group))
    types = {"q": "*fp32", "k_cache": kv, "v_cache": kv, "q_pos_ptr": "*i64", "k_pos": "*i64",
             "out": "*fp32", "xq": "*i8", "xd": "*fp32", "xs": "*i32", "ws_m": "*fp32",
             "ws_l": "*fp32", "ws_acc": "*fp32", "tickets": "*i32", "S": "i32", "window": "i32",
             "split_len": "i32", "n_splits": "i32", "n_hchunks": "i32", "stride_qh": "i32", "stride_kh": "i32",
             "stride_ks": "i32", "stride_vh": "i32", "stride_vs": "i32", "qk_scale": "fp32",
             "softcap": "fp32"}  # fmt: skip
    constexprs = {"GROUP": group, "GP": gp, "D": d, "D_PAD": d_pad,
                  "BLOCK_S": default_block_s(d), "RING": ring, "HAS_WINDOW": ring,
                  "SOFTCAP": softcap, "SINGLE": single, "IEEE": kv == "*fp32", "BH": BLOCK_H,
                  "CHUNK": max(1, _pow2_at_most(MERGE_ELEMENTS // (gp * d_pad))),
                  "Q8": q8 and q8_output(group, d)}  # fmt: skip
    # Pointers and model dimensions are 16-byte multiples; positions, splits and windows
    # are not (a head_dim of 96 makes strides 16-aligned still).
    aligned = tuple(n for n in types if n.startswith(("stride", "q", "k_", "v_", "out", "ws",
                                                      "tickets", "x")) and n != "qk_scale")
    return Case(_decode_attention_kernel, types, constexprs, num_warps=NUM_WARPS, arch=arch,
                num_stages=NUM_STAGES, aligned=aligned)
