"""Long fuzzing run of the GGUF validator (random mutations of small valid files).

    python bench/fuzz_gguf.py --seconds 600 [--seed N] [--crash-dir DIR]
    python bench/fuzz_gguf.py --metadata --seconds 600 [--seed N]

``--metadata`` mutates hyperparameter VALUES instead of bytes: a small valid model of each
family (``gguf_craft.metadata_fuzz_seeds``) gets 1-3 keys set to hostile values (0, NaN, inf,
2^40, strings, arrays, deleted keys, another family's name: ``gguf_craft.mutate_metadata``)
and goes through the whole load and a few decode steps (``gguf_craft.load_with_metadata``).
A crash is any exception other than ``LocalLLMError``, or a hang; the mutated metadata of each
crash is printed.

Each execution mutates one of ``tests/gguf_craft.fuzz_seeds()`` with 1-4 random operations
(bit flips, byte sets, truncation, insertion, deletion, span copies, integer extremes aimed at
the header's count/length/type/dimension/offset fields) and runs ``parse_gguf`` and
``validate_vocab`` on it. A crash is any exception other than ``GGUFError``, a call that takes
longer than ``--timeout`` seconds, or an accepted file that ``gguf.GGUFReader`` cannot read
(checked on every ``--reader-every``-th accepted file). The address space is capped at current
usage + ``--mem-mib`` MiB. Crashing inputs are saved to ``--crash-dir``. Prints executions/s,
accepted/rejected counts and crashes; exits 1 if there was any crash.
"""

from __future__ import annotations

import argparse
import random
import resource
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

import gguf
from gguf_craft import apply_op, fuzz_seeds, random_op

from localllm.errors import GGUFError
from localllm.gguf.validate import parse_gguf, validate_vocab


class Hang(Exception):
    pass


def _alarm(signum, frame):
    raise Hang("timeout")


def _cap_memory(extra_mib: int) -> None:
    with open("/proc/self/statm") as f:
        used = int(f.read().split()[0]) * resource.getpagesize()
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = used + (extra_mib << 20)
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--timeout", type=float, default=5.0, help="seconds allowed per execution")
    ap.add_argument("--mem-mib", type=int, default=1024, help="address space allowed on top")
    ap.add_argument("--reader-every", type=int, default=50)
    ap.add_argument("--crash-dir", type=Path, default=Path("fuzz-crashes"))
    ap.add_argument("--metadata", action="store_true", help="mutate metadata values")
    args = ap.parse_args()
    if args.metadata:
        return fuzz_metadata(args)

    seed = args.seed if args.seed is not None else time.time_ns() % 2**32
    rng = random.Random(seed)
    seeds = fuzz_seeds()
    tmp = Path(tempfile.mkdtemp(prefix="fuzz-gguf-"))
    signal.signal(signal.SIGALRM, _alarm)
    _cap_memory(args.mem_mib)

    n = accepted = crashes = 0
    start = time.monotonic()
    end = start + args.seconds
    next_report = start + 10
    while True:
        now = time.monotonic()
        if now >= end:
            break
        if now >= next_report:
            print(
                f"  {now - start:6.0f} s  {n} execs  {n / (now - start):,.0f}/s  {crashes} crashes",
                flush=True,
            )
            next_report += 10
        built = seeds[rng.randrange(len(seeds))]
        data = built.data
        for _ in range(rng.randrange(1, 5)):
            data = apply_op(data, built.fields, random_op(rng))
        n += 1
        signal.setitimer(signal.ITIMER_REAL, args.timeout)
        try:
            try:
                header = parse_gguf(data, len(data), "fuzz.gguf")
            except GGUFError:
                continue
            accepted += 1
            try:
                validate_vocab(header.metadata, "fuzz.gguf")
            except GGUFError:
                pass
            if accepted % args.reader_every == 1:
                path = tmp / "accepted.gguf"
                path.write_bytes(data)
                reader = gguf.GGUFReader(path)
                if [t.name for t in reader.tensors] != [t.name for t in header.tensors]:
                    raise AssertionError("GGUFReader disagrees on the tensor list")
                del reader
        except Exception:  # noqa: BLE001 - everything that is not GGUFError is a finding
            crashes += 1
            args.crash_dir.mkdir(parents=True, exist_ok=True)
            out = args.crash_dir / f"crash-{seed}-{n}.gguf"
            out.write_bytes(data)
            print(f"CRASH #{crashes} (saved {out}):", file=sys.stderr)
            traceback.print_exc(limit=3)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)

    elapsed = time.monotonic() - start
    print(
        f"gguf fuzz: seed {seed}: {n} executions in {elapsed:.1f} s "
        f"({n / elapsed:,.0f}/s), {accepted} accepted, {n - accepted} refused with GGUFError, "
        f"{crashes} crashes"
    )
    return 1 if crashes else 0


def fuzz_metadata(args) -> int:
    from gguf_craft import load_with_metadata, metadata_fuzz_seeds, mutate_metadata

    seed = args.seed if args.seed is not None else time.time_ns() % 2**32
    rng = random.Random(seed)
    seeds = metadata_fuzz_seeds(tempfile.mkdtemp(prefix="fuzz-md-"))
    signal.signal(signal.SIGALRM, _alarm)
    _cap_memory(args.mem_mib)
    outcomes = {"loaded": 0, "refused": 0, "crash": 0}
    start = time.monotonic()
    while time.monotonic() - start < args.seconds:
        f = seeds[rng.randrange(len(seeds))]
        md = mutate_metadata(f.metadata, rng)
        signal.setitimer(signal.ITIMER_REAL, args.timeout)
        try:
            outcomes[load_with_metadata(f, md, rng)] += 1
        except Exception:  # noqa: BLE001 - everything that is not LocalLLMError is a finding
            outcomes["crash"] += 1
            changed = {k: v for k, v in md.items() if f.metadata.get(k, object()) != v}
            removed = sorted(set(f.metadata) - set(md))
            print(f"CRASH on {f.path.name}: changed {changed!r} removed {removed}",
                  file=sys.stderr)
            traceback.print_exc(limit=3)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    n = sum(outcomes.values())
    elapsed = time.monotonic() - start
    print(f"metadata fuzz: seed {seed}: {n} executions in {elapsed:.1f} s ({n / elapsed:,.1f}/s), "
          f"{outcomes['loaded']} loaded, {outcomes['refused']} refused with LocalLLMError, "
          f"{outcomes['crash']} crashes")
    return 1 if outcomes["crash"] else 0


if __name__ == "__main__":
    sys.exit(main())
