"""Building and loading the native CPU kernels (``csrc/*.cpp``) on first use.

The sources (with the headers they include, ``csrc/*.h``) are compiled with torch's
extension tooling (:func:`torch.utils.cpp_extension.load`, ``-O3 -march=native``) into the
user's cache directory (platformdirs), under a key made of the sources' and headers' hash,
the torch version, the compiler and the CPU's instruction-set flags, so a
later process loads the shared library directly (no compiler, no ninja). The library
registers its operators as ``torch.ops.localllm_cpu.*``.

``LOCALLLM_NATIVE_CPU=0`` turns the native kernels off (the torch path is used instead);
``LOCALLLM_CPU_ARCH`` compiles for another ``-march`` than ``native`` (tests of the AVX2 and
portable code paths).
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import sys
from pathlib import Path

import torch

CSRC = Path(__file__).parent / "csrc"
SOURCES = sorted(CSRC.glob("*.cpp"))
# What the library is built from: the sources and the headers they include.
BUILD_INPUTS = sorted(SOURCES + list(CSRC.glob("*.h")))
# LOCALLLM_CPU_ARCH picks another -march (haswell: the AVX2 path, x86-64: the portable one).
# -fopenmp: at::parallel_for is an OpenMP loop compiled into this library (without the flag it
# runs on one thread); the library then links libgomp.so.1, which resolves to the copy torch
# has already loaded, so torch.set_num_threads governs it.
CFLAGS = ["-O3", f"-march={os.environ.get('LOCALLLM_CPU_ARCH', 'native')}", "-ffp-contract=off",
          "-fopenmp"]
LDFLAGS = ["-fopenmp"]

_state: dict[str, object] = {}


def _cpu_flags() -> str:
    """The CPU's instruction-set flags (Linux /proc/cpuinfo), or the machine name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return platform.machine()


def build_key() -> str:
    """Hash of what the compiled library depends on (sources, flags, torch, compiler, CPU)."""
    h = hashlib.sha256()
    for src in BUILD_INPUTS:
        h.update(src.name.encode())
        h.update(src.read_bytes())
    h.update(" ".join(CFLAGS + LDFLAGS).encode())
    h.update(torch.__version__.encode())
    h.update((shutil.which(os.environ.get("CXX", "c++")) or "").encode())
    h.update(_cpu_flags().encode())
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("localllm")) / "cpu" / build_key()


def _load() -> None:
    name = f"localllm_cpu_{build_key()}"
    directory = cache_dir()
    lib = directory / f"{name}.so"
    if lib.exists():
        try:
            torch.ops.load_library(str(lib))
            return
        except OSError:  # being written by another process: build under torch's lock below
            pass
    from torch.utils.cpp_extension import load

    try:  # the ninja wheel's binary, when the venv's bin/ is not on PATH
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    directory.mkdir(parents=True, exist_ok=True)
    _clear_stale_lock(directory)
    print("localllm: compiling the native CPU kernels (once)...", file=sys.stderr, flush=True)
    load(name, [str(s) for s in SOURCES], extra_cflags=CFLAGS, extra_ldflags=LDFLAGS,
         build_directory=str(directory),
         is_python_module=False, verbose=False)


# A build takes a minute or two; torch's build lock (a ``lock`` file in the build directory,
# ``torch.utils.file_baton``) left by a build that was killed is waited on forever.
STALE_LOCK_SECONDS = 600


def _clear_stale_lock(directory: Path) -> None:
    """Remove the build lock of a killed build (older than :data:`STALE_LOCK_SECONDS`), so
    that the next build does not wait on it forever."""
    import time

    lock = directory / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except OSError:
        return
    if age > STALE_LOCK_SECONDS:
        print(f"localllm: removing a stale build lock ({lock}, {age / 60:.0f} min old)",
              file=sys.stderr, flush=True)
        lock.unlink(missing_ok=True)


def load_native() -> bool:
    """Build (first time) and load the kernels; True when ``torch.ops.localllm_cpu`` works.

    Never raises: without a compiler (or with ``LOCALLLM_NATIVE_CPU=0``) it returns False,
    after a one-line notice on stderr when the build failed.
    """
    if "ok" in _state:
        return bool(_state["ok"])
    ok = False
    if os.environ.get("LOCALLLM_NATIVE_CPU", "1") != "0":
        try:
            _load()
            torch.ops.localllm_cpu.gemv  # noqa: B018 (raises when the library did not register)
            ok = True
        except Exception as e:  # noqa: BLE001 (no compiler, no ninja, a failed build: fall back
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            print(f"notice: native CPU kernels unavailable ({reason[:160]}); using the torch "
                  "path (weights dequantized to float16 at load)", file=sys.stderr)
    _state["ok"] = ok
    return ok
