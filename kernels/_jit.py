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

Tested with Triton 3.6, 3.8 and 3.9. The interpreter internals used here are looked up defensively;
where one is missing (another Triton version), the launch goes ahead without that adjustment.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from contextlib import contextmanager
from functools import cache
from typing import Any

import torch
import triton.runtime.interpreter as _interpreter
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction


@cache
def _interpreted(fn: Callable) -> InterpretedFunction:
    return InterpretedFunction(fn)


def _call_interpreted(self: JITFunction, *args, **kwargs):
    return _interpreted(self.fn)(*args, **kwargs)


_MISSING = object()


def _scalar_index(self) -> int:
    # The interpreter holds scalars as 1-element 1-D arrays. Triton 3.6 (not 3.8) turns them
    # into loop bounds with int(array), which NumPy >= 2.4 refuses for arrays of ndim > 0
    # ("only 0-dimensional arrays can be converted"); .item() takes any 1-element array.
    return int(self.handle.data.item())


def _patch_lang_tensor_robust(original: Callable) -> Callable:
    """Wrap the interpreter's ``_patch_lang_tensor`` to install :func:`_scalar_index`."""

    def patch(tensor, *rest):
        original(tensor, *rest)
        # Recent Triton (3.6 to 3.9 at least) passes a scope that undoes the patches after
        # the launch; older versions, (tensor) or (tensor, builder), set them for good.
        scope = rest[0] if rest and hasattr(rest[0], "set_attr") else None
        if scope is not None:
            scope.set_attr(tensor, "__index__", _scalar_index)
        else:
            tensor.__index__ = _scalar_index

    return patch


def _language_namespaces() -> list[Any]:
    """``triton.language``'s modules and classes: what the interpreter patches for a launch."""
    import triton.language as tl

    core = tl.core
    found = {id(o): o for o in (tl, core, getattr(tl, "math", None)) if o is not None}
    for v in vars(core).values():
        if isinstance(v, type) and v.__module__ == core.__name__:
            found[id(v)] = v
    return list(found.values())


@contextmanager
def _language_restored():
    """Undo, when the block exits, what the interpreter patched into ``triton.language``.

    The interpreter swaps ``tl.tensor``'s operators, ``tl.range`` etc. for NumPy versions
    during a launch. Each call of an interpreted helper patches them again and never
    restores them (Triton 3.6 to 3.9 at least; older versions restore nothing): harmless
    under ``TRITON_INTERPRET=1``, but here a later compilation in the same process would
    build its IR with the NumPy operators and fail ("'value' object has no attribute
    'dtype'").
    """
    saved = [(o, dict(vars(o))) for o in _language_namespaces()]
    try:
        yield
    finally:
        for obj, before in saved:
            now = dict(vars(obj))
            for name, value in now.items():
                # Added by the patches; a submodule imported meanwhile stays.
                if name not in before and not inspect.ismodule(value):
                    delattr(obj, name)
            for name, value in before.items():
                if now.get(name, _MISSING) is not value:
                    setattr(obj, name, value)


_lock = threading.RLock()


@contextmanager
def _jit_calls_interpreted():
    """Within the block, calling a ``JITFunction`` runs it in the interpreter.

    Also makes the interpreter's scalar ``__index__`` work with any NumPy 2 (see
    :func:`_scalar_index`), where the interpreter has the hook for it, and leaves
    ``triton.language`` as it found it (see :func:`_language_restored`).
    """
    with _lock, _language_restored():
        saved = JITFunction.__call__
        saved_patch = getattr(_interpreter, "_patch_lang_tensor", None)
        JITFunction.__call__ = _call_interpreted
        if saved_patch is not None:
            _interpreter._patch_lang_tensor = _patch_lang_tensor_robust(saved_patch)
        try:
            yield
        finally:
            JITFunction.__call__ = saved
            if saved_patch is not None:
                _interpreter._patch_lang_tensor = saved_patch


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
