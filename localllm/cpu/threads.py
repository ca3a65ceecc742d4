"""CPU thread count (llama.cpp's ``-t/--threads``): torch's intra-op threads, which the
native kernels (``at::parallel_for``), torch's GEMMs and element-wise ops all use."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..errors import ParameterError


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


def set_threads(n: int | None) -> int:
    """Use ``n`` CPU threads (None: :func:`physical_cores`, unless OMP_NUM_THREADS is set);
    returns the count in effect.

    Raises:
        ParameterError: ``n`` < 1.
    """
    if n is None:
        if os.environ.get("OMP_NUM_THREADS"):
            return torch.get_num_threads()
        n = physical_cores()
    if n < 1:
        raise ParameterError(f"-t/--threads must be >= 1, got {n}")
    if n != torch.get_num_threads():
        torch.set_num_threads(n)
    return n
