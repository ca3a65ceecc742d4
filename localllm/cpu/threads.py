"""CPU thread counts (llama.cpp's ``-t/--threads`` and ``-tb/--threads-batch``): torch's
intra-op threads, which the native kernels (``at::parallel_for``), torch's GEMMs and
element-wise ops all use.

Counts are clamped to :data:`MAX_THREADS` (llama.cpp's ``GGML_MAX_N_THREADS``, 512): a
thread pool of 100,000 OpenMP threads crashed the process (SIGSEGV), and 10,000 took 51 s
for two tokens. ``torch.set_num_threads(n)`` sizes two pools, each ``n - 1`` workers plus
the caller: OpenMP's (started by the first parallel loop) and torch's pthreadpool (started
at once, used by XNNPACK/QNNPACK only; its workers sleep) — so ``-t 10000`` was 20,000
threads, and ``-t 512`` is at most 1,022 besides the interpreter's own.

On a machine whose cores another process takes, a decode is not slowed down by its own
threads: one-token steps run on fewer threads while that is measured to be faster
(:class:`CoreShare`), and waiting threads sleep instead of spinning when OpenMP's wait
policy allows it (``OMP_WAIT_POLICY=PASSIVE``, set by the command line before torch loads
when the cores are busy at start).
"""

from __future__ import annotations

import os
import time
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


def set_threads(n: int | None, n_batch: int | None = None, *, adapt: bool = True) -> int:
    """Use ``n`` CPU threads for one-token steps and ``n_batch`` for prompt batches
    (llama.cpp's ``-t`` / ``-tb``); returns the count for one-token steps in effect.

    Counts above :data:`MAX_THREADS` are clamped to it (:func:`thread_counts` says whether).
    The count is per calling thread in torch's OpenMP backend: :func:`use_threads_for`
    applies it on the thread that runs the model. With ``adapt`` (the default, unless the
    environment sets ``LOCALLLM_ADAPTIVE_THREADS=0``) and more than one thread, steps run
    on fewer threads while other processes keep the cores busy (:class:`CoreShare`).

    Raises:
        ParameterError: a count below 1, or not an integer.
    """
    global _counts, _share
    counts = thread_counts(n, n_batch)
    _counts = counts
    adapt = adapt and os.environ.get("LOCALLLM_ADAPTIVE_THREADS", "1") != "0"
    _share = CoreShare(counts.threads) if adapt and counts.threads > 1 else None
    if counts.threads != torch.get_num_threads():
        torch.set_num_threads(counts.threads)
    return counts.threads


def step_threads() -> dict[int, int] | None:
    """One-token steps run at each thread count since :func:`set_threads` (fewer than
    ``-t`` while other processes took the cores), or None when the count is fixed."""
    return None if _share is None else dict(_share.steps)


def current_counts() -> ThreadCounts | None:
    """What :func:`set_threads` last chose (None: it was never called)."""
    return _counts


def use_threads_for(n_tokens: int) -> None:
    """Switch the calling thread's intra-op threads to ``threads_batch`` for a batch of
    ``n_tokens`` > 1, or to ``threads`` for one token (llama.cpp picks ``n_threads_batch``
    when a micro-batch holds more than one token, ``src/llama-context.cpp``), fewer when
    other processes keep the cores busy (:class:`CoreShare`). Does nothing unless
    :func:`set_threads` was called with two different counts or an adaptive one; otherwise
    costs one ``torch.get_num_threads()`` when nothing changes, and a read of the threads'
    ``schedstat`` every :data:`CoreShare.INTERVAL` seconds of steps."""
    counts, share = _counts, _share
    if counts is None or (share is None and counts.threads == counts.threads_batch):
        return
    want = counts.threads_batch if n_tokens > 1 else counts.threads
    if share is not None:
        n = share.usable(n_tokens)
        if n < share.cap:  # crowded: batches on no more threads than steps
            want = min(want, n)
    if torch.get_num_threads() != want:
        torch.set_num_threads(want)


def run_queue_wait() -> float | None:
    """Seconds this process's threads have spent runnable but not running, waiting for a
    CPU, since each started (the second field of Linux's ``/proc/self/task/*/schedstat``,
    nanoseconds), or None where the kernel does not keep it."""
    total = 0
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat", "rb") as f:
                total += int(f.read(256).split()[1])
        except FileNotFoundError:
            continue  # the thread ended between the listing and the read
        except (OSError, ValueError, IndexError):
            return None
    return total / 1e9


