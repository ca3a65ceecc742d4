"""Triton decode attention (flash-decoding on tl.dot) against the torch reference ``attend``.

Every test runs on CPU tensors through Triton's interpreter and, as a cuda-marked variant,
natively on a GPU (skipped without one). Caches are small (S of 37..300) to keep the
interpreter fast, with sizes that are not multiples of the block size.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from kernel_checks import HOST_READS, NoLaunch, OpRecorder

from localllm.backends.dense import attend

kernels = pytest.importorskip("localllm.kernels")
if not kernels.triton_available():
    pytest.skip("Triton is not installed", allow_module_level=True)

from localllm.kernels import _sync, attention
from localllm.kernels.attention import decode_attention, default_block_s, split_plan

POISON = 1e4  # written to the slots a query must not see: a leak shows at once


def random_qkv(n_heads, n_kv, s, d, *, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n_heads, d, generator=g)
    k = torch.randn(n_kv, s, d, generator=g)
    v = torch.randn(n_kv, s, d, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def reference(q, k, v, q_pos: int, k_positions=None, window=None, scale=0.125, softcap=None,
              sinks=None, chunk=None):
    """``attend`` for one query, (1, n_heads * d) float32, on the CPU."""
    s = k.shape[1]
    kp = torch.arange(s) if k_positions is None else k_positions.cpu()
    return attend(q.float().cpu()[:, None], k.float().cpu(), v.float().cpu(),
                  torch.tensor([q_pos]), kp, window=window, scale=scale, softcap=softcap,
                  sinks=None if sinks is None else sinks.cpu(), chunk=chunk)  # fmt: skip


def run(q, k, v, q_pos: int, device, **kw):
    kp = kw.pop("k_positions", None)
    return decode_attention(
        q.to(device), k.to(device), v.to(device), torch.tensor([q_pos], device=device),
        k_positions=None if kp is None else kp.to(device), **kw,
    ).cpu()  # fmt: skip


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    y, ref = y.double(), ref.double()
    return ((y - ref).norm() / ref.norm()).item()


def ring_positions(s: int, n_written: int, empty=()) -> torch.Tensor:
    """Slot j of a ring of s slots after writing positions 0..n_written-1; ``empty`` cleared."""
    kp = torch.full((s,), -1, dtype=torch.int64)
    for p in range(n_written):
        kp[p % s] = p
    kp[list(empty)] = -1
    return kp


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_full_cache_matches_attend(group, where, device):
    n_kv, s, d = 2, 77, 64
    q, k, v = random_qkv(n_kv * group, n_kv, s, d, seed=group)
    q_pos = {"first": 0, "middle": 40, "last": s - 1}[where]
    k[:, q_pos + 1 :] = POISON
    v[:, q_pos + 1 :] = POISON
    y = run(q, k, v, q_pos, device, scale=0.125)
    assert y.shape == (1, n_kv * group * d) and y.dtype == torch.float32
    assert rel_err(y, reference(q, k, v, q_pos)) < 1e-5


@pytest.mark.parametrize("window", [1, 5, 30, 200])
def test_full_cache_window_skips_old_blocks(window, device):
    n_kv, s, d = 1, 90, 64
    q, k, v = random_qkv(2, n_kv, s, d, seed=window)
    q_pos = 70
    k[:, q_pos + 1 :] = POISON
    v[:, q_pos + 1 :] = POISON
    lo = max(0, q_pos - window + 1)
    v[:, :lo] = POISON  # keys before the window must not count either
    y = run(q, k, v, q_pos, device, window=window, scale=0.2, n_splits=3, block_s=16)
    assert rel_err(y, reference(q, k, v, q_pos, window=window, scale=0.2)) < 1e-5


@pytest.mark.parametrize("window", [None, 16, 17])
def test_ring_cache_matches_attend(window, device):
    n_kv, s, d = 2, 50, 64
    q, k, v = random_qkv(4, n_kv, s, d, seed=3)
    n_written = 123  # wrapped twice: slot j holds 100 + j for j < 23, else 50 + j
    kp = ring_positions(s, n_written, empty=(3, 30, 31))
    q_pos = n_written - 1
    if window is not None:
        # q_pos - 16 = 106 sits in slot 6, q_pos - 15 in slot 7: the boundary is hit exactly.
        assert (kp == q_pos - 16).any() and (kp == q_pos - window + 1).any()
    k[:, kp < 0] = POISON
    v[:, kp < 0] = POISON
    y = run(q, k, v, q_pos, device, k_positions=kp, window=window, scale=0.125, n_splits=4)
    assert rel_err(y, reference(q, k, v, q_pos, kp, window)) < 1e-5


def test_ring_cache_with_future_slots(device):
    """Positions past the query (a cache ahead after a rewind) stay invisible."""
    s, d = 40, 64
    q, k, v = random_qkv(2, 1, s, d, seed=4)
    kp = ring_positions(s, 60)
    q_pos = 45
    k[:, kp > q_pos] = POISON
    v[:, kp > q_pos] = POISON
    y = run(q, k, v, q_pos, device, k_positions=kp, scale=0.125, n_splits=2, block_s=16)
    assert rel_err(y, reference(q, k, v, q_pos, kp)) < 1e-5


def test_non_contiguous_cache(device):
    """One layer's (n_kv, S, d) slice of a larger cache is read in place, strides and all."""
    s, d = 45, 64
    q, k_big, v_big = random_qkv(4, 2, 64, d, seed=5)
    k, v = k_big[:, :s], v_big[:, 10 : 10 + s]
    assert not k.is_contiguous()
    kp = ring_positions(s, 70)
    y = run(q, k, v, 69, device, k_positions=kp, scale=0.125)
    assert rel_err(y, reference(q, k, v, 69, kp)) < 1e-5


