"""Fixed-size recurrent state (hybrid and state-space models), and context checkpoints.

A recurrent layer (Mamba2's SSD, a gated delta-net) folds every position into a state of
fixed size: a short-convolution window (the last ``d_conv - 1`` inputs) and an SSM /
delta-rule matrix. It cannot forget the last few positions, so going back to a shorter
prefix means restoring a copy of the state taken there: a context checkpoint (llama.cpp's
``llama_memory_recurrent``; its server's ``--ctx-checkpoints``). :class:`Checkpoints` keeps
a bounded number of them, dropping the oldest.
"""

from __future__ import annotations

import torch


class Appendable:
    """The runtime side of a memory that holds every position it was given (a full KV cache,
    a latent cache): any prefix is restorable by forgetting the rest; ``n`` positions held."""

    cheap_rewind = True  # see memory.LayerMemory

    n: int

    @property
    def seq_len(self) -> int:
        return self.n

    def set_length(self, n: int) -> None:
        self.n = n

    def restorable(self, n: int) -> int:
        return min(n, self.n)

    def truncate(self, n: int) -> None:
        self.n = min(self.n, n)

    def checkpoint(self) -> None:
        """Nothing to keep: any prefix is restorable."""

    def wants_checkpoints(self, upto: int) -> bool:
        return False

    def reset(self) -> None:
        self.n = 0

    def rewritten(self) -> list[torch.Tensor]:
        return []  # a step writes only the cells of its own positions


class Checkpoints:
    """At most ``limit`` copies of a memory's tensors, by the position they were taken at."""

    def __init__(self, limit: int) -> None:
        self.limit = max(0, int(limit))
        self.items: list[tuple[int, dict[str, torch.Tensor]]] = []  # increasing positions

    def save(self, pos: int, tensors: dict[str, torch.Tensor]) -> None:
        """Keep a copy of ``tensors`` as the state at ``pos`` (replacing one at ``pos``)."""
        if self.limit == 0:
            return
        self.items = [(p, t) for p, t in self.items if p != pos]
        self.items.append((pos, {k: v.clone() for k, v in tensors.items()}))
        self.items.sort(key=lambda item: item[0])
        while len(self.items) > self.limit:
            self.items.pop(0)

    def best(self, n: int) -> int | None:
        """The latest checkpoint position ``<= n``, or None."""
        ps = [p for p, _ in self.items if p <= n]
        return ps[-1] if ps else None

    def get(self, pos: int) -> dict[str, torch.Tensor] | None:
        return next((t for p, t in self.items if p == pos), None)

    def drop_after(self, n: int) -> None:
        self.items = [(p, t) for p, t in self.items if p <= n]

    def clear(self) -> None:
        self.items = []

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for _, t in self.items for v in t.values())


class RecurrentState:
    """Named float32 state tensors of fixed shapes (``shapes``: name -> shape), zero at
    position 0, and up to ``checkpoints`` copies of them at earlier positions.

    The layer's mixer reads and writes the tensors in place (``state["conv"]`` ...) and the
    runtime counts positions through :meth:`set_length` / :meth:`advance`.
    """

    cheap_rewind = False  # see memory.LayerMemory

    window: int | None = None

    def __init__(self, shapes: dict[str, tuple[int, ...]], *, device,
                 checkpoints: int = 0) -> None:
        self.tensors = {k: torch.zeros(s, dtype=torch.float32, device=device)
                        for k, s in shapes.items()}
        self.n = 0
        self.checkpoints = Checkpoints(checkpoints)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def advance(self, t: int) -> None:
        """Count ``t`` more positions folded into the state (called by the mixer)."""
        self.n += t

    @property
    def seq_len(self) -> int:
        return self.n

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values()) + self.checkpoints.nbytes

    def set_length(self, n: int) -> None:
        self.n = n

    def restorable(self, n: int) -> int:
        if n >= self.n:
            return self.n
        at = self.checkpoints.best(n)
        return at if at is not None else 0

    def truncate(self, n: int) -> None:
        if n >= self.n:
            return
        self.checkpoints.drop_after(n)
        if n == 0:
            self.reset()
            return
        saved = self.checkpoints.get(n)
        if saved is None:
            raise ValueError(f"no checkpoint of the recurrent state at position {n}")
        for k, t in self.tensors.items():
            t.copy_(saved[k])
        self.n = n

    def wants_checkpoints(self, upto: int) -> bool:
        return self.checkpoints.limit > 0

    def checkpoint(self) -> None:
        if self.n > 0:
            self.checkpoints.save(self.n, self.tensors)

    def reset(self) -> None:
        for t in self.tensors.values():
            t.zero_()
        self.n = 0
        self.checkpoints.clear()

    def rewritten(self) -> list[torch.Tensor]:
        return list(self.tensors.values())  # every step folds into the whole state

    def describe(self) -> str:
        return "recurrent" + "".join(f"-{k}{'x'.join(map(str, t.shape))}"
                                     for k, t in self.tensors.items())

    def state(self) -> dict[str, torch.Tensor]:
        """The state tensors, and those of the latest checkpoint before the present position
        as ``{name}@{position}``: a prompt cache saved after a prompt then holds its state
        one token before the end (the session takes that checkpoint), from which the same
        prompt is resumed with one token recomputed instead of all of them."""
        out = dict(self.tensors)
        at = self.checkpoints.best(self.n - 1)
        if at is not None:
            out.update({f"{k}@{at}": t for k, t in self.checkpoints.get(at).items()})
        return out

    def load_state(self, state: dict[str, torch.Tensor], n: int) -> None:
        """The inverse of :meth:`state` at ``n`` positions; a checkpoint in ``state`` is kept
        where this memory keeps checkpoints.

        Raises:
            ValueError: a tensor missing, mis-shaped, not floats or non-finite; a checkpoint
                name that is not ``{name}@{position}`` with 0 < position < n.
        """
        saved: dict[int, dict[str, torch.Tensor]] = {}
        for key, s in state.items():
            name, _, at = key.partition("@")
            if not at:
                continue
            if not at.isdigit() or not 0 < int(at) < n or name not in self.tensors:
                raise ValueError(f"{key[:40]!r} is not a checkpoint of this state before {n}")
            saved.setdefault(int(at), {})[name] = s
        for k, t in self.tensors.items():
            for where in (state, *saved.values()):
                s = where.get(k)
                if s is None or not s.is_floating_point() or s.shape != t.shape:
                    raise ValueError(f"{k!r} must be floats {tuple(t.shape)}")
                if not bool(torch.isfinite(s).all()):
                    raise ValueError(f"{k!r} holds non-finite values")
        for k, t in self.tensors.items():
            t.copy_(state[k])
        self.n = n
        self.checkpoints.clear()
        for at, tensors in sorted(saved.items()):
            self.checkpoints.save(at, tensors)
