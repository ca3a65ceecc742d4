"""Fused dequantize x vector for decode: ``Y[b, n] = sum_k W[n, k] * X[b, k]``.

The kernel reads the quantized blocks of ``W`` directly (no float16 copy of the weights ever
exists), decodes a (BLOCK_N, BLOCK_K) tile in registers (:mod:`.decode`) and accumulates in
float32 against up to 8 input vectors at once (a small decode batch).

A single vector (the common decode step) of the types in ``decode.MMVQ_TYPES`` (and, from
their planes, ``decode.MMVQ32_TYPES`` and ``decode_k23.MMVQ64_TYPES``: see :func:`mmvq_unit`)
takes the integer-dot kernel, llama.cpp's ``mul_mat_vec_q`` design (``ggml/src/ggml-cuda/mmvq.cu``):
the vector is quantized once to 8 bits per 32 values (:func:`quantize_q8`, as
``quantize_q8_1``, or by the fused kernel that produced it: :func:`attached_q8`), the weights
are read as 32-bit words of four packed values (16-byte loads where the blocks, or their
planes, are 16-byte aligned: ``QuantWeight.aligned``), multiplied with ``dp4a`` and scaled
per 16-weight group (``_mmvq_kernel``), per 32-weight sub-block (``_mmvq32_kernel``, the
planes of ``decode.MMVQ32_TYPES``, MXFP4 included) or per 64-weight unit of four groups
(``_mmvq64_kernel``: Q2_K and Q3_K, whose 16 bytes of 2-bit fields hold four groups), each thread keeping float partial sums that are reduced
once after the loop; rows per program and a split of the key axis are chosen per shape
(:func:`mmvq_config`), the splits' partial sums added in split order by the program that
finishes its rows last (ticket counters, :mod:`._sync`), so a split costs no launch. Its result is exact up to float32 rounding for the quantized vector,
which differs from the float vector by about 0.5% per dot product (llama.cpp's CUDA and CPU
paths quantize activations the same way). Other types take a kernel whose tile is (rows,
scale groups, group size), so that each scale is loaded once per group.

Matrices that share the input (Q/K/V, gate/up) are fused by concatenating their rows
(``QuantWeight.cat``): one launch covers the concatenated row range.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _sync
from ._jit import device_fn, kernel
from .decode import (
    GROUP_SIZES,
    IQ4_NL,
    IQ4_XS,
    MMVQ32_TYPES,
    MMVQ_TYPES,
    decode_grouped,
    decode_tile,
    decode_unit32,
    decode_word16,
    decode_words,
    decode_words_planes,
    iq4nl_word,
    scale_min16,
)
from .decode_k23 import MMVQ64_TYPES, unit64_group, unit64_head, unit64_pointers
from .layout import PLANES, block_format, plane_offsets

MAX_BATCH = 8

# ---- integer-dot GEMV for one vector (llama.cpp's mul_mat_vec_q) ------------------------------


@device_fn
def q8_chunks(v):
    """(q int32, d float32) of values ``v`` (C, 2, 16) float32, chunks of 32 on the first
    axis: ``d = max|v| / 127`` and ``q = round-half-up(v * 127 / max|v|)`` per chunk, as
    llama.cpp's ``quantize_q8_1`` (shared by :func:`quantize_q8` and :func:`store_q8`)."""
    amax = tl.max(tl.max(tl.abs(v), axis=2), axis=1)
    d = amax / 127.0
    inv = tl.where(amax > 0.0, 127.0 / tl.where(amax > 0.0, amax, 1.0), 0.0)
    q = tl.floor(v * inv[:, None, None] + 0.5)  # |q| <= 127: amax * inv rounds to 127
    q = tl.minimum(tl.maximum(q, -127.0), 127.0).to(tl.int32)
    return q, d


@device_fn
def store_q8(v, c, cm, xq, xd, xs, NC: tl.constexpr):
    """Store the 8-bit copy of ``v`` (NC * 32,) float32, NC chunks of 32 values, as
    :func:`quantize_q8` writes it (values ``xq``, per-32 scales ``xd``, per-16 sums ``xs``):
    chunk i of ``v`` is chunk ``c[i]`` (int32 (NC,)) of the vector, stored where ``cm[i]``.
    For the kernels that also write the quantized copy of their output (attach_q8)."""
    q, d = q8_chunks(tl.reshape(v, (NC, 2, 16)))
    offs = c[:, None, None] * 32 + tl.arange(0, 2)[None, :, None] * 16
    offs = offs + tl.arange(0, 16)[None, None, :]
    tl.store(xq + offs, q.to(tl.int8), mask=cm[:, None, None])
    tl.store(xd + c, d, mask=cm)
    tl.store(xs + c[:, None] * 2 + tl.arange(0, 2)[None, :], tl.sum(q, axis=2), mask=cm[:, None])


