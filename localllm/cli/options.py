"""Options several commands share, and what they set up (``-t`` / ``-tb``)."""

from __future__ import annotations

from typing import Annotated

import typer

from .terminal import say

ThreadsOpt = Annotated[int | None, typer.Option(
    "--threads", "-t", help="CPU threads for generation (default: physical cores; at most 512)")]
ThreadsBatchOpt = Annotated[int | None, typer.Option(
    "--threads-batch", "-tb", help="CPU threads for prompt batches (default: --threads)")]


def apply_threads(threads: int | None, threads_batch: int | None = None) -> int:
    """``-t`` / ``-tb`` of a command: sets them (:func:`localllm.cpu.threads.set_threads`,
    which clamps them to 512 as llama.cpp does), with one ``note:`` line on stderr per count
    clamped; returns the count for one-token steps.

    Raises:
        ParameterError: a count below 1.
    """
    from ..cpu.threads import MAX_THREADS, set_threads, thread_counts

    counts = thread_counts(threads, threads_batch)
    for flag in counts.clamped:
        asked = threads if flag.startswith("-t/") else threads_batch
        say(f"note: {flag} {asked} is more than {MAX_THREADS} (llama.cpp's bound): using "
            f"{MAX_THREADS}")
    return set_threads(threads, threads_batch)


def prefer_passive_openmp_wait(environ=None) -> None:
    """Let idle OpenMP threads sleep instead of spin: ``OMP_WAIT_POLICY=PASSIVE`` unless the
    user chose (``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT``).

    GNU libgomp's default spins about 300,000 iterations (a few ms) at every barrier and
    between parallel loops before sleeping. A decode runs hundreds of short loops per token,
    so with a core taken by another process our waiting threads take time from it and from
    our own working thread (``bench/bench_contention.py``). libgomp reads the variable once,
    when torch loads it: this must run before ``import torch``.
    """
    import os

    environ = os.environ if environ is None else environ
    if not any(k in environ for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")):
        environ["OMP_WAIT_POLICY"] = "PASSIVE"
