"""One Triton kernel source, two ways to run it: compiled for CUDA tensors, interpreted for CPU.

``triton.jit`` decides between compiling and interpreting once, at decoration time, from the
``TRITON_INTERPRET`` environment variable. Here both variants are built from the same Python
function, so a process (the test suite) can run a kernel on CPU tensors through Triton's
interpreter and on CUDA tensors natively, without touching the environment:

- :func:`kernel` wraps a top-level kernel; ``k[grid](*args)`` picks the variant from the
  device of the first tensor argument.
- :func:`device_fn` wraps a helper called from kernels: a plain ``JITFunction``, what the
  compiler inlines.

The interpreter runs a kernel as Python, so calls to ``JITFunction`` helpers (ours and
``triton.language``'s own, such as ``tl.zeros``) become Python calls, which ``JITFunction``
refuses outside a compilation. During an interpreted launch those calls are routed to the
interpreted helper, which is what ``TRITON_INTERPRET=1`` would have built at decoration time.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import contextmanager
from functools import cache
from typing import Any

import torch
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction


@cache
def _interpreted(fn: Callable) -> InterpretedFunction:
    return InterpretedFunction(fn)


def _call_interpreted(self: JITFunction, *args, **kwargs):
    return _interpreted(self.fn)(*args, **kwargs)


_lock = threading.RLock()


@contextmanager
def _jit_calls_interpreted():
    """Within the block, calling a ``JITFunction`` runs it in the interpreter."""
    with _lock:
        saved = JITFunction.__call__
        JITFunction.__call__ = _call_interpreted
        try:
            yield
        finally:
            JITFunction.__call__ = saved


def device_fn(fn: Callable) -> JITFunction:
    """Decorator for helpers called inside kernels (the ``@triton.jit`` of device functions).

    Not ``triton.jit``: under ``TRITON_INTERPRET`` it would build an interpreted function
    that the compiler cannot inline.
    """
    return JITFunction(fn)


class DualKernel:
    """A kernel launched as ``k[grid](*args, **kwargs)`` in the mode its tensors call for.

    Launch options the interpreter does not know (``num_warps``, ``enable_fp_fusion``) are
    dropped by it.
    """

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self._native: JITFunction | None = None
        self._interp: InterpretedFunction | None = None

    def variant(self, device: torch.device) -> Any:
        """The compiled kernel for CUDA devices, the interpreted one otherwise."""
        if device.type == "cuda":
            if self._native is None:
                # Not triton.jit: it would return an interpreted function under TRITON_INTERPRET.
                self._native = JITFunction(self.fn)
            return self._native
        if self._interp is None:
            self._interp = InterpretedFunction(self.fn)
        return self._interp

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            device = next(a.device for a in args if isinstance(a, torch.Tensor))
            fn = self.variant(device)
            if device.type == "cuda":
                return fn[grid](*args, **kwargs)
            with _jit_calls_interpreted():
                return fn[grid](*args, **kwargs)

        return launch


def kernel(fn: Callable) -> DualKernel:
    """Decorator for top-level kernels (see :class:`DualKernel`)."""
    return DualKernel(fn)
