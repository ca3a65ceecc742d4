"""Fuzzing the GGUF validator: mutated files raise GGUFError or validate; nothing else happens.

Properties checked on every mutated file (seeds from ``gguf_craft.fuzz_seeds``):
- ``parse_gguf`` / ``validate_vocab`` either succeed or raise :class:`GGUFError`;
- no hang (each call runs under a 5 s interval timer);
- bounded memory: the address space is capped (``RLIMIT_AS``, current usage + 1 GiB) and the
  Python heap peak is measured with ``tracemalloc``;
- a file we accept is also read by ``gguf.GGUFReader`` without error (checked on a sample).

CI runs about 25 s in all; ``LOCALLLM_FUZZ_SECONDS=600 pytest tests/test_fuzz_gguf.py`` runs the
random loop for that long (and more hypothesis examples, not derandomized).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import resource
import signal
import time
import tracemalloc

import gguf
import pytest
from gguf_craft import (
    N_OP_KINDS,
    apply_op,
    fuzz_seeds,
    load_with_metadata,
    metadata_fuzz_seeds,
    mutate_metadata,
    random_op,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from localllm.errors import GGUFError
from localllm.gguf.validate import parse_gguf, validate_vocab

_ON_DEMAND = os.environ.get("LOCALLLM_FUZZ_SECONDS")
FUZZ_SECONDS = float(_ON_DEMAND or 15)
SEEDS = fuzz_seeds()
HEAP_LIMIT = 16 << 20  # the seeds are < 2 KB; anything near this means an unchecked count
CALL_TIMEOUT_S = 5.0


class Hang(Exception):
    pass


def _alarm(signum, frame):
    raise Hang(f"validator ran longer than {CALL_TIMEOUT_S} s")


@contextlib.contextmanager
def guarded():
    """Cap the address space and arm an interval timer for the duration of the block."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as f:
        used = int(f.read().split()[0]) * resource.getpagesize()
    cap = used + (1 << 30)
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    old_handler = signal.signal(signal.SIGALRM, _alarm)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)


def check_one(data: bytes):
    """Validate ``data``; return the header or None. Anything but GGUFError propagates."""
    signal.setitimer(signal.ITIMER_REAL, CALL_TIMEOUT_S)
    try:
        try:
            header = parse_gguf(data, len(data), "fuzz.gguf")
        except GGUFError as e:
            assert "\n" not in str(e) and str(e).startswith("fuzz.gguf: ")
            return None
        try:
            validate_vocab(header.metadata, "fuzz.gguf")
        except GGUFError:
            pass
        check_layout_invariants(header, len(data))
        return header
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def check_layout_invariants(header, size: int) -> None:
    """What an accepted header promises the loaders: aligned, in-file, non-overlapping data."""
    assert header.data_offset % header.alignment == 0
    spans = []
    for t in header.tensors:
        assert t.offset % header.alignment == 0 and t.n_bytes > 0
        assert header.data_offset + t.offset + t.n_bytes <= size
        assert len(t.ne) in (1, 2, 3, 4) and min(t.ne) > 0 and len(t.name.encode()) < 64
        spans.append((t.offset, t.offset + t.n_bytes))
    spans.sort()
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(spans))
    assert len({t.name for t in header.tensors}) == len(header.tensors)


def check_reader_agrees(data: bytes, header, tmp_dir) -> None:
    """gguf.GGUFReader must read a file we accepted, with the same tensors."""
    path = tmp_dir / "accepted.gguf"
    path.write_bytes(data)
    reader = gguf.GGUFReader(path)
    assert reader.data_offset == header.data_offset
    assert [t.name for t in reader.tensors] == [t.name for t in header.tensors]
    assert [int(t.n_bytes) for t in reader.tensors] == [t.n_bytes for t in header.tensors]
    del reader


_op = st.tuples(
    st.integers(0, N_OP_KINDS - 1),
    st.integers(0, 2**32 - 1),
    st.integers(0, 2**64 - 1),
    st.binary(min_size=1, max_size=16),
)


