"""Multi-head latent attention at decode: one query position over the latent cache.

With the projections absorbed (DeepSeek-V2; llama.cpp's ``src/models/deepseek2.cpp``) every
head's query is ``[k_b q_nope, q_pe]`` (``r + n_rot`` values) and every head attends over the
same cached latents ``[c, k_pe]`` (multi-query attention: one shared key), the values being
the latents' first ``r`` values. A program takes :data:`BLOCK_H` heads and one split of the
positions (flash-decoding, Dao et al. 2023): the latents of a step of ``BLOCK_S`` positions
are loaded once for all its heads, the scores are two ``tl.dot`` (the ``r`` part and the RoPE
part, each padded to a power of two) and the values one more, with an online softmax. Each
split writes its running maximum, sum and unnormalized result; :func:`mla_decode` merges the
splits with torch operations (no host reads: the query position is a device tensor, grid and
shapes depend on shapes only, so a step can be captured in a CUDA graph).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._jit import kernel

LOG2E = 1.4426950408889634
BLOCK_H = 16  # heads per program: tl.dot's smallest M
BLOCK_S = 32  # positions per step
TARGET_PROGRAMS = 264  # two per SM of an H100 (132 SMs)
MAX_SPLITS = 64


@kernel
def _mla_decode_kernel(q, lat, q_pos_ptr, ws_m, ws_l, ws_acc, H, split_len, stride_qh,
                       stride_ls, qk_scale, R: tl.constexpr, R_PAD: tl.constexpr,
                       ROT: tl.constexpr, ROT_PAD: tl.constexpr, BH: tl.constexpr,
                       BS: tl.constexpr):
    """Program (head block, split): heads ``BH * pid0 ..``, positions ``split_len * pid1 ..``
    up to the query's; writes ws_m / ws_l (splits, H) and ws_acc (splits, H, R_PAD)."""
    pid_h = tl.program_id(0)
    pid_s = tl.program_id(1)
    heads = pid_h * BH + tl.arange(0, BH)
    hmask = heads < H
    q_pos = tl.load(q_pos_ptr)
    start = pid_s * split_len
    end = tl.minimum(start + split_len, q_pos + 1)
    rr = tl.arange(0, R_PAD)
    tt = tl.arange(0, ROT_PAD)
    rmask = rr < R
    tmask = tt < ROT
    qrow = q + heads[:, None] * stride_qh
    qc = tl.load(qrow + rr[None, :], mask=hmask[:, None] & rmask[None, :], other=0.0)
    qr = tl.load(qrow + R + tt[None, :], mask=hmask[:, None] & tmask[None, :], other=0.0)
    qc = qc.to(lat.dtype.element_ty)
    qr = qr.to(lat.dtype.element_ty)
    m = tl.full([BH], float("-inf"), tl.float32)
    ell = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, R_PAD], tl.float32)
    for s0 in range(start, end, BS):
        ss = s0 + tl.arange(0, BS)
        smask = ss < end
        row = lat + ss[:, None] * stride_ls
        kc = tl.load(row + rr[None, :], mask=smask[:, None] & rmask[None, :], other=0.0)
        kr = tl.load(row + R + tt[None, :], mask=smask[:, None] & tmask[None, :], other=0.0)
        scores = tl.dot(qc, tl.trans(kc)) + tl.dot(qr, tl.trans(kr))  # (BH, BS)
        scores = tl.where(smask[None, :], scores * qk_scale, float("-inf"))  # log2 units
        m_new = tl.maximum(m, tl.max(scores, 1))
        p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        ell = ell * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(kc.dtype), kc)
        m = m_new
    base = pid_s * H + heads
    tl.store(ws_m + base, m, mask=hmask)
    tl.store(ws_l + base, ell, mask=hmask)
    tl.store(ws_acc + base[:, None] * R_PAD + rr[None, :], acc, mask=hmask[:, None])


