"""The per-layer memory interface (localllm.memory): what the runtime relies on, for each kind
(full KV cache, sliding-window ring, latent cache, recurrent state with checkpoints), and the
session behaviours built on it (truncation through checkpoints, prompt-cache files, per-session
hyperparameters)."""

from __future__ import annotations

import pytest
import torch
from families import write_family
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from localllm.errors import LocalLLMError
from localllm.memory import (
    KVCache,
    KVSpec,
    LatentCache,
    LayerMemory,
    Memory,
    RecurrentSpec,
    RecurrentState,
    RingKVCache,
    make_memory,
)
from localllm.runtime.session import Session, load_model


def _kv(t: int, value: float, heads: int = 2, hd: int = 4):
    x = torch.full((heads, t, hd), value)
    return x, x.clone()


@pytest.mark.parametrize("memory", [
    KVCache(16, 2, 4, dtype=torch.float32, device="cpu"),
    RingKVCache(4, 2, 4, slack=2, dtype=torch.float32, device="cpu", checkpoints=2),
    LatentCache(16, 8, dtype=torch.float32, device="cpu"),
    RecurrentState({"conv": (3, 4), "ssm": (2, 4, 4)}, device="cpu", checkpoints=2),
])
def test_every_kind_implements_the_protocol(memory):
    assert isinstance(memory, LayerMemory)
    assert memory.seq_len == 0 and memory.nbytes > 0 and memory.describe()


def test_full_cache_truncates_anywhere_and_round_trips_its_state():
    c = KVCache(16, 2, 4, dtype=torch.float32, device="cpu")
    c.update(0, *_kv(5, 1.0))
    assert c.restorable(3) == 3
    c.truncate(3)
    assert c.seq_len == 3
    other = KVCache(16, 2, 4, dtype=torch.float32, device="cpu")
    other.load_state(c.state(), 3)
    assert other.seq_len == 3 and torch.equal(other.k[:, :3], c.k[:, :3])
    with pytest.raises(ValueError, match="non-finite"):
        other.load_state({"k": torch.full((2, 3, 4), float("nan")), "v": c.v[:, :3]}, 3)
    with pytest.raises(ValueError, match="expected"):
        other.load_state({"k": c.k[:, :2], "v": c.v[:, :2]}, 3)


def test_wrapped_ring_goes_back_through_a_checkpoint():
    ring = RingKVCache(4, 2, 4, slack=2, dtype=torch.float32, device="cpu", checkpoints=4)
    ring.update(0, *_kv(8, 0.0))  # wraps (6 cells)
    assert ring.wants_checkpoints(9)
    ring.checkpoint()  # at 8
    saved_k = ring.k.clone()
    for p in range(8, 16):
        ring.update(p, *_kv(1, float(p)))
    # the ring (6 cells) holds positions 10..15
    assert ring.restorable(14) == 14  # its window 10..13 is still held
    assert ring.restorable(12) == 8  # 8, 9 were overwritten: back to the checkpoint
    ring.truncate(8)
    assert ring.seq_len == 8 and torch.equal(ring.k, saved_k)
    assert ring.restorable(5) == 0  # before any checkpoint: from the start


def test_ring_state_refuses_positions_that_do_not_fit():
    ring = RingKVCache(4, 2, 4, slack=2, dtype=torch.float32, device="cpu")
    ring.update(0, *_kv(3, 1.0))
    state = ring.state()
    fresh = RingKVCache(4, 2, 4, slack=2, dtype=torch.float32, device="cpu")
    fresh.load_state(state, 3)
    assert fresh.seq_len == 3 and fresh.restorable(3) == 3
    for bad in (torch.tensor([0, 1, 2**62, -1, -1, -1]), torch.tensor([0, 1, -5, -1, -1, -1]),
                torch.tensor([1, 0, 2, -1, -1, -1]), torch.tensor([0, 1, 2, -1, -1, -1.0])):
        with pytest.raises(ValueError):
            fresh.load_state({**state, "positions": bad}, 3)


def test_recurrent_state_restores_checkpoints_and_drops_later_ones():
    s = RecurrentState({"ssm": (2, 3)}, device="cpu", checkpoints=2)
    for step in range(1, 6):
        s["ssm"].add_(1.0)
        s.advance(1)
        if step in (2, 3, 4):
            s.checkpoint()
    assert s.seq_len == 5
    assert s.restorable(3) == 3 and s.restorable(2) == 0  # at most 2 kept: 3 and 4
    s.truncate(3)
    assert s.seq_len == 3 and torch.equal(s["ssm"], torch.full((2, 3), 3.0))
    assert s.restorable(4) == 3  # the checkpoint at 4 was after the truncation point
    with pytest.raises(ValueError):
        s.load_state({"ssm": torch.zeros(3, 2)}, 1)


