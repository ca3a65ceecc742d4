"""Attention reads only live cache cells: a ring before it wraps, a full cache up to the
position (the math is checked end to end by test_models.py)."""

from __future__ import annotations

import torch

from localllm.memory import KVCache, RingKVCache


def _kv(t: int, fill: float):
    return torch.full((2, t, 4), fill), torch.full((2, t, 4), -fill)


def test_ring_returns_live_prefix_until_it_wraps():
    ring = RingKVCache(4, 2, 4, slack=4, dtype=torch.float32, device="cpu")  # 8 cells
    keys, _values, pos = ring.update(0, *_kv(3, 1.0))  # prefill 0..2
    assert keys.shape[1] == 3 and pos.tolist() == [0, 1, 2]
    for p in range(3, 8):  # decode up to the last cell
        keys, _values, pos = ring.update(p, *_kv(1, float(p)))
        assert keys.shape[1] == p + 1 and pos.tolist() == list(range(p + 1))
        assert torch.equal(keys[:, p], torch.full((2, 4), float(p)))
    ring.truncate(6)  # rollback inside the prefix: still live cells only
    keys, _, pos = ring.update(6, *_kv(1, 9.0))
    assert pos.tolist() == list(range(7)) and keys[0, 6, 0] == 9.0
    keys, _, pos = ring.update(7, *_kv(1, 7.0))
    keys, _, pos = ring.update(8, *_kv(1, 8.0))  # wraps: the whole ring, slot 0 now holds 8
    assert keys.shape[1] == 8 and pos[0] == 8 and not ring.linear
    ring.reset()
    keys, _, pos = ring.update(0, *_kv(2, 1.0))
    assert keys.shape[1] == 2 and ring.linear


def test_ring_prefill_past_its_size_keeps_the_old_path():
    ring = RingKVCache(4, 2, 4, slack=4, dtype=torch.float32, device="cpu")
    keys, _, pos = ring.update(0, *_kv(10, 1.0))
    assert keys.shape[1] == 8 + 10 and (pos[:8] == -1).all() and not ring.linear


def test_full_cache_returns_positions_up_to_the_query():
    cache = KVCache(16, 2, 4, dtype=torch.float32, device="cpu")
    keys, _, pos = cache.update(0, *_kv(5, 1.0))
    assert keys.shape[1] == 5 and pos is None
    keys, _, _ = cache.update(5, *_kv(1, 2.0))
    assert keys.shape[1] == 6