def split_plan(h: int, s: int) -> tuple[int, int]:
    """(positions per split, splits) for ``h`` heads over a cache of ``s`` cells: about
    :data:`TARGET_PROGRAMS` programs, at most :data:`MAX_SPLITS` splits, whole steps."""
    want = max(1, min(MAX_SPLITS, TARGET_PROGRAMS // triton.cdiv(h, BLOCK_H)))
    split = triton.cdiv(triton.cdiv(s, want), BLOCK_S) * BLOCK_S
    return split, triton.cdiv(s, split)


def mla_decode(q: torch.Tensor, latent: torch.Tensor, q_pos: torch.Tensor, r: int,
               scale: float) -> torch.Tensor:
    """One query position's MLA over the latent cache (module docstring).

    Args:
        q: (H, r + n_rot) float32, the absorbed queries ``[k_b q_nope, q_pe]``.
        latent: (S, r + n_rot) float16/float32, the cache (cell j: position j), holding the
            query's own position already.
        q_pos: (1,) int64 device tensor, the query's position (cells 0 .. q_pos are read).
        r: kv_lora_rank (the values are each latent's first r entries).
        scale: the scores' scale.
    Returns:
        (H, r) float32: each head's softmax-weighted latent.
    """
    h, d = q.shape
    s = latent.shape[0]
    rot = d - r
    r_pad = max(16, triton.next_power_of_2(r))
    rot_pad = max(16, triton.next_power_of_2(rot))
    split, n_splits = split_plan(h, s)
    ws_m = torch.empty(n_splits, h, dtype=torch.float32, device=q.device)
    ws_l = torch.empty_like(ws_m)
    ws_acc = torch.empty(n_splits, h, r_pad, dtype=torch.float32, device=q.device)
    q = q.contiguous()
    _mla_decode_kernel[(triton.cdiv(h, BLOCK_H), n_splits)](
        q, latent, q_pos, ws_m, ws_l, ws_acc, h, split, q.stride(0), latent.stride(0),
        scale * LOG2E, R=r, R_PAD=r_pad, ROT=rot, ROT_PAD=rot_pad, BH=BLOCK_H, BS=BLOCK_S,
        num_warps=8 if r_pad >= 256 else 4)
    # Merge the splits (a split past the query holds -inf and 0: weight 0).
    top = ws_m.max(0).values  # (H,)
    w = torch.exp2(ws_m - top)  # (splits, H)
    total = (ws_l * w).sum(0)
    return ((ws_acc * w[:, :, None]).sum(0) / total[:, None])[:, :r]


def mla_case(h: int, r: int, rot: int, *, kv: str = "*fp16", arch: int = 90):
    """The kernel's specialization as :func:`mla_decode` launches it for ``h`` heads, latent
    ``r + rot``, for ahead-of-time compilation (:mod:`._aot`: tests/test_kernel_compile.py,
    bench/kernel_profile.py); and its launch figures (bytes a step reads: BLOCK_S latents)."""
    from ._aot import Case

    r_pad = max(16, triton.next_power_of_2(r))
    rot_pad = max(16, triton.next_power_of_2(rot))
    types = {"q": "*fp32", "lat": kv, "q_pos_ptr": "*i64", "ws_m": "*fp32", "ws_l": "*fp32",
             "ws_acc": "*fp32", "H": "i32", "split_len": "i32", "stride_qh": "i32",
             "stride_ls": "i32", "qk_scale": "fp32"}
    case = Case(_mla_decode_kernel, types,
                {"R": r, "R_PAD": r_pad, "ROT": rot, "ROT_PAD": rot_pad, "BH": BLOCK_H,
                 "BS": BLOCK_S}, num_warps=8 if r_pad >= 256 else 4, arch=arch,
                aligned=("q", "lat", "ws_m", "ws_l", "ws_acc", "stride_qh", "stride_ls"))
    itemsize = 2 if kv == "*fp16" else 4
    return case, {"bytes_per_step": BLOCK_S * (r + rot) * itemsize, "marker": None,
                  "loop_op": "HMMA", "variant": f"H{BLOCK_H}R{r_pad}+{rot_pad}S{BLOCK_S}"}
