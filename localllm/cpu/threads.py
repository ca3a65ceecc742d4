"""CPU thread counts (llama.cpp's ``-t/--threads`` and ``-tb/--threads-batch``): torch's
intra-op threads, which the native kernels (``at::parallel_for``), torch's GEMMs and
element-wise ops all use.

Counts are clamped to :data:`MAX_THREADS` (llama.cpp's ``GGML_MAX_N_THREADS``, 512): a
thread pool of 100,000 OpenMP threads crashed the process (SIGSEGV), and 10,000 took 51 s
for two tokens. ``torch.set_num_threads(n)`` sizes two pools, each ``n - 1`` workers plus
the caller: OpenMP's (started by the first parallel loop) and torch's pthreadpool (started
at once, used by XNNPACK/QNNPACK only; its workers sleep) — so ``-t 10000`` was 20,000
threads, and ``-t 512`` is at most 1,022 besides the interpreter's own. Waiting threads sleep instead of spinning when OpenMP's wait policy allows
it (``OMP_WAIT_POLICY=PASSIVE``, set by the command line before torch loads when the cores are busy at start), so that a decode on a machine whose cores are taken by
another process is not slowed down by our own idle threads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import ParameterError

MAX_THREADS = 512  # llama.cpp: GGML_MAX_N_THREADS (ggml/include/ggml.h)


@dataclass(frozen=True)
class ThreadCounts:
    """The counts in effect: ``threads`` for one-token steps (decode), ``threads_batch`` for
    batches of several tokens (prefill), as llama.cpp's ``n_threads`` / ``n_threads_batch``;
    ``clamped`` names the flags whose value was above :data:`MAX_THREADS`."""

    threads: int
    threads_batch: int
    clamped: tuple[str, ...] = ()


_counts: ThreadCounts | None = None  # what set_threads chose; None: torch's own setting


def physical_cores() -> int:
    """Physical cores this process may run on (Linux sysfs topology; else the CPU count),
    as llama.cpp's default thread count (``cpu_get_num_math``)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:
        cpus = list(range(os.cpu_count() or 1))
    cores = set()
    for c in cpus:
        sib = Path(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list")
        try:
            cores.add(sib.read_text().strip())
        except OSError:
            cores.add(str(c))
    return max(1, len(cores))


def _checked(n: object, flag: str) -> int:
    if isinstance(n, bool) or not isinstance(n, int):
        raise ParameterError(f"{flag} must be an integer, got {type(n).__name__}")
    if n < 1:
        raise ParameterError(f"{flag} must be >= 1, got {n}")
    return n


def thread_counts(n: int | None, n_batch: int | None = None) -> ThreadCounts:
    """The counts :func:`set_threads` would use, without changing anything.

    ``n`` None: :func:`physical_cores`, or torch's count when ``OMP_NUM_THREADS`` is set
    (clamped too); ``n_batch`` None: the same as ``n`` (llama.cpp's default).

    Raises:
        ParameterError: a count below 1, or not an integer.
    """
    clamped = []
    if n is None:
        n = torch.get_num_threads() if os.environ.get("OMP_NUM_THREADS") else physical_cores()
        n = max(1, n)
    else:
        n = _checked(n, "-t/--threads")
    if n > MAX_THREADS:
        clamped.append("-t/--threads")
        n = MAX_THREADS
    if n_batch is None:
        nb = n
    else:
        nb = _checked(n_batch, "-tb/--threads-batch")
        if nb > MAX_THREADS:
            clamped.append("-tb/--threads-batch")
            nb = MAX_THREADS
    return ThreadCounts(n, nb, tuple(clamped))


def set_threads(n: int | None, n_batch: int | None = None) -> int:
    """Use ``n`` CPU threads for one-token steps and ``n_batch`` for prompt batches
    (llama.cpp's ``-t`` / ``-tb``); returns the count for one-token steps in effect.

    Counts above :data:`MAX_THREADS` are clamped to it (:func:`thread_counts` says whether).
    The count is per calling thread in torch's OpenMP backend: :func:`use_threads_for`
    applies it on the thread that runs the model.

    Raises:
        ParameterError: a count below 1, or not an integer.
    """
    global _counts
    counts = thread_counts(n, n_batch)
    _counts = counts
    if counts.threads != torch.get_num_threads():
        torch.set_num_threads(counts.threads)
    return counts.threads


def current_counts() -> ThreadCounts | None:
    """What :func:`set_threads` last chose (None: it was never called)."""
    return _counts


def use_threads_for(n_tokens: int) -> None:
    """Switch the calling thread's intra-op threads to ``threads_batch`` for a batch of
    ``n_tokens`` > 1, or to ``threads`` for one token (llama.cpp picks ``n_threads_batch``
    when a micro-batch holds more than one token, ``src/llama-context.cpp``). Does nothing
    unless :func:`set_threads` was given two different counts; otherwise costs one
    ``torch.get_num_threads()`` when nothing changes."""
    counts = _counts
    if counts is None or counts.threads == counts.threads_batch:
        return
    want = counts.threads_batch if n_tokens > 1 else counts.threads
    if torch.get_num_threads() != want:
        torch.set_num_threads(want)
