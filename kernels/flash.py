"""What the decode attention kernel (:mod:`.attention`) and the prefill one
(:mod:`.flash_attention`) share: the checks of their arguments and the inner step of flash
attention, the scores of one block of keys and the online softmax's update of the running
maximum, sum and output by that block (Milakov & Gimelshein 2018, "Online normalizer
calculation for softmax"; Dao et al. 2022, FlashAttention).

The device functions work in log2 units: the kernels fold the scale, and log2(e) where there
is no soft-capping, into the queries once, so that the softmax runs on ``exp2``.
"""

from __future__ import annotations

import torch
import triton.language as tl

from ._jit import device_fn


@device_fn
def block_scores(qv, kb, softcap, SOFTCAP: tl.constexpr, IEEE: tl.constexpr):
    """(R, BLOCK) float32 scores of queries ``qv`` (R, D) against keys ``kb`` (BLOCK, D), both
    of the cache's dtype (``IEEE``: exact float32 products, for float32 caches); with
    ``SOFTCAP``, ``softcap * tanh(s / softcap)`` (Gemma 2's attention soft-capping) taken to
    log2 units here."""
    if IEEE:
        s = tl.dot(qv, tl.trans(kb), input_precision="ieee")
    else:
        s = tl.dot(qv, tl.trans(kb))
    if SOFTCAP:
        # tanh(x) = 1 - 2 / (exp(2x) + 1); times log2(e)
        s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0)) * 1.4426950408889634
    return s


@device_fn
def online_softmax_start(ROWS: tl.constexpr, D_PAD: tl.constexpr):
    """The running (max, sum, output) of ROWS query rows before any key: (-inf, 0, 0)."""
    return (tl.full((ROWS,), float("-inf"), tl.float32), tl.zeros((ROWS,), tl.float32),
            tl.zeros((ROWS, D_PAD), tl.float32))


@device_fn
def online_softmax_step(s, vb, m_i, l_i, acc, IEEE: tl.constexpr):
    """The running (max ``m_i`` (R,), sum ``l_i`` (R,), output ``acc`` (R, D)) float32 of R
    query rows, updated by a block of scores ``s`` (R, BLOCK) in log2 units (-inf: not
    visible) and its values ``vb`` (BLOCK, D); returns the three. The output is
    ``acc / l_i`` once every block is in."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # A row with nothing visible yet keeps m = -inf; subtracting 0 instead avoids
    # exp2(-inf - -inf) = NaN, and exp2(-inf) = 0 leaves it empty.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if IEEE:
        pv = tl.dot(p, vb.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(vb.dtype), vb)
    return m_new, l_i, acc * alpha[:, None] + pv


def check_attention(op: str, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    q_positions: torch.Tensor, k_positions: torch.Tensor | None,
                    window: int | None, softcap: float | None,
                    names: tuple[str, str, str, str]) -> None:
    """The checks both attention launchers make, on tensors whose ranks are checked already.

    Args:
        op: the launcher's name, first in each message.
        q: (n_heads, head_dim) (one query) or (n_heads, T, head_dim).
        keys, values: (n_kv_heads, S, head_dim), one dtype; q's dtype float32 or float16 too.
        q_positions: (1,) or (T,) int64; k_positions: None or (S,) int64.
        window, softcap: None, or >= 1 and > 0.
        names: how messages call q, keys, values and q_positions.
    Raises:
        ValueError: the first of these that fails, naming the argument.
    """
    n_heads, d = q.shape[0], q.shape[-1]
    n_q = q.shape[1] if q.ndim == 3 else 1
    n_kv, n_slots, d_kv = keys.shape
    if d != d_kv:
        raise ValueError(f"{op}: q head_dim {d} != cache head_dim {d_kv}")
    if not 1 <= d <= 256:
        raise ValueError(f"{op}: head_dim {d} is not in 1..256")
    if n_kv == 0 or n_heads % n_kv:
        raise ValueError(f"{op}: {n_heads} heads do not split into {n_kv} KV heads")
    for name, x in zip(names[:3], (q, keys, values), strict=True):
        if x.dtype not in (torch.float32, torch.float16):
            raise ValueError(f"{op}: {name} is {x.dtype}, want float32 or float16")
    if values.dtype != keys.dtype:
        raise ValueError(f"{op}: {names[1]} and {names[2]} differ in dtype")
    if q_positions.shape != (n_q,) or q_positions.dtype != torch.int64:
        raise ValueError(f"{op}: {names[3]} must be ({n_q},) int64, got "
                         f"{tuple(q_positions.shape)} {q_positions.dtype}")
    if k_positions is not None and (k_positions.shape != (n_slots,)
                                    or k_positions.dtype != torch.int64):  # fmt: skip
        raise ValueError(f"{op}: k_positions must be ({n_slots},) int64")
    if window is not None and window < 1:
        raise ValueError(f"{op}: window must be >= 1, got {window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"{op}: softcap must be > 0, got {softcap}")