@pytest.mark.parametrize("q_dtype", [torch.float16, torch.float32])
def test_float16_cache(q_dtype, device):
    n_kv, s, d = 2, 61, 64
    q, k, v = random_qkv(4, n_kv, s, d, seed=6, dtype=torch.float16)
    q = q.to(q_dtype)
    for q_pos in (0, 33, s - 1):
        y = run(q, k, v, q_pos, device, scale=0.125)
        # q and the softmax weights are rounded to float16 for the tensor-core products
        # (as llama.cpp's fattn kernels do): ~1e-3 of float16's 2**-11 rounding, no more.
        assert rel_err(y, reference(q, k, v, q_pos)) < 3e-3
    kp = ring_positions(s, 100, empty=(0,))
    y = run(q, k, v, 99, device, k_positions=kp, window=40, scale=0.125)
    assert rel_err(y, reference(q, k, v, 99, kp, window=40)) < 3e-3


@pytest.mark.parametrize("n_splits", [1, 2, 5, 16])
def test_splits_and_ragged_blocks(n_splits, device):
    """S = 37 in blocks of 16; 16 splits leave splits past S, small q_pos whole splits empty."""
    s, d = 37, 64
    q, k, v = random_qkv(2, 1, s, d, seed=7)
    for q_pos in (3, 20, s - 1):
        kk, vv = k.clone(), v.clone()
        kk[:, q_pos + 1 :] = POISON
        vv[:, q_pos + 1 :] = POISON
        y = run(q, kk, vv, q_pos, device, scale=0.125, n_splits=n_splits, block_s=16)
        assert rel_err(y, reference(q, kk, vv, q_pos)) < 1e-5
    # Ring: the first split's slots are all empty, the second's all in the future.
    kp = ring_positions(s, s)
    kp[:8] = -1
    kp[8:16] += 1000
    y = run(q, k, v, s - 1, device, k_positions=kp, scale=0.125, n_splits=n_splits, block_s=16)
    assert torch.isfinite(y).all()
    assert rel_err(y, reference(q, k, v, s - 1, kp)) < 1e-5


