"""GEMV throughput of the native CPU kernels per build: int8 versus float32 activations.

    .venv/bin/python bench/bench_cpu_gemv.py MODEL.gguf --arch native haswell --rounds 5

Loads MODEL's matrices as the native backend packs them (views of the memory-mapped file) and
times products ``y = x @ W.T`` of one activation row (decode's GEMV; ``--rows`` up to 8: a
speculative verification; ``localllm.cpu.qmatmul``) with int8 activations (``gemv_q8``) and
with float32 activations (``gemv``), on every matrix of the file in turn, so that the weights
stream from DRAM as in a decode step (the file is larger than the L3), after one untimed pass
that maps the file's pages. Printed per (type, shape) and for all matrices together: GB/s of
weight bytes, medians over the rounds, in thread CPU time (steadier than wall time when other
jobs share the cores; the products run on one thread) and in wall time.

Each ``--arch`` runs in its own process with ``LOCALLLM_CPU_ARCH`` set (``native``: this
CPU, e.g. AVX512-VNNI; ``haswell``: the AVX2 kernels; the build is cached per flags), the
archs alternating round by round so that a shared machine's load hits them alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def worker(path: str, rows: int = 1) -> dict:
    """One round in this process's build: {mode: {key: (bytes, cpu s, wall s)}}."""
    import torch

    torch.set_num_threads(1)
    from localllm import cpu
    from localllm.runtime.session import load_model

    if not cpu.available():
        sys.exit("error: the native CPU kernels are unavailable")
    m = load_model(path, device="cpu", progress=False, backend="native")
    weights, seen = [], set()

    def walk(obj, depth=0):  # every PackedWeight of the model (layers, output head)
        if isinstance(obj, cpu.PackedWeight):
            if id(obj) not in seen and obj.qtype not in cpu.FLOAT_TYPES:
                seen.add(id(obj))
                weights.append(obj)
        elif isinstance(obj, (list, tuple)):
            for o in obj:
                walk(o, depth + 1)
        elif depth < 8 and hasattr(obj, "__dict__") and not isinstance(obj, torch.Tensor):
            for v in vars(obj).values():
                walk(v, depth + 1)

    walk(m.model)
    if not weights:
        sys.exit("error: the model has no quantized matrix with a native kernel")
    modes = {"int8": [cpu.PackedWeight.from_bytes(w.data, w.qtype, w.shape, q8=True)
                      for w in weights],
             "float32": [cpu.PackedWeight.from_bytes(w.data, w.qtype, w.shape) for w in weights]}
    if not modes["int8"][0].q8:
        del modes["int8"]  # no int8 GEMV in this build
    x = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
    out: dict = {}
    for w in modes["float32"]:  # warm-up: maps every page of the file (no page faults timed)
        cpu.qmatmul(x[w.shape[1]], w)
    for mode, ws in modes.items():
        res = out.setdefault(mode, {})
        for w in ws:
            key = f"{w.qtype.name} {w.shape[0]}x{w.shape[1]}"
            c0, t0 = time.thread_time(), time.perf_counter()
            cpu.qmatmul(x[w.shape[1]], w)
            c1, t1 = time.thread_time(), time.perf_counter()
            b, c, t = res.get(key, (0, 0.0, 0.0))
            res[key] = (b + w.data.numel(), c + c1 - c0, t + t1 - t0)
    return {"isa": "int8 available" if "int8" in modes else "no int8", "res": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="GGUF file")
    ap.add_argument("--arch", nargs="+", default=["native", "haswell"],
                    help="-march values to compare (LOCALLLM_CPU_ARCH), each in its own process")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rows", type=int, default=1, choices=range(1, 9), metavar="1..8",
                    help="activation rows per product (1: decode; 2-8: a speculative "
                         "verification or a small batch)")
    ap.add_argument("--json", help="write every round and the medians to this file")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if not os.path.isfile(a.model):
        sys.exit(f"error: no such file: {a.model}")
    if a.worker:
        print(json.dumps(worker(a.model, a.rows)))
        return
    runs: dict = {arch: [] for arch in a.arch}
    for _ in range(a.rounds):
        for arch in a.arch:
            env = dict(os.environ, LOCALLLM_CPU_ARCH=arch)
            r = subprocess.run([sys.executable, __file__, a.model, "--worker", "--rows",
                                str(a.rows)], env=env,
                               capture_output=True, text=True, check=False)
            if r.returncode != 0:
                sys.exit(f"error: the {arch} worker failed: "
                         f"{(r.stderr.strip().splitlines() or ['?'])[-1]}")
            runs[arch].append(json.loads(r.stdout.strip().splitlines()[-1])["res"])
    print(f"load average {os.getloadavg()[0]:.2f}; {a.rounds} rounds; GB/s of weight bytes, "
          f"{a.rows} activation row(s), 1 thread: thread CPU time / wall time (medians)")
    medians: dict = {}
    for arch, rs in runs.items():
        for mode in rs[0]:
            keys = list(rs[0][mode]) + ["all"]
            for key in keys:
                cpu_gbs, wall_gbs = [], []
                for r in rs:
                    vals = list(r[mode].values()) if key == "all" else [r[mode][key]]
                    b = sum(v[0] for v in vals)
                    cpu_gbs.append(b / sum(v[1] for v in vals) / 1e9)
                    wall_gbs.append(b / sum(v[2] for v in vals) / 1e9)
                med = (statistics.median(cpu_gbs), statistics.median(wall_gbs))
                medians[f"{arch} {mode} {key}"] = med
                print(f"{arch:>8} {mode:>7}  {key:<24} {med[0]:6.1f} / {med[1]:6.1f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"runs": runs, "medians": medians, "loadavg": os.getloadavg()}, f)


if __name__ == "__main__":
    main()
