"""Shared by the kernel tests: the check that a launcher reads nothing back to the host
(what CUDA-graph capture forbids). Their ``device`` fixture is in conftest.py."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode

# Ops that copy a value to the host (a sync, illegal during CUDA-graph capture).
HOST_READS = {"aten._local_scalar_dense", "aten.item", "aten.nonzero", "aten.masked_select",
              "aten.is_nonzero", "aten.equal"}  # fmt: skip


class OpRecorder(TorchDispatchMode):
    """Records the names of the aten ops dispatched inside the block (``ops``)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


class NoLaunch:
    """Stands in for a kernel: records each launch's grid, runs nothing (the interpreter
    itself uses torch ops, which would blur the recording)."""

    def __init__(self) -> None:
        self.grids: list[tuple[int, ...]] = []

    @property
    def launches(self) -> int:
        return len(self.grids)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.grids.append(tuple(grid))

        return launch