@kernel
def _quantize_q8_kernel(x, xq, xd, xs, n_chunks, CH: tl.constexpr):
    # x (K,) -> xq int8 (K,), xd float32 (K/32,) scales, xs int32 (K/16,) sums of 16 values.
    rc = tl.program_id(0) * CH + tl.arange(0, CH)
    c_mask = rc < n_chunks
    offs = rc[:, None, None] * 32 + tl.arange(0, 2)[None, :, None] * 16
    offs = offs + tl.arange(0, 16)[None, None, :]
    v = tl.load(x + offs, mask=c_mask[:, None, None], other=0.0).to(tl.float32)
    q, d = q8_chunks(v)
    tl.store(xq + offs, q.to(tl.int8), mask=c_mask[:, None, None])
    tl.store(xd + rc, d, mask=c_mask)
    rh = rc[:, None] * 2 + tl.arange(0, 2)[None, :]
    tl.store(xs + rh, tl.sum(q, axis=2), mask=c_mask[:, None])


@device_fn
def _dp4a(a, b, c, ASM: tl.constexpr):
    """``c`` plus the dot product of the four signed bytes of int32 ``a`` and ``b`` (CUDA
    ``dp4a``; ``ASM`` False: the same in portable integer code, for the interpreter)."""
    if ASM:
        r = tl.inline_asm_elementwise(
            "dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
            is_pure=True, pack=1,
        )  # fmt: skip
    else:
        r = c + ((a << 24) >> 24) * ((b << 24) >> 24)
        r += ((a << 16) >> 24) * ((b << 16) >> 24)
        r += ((a << 8) >> 24) * ((b << 8) >> 24)
        r += (a >> 24) * (b >> 24)
    return r