@pytest.mark.parametrize("d", [64, 256])
def test_head_dims(d, device):
    """Gemma 3 shapes (4 heads on 1 KV head, d = 256, window 512) and d = 64."""
    s = 300
    q, k, v = random_qkv(4, 1, s, d, seed=d)
    for q_pos, window in ((0, None), (150, None), (299, 100)):
        y = run(q, k, v, q_pos, device, window=window, scale=d**-0.5)
        assert rel_err(y, reference(q, k, v, q_pos, window=window, scale=d**-0.5)) < 1e-5


@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_groups_and_head_dims(group, d, device):
    """GQA groups 1..8 (padded to 16 rows for tl.dot) and head dims 64..256: full cache at
    an odd length, a ring before it wraps and a wrapped ring with a window."""
    n_kv, s = 2, 83
    q, k, v = random_qkv(n_kv * group, n_kv, s, d, seed=group * d)
    scale = d**-0.5
    y = run(q, k, v, 60, device, scale=scale)
    assert rel_err(y, reference(q, k, v, 60, scale=scale)) < 1e-5
    kp = ring_positions(s, 50)  # not wrapped: slots 50.. empty
    y = run(q, k, v, 49, device, k_positions=kp, window=33, scale=scale)
    assert rel_err(y, reference(q, k, v, 49, kp, window=33, scale=scale)) < 1e-5
    kp = ring_positions(s, 200)  # wrapped twice; the window's slots straddle the wrap
    y = run(q, k, v, 199, device, k_positions=kp, window=71, scale=scale)
    assert rel_err(y, reference(q, k, v, 199, kp, window=71, scale=scale)) < 1e-5


def test_ring_reads_only_the_live_window(device):
    """With a window, a ring is read only in the ``window`` slots ending at ``q_pos % S``.

    A position that breaks the ring's layout (visible, but planted outside those slots)
    would count if the kernel read that slot; it does not."""
    s, d, window = 64, 64, 20
    q, k, v = random_qkv(4, 2, s, d, seed=11)
    kp = ring_positions(s, 150)  # q_pos 149 in slot 21; the window: slots 2..21
    q_pos = 149
    planted = kp.clone()
    planted[40] = q_pos - 3  # in the window by position, in slot 40 by mistake
    y = run(q, k, v, q_pos, device, k_positions=planted, window=window, scale=0.125)
    assert rel_err(y, reference(q, k, v, q_pos, kp, window=window)) < 1e-5
    assert rel_err(y, reference(q, k, v, q_pos, planted, window=window)) > 1e-3
    # Without a window nothing is assumed about the layout: every slot is read.
    y = run(q, k, v, q_pos, device, k_positions=planted, scale=0.125)
    assert rel_err(y, reference(q, k, v, q_pos, planted)) < 1e-5


@pytest.mark.parametrize("d", [16, 96])
def test_head_dims_padded(d, device):
    """Head dims that are not powers of two (Phi-3: 96) or below tl.dot's 16 are padded."""
    s = 45
    q, k, v = random_qkv(6, 2, s, d, seed=d)
    for q_pos in (0, 30, s - 1):
        y = run(q, k, v, q_pos, device, scale=d**-0.5)
        assert rel_err(y, reference(q, k, v, q_pos, scale=d**-0.5)) < 1e-5


def test_large_group_takes_several_programs(device):
    """32 query heads on one KV head (multi-query): two programs of 16 heads per KV head."""
    s, d = 70, 64
    q, k, v = random_qkv(32, 1, s, d, seed=12)
    y = run(q, k, v, 69, device, scale=0.125, n_splits=3)
    assert rel_err(y, reference(q, k, v, 69)) < 1e-5


@pytest.mark.parametrize("softcap", [1.5, 50.0])
def test_softcap(softcap, device):
    """Gemma 2's soft-capping, ``softcap * tanh(score / softcap)``, as ``attend`` applies it."""
    s, d = 70, 128
    q, k, v = random_qkv(4, 2, s, d, seed=13)
    q = q * 3  # scores of several units: the cap bends them
    for kw in ({}, {"k_positions": ring_positions(s, 100), "window": 30}):
        y = run(q, k, v, 99 if kw else 69, device, scale=d**-0.5, softcap=softcap, **kw)
        want = reference(q, k, v, 99 if kw else 69, kw.get("k_positions"), kw.get("window"),
                         scale=d**-0.5, softcap=softcap)  # fmt: skip
        assert rel_err(y, want) < 1e-5