# Hypothesis profiles (registered here, applied only to this test): "gguf-fuzz-ci" is
# derandomized and sized to ~5 s; "gguf-fuzz-long" scales with LOCALLLM_FUZZ_SECONDS.
_COMMON = {
    "deadline": None,  # the interval timer catches hangs; shared-CI load makes deadlines flaky
    "database": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
}
settings.register_profile("gguf-fuzz-ci", max_examples=1500, derandomize=True, **_COMMON)
settings.register_profile(
    "gguf-fuzz-long", max_examples=int(FUZZ_SECONDS * 200), derandomize=False, **_COMMON
)
FUZZ_PROFILE = settings.get_profile("gguf-fuzz-long" if _ON_DEMAND else "gguf-fuzz-ci")


@settings(FUZZ_PROFILE)
@given(seed=st.integers(0, len(SEEDS) - 1), ops=st.lists(_op, min_size=1, max_size=4))
def test_hypothesis_mutations_raise_only_gguf_error(seed, ops):
    built = SEEDS[seed]
    data = built.data
    for op in ops:
        data = apply_op(data, built.fields, op)
    with guarded():
        check_one(data)


def test_random_mutation_loop_is_clean(tmp_path):
    """Time-bounded random fuzzing (LOCALLLM_FUZZ_SECONDS, default 15 s), heap peak measured."""
    seed = int(os.environ.get("LOCALLLM_FUZZ_SEED", "0" if not _ON_DEMAND else time.time_ns()))
    rng = random.Random(seed)
    n = accepted = 0
    tracemalloc.start()
    try:
        deadline = time.monotonic() + FUZZ_SECONDS
        with guarded():
            while time.monotonic() < deadline:
                for _ in range(100):
                    built = SEEDS[rng.randrange(len(SEEDS))]
                    data = built.data
                    for _ in range(rng.randrange(1, 5)):
                        data = apply_op(data, built.fields, random_op(rng))
                    header = check_one(data)
                    n += 1
                    if header is not None:
                        accepted += 1
                        if accepted % 50 == 1:
                            check_reader_agrees(data, header, tmp_path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    print(f"gguf fuzz: seed {seed}, {n} files, {accepted} accepted, heap peak {peak} B")
    assert n > 0 and 0 < accepted < n
    assert peak < HEAP_LIMIT


@pytest.mark.parametrize("which", range(len(SEEDS)))
def test_seeds_are_valid_and_read_by_gguf_reader(which, tmp_path):
    data = SEEDS[which].data
    header = check_one(data)
    assert header is not None
    check_reader_agrees(data, header, tmp_path)


# ---- metadata values: a small valid model of each family with hyperparameters mutated ------------
METADATA_FUZZ_SECONDS = float(_ON_DEMAND or 6)


@pytest.fixture(scope="module")
def metadata_seeds(tmp_path_factory):
    return metadata_fuzz_seeds(tmp_path_factory.mktemp("md-fuzz"))


def test_metadata_value_fuzz_raises_only_localllm_errors(metadata_seeds, monkeypatch):
    """Mutated hyperparameter values (0, NaN, inf, 2^40, strings, arrays, deleted keys, another
    family's name ...) through the whole load and a few decode steps: every outcome is a load
    or one LocalLLMError line; no other exception, no hang, bounded memory."""
    monkeypatch.delenv("LOCALLLM_SKIP_MEMORY_CHECK", raising=False)
    seed = int(os.environ.get("LOCALLLM_FUZZ_SEED", "0" if not _ON_DEMAND else time.time_ns()))
    rng = random.Random(seed)
    outcomes = {"loaded": 0, "refused": 0}
    deadline = time.monotonic() + METADATA_FUZZ_SECONDS
    with guarded():
        while time.monotonic() < deadline or sum(outcomes.values()) < 40:
            f = metadata_seeds[rng.randrange(len(metadata_seeds))]
            md = mutate_metadata(f.metadata, rng)
            signal.setitimer(signal.ITIMER_REAL, CALL_TIMEOUT_S)
            try:
                outcomes[load_with_metadata(f, md, rng)] += 1
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
    print(f"metadata fuzz: seed {seed}: {outcomes}")
    assert outcomes["loaded"] > 0 and outcomes["refused"] > 0


def test_metadata_seeds_load_unchanged(metadata_seeds):
    """Every seed of the fuzzer (the tiny models and the families' fixtures) loads as it is."""
    for f in metadata_seeds:
        assert load_with_metadata(f, f.metadata, random.Random(0)) == "loaded", f.path
