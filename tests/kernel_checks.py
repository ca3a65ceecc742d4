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


# Allocations: no kernel runs (views are recognized by their schema, see _launches_kernel).
NO_KERNEL = {"aten.empty", "aten.empty_strided", "aten.empty_like", "aten.lift_fresh"}


def _launches_kernel(func) -> bool:
    """Whether an aten op runs device code: not a view (a result aliasing an input without
    writing it) and not a bare allocation."""
    if str(func.overloadpacket) in NO_KERNEL:
        return False
    returns = func._schema.returns
    return not (returns and all(r.alias_info is not None and not r.alias_info.is_write
                                for r in returns))  # fmt: skip


class LaunchCounter(TorchDispatchMode):
    """Counts the kernels the block launches, as a GPU would run them: every Triton kernel
    launch (``localllm.kernels._jit.DualKernel``, by kernel name) and every aten op that
    computes (views and allocations excluded), by op name. What a kernel does inside its
    launch (the interpreter's own torch calls on the CPU) is not counted.

    With ``run=False`` the Triton kernels are counted but not run (their outputs stay
    uninitialized): enough for a step that reads nothing back to the host, and fast."""

    def __init__(self, *, run: bool = True) -> None:
        super().__init__()
        from collections import Counter

        self.launches: Counter[str] = Counter()
        self.run = run
        self._inside = 0

    @property
    def total(self) -> int:
        return sum(self.launches.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self._inside and _launches_kernel(func):
            self.launches[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        from localllm.kernels._jit import DualKernel

        self._saved = DualKernel.__getitem__
        counter, saved = self, self._saved

        def getitem(kernel, grid):
            launch = saved(kernel, grid)

            def counted(*args, **kwargs):
                counter.launches[kernel.fn.__name__.strip("_")] += 1
                if not counter.run:
                    return None
                counter._inside += 1
                try:
                    return launch(*args, **kwargs)
                finally:
                    counter._inside -= 1

            return counted

        DualKernel.__getitem__ = getitem
        return super().__enter__()

    def __exit__(self, *exc):
        from localllm.kernels._jit import DualKernel

        DualKernel.__getitem__ = self._saved
        return super().__exit__(*exc)