@pytest.mark.parametrize("n_splits", [1, 3])
@pytest.mark.parametrize("group", [1, 4, 20])
def test_sinks_match_attend(group, n_splits, device):
    """gpt-oss's attention sinks (one logit per query head in the softmax's denominator):
    a full cache and a ring with a window (gpt-oss's sliding layers), GQA, one split (the
    program normalizes) and several (the merge does); sinks of both signs, one far above the
    scores (it takes nearly everything) and one far below (it takes nothing)."""
    n_kv, s, d = 2, 70, 64
    n_heads = n_kv * group
    q, k0, v0 = random_qkv(n_heads, n_kv, s, d, seed=group + n_splits)
    g = torch.Generator().manual_seed(group)
    sinks = torch.randn(n_heads, generator=g) * 2
    sinks[0], sinks[-1] = 30.0, -30.0
    kp = ring_positions(s, 100, empty=(5,))
    for q_pos, kw in ((0, {}), (45, {}), (99, {"k_positions": kp, "window": 33})):
        k, v = k0.clone(), v0.clone()  # poisoned where the query must not look
        hidden = kp < 0 if kw else torch.arange(s) > q_pos
        k[:, hidden] = POISON
        v[:, hidden] = POISON
        y = run(q, k, v, q_pos, device, scale=0.125, sinks=sinks.to(device),
                n_splits=n_splits, block_s=16, **kw)  # fmt: skip
        want = reference(q, k, v, q_pos, kw.get("k_positions"), kw.get("window"), sinks=sinks)
        assert rel_err(y, want) < 1e-5
        # the sinks take a share: without them the result differs
        assert rel_err(y, reference(q, k, v, q_pos, kw.get("k_positions"),
                                    kw.get("window"))) > 1e-3  # fmt: skip


def test_sinks_float16_cache_and_no_visible_key(device):
    """A float16 cache (the Triton backend's) with float32 sinks; a query with no visible
    key gives zeros, as ``attend`` with sinks does (the sink takes everything)."""
    s, d = 40, 64
    q, k, v = random_qkv(4, 2, s, d, seed=21, dtype=torch.float16)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    y = run(q, k, v, 30, device, scale=0.125, sinks=sinks.to(device))
    assert rel_err(y, reference(q, k, v, 30, sinks=sinks)) < 2e-3
    kp = torch.full((s,), -1, dtype=torch.int64)
    for n_splits in (1, 3):
        y = run(q, k, v, 5, device, k_positions=kp, scale=0.125, sinks=sinks.to(device),
                n_splits=n_splits)  # fmt: skip
        assert torch.equal(y, torch.zeros_like(y))
        want = reference(q, k, v, 5, kp, sinks=sinks)
        assert torch.equal(want, torch.zeros_like(want))


def test_sinks_with_softcap(device):
    """Soft-capping bends the scores, never the sink (as ``attend``)."""
    s, d = 50, 64
    q, k, v = random_qkv(4, 2, s, d, seed=22)
    sinks = torch.tensor([1.0, 3.0, -2.0, 0.0])
    y = run(q * 3, k, v, 49, device, scale=0.125, softcap=2.0, sinks=sinks.to(device))
    assert rel_err(y, reference(q * 3, k, v, 49, softcap=2.0, sinks=sinks)) < 1e-5