@device_fn
def _store_rows(y, ws, tickets, out, rn, N, SPLITK: tl.constexpr):
    """Store a program's dot products ``out`` (ROWS,) float32 of rows ``rn`` (those < N).

    Without SPLITK, to ``y``. With it (grid axis 1: the splits of the key axis), to the
    split's row of the (splits, N) float32 workspace ``ws``; the program that draws the last
    ticket of its row range (``tickets[pid]``, see ``_sync``) adds the splits' rows in split
    order into ``y`` and resets the ticket: no separate launch to sum them, and the same sum
    whichever program comes last.
    """
    mask = rn < N
    if SPLITK:
        pid = tl.program_id(0)
        n_splits = tl.num_programs(1)
        tl.store(ws + tl.program_id(1) * N + rn, out, mask=mask)
        # Every thread's stores before the ticket; the ticket's acq_rel orders them for the
        # program that draws the last one.
        tl.debug_barrier()
        ticket = tl.atomic_add(tickets + pid, 1, sem="acq_rel")
        if ticket == n_splits - 1:
            tl.debug_barrier()
            tl.store(tickets + pid, 0)  # ready for the next launch (graph replay)
            total = tl.load(ws + rn, mask=mask, other=0.0, cache_modifier=".cg")
            for s in range(1, n_splits):
                total += tl.load(ws + s * N + rn, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(y + rn, total.to(y.dtype.element_ty), mask=mask)
    else:
        tl.store(y + rn, out.to(y.dtype.element_ty), mask=mask)


@kernel
def _mmvq_kernel(w, xq, xd, xs, y, ws, tickets, N, K, blocks_per_split, BS: tl.constexpr,
                 TS: tl.constexpr, UNIT: tl.constexpr, QTYPE: tl.constexpr, OFF: tl.constexpr,
                 ROWS: tl.constexpr, GP: tl.constexpr, STAGES: tl.constexpr,
                 DP4A: tl.constexpr, SPLITK: tl.constexpr, PLANES: tl.constexpr = False):  # fmt: skip
    # Program (rows, split): ROWS rows x the split's blocks, GP 16-weight groups (GP * 16 / BS
    # whole blocks) a step. Each thread keeps float partial sums for its (row, group) slots:
    # one reduction after the loop. The group -> (block, group in block) split and everything
    # derived from it (shifts, scale positions) is loop-invariant; only the block advances.
    # PLANES (Q6_K from aligned planes): offsets are block indices, the decoder finds planes.
    GPB: tl.constexpr = BS // 16  # groups per block
    BPS: tl.constexpr = GP // GPB  # blocks per step
    TSU: tl.constexpr = 1 if PLANES else TS // UNIT  # block size in UNIT-byte elements
    pid = tl.program_id(0)
    split = tl.program_id(1)
    rn = pid * ROWS + tl.arange(0, ROWS)
    # Rows past N read row N-1 (no masks on the weight loads) and are not stored.
    rc = tl.minimum(rn, N - 1)
    if UNIT == 4:
        wp = w.to(tl.pointer_type(tl.int32))
    else:
        wp = w.to(tl.pointer_type(tl.int16))
    xw = xq.to(tl.pointer_type(tl.int32))
    g = tl.arange(0, GP)
    gb = (g % GPB)[None, :, None]
    t = tl.arange(0, 4)[None, None, :]
    b_lo = split * blocks_per_split
    # Offsets of the first step, in UNIT-byte elements; later steps add BPS blocks.
    blk = (rc.to(tl.int64) * ((K // BS) * TSU) + b_lo * TSU)[:, None, None]
    blk = blk + ((g // GPB) * TSU)[None, :, None]
    gg = b_lo * GPB + g  # 16-weight groups along K
    acc = tl.zeros((ROWS, GP, 1), dtype=tl.float32)
    for _ in tl.range(0, blocks_per_split, BPS, num_stages=STAGES):
        if PLANES:  # 16-byte aligned planes: (.., 4) word tiles, 128-bit loads
            wq, scale, vmin = decode_words_planes(wp, N * (K // BS), blk, gb, t, QTYPE)
            xv = tl.load(xw + gg[None, :, None] * 4 + t)
            dot = tl.sum(_dp4a(wq, xv, tl.zeros_like(wq), DP4A), axis=2, keep_dims=True)
        elif TS % 16 == 0:  # 16-byte aligned blocks: groups as (.., 4) word tiles, 128-bit loads
            wq, scale, vmin = decode_words(wp, blk, gb, t, QTYPE)
            xv = tl.load(xw + gg[None, :, None] * 4 + t)
            dot = tl.sum(_dp4a(wq, xv, tl.zeros_like(wq), DP4A), axis=2, keep_dims=True)
        elif UNIT == 4:  # word by word (a tile of unaligned words would be spread over threads)
            dot = tl.zeros_like(blk).to(tl.int32)
            for j in tl.static_range(4):
                wq, scale, vmin = decode_words(wp, blk, gb, j, QTYPE)
                if QTYPE == IQ4_XS:
                    wq = iq4nl_word(wq, DP4A)
                xv = tl.load(xw + gg[None, :, None] * 4 + j)
                dot = _dp4a(wq, xv, dot, DP4A)
        else:  # word by word from 16-bit halves
            scale, vmin = scale_min16(wp, blk, gb, QTYPE)
            dot = tl.zeros_like(blk).to(tl.int32)
            for j in tl.static_range(4):
                xv = tl.load(xw + gg[None, :, None] * 4 + j)
                wq = decode_word16(wp, blk, gb, j, QTYPE)
                if QTYPE == IQ4_NL:
                    wq = iq4nl_word(wq, DP4A)
                dot = _dp4a(wq, xv, dot, DP4A)
        isum = tl.load(xs + gg)[None, :, None]
        dx = tl.load(xd + gg // 2)[None, :, None]
        if OFF != 0:
            dot = dot - OFF * isum
        acc += dx * (scale * dot.to(tl.float32) - vmin * isum.to(tl.float32))
        blk += BPS * TSU
        gg += GP
    _store_rows(y, ws, tickets, tl.sum(tl.sum(acc, axis=2), axis=1), rn, N, SPLITK)


@kernel
def _mmvq32_kernel(w, xq, xd, xs, y, ws, tickets, N, K, units_per_split, QTYPE: tl.constexpr,
                   BS: tl.constexpr, OFF: tl.constexpr, ROWS: tl.constexpr, GP: tl.constexpr,
                   STAGES: tl.constexpr, DP4A: tl.constexpr, SPLITK: tl.constexpr):  # fmt: skip
    # The types of MMVQ32_TYPES from their planes: a slot is a (row, 32-weight sub-block)
    # with one scale; its weight bits are one (Q8_0: two) 16-byte loads, decoded into the
    # words of weights 0-15 and 16-31 for two dp4a against the activations' words. Program
    # (rows, split): ROWS rows x the split's sub-blocks, GP sub-blocks a step; float partial
    # sums per slot, one reduction after the loop.
    pid = tl.program_id(0)
    split = tl.program_id(1)
    rn = pid * ROWS + tl.arange(0, ROWS)
    rc = tl.minimum(rn, N - 1)  # rows past N read row N-1 and are not stored
    nu = K // 32  # sub-blocks per row
    nblk = N * (K // BS)
    wp = w.to(tl.pointer_type(tl.int32))
    xw = xq.to(tl.pointer_type(tl.int32))
    t = tl.arange(0, 4)[None, None, :]
    uk = split * units_per_split + tl.arange(0, GP)  # sub-blocks along K
    u = (rc.to(tl.int64) * nu)[:, None, None] + uk[None, :, None]  # in the whole matrix
    acc = tl.zeros((ROWS, GP, 1), dtype=tl.float32)
    for _ in tl.range(0, units_per_split, GP, num_stages=STAGES):
        lo, hi, scale = decode_unit32(wp, nblk, u, t, QTYPE, DP4A)
        xlo = tl.load(xw + uk[None, :, None] * 8 + t)
        xhi = tl.load(xw + uk[None, :, None] * 8 + 4 + t)
        dot = _dp4a(hi, xhi, _dp4a(lo, xlo, tl.zeros_like(lo), DP4A), DP4A)
        dot = tl.sum(dot, axis=2, keep_dims=True)
        if OFF != 0:
            isum = tl.load(xs + uk * 2) + tl.load(xs + uk * 2 + 1)
            dot = dot - OFF * isum[None, :, None]
        dx = tl.load(xd + uk)[None, :, None]
        acc += dx * (scale * dot.to(tl.float32))
        u += GP
        uk += GP
    _store_rows(y, ws, tickets, tl.sum(tl.sum(acc, axis=2), axis=1), rn, N, SPLITK)


@kernel
def _mmvq64_kernel(w, xq, xd, xs, y, ws, tickets, N, K, units_per_split, QTYPE: tl.constexpr,
                   ROWS: tl.constexpr, GP: tl.constexpr, STAGES: tl.constexpr,
                   DP4A: tl.constexpr, SPLITK: tl.constexpr):  # fmt: skip
    # Q2_K / Q3_K from their planes (MMVQ64_TYPES): a slot is a (row, 64-weight unit), the
    # unit 16 bytes of qs (one 128-bit load; Q3_K's third bits one more) holding four
    # 16-weight groups 32 weights apart (see .decode_k23). Program (rows, split): ROWS rows x
    # the split's units, GP units (whole blocks) a step; float partial sums per slot, one
    # reduction after the loop. Every pointer is formed once; a step adds a scalar to it.
    pid = tl.program_id(0)
    split = tl.program_id(1)
    rn = pid * ROWS + tl.arange(0, ROWS)
    rc = tl.minimum(rn, N - 1)  # rows past N read row N-1 and are not stored
    wp = w.to(tl.pointer_type(tl.int32))
    xw = xq.to(tl.pointer_type(tl.int32))
    t = tl.arange(0, 4)[None, None, :]
    uk = split * units_per_split + tl.arange(0, GP)  # units along K
    u = (rc.to(tl.int64) * (K // 64))[:, None, None] + uk[None, :, None]  # in the matrix
    h = ((uk % 4) // 2)[None, :, None]  # the unit's half of its block
    par = (uk % 2)[None, :, None]
    # the unit's first weight along K; its groups start 0, 32, 64, 96 weights later
    xk = ((uk // 4) * 256 + (uk % 4 // 2) * 128 + (uk % 2) * 16)[None, :, None]
    heads = unit64_pointers(wp, N * (K // 256), u, t, par, QTYPE)
    xv_p = xw + xk // 4 + t
    xs_p = xs + xk // 16
    xd_p = xd + xk // 32
    acc = tl.zeros((ROWS, GP, 1), dtype=tl.float32)
    for j in tl.range(0, units_per_split, GP, num_stages=STAGES):
        q, hm, s0, s1, s2, d, dmin = unit64_head(heads, j // 4, QTYPE)
        hm = hm >> (h * 4)  # Q3_K: the unit's half's four third bits at bits 0..3
        part_a = tl.zeros_like(acc)
        part_b = tl.zeros_like(acc)
        for i in tl.static_range(4):
            words, a, b = unit64_group(q, hm, s0, s1, s2, h, par, i, QTYPE)
            xv = tl.load(xv_p + j * 16 + 8 * i)
            dot = tl.sum(_dp4a(words, xv, tl.zeros_like(words), DP4A), axis=2, keep_dims=True)
            isum = tl.load(xs_p + j * 4 + 2 * i)
            dx = tl.load(xd_p + j * 2 + i)
            if QTYPE == 10:  # Q2_K: scale and min
                part_a += dx * (a * dot).to(tl.float32)
                part_b += dx * (b * isum).to(tl.float32)
            else:  # Q3_K: values u - 4
                part_a += dx * (a * (dot - 4 * isum)).to(tl.float32)
        if QTYPE == 10:
            acc += d * part_a - dmin * part_b
        else:
            acc += d * part_a
    _store_rows(y, ws, tickets, tl.sum(tl.sum(acc, axis=2), axis=1), rn, N, SPLITK)


# Streaming multiprocessors the launch shapes aim to fill (an H100 SXM has 132).
TARGET_SMS = 132
MMVQ_WARPS = 4
# Weight bytes the launch shapes aim to have in flight per SM (one loop step per program):
# an H100 needs about bandwidth x latency = 3.35 TB/s x ~650 ns / 132 SMs ~ 16 KB.
IN_FLIGHT_PER_SM = 16384
# Rows each thread keeps: its activation words are loaded once for all of them.
ROWS_PER_THREAD = 2
# Fewest rows a program takes where more groups a step would fill the GPU as well: with 4
# rows (2-warp programs of 16 groups, Gemma-3-270M's 640 x 1024 attn_output) Triton loads the
# activations' words 32 bits at a time (one LDG.128 in the loop, the weights'): 0.27-0.30
# warp-instructions per byte for IQ4_NL / IQ4_XS against 0.20-0.23 with 8 rows of 8 groups
# (bench/kernel_profile.py, Triton 3.6 and 3.9).
MIN_ROWS = 8


def mmvq_unit(qtype, layout: str = "blocks") -> int:
    """Weights per slot of the integer-dot GEMV for ``qtype`` kept in ``layout``: 64
    (``_mmvq64_kernel``: the planes of :data:`.decode_k23.MMVQ64_TYPES`), 32
    (``_mmvq32_kernel``: the planes of :data:`.decode.MMVQ32_TYPES`), 16 (``_mmvq_kernel``:
    :data:`.decode.MMVQ_TYPES`), or 0 where it has no kernel for them (one vector then takes
    the float GEMV)."""
    planes = layout == "planes"
    if planes and qtype in MMVQ64_TYPES:
        return 64
    if planes and qtype in MMVQ32_TYPES:
        return 32
    return 16 if qtype in MMVQ_TYPES else 0


def mmvq_config(qtype, n: int, k: int, sms: int = TARGET_SMS, layout: str = "blocks") -> dict:
    """Launch shape of the integer-dot GEMV for an (n, k) matrix of ``qtype`` in ``layout``.

    Each of the 32 * WARPS threads of a program (WARPS = MMVQ_WARPS, or half where that
    cannot make 2 programs per SM) takes RPT rows of one group a step
    (UNIT weights, :func:`mmvq_unit`): GP groups (a power of two <= 16 dividing K/UNIT, whole blocks) by
    ROWS = threads * RPT / GP rows. The key axis is split (SPLIT programs per row range,
    partial sums added by the range's last program, in the launch) until the programs hold IN_FLIGHT_PER_SM bytes per SM in one
    step, and at least 2 programs per SM; small matrices first drop to one row per thread,
    then to fewer groups per step, to get to 2 per SM. A program of fewer than MIN_ROWS rows
    is taken only where fewer groups a step (more rows) would not make 2 per SM.

    Returns:
        dict with UNIT, ROWS, GP, RPT, SPLIT, STAGES, the grid, ``blocks_per_split`` and
        ``bytes_per_step`` (weight bytes one program reads per loop step).
    """
    fmt = block_format(qtype)
    unit = mmvq_unit(qtype, layout)
    n_groups = k // unit
    gpb = max(1, fmt.block_size // unit)
    best, best_key = None, None
    for warps in (MMVQ_WARPS, MMVQ_WARPS // 2):  # smaller programs only where 4 warps can't
        threads = 32 * warps
        for rpt in (ROWS_PER_THREAD, 1):
            gp = 16
            while n_groups % gp:
                gp //= 2
            fills = None
            while True:
                rows = threads * rpt // gp
                ctas = triton.cdiv(n, rows)
                steps = n_groups // gp
                split = 1
                bytes_per_step = rows * gp * unit * fmt.type_size // fmt.block_size
                target = max(2 * sms, triton.cdiv(IN_FLIGHT_PER_SM * sms, bytes_per_step))
                while ctas * split < target:
                    nxt = next((s for s in range(split + 1, steps + 1) if steps % s == 0), None)
                    if nxt is None:
                        break
                    split = nxt
                cfg = {"UNIT": unit, "WARPS": warps, "ROWS": rows, "GP": gp, "RPT": rpt,
                       "SPLIT": split, "STAGES": 1, "grid": (ctas, split),
                       "blocks_per_split": k // fmt.block_size // split,
                       "bytes_per_step": bytes_per_step}  # fmt: skip
                if ctas * split >= 2 * sms:
                    if rows >= MIN_ROWS or gp // 2 < gpb:
                        return cfg
                    fills = cfg  # fewer than MIN_ROWS rows: try fewer groups a step first
                elif fills is not None:
                    return fills
                # the most programs; among as many, programs of at least MIN_ROWS rows
                key = (ctas * split, min(rows, MIN_ROWS))
                if best is None or key > best_key:
                    best, best_key = cfg, key
                if gp // 2 < gpb or rows * 2 > 1024:
                    break
                gp //= 2
            if fills is not None:
                return fills
    return best


def mmvq_case(qtype, n: int, k: int, *, layout: str = "blocks", arch: int = 90):
    """The integer-dot GEMV's specialization as :func:`gemv` launches it for one vector of an
    (n, k) ``qtype`` matrix in ``layout``, for ahead-of-time compilation without a GPU
    (:mod:`._aot`; tests/test_kernel_compile.py, bench/kernel_profile.py), for ``sm_<arch>``.

    Returns:
        (``_aot.Case``, :func:`mmvq_config`'s launch shape).
    """
    from ._aot import Case

    fmt, cfg = block_format(qtype), mmvq_config(qtype, n, k, layout=layout)
    splitk = cfg["SPLIT"] > 1
    out = {"w": "*u8", "xq": "*i8", "xd": "*fp32", "xs": "*i32", "y": "*fp32", "ws": "*fp32",
           "tickets": "*i32", "N": "i32", "K": "i32"}
    if cfg["UNIT"] == 64:  # Q2_K / Q3_K, from planes
        case = Case(
            _mmvq64_kernel, out | {"units_per_split": "i32"},
            {"QTYPE": int(qtype), "ROWS": cfg["ROWS"], "GP": cfg["GP"], "STAGES": cfg["STAGES"],
             "DP4A": True, "SPLITK": splitk},
            num_warps=cfg["WARPS"], arch=arch,
        )  # fmt: skip
        return case, cfg
    if cfg["UNIT"] == 32:  # the sub-block kernel, from planes
        case = Case(
            _mmvq32_kernel, out | {"units_per_split": "i32"},
            {"QTYPE": int(qtype), "BS": fmt.block_size, "OFF": MMVQ32_TYPES[qtype],
             "ROWS": cfg["ROWS"], "GP": cfg["GP"], "STAGES": cfg["STAGES"], "DP4A": True,
             "SPLITK": splitk},
            num_warps=cfg["WARPS"], arch=arch,
        )  # fmt: skip
        return case, cfg
    unit, off = MMVQ_TYPES[qtype]
    planes = layout == "planes"
    case = Case(
        _mmvq_kernel, out | {"blocks_per_split": "i32"},
        {"BS": fmt.block_size, "TS": fmt.type_size, "UNIT": 4 if planes else unit,
         "QTYPE": int(qtype), "OFF": off, "ROWS": cfg["ROWS"], "GP": cfg["GP"],
         "STAGES": cfg["STAGES"], "DP4A": True, "SPLITK": splitk, "PLANES": planes},
        num_warps=cfg["WARPS"], arch=arch,
    )  # fmt: skip
    return case, cfg


def q8_buffers(n: int, device: torch.device):
    """Empty (xq, xd, xs) for the 8-bit copy of a vector of ``n`` values (see
    :func:`quantize_q8`), on ``device``."""
    return (torch.empty(n, dtype=torch.int8, device=device),
            torch.empty(n // 32, dtype=torch.float32, device=device),
            torch.empty(n // 16, dtype=torch.int32, device=device))  # fmt: skip


def quantize_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Activations quantized to 8 bits per 32 values, as llama.cpp's ``quantize_q8_1``.

    Args:
        x: (K,) float16/float32/bfloat16, K a multiple of 32, contiguous.

    Returns:
        ``xq`` int8 (K,), ``xd`` float32 (K/32,) with ``x ~ xd[i // 32] * xq[i]``
        (``xd = max|x| / 127`` per 32 values, round half up) and ``xs`` int32 (K/16,), the
        sums of ``xq`` over 16 values.
    """
    k = x.shape[0]
    xq, xd, xs = q8_buffers(k, x.device)
    ch = 8
    _quantize_q8_kernel[(triton.cdiv(k // 32, ch),)](x, xq, xd, xs, k // 32, CH=ch, num_warps=4)
    return xq, xd, xs


# Attribute under which a kernel that produced a one-row activation tensor attaches its 8-bit
# copy (xq, xd, xs as quantize_q8 returns them), so that the GEMV reading it needs no launch
# of its own to quantize it (see fused.residual_rms_norm and fused.gated_act). It is set on
# the tensor's storage (whose Python object torch preserves), so that views of the whole
# tensor find it too, ``n[-1:]`` included (inference mode records no view bases).
Q8_ATTR = "_localllm_q8"


def attach_q8(x: torch.Tensor, q8: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    """Record ``q8``, equal to ``quantize_q8(x.reshape(-1))``, with the new contiguous ``x``."""
    setattr(x.untyped_storage(), Q8_ATTR, (x.storage_offset(), x.numel(), x.dtype, q8))


def attached_q8(x: torch.Tensor):
    """The 8-bit copy a kernel attached to ``x`` or to the tensor ``x`` is a whole contiguous
    view of (:func:`attach_q8`), else None."""
    rec = getattr(x.untyped_storage(), Q8_ATTR, None)
    if rec is None or not x.is_contiguous():
        return None
    offset, numel, dtype, q8 = rec
    if x.storage_offset() != offset or x.numel() != numel or x.dtype != dtype:
        return None
    return q8


def _mmvq(w_data, qtype, n_out: int, x: torch.Tensor, out_dtype, layout: str,
          x_q8=None) -> torch.Tensor:  # fmt: skip
    k = x.shape[1]
    fmt = block_format(qtype)
    xq, xd, xs = quantize_q8(x[0]) if x_q8 is None else x_q8
    cfg = mmvq_config(qtype, n_out, k, layout=layout)
    split = cfg["SPLIT"]
    y = torch.empty((1, n_out), dtype=out_dtype, device=x.device)
    if split > 1:  # the splits' partial sums, added by the program that finishes last
        ws = torch.empty((split, n_out), dtype=torch.float32, device=x.device)
        tickets = _sync.tickets(x.device, cfg["grid"][0])
    else:  # unread
        ws = tickets = y
    try:
        if cfg["UNIT"] == 64:
            _mmvq64_kernel[cfg["grid"]](
                w_data, xq, xd, xs, y, ws, tickets, n_out, k, k // 64 // split,
                QTYPE=int(qtype), ROWS=cfg["ROWS"], GP=cfg["GP"], STAGES=cfg["STAGES"],
                DP4A=x.is_cuda, SPLITK=split > 1, num_warps=cfg["WARPS"],
            )  # fmt: skip
        elif cfg["UNIT"] == 32:
            _mmvq32_kernel[cfg["grid"]](
                w_data, xq, xd, xs, y, ws, tickets, n_out, k, k // 32 // split,
                QTYPE=int(qtype), BS=fmt.block_size, OFF=MMVQ32_TYPES[qtype], ROWS=cfg["ROWS"],
                GP=cfg["GP"], STAGES=cfg["STAGES"], DP4A=x.is_cuda, SPLITK=split > 1,
                num_warps=cfg["WARPS"],
            )  # fmt: skip
        else:
            unit, off = MMVQ_TYPES[qtype]
            _mmvq_kernel[cfg["grid"]](
                w_data, xq, xd, xs, y, ws, tickets, n_out, k, cfg["blocks_per_split"],
                BS=fmt.block_size, TS=fmt.type_size, UNIT=4 if layout == "planes" else unit,
                QTYPE=int(qtype), OFF=off, ROWS=cfg["ROWS"], GP=cfg["GP"],
                STAGES=cfg["STAGES"], DP4A=x.is_cuda, SPLITK=split > 1,
                PLANES=layout == "planes", num_warps=cfg["WARPS"],
            )  # fmt: skip
    except BaseException:
        if split > 1:  # a launch cut short may leave tickets drawn: start again from zero
            tickets.zero_()
        raise
    return y


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
    PLANES: tl.constexpr = False,
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
        wv = decode_tile(w, row, rn, rk, wmask, N, K, BS, TS, QTYPE, PLANES)
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
    name: str, w_data: torch.Tensor, qtype, n_out: int, x: torch.Tensor, rows: str = "B",
    layout: str = "blocks",
):  # fmt: skip
    """The block format of ``qtype`` and ``x`` with contiguous rows, for ``x @ W.T`` with
    ``W`` (n_out, K) in ``w_data``'s blocks, laid out as ``layout`` (see
    ``localllm.kernels.QuantWeight``; shared by the GEMV and GEMM launchers).

    Raises:
        ValueError: ``x`` is not 2-D, K and the weight bytes disagree, or no such layout.
    """
    fmt = block_format(qtype)
    if x.ndim != 2:
        raise ValueError(f"{name}: x must be ({rows}, K), got {tuple(x.shape)}")
    k = x.shape[1]
    if layout not in ("blocks", "planes") or (layout == "planes" and qtype not in PLANES):
        raise ValueError(f"{name}: no layout {layout!r} for this type")
    want = n_out * (k // fmt.block_size) * fmt.type_size
    if layout == "planes" and k % fmt.block_size == 0:
        want = plane_offsets(qtype, n_out * (k // fmt.block_size))[1]
    if k % fmt.block_size or w_data.numel() != want:
        raise ValueError(f"{name}: {w_data.numel()} weight bytes do not hold ({n_out}, {k})")
    return fmt, x if x.stride(1) == 1 else x.contiguous()


def gemv(
    w_data: torch.Tensor,
    qtype,
    n_out: int,
    x: torch.Tensor,
    *,
    out_dtype: torch.dtype | None = None,
    layout: str = "blocks",
    x_q8: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``x @ W.T`` for a few rows, reading ``W`` quantized.

    One launch (two where a single vector must first be quantized), with no host reads:
    usable inside CUDA-graph capture. A split key axis is summed inside the launch with the
    ticket counters of :mod:`._sync`, so launches on one device must not run concurrently
    on several streams (as for ``decode_attention``).

    Args:
        w_data: uint8 (n_out, row_bytes) or flat; the blocks of ``W`` (n_out, K) row by row
            (or their planes, see ``layout``).
        qtype: ggml type of ``W`` (see :data:`.decode.KERNEL_TYPES`).
        n_out: N, the number of rows of ``W``.
        x: (B, K) float16/float32/bfloat16, B <= 8, same device as ``w_data``; rows contiguous.
        out_dtype: dtype of the result (default ``x.dtype``).
        layout: "blocks" (the GGUF layout) or "planes" (``localllm.kernels.PLANES``).
        x_q8: for one vector, ``quantize_q8(x[0])`` when already computed (by the kernel
            that produced ``x``): the integer-dot kernel then reads it instead of
            quantizing ``x`` in a launch of its own.

    Returns:
        (B, N) ``out_dtype``; accumulated in float32.

    Raises:
        ValueError: shapes do not agree, B > 8 or no such layout for the type.
    """
    fmt, x = check_operands("gemv", w_data, qtype, n_out, x, layout=layout)
    nb, k = x.shape
    if nb > MAX_BATCH:
        raise ValueError(f"gemv: at most {MAX_BATCH} vectors, got {nb}")
    y = torch.empty((nb, n_out), dtype=out_dtype or x.dtype, device=x.device)
    if nb == 0 or n_out == 0:
        return y
    planes = layout == "planes"
    if nb == 1 and mmvq_unit(qtype, layout) and k % 32 == 0:
        return _mmvq(w_data, qtype, n_out, x, y.dtype, layout, x_q8)
    if nb == 1 and qtype in GROUP_SIZES and not planes:
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
        PLANES=planes,
        num_warps=4,
        enable_fp_fusion=True,
    )
    return y