def test_memory_restorable_is_a_fixed_point_over_layers():
    full = KVCache(32, 1, 2, dtype=torch.float32, device="cpu")
    rec = RecurrentState({"s": (1,)}, device="cpu", checkpoints=4)
    mem = Memory([full, rec], ctx_size=32)
    full.update(0, torch.zeros(1, 10, 2), torch.zeros(1, 10, 2))
    rec.advance(6)
    rec.checkpoint()
    rec.advance(4)
    assert mem.restorable(9) == 6 and mem.restorable(10) == 10
    mem.truncate(6)
    assert mem.seq_len == 6
    layout = [KVSpec(2, 4), KVSpec(2, 4, window=4), RecurrentSpec((("s", (3,)),))]
    made = make_memory(layout, 64, dtype=torch.float16, device="cpu", slack=2, checkpoints=1)
    assert [m.describe() for m in made] == ["full:2x4x4", "ring6:2x4x4", "recurrent-s3"]


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    return load_model(write_family("phi3", tmp_path_factory.mktemp("phi3")), device="cpu",
                      progress=False)


def test_phi3_rope_factors_are_per_session(phi3):
    """Phi-3's LongRoPE factors depend on the session's context (long above the original
    32): two sessions of different context sizes on one model each keep their own, whatever
    order they are made and used in (the factors once lived on the shared model)."""
    ids = list(range(5, 25))
    alone_long = Session(phi3, ctx_size=64).eval(ids)
    alone_short = Session(phi3, ctx_size=32).eval(ids)
    assert not torch.allclose(alone_long, alone_short)  # the factor sets differ
    long, short = Session(phi3, ctx_size=64), Session(phi3, ctx_size=32)
    torch.testing.assert_close(long.eval(ids), alone_long, rtol=0, atol=0)
    torch.testing.assert_close(short.eval(ids), alone_short, rtol=0, atol=0)


def test_prompt_cache_refuses_malformed_tokens(phi3, tmp_path):
    s = Session(phi3, ctx_size=32)
    s.eval([1, 2, 3])
    path = tmp_path / "cache.safetensors"
    s.save(path)
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    tensors = load_file(str(path))
    for bad in (torch.tensor([1.0, float("nan"), 3.0]), torch.tensor([True, False, True]),
                torch.tensor([1, 2, 10**9])):
        save_file({**tensors, "tokens": bad}, str(path), metadata=meta)
        with pytest.raises(LocalLLMError, match="token"):
            Session(phi3, ctx_size=32).load(path)
    save_file({**tensors, "0.k": torch.full_like(tensors["0.k"], float("inf"))}, str(path),
              metadata=meta)
    with pytest.raises(LocalLLMError, match="malformed"):
        Session(phi3, ctx_size=32).load(path)


# ---- chunked local attention (Llama 4: llama.cpp's LLAMA_SWA_TYPE_CHUNKED) ----------------
def test_chunked_mask_sees_only_the_query_chunk():
    """A query at p sees keys floor(p / chunk) * chunk .. p, as llama.cpp's is_masked_swa."""
    from localllm.memory import attention_mask

    q, k = torch.arange(12), torch.arange(12)
    mask = attention_mask(q, k, None, 4)
    for p in range(12):
        for j in range(12):
            assert bool(mask[p, j]) == (p // 4 * 4 <= j <= p), (p, j)
    # empty cells (-1) stay hidden; a window and a chunk together: both hold
    assert not attention_mask(q, torch.full((3,), -1), None, 4).any()
    both = attention_mask(q, k, 2, 4)
    assert torch.equal(both, attention_mask(q, k, 2, None) & mask)


@pytest.mark.parametrize("ring", [True, False])  # a ring of chunk + slack, a full cache
def test_chunked_spec_makes_a_cache_whose_attention_is_chunked(ring):
    """KVSpec(chunked=True) gives a cache with ``chunk``; the torch attention over it, a
    prompt then one-token steps across chunk boundaries, equals a brute-force chunked
    softmax; query_window gives the one-token kernels the same keys."""
    from localllm.backends.dense import TorchOps
    from localllm.memory import query_window

    spec = KVSpec(1, 4, 4, chunked=True)
    cache = (spec.make(64, dtype=torch.float32, device="cpu", slack=2, checkpoints=0)
             if ring else KVCache(16, 1, 4, dtype=torch.float32, device="cpu", chunk=4))
    assert cache.chunk == 4 and "chunk4" in cache.describe()
    assert isinstance(cache, RingKVCache) == ring  # the ring (6 cells) wraps below
    g = torch.Generator().manual_seed(0)
    n = 10
    q, k, v = (torch.randn(1, n, 4, generator=g) for _ in range(3))
    ops = TorchOps()
    out = [ops.attention(q[:, :5], k[:, :5], v[:, :5], cache, 0, torch.arange(5), scale=0.5)]
    for p in range(5, n):
        out.append(ops.attention(q[:, p:p + 1], k[:, p:p + 1], v[:, p:p + 1], cache, p,
                                 torch.tensor([p]), scale=0.5))
        assert query_window(cache, p) == p % 4 + 1
    got = torch.cat(out)  # (n, 4)
    for p in range(n):
        lo = p // 4 * 4
        w = torch.softmax(q[0, p] @ k[0, lo:p + 1].T * 0.5, -1)
        assert torch.allclose(got[p], w @ v[0, lo:p + 1], atol=1e-5), p
    with pytest.raises(ValueError, match="chunk"):
        KVSpec(1, 4, None, chunked=True)