@pytest.mark.parametrize("n_splits", [1, 3])
def test_chunked_window(n_splits, device):
    """Llama 4's chunked layers: a query sees the keys of its own chunk only (the window
    ``q_pos % chunk + 1`` computed in the kernel from the device position), on a full cache
    and on a ring of the chunk (what the model allocates), also with a narrower window;
    keys outside the chunk poisoned."""
    s, d, chunk = 60, 64, 16
    q, k0, v0 = random_qkv(4, 2, s, d, seed=30 + n_splits)
    ring = ring_positions(20, 45)  # a ring of chunk + 4 slots after 45 positions
    for q_pos, kp, window in ((0, None, None), (15, None, None), (16, None, None),
                              (37, None, None), (59, None, 5), (44, ring, 16), (41, ring, None),
                              (44, ring, 3)):  # fmt: skip
        n = s if kp is None else 20
        pos = torch.arange(n) if kp is None else kp
        k, v = k0[:, :n].clone(), v0[:, :n].clone()
        hidden = (pos > q_pos) | (pos < q_pos - q_pos % chunk) | (pos < 0)
        k[:, hidden] = POISON
        v[:, hidden] = POISON
        y = run(q, k, v, q_pos, device, k_positions=kp, window=window, chunk=chunk,
                scale=0.125, n_splits=n_splits, block_s=16)  # fmt: skip
        assert rel_err(y, reference(q, k, v, q_pos, kp, window, chunk=chunk)) < 1e-5, q_pos


@pytest.mark.parametrize(("k_type", "v_type"), [("q8_0", "q8_0"), ("q8_0", torch.float16),
                                                ("q8_0", torch.float32),
                                                (torch.float16, "q8_0")])  # fmt: skip