class CoreShare:
    """How many threads one-token steps run on now: ``cap``, or fewer while other processes
    of the same or higher priority take the CPUs.

    When another process takes a core we would run a thread on, a thread of ours waits at
    every one of a step's parallel loops for a colleague the scheduler has parked, and
    OpenMP's spinning idle threads take time from both: on this project's 2-core machine a
    2-thread decode kept 0.24-0.30 of its idle speed beside one busy process, llama.cpp
    0.39 (``bench/bench_contention.py``), where one thread keeps the one-thread speed. Yet
    beside ``nice 19`` jobs our threads also wait (about 0.2 s per second each, measured)
    while two threads still beat one. So the count is chosen by the steps' own speed:
    over each :data:`INTERVAL` of step time the steps per second at the count in use are
    measured; when our threads waited for a CPU (:func:`run_queue_wait`, more than
    :data:`CROWDED` s per thread per second) one thread fewer is tried for one interval,
    and below ``cap`` one more is tried every :data:`RETRY` seconds; a tried count is kept
    only if its steps are :data:`BETTER` times faster. On an idle machine nothing is tried.
    Where the kernel keeps no run-queue times, the count is always ``cap``.

    Args:
        cap: the most threads (``-t``).
        wait: seconds of run-queue wait of this process so far, or None (tests give
            their own; default :func:`run_queue_wait`).  clock: wall seconds.
    """

    INTERVAL = 0.25  # seconds of step time per measurement: a few decode steps
    CROWDED = 0.10  # run-queue wait per thread per second that starts a trial of one fewer
    BETTER = 1.05  # a tried count must be this much faster to be kept
    RETRY = 4.0  # seconds after a failed trial, or between trials of one more thread
    GAP = 1.0  # seconds between two steps beyond which the time is not a step's

    def __init__(self, cap: int, *, wait=run_queue_wait, clock=time.monotonic):
        self.cap = cap
        self._wait, self._clock = wait, clock
        now, waited = clock(), wait()
        self._enabled = waited is not None
        self._mark = (now, waited)  # the last reading of the run-queue wait
        self._n = cap
        self._prev: float | None = None  # clock at the last one-token call
        self._steps, self._step_s = 0, 0.0  # this interval's steps and their seconds
        self._rate: dict[int, float] = {}  # steps per second last measured at each count
        self._trial: int | None = None  # the count we came from while trying another
        self._next_try = now
        self.waiting: float | None = None  # last interval's wait per thread per second
        self.steps: dict[int, int] = {}  # one-token steps run at each count, since the start

    def usable(self, n_tokens: int = 1) -> int:
        """Threads for the next step; ``n_tokens`` > 1: a batch, whose time is not
        measured (it runs on the current count)."""
        now = self._clock()
        prev, self._prev = self._prev, now if n_tokens == 1 else None
        if self._enabled and prev is not None and now - prev <= self.GAP:
            self._steps += 1
            self._step_s += now - prev
            if self._step_s >= self.INTERVAL and self._steps >= 2:
                self._measured(now)
        if n_tokens == 1:
            self.steps[self._n] = self.steps.get(self._n, 0) + 1
        return self._n

    def _measured(self, now: float) -> None:
        rate = self._steps / self._step_s
        self._steps, self._step_s = 0, 0.0
        waited = self._wait()
        if waited is None:
            self._enabled, self._n = False, self.cap
            return
        t0, w0 = self._mark
        self._mark = (now, waited)
        self.waiting = max(0.0, waited - w0) / max(now - t0, 1e-9) / self._n
        self._rate[self._n] = rate
        if self._trial is not None:  # judge the count tried in this interval
            came, self._trial = self._trial, None
            if rate < self._rate.get(came, 0.0) * self.BETTER:
                self._n = came
                self._next_try = now + self.RETRY
            elif self._n < came:  # fewer kept: the next trial of more after RETRY
                self._next_try = now + self.RETRY
            return
        if now < self._next_try:
            return
        if self._n > 1 and self.waiting > self.CROWDED:
            self._trial, self._n = self._n, self._n - 1
        elif self._n < self.cap:
            self._trial, self._n = self._n, self._n + 1


_share: CoreShare | None = None  # set_threads' watch of the CPUs; None: fixed counts
