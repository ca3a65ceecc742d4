"""Per-layer KV caches for a single sequence.

Both caches are preallocated, so decoding never allocates cache memory:

* :class:`KVCache` holds every position up to the context size (global-attention layers).
* :class:`RingKVCache` holds the last ``window + slack`` positions of a sliding-window layer
  (Gemma 3's local layers, Mistral-style SWA). Slots are written at ``position % size``;
  the absolute position of each slot is kept beside it, so RoPE and the attention mask use
  absolute positions while the write index wraps. The ``slack`` lets a caller roll back
  up to ``slack`` tokens (chat turns re-rendered by the template) without recomputation,
  as llama.cpp's SWA cache keeps ``n_swa + n_ubatch`` cells.

``update(pos, k, v)`` writes ``T`` new positions and returns the keys, values and their
absolute positions that the new queries attend over; :func:`attention_mask` turns those
positions into the boolean mask.
"""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values of positions ``0 .. size-1``.

    Args:
        size: context size in tokens.
        n_kv_heads, head_dim: per-layer geometry.
    Tensors ``k``/``v`` have shape (n_kv_heads, size, head_dim).
    """

    window: int | None = None

    def __init__(
        self, size: int, n_kv_heads: int, head_dim: int, *, dtype: torch.dtype, device
    ) -> None:
        self.size = size
        self.k = torch.zeros(n_kv_heads, size, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.n = 0  # positions 0 .. n-1 are valid

    def update(self, pos: int, k: torch.Tensor, v: torch.Tensor):
        """Write ``k``/``v`` (n_kv_heads, T, head_dim) at positions ``pos .. pos+T-1``.

        Returns (keys, values, key_positions): (n_kv_heads, S, head_dim) twice and (S,) int64,
        with S = pos + T.
        """
        t = k.shape[1]
        end = pos + t
        self.k[:, pos:end] = k
        self.v[:, pos:end] = v
        self.n = end
        positions = torch.arange(end, device=self.k.device)
        return self.k[:, :end], self.v[:, :end], positions

    def can_truncate(self, n: int) -> bool:
        return n <= self.n

    def truncate(self, n: int) -> None:
        self.n = min(self.n, n)

    def reset(self) -> None:
        self.n = 0


class RingKVCache:
    """Keys and values of the last ``size = window + slack`` positions, in a ring.

    ``positions[i]`` is the absolute position held by slot ``i`` (-1 when empty).
    """

    def __init__(
        self,
        window: int,
        n_kv_heads: int,
        head_dim: int,
        *,
        slack: int,
        dtype: torch.dtype,
        device,
    ) -> None:
        self.window = window
        self.size = window + slack
        self.k = torch.zeros(n_kv_heads, self.size, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.positions = torch.full((self.size,), -1, dtype=torch.long, device=device)
        self.n = 0  # next absolute position expected

    def update(self, pos: int, k: torch.Tensor, v: torch.Tensor):
        """Attend over the ring's valid slots plus the ``T`` new positions, then store them.

        Returns (keys, values, key_positions) with S = size + T entries; empty slots and
        positions at or after ``pos`` carry position -1 (masked out).
        """
        t = k.shape[1]
        device = self.k.device
        if t == 1:
            # Decode: write first, then the ring itself holds the window (no concatenation).
            slot = pos % self.size
            self.k[:, slot] = k[:, 0]
            self.v[:, slot] = v[:, 0]
            self.positions[slot] = pos
            self.n = pos + 1
            return self.k, self.v, self.positions
        old_pos = torch.where(self.positions < pos, self.positions, -1)
        new_pos = torch.arange(pos, pos + t, device=device)
        keys = torch.cat([self.k, k], dim=1)
        values = torch.cat([self.v, v], dim=1)
        positions = torch.cat([old_pos, new_pos])
        # Store only the last `size` of the new positions (older ones are out of every window).
        keep = min(t, self.size)
        slots = new_pos[t - keep :] % self.size
        self.k[:, slots] = k[:, t - keep :]
        self.v[:, slots] = v[:, t - keep :]
        self.positions[slots] = new_pos[t - keep :]
        self.n = pos + t
        return keys, values, positions

    def can_truncate(self, n: int) -> bool:
        """True when positions ``n - window .. n - 1`` are all still in the ring."""
        lo = max(0, n - self.window)
        if n > self.n:
            return False
        held = self.positions[(self.positions >= lo) & (self.positions < n)]
        return held.numel() == n - lo

    def truncate(self, n: int) -> None:
        self.positions[self.positions >= n] = -1
        self.n = min(self.n, n)

    def reset(self) -> None:
        self.positions.fill_(-1)
        self.n = 0


def make_cache(
    ctx_size: int, window: int | None, n_kv_heads: int, head_dim: int, *, slack: int, device
) -> KVCache | RingKVCache:
    """A float32 cache for one layer: a ring of ``window + slack`` cells when the layer uses
    sliding-window attention with a window smaller than the context, else the full context."""
    if window and window < ctx_size:
        return RingKVCache(window, n_kv_heads, head_dim, slack=slack, dtype=torch.float32,
                           device=device)
    return KVCache(ctx_size, n_kv_heads, head_dim, dtype=torch.float32, device=device)


def attention_mask(
    q_positions: torch.Tensor, k_positions: torch.Tensor, window: int | None
) -> torch.Tensor:
    """Boolean (T, S) mask, True where query ``i`` may attend to key ``j``.

    Causal over absolute positions; keys with position -1 are empty slots. With a
    ``window``, a query at p sees keys at p - window + 1 .. p (llama.cpp's standard SWA).
    """
    q = q_positions[:, None]
    k = k_positions[None, :]
    mask = (k >= 0) & (k <= q)
    if window is not None:
        mask &= q - k < window
    return mask