def test_q8_0_cache_matches_attend(k_type, v_type, device):
    """A KV cache of q8_0 blocks (``-ctk/-ctv q8_0``: uint8 rows of ggml's ``block_q8_0``,
    written by localllm's quantizer, ggml's rounding), K, V or both, read by the kernel
    directly: against ``attend`` on the blocks dequantized by the reference dequantizer
    (gguf-py's), on a full cache and a ring, one split and several. Products in float16
    (float32 where the other cache is float32)."""
    from localllm.memory.kvtypes import CACHE_TYPES

    q8 = CACHE_TYPES["q8_0"]
    s, d = 70, 128
    q, k, v = random_qkv(8, 2, s, d, seed=40)
    stored, dense = [], []
    for x, t in ((k, k_type), (v, v_type)):
        if t == "q8_0":
            blocks = q8.encode(x)
            assert blocks.dtype == torch.uint8 and blocks.shape == (2, s, d // 32 * 34)
            stored.append(blocks)
            dense.append(q8.decode(blocks, d))
        else:
            stored.append(x.to(t))
            dense.append(x.to(t).float())
    tol = 1e-5 if torch.float32 in (k_type, v_type) else 3e-3
    kp = ring_positions(s, 100, empty=(7,))
    for q_pos, kw in ((0, {}), (50, {}), (99, {"k_positions": kp, "window": 40})):
        for n_splits in (1, 3):
            y = run(q, *stored, q_pos, device, scale=d**-0.5, n_splits=n_splits, block_s=16,
                    **kw)  # fmt: skip
            want = reference(q, *dense, q_pos, kw.get("k_positions"), kw.get("window"),
                             scale=d**-0.5)  # fmt: skip
            assert rel_err(y, want) < tol, (q_pos, n_splits)


def test_tickets_are_reset_for_the_next_launch():
    """The program that merges the splits leaves its ticket counter at zero, so the next
    launch (a CUDA-graph replay) merges again; many launches in a row stay right."""
    s, d = 90, 64
    q, k, v = random_qkv(8, 2, s, d, seed=14)
    for q_pos in (10, 50, 89, 89):
        y = run(q, k, v, q_pos, torch.device("cpu"), scale=0.125, n_splits=4, block_s=16)
        assert rel_err(y, reference(q, k, v, q_pos)) < 1e-5
        assert not _sync.TICKETS[torch.device("cpu")][-1].any()


@pytest.mark.parametrize(("n_kv", "group", "s", "d", "n_splits"), [
    (2, 3, 70, 96, 3),  # merge of 4 padded rows (3 heads) a program; padded head rows
    (2, 3, 70, 96, 1),  # one split: the program's 16 rows, 3 of them heads
    (1, 20, 40, 64, 2),  # two chunks of query heads, the second of 4
    (3, 1, 50, 256, None),  # Gemma-3's head_dim
    (2, 2, 40, 16, 2),  # head_dim 16: a chunk holds two heads
    (1, 20, 30, 16, 1),  # ... of the first 16 heads, then of the last 4
])  # fmt: skip
def test_output_carries_its_q8_copy(n_kv, group, s, d, n_splits, device):
    """The program that writes a head's output also writes it quantized to 8 bits per 32
    values (what the output projection's integer-dot GEMV reads): the copy is
    ``quantize_q8(out)``, byte for byte, and no other launch makes it."""
    from localllm.kernels.gemv import attached_q8, quantize_q8

    q, k, v = random_qkv(n_kv * group, n_kv, s, d, seed=d + group)
    kw = {"n_splits": n_splits, "block_s": 16} if n_splits else {}
    y = decode_attention(q.to(device) * 4, k.to(device), v.to(device),
                         torch.tensor([s - 1], device=device), scale=d**-0.5, **kw)  # fmt: skip
    got = attached_q8(y)
    assert got is not None
    for a, b in zip(got, quantize_q8(y.reshape(-1)), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert rel_err(y.cpu(), reference(q * 4, k, v, s - 1, scale=d**-0.5)) < 1e-5


@pytest.mark.parametrize(("group", "d"), [(2, 48), (1, 16)])
def test_no_q8_copy_for_partial_chunks(group, d, device):
    """Chunks of 32 values that would span a padded head (48) or two programs (a group of
    one head of 16): nothing attached (the GEMV quantizes the output itself)."""
    from localllm.kernels.gemv import attached_q8

    q, k, v = random_qkv(2 * group, 2, 30, d, seed=3)
    y = decode_attention(q.to(device), k.to(device), v.to(device),
                         torch.tensor([29], device=device), scale=0.125)  # fmt: skip
    assert attached_q8(y) is None
    assert rel_err(y.cpu(), reference(q, k, v, 29)) < 1e-5


def test_no_visible_key_gives_zeros(device):
    q, k, v = random_qkv(2, 1, 20, 64, seed=8)
    kp = torch.full((20,), -1, dtype=torch.int64)
    y = run(q, k, v, 5, device, k_positions=kp, scale=0.125, n_splits=3)
    assert torch.equal(y, torch.zeros_like(y))


def test_default_sizes_are_functions_of_shapes():
    # >= 32 slots per step, a K (and V) tile of at most 8192 elements.
    assert [default_block_s(d) for d in (16, 64, 96, 128, 256)] == [128, 128, 64, 64, 32]
    # One step per program while the programs stay within TARGET_PROGRAMS, else two...
    assert split_plan(4096, 8, 64) == (32, 128)  # 64 x 8 = 512 programs > 264: 2 steps
    assert split_plan(512, 1, 32) == (16, 32)  # gemma3-270m's ring layers: 1 step each
    assert split_plan(37, 2, 32) == (2, 32)
    # ... and more steps only past MAX_SPLITS splits (long contexts).
    n, length = split_plan(131072, 8, 64)
    assert n <= attention.MAX_SPLITS and n * length >= 131072


@pytest.mark.parametrize(
    ("q_shape", "kv_shape", "kwargs", "match"),
    [
        ((4, 512), (2, 10, 512), {}, "head_dim"),
        ((4, 0), (2, 10, 0), {}, "head_dim"),
        ((3, 64), (2, 10, 64), {}, "KV heads"),
        ((4, 64), (2, 10, 32), {}, "head_dim"),
        ((4, 64), (2, 10, 64), {"window": 0}, "window"),
        ((4, 64), (2, 10, 64), {"n_splits": 0}, "n_splits"),
        ((4, 64), (2, 10, 64), {"block_s": 12}, "block_s"),
        ((4, 64), (2, 10, 64), {"block_s": 8}, "block_s"),
        ((4, 64), (2, 10, 64), {"softcap": 0.0}, "softcap"),
        ((4, 64), (2, 10, 64), {"k_positions": torch.arange(9)}, "k_positions"),
        ((4, 64), (2, 10, 64), {"sinks": torch.zeros(2)}, "sinks"),
        ((4, 64), (2, 10, 64), {"chunk": 0}, "chunk"),
        ((4, 64), (2, 10, 64), {"v_cache": torch.zeros(2, 10, 64, dtype=torch.uint8)},
         "q8_0 blocks"),
        ((4, 48), (2, 10, 48), {"k_cache": torch.zeros(2, 10, 51, dtype=torch.uint8)},
         "q8_0 blocks"),
        ((4, 64), (2, 10, 64), {"sinks": torch.zeros(4, dtype=torch.int64)}, "sinks"),
    ],
)
def test_bad_arguments(q_shape, kv_shape, kwargs, match):
    q, kv = torch.zeros(q_shape), torch.zeros(kv_shape)
    caches = {"k_cache": kv, "v_cache": kv}
    for name in caches:
        if name in kwargs:
            caches[name] = kwargs.pop(name)
    with pytest.raises(ValueError, match=match):
        decode_attention(q, caches["k_cache"], caches["v_cache"], torch.tensor([0]), scale=1.0,
                         **kwargs)
    with pytest.raises(ValueError, match="q_pos"):
        decode_attention(torch.zeros(4, 64), torch.zeros(2, 5, 64), torch.zeros(2, 5, 64),
                         torch.tensor([0], dtype=torch.int32), scale=1.0)  # fmt: skip


def test_no_host_reads_one_launch(monkeypatch):
    launch = NoLaunch()
    monkeypatch.setattr(attention, "_decode_attention_kernel", launch)
    q, k, v = random_qkv(4, 2, 50, 64)
    q_pos = torch.tensor([30])
    kp = ring_positions(50, 80)
    decode_attention(q, k, v, q_pos, scale=0.125, n_splits=2)  # allocates the tickets once
    with OpRecorder() as rec:
        decode_attention(q, k, v, q_pos, scale=0.125)
        decode_attention(q, k, v, q_pos, window=8, scale=0.125, n_splits=3)
        decode_attention(q, k, v, q_pos, k_positions=kp, scale=0.125)
    assert launch.launches == 4  # the splits merge inside the kernel: no second launch
    assert launch.grids[2] == (2, 3)
    assert not rec.ops & HOST_READS, rec.ops & HOST_READS
    # nor any other kernel: allocations only (no memset of the ticket counters per call)
    assert rec.ops <= {"aten.empty", "aten.empty_strided"}, rec.ops
    # The recorder does see a host read when there is one: the check above can fail.
    with OpRecorder() as rec:
        q_pos.item()
    assert rec.ops & HOST_READS


@pytest.mark.cuda
def test_cuda_graph_replay(device):
    if device.type != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    s, d = 256, 128
    q, k, v = (t.to(device) for t in random_qkv(8, 2, s, d, seed=9))
    q_pos = torch.tensor([0], device=device)
    decode_attention(q, k, v, q_pos, scale=0.1)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, k, v, q_pos, scale=0.1)
    for p in (5, 100, s - 1):
        q_pos.fill_(p)
        graph.replay()
        assert rel_err(out.cpu(), reference(q, k, v, p, scale=0.1)) < 1e-5


# Run in a fresh process: Triton's interpreter patches triton.language during the interpreted
# tests above and (3.6 to 3.9) does not undo the patches made for @jit helpers such as tl.sum;
# a native compile after them in the same process failed ("'value' object has no attribute
# 'dtype'") until kernels/_jit.py restored them. The check must not depend on that state.
COMPILE_SCRIPT = """
import sys
sys.path.insert(0, "tests")
from localllm.kernels import _aot
from test_kernel_compile import CASES

for name, case in CASES.items():
    if name.startswith("attention"):
        assert _aot.compile_case(case).asm["cubin"], name
print("compiled")
"""


def test_compiles_for_sm90():
    """The kernel's specializations of tests/test_kernel_compile.py compile to cubins in a
    fresh process (no interpreted launch before), without a GPU (bundled ptxas)."""
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError:
        pytest.skip("this Triton has no ASTSource/GPUTarget")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", COMPILE_SCRIPT],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("compiled")


@pytest.mark.parametrize("model", ["llama3-8b", "gemma3-270m"])
def test_static_profile(model):
    """From the sm_90 SASS (bench/kernel_profile.py): the main loop multiplies on tensor cores
    (HMMA), loads K and V 16 bytes a thread, spills nothing, and issues about 0.05-0.07
    warp-instructions per cache byte (the split-K kernel before it: about 0.9)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    import kernel_profile
    from localllm.kernels import _aot

    name = f"decode_attention/{model}"
    try:
        case, launch = kernel_profile.other_cases(90)[name]
        fig = kernel_profile.static_figures(_aot.compile_case(case), case, launch)
    except _aot.CompileUnavailable as e:
        pytest.skip(str(e))
    assert fig["instruction_mix"].get("HMMA", 0) > 0
    assert 128 in fig["load_widths_bits"]
    assert fig["spill_instructions"] == 0 and fig["local_bytes"] == 0
    assert fig["warp_instructions_per_byte"] < 0.1


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("kind", ["full-chunk", "ring-chunk", "ring-sinks", "full-sinks",
                                  "full-q8_0", "ring-sinks-q8_0"])
def test_kernel_ops_decode_matches_torch_ops(kind, static, device, monkeypatch):
    """The Triton backend's decode step (``KernelOps.self_attention``: the fused RoPE and
    cache write, then this kernel) against the torch ops, token by token past two chunk
    boundaries and a ring's wrap: Llama 4's chunked layers (the window ``pos % chunk + 1``
    from the host position, ``query_window``) on a full cache and on a ring of the chunk,
    and gpt-oss's attention sinks on a sliding-window ring and a full cache; caches of q8_0
    blocks (``-ctk/-ctv q8_0``, the torch QK-norm/RoPE and block writes, then the kernel
    reading the blocks; products in float16, hence the looser bound). Every step
    runs the kernel (no torch fallback), with the position an int (eager) or a device tensor
    (``static``: the step CUDA graphs capture, whole buffers, the chunk's window found in
    the kernel)."""
    from localllm.backends.dense import TorchOps
    from localllm.backends.triton import KernelOps
    from localllm.memory.kv import KVCache, RingKVCache
    from localllm.memory.kvtypes import CACHE_TYPES

    n_heads, n_kv, hd, chunk = 4, 2, 16, 8
    g = torch.Generator().manual_seed(len(kind))
    sinks = (torch.randn(n_heads, generator=g) * 2).to(device) if "sinks" in kind else None
    chunked = chunk if "chunk" in kind else None
    q8 = CACHE_TYPES["q8_0"] if "q8_0" in kind else None
    hd = 32 if q8 else hd  # whole blocks of 32 values

    def make():
        kw = {"dtype": torch.float32, "device": device, "chunk": chunked, "type_k": q8,
              "type_v": q8}
        if kind.startswith("full"):
            return KVCache(40, n_kv, hd, **kw)
        return RingKVCache(chunk, n_kv, hd, slack=3, **kw)

    launched = []
    real = kernels.decode_attention
    monkeypatch.setattr(kernels, "decode_attention",
                        lambda *a, **kw: launched.append(kw["chunk"]) or real(*a, **kw))
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, hd, 2, device=device) / hd)
    ref_cache, cache = make(), make()
    n_steps = 2 * chunk + 5
    for pos in range(n_steps):
        q = torch.randn(1, n_heads * hd, generator=g).to(device)
        k = torch.randn(1, n_kv * hd, generator=g).to(device)
        v = torch.randn(1, n_kv * hd, generator=g).to(device)
        positions = torch.tensor([pos], device=device)
        out = []
        for ops, c in ((TorchOps(), ref_cache), (KernelOps(), cache)):
            out.append(ops.self_attention(
                q, k, v, None, None, 1e-6, ops.rope_angles(positions, inv_freq), c,
                positions if static else pos, positions, head_dim=hd, neox=True, scale=hd**-0.5, sinks=sinks).cpu())
        assert rel_err(out[1], out[0]) < (3e-3 if q8 else 1e-5), pos
    assert launched == [chunked] * n_steps
