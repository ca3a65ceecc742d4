"""The latent cache of multi-head latent attention (MLA; DeepSeek-V2, Liu et al. 2024,
"DeepSeek-V2: A Strong, Economical, and Efficient Mixture-of-Experts Language Model"):
one vector per position, the compressed KV (``kv_lora_rank`` values) followed by the
decoupled RoPE key (``n_rot`` values), instead of every head's keys and values. At decode the
up-projections are absorbed into the query and output (llama.cpp's ``deepseek2.cpp``), so
attention reads only this cache.
"""

from __future__ import annotations

import torch

from .recurrent import Appendable


class LatentCache(Appendable):
    """``c`` (size, dim): the latent vector of positions ``0 .. size-1``."""

    window: int | None = None

    def __init__(self, size: int, dim: int, *, dtype: torch.dtype, device) -> None:
        self.size = size
        self.c = torch.zeros(size, dim, dtype=dtype, device=device)
        self.n = 0

    def update(self, pos: int, c: torch.Tensor) -> torch.Tensor:
        """Write ``c`` (T, dim) at positions ``pos .. pos+T-1``; returns the (pos+T, dim)
        latents of every position so far."""
        end = pos + c.shape[0]
        self.c[pos:end] = c
        self.n = end
        return self.c[:end]

    def update_static(self, pos: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """:meth:`update` of one token at a (1,) device position: the whole buffer."""
        self.c.index_copy_(0, pos, c.to(self.c.dtype))
        return self.c

    @property
    def nbytes(self) -> int:
        return self.c.nbytes

    def describe(self) -> str:
        return f"latent{self.c.shape[1]}"

    def state(self) -> dict[str, torch.Tensor]:
        return {"c": self.c[: self.n]}

    def load_state(self, state: dict[str, torch.Tensor], n: int) -> None:
        c = state.get("c")
        if not 0 <= n <= self.size:
            raise ValueError(f"{n} positions do not fit in {self.size} cells")
        if c is None or not c.is_floating_point() or tuple(c.shape) != (n, self.c.shape[1]):
            raise ValueError(f"'c' must be floats ({n}, {self.c.shape[1]})")
        if not bool(torch.isfinite(c).all()):
            raise ValueError("'c' holds non-finite values")
        self.c[:n] = c
        self.n = n
