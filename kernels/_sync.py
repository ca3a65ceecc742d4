"""Ticket counters for kernels whose last program merges the others' partial results.

A split launch (split-K GEMV, flash-decoding attention) ends in one launch, not two: each
program stores its partial result, then draws a ticket (``atomic_add(tickets + row, 1)``
with acquire-release order); the program that draws the last ticket of its row merges the
partial results of the row, in a fixed order (so the result does not depend on which program
came last), and resets the counter to zero for the next launch (a CUDA-graph replay).

The counters are zero between launches, so they are allocated once per device, not per
launch (no memset kernel), and shared by every such kernel: launches on one device must run
in order on one stream (the decode step's do).
"""

from __future__ import annotations

import torch

# Per device, every counter array allocated so far (the last one is the largest). The older
# ones stay alive: a CUDA graph captured with one keeps its address.
TICKETS: dict[torch.device, list[torch.Tensor]] = {}


def tickets(device: torch.device, n: int) -> torch.Tensor:
    """At least ``n`` int32 ticket counters on ``device``, all zero between launches."""
    held = TICKETS.setdefault(device, [])
    if not held or held[-1].numel() < n:
        held.append(torch.zeros(max(n, 256, 2 * held[-1].numel() if held else 0),
                                dtype=torch.int32, device=device))  # fmt: skip
    return held[-1]
