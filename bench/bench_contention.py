"""Decode speed with and without a competing busy process, localllm against llama.cpp,
interleaved, one process per run.

    .venv/bin/python bench/bench_contention.py MODEL.gguf --threads 2 --busy 1 --rounds 3 \
        --llama-python /path/to/venv-with-llama_cpp/bin/python \
        --policy default --policy OMP_WAIT_POLICY=PASSIVE

Each round runs every side twice, once on an otherwise unchanged machine and once with
``--busy`` processes spinning (``while True: pass``, one core each), in alternating order.
A side is localllm under one OpenMP setting (``--policy``: ``default`` is the environment
as it is, without the command line's own ``OMP_WAIT_POLICY=PASSIVE``, with the adaptive
thread count of ``localllm.cpu.threads.CoreShare``; ``LOCALLLM_ADAPTIVE_THREADS=0`` fixes
the count; ``VAR=VALUE``
entries are added to the child's environment before torch loads) or llama.cpp through
llama-cpp-python (``--llama-python``). Each run times ``--n-gen`` one-token greedy steps
after a short prompt (bench_cpu.py's protocol, after one warm-up pass).

Printed: per side, the median tokens/s idle and busy, and busy / idle (the fraction of its
speed a side keeps when a core is taken; the issue's target: localllm's no worse than
llama.cpp's in the same run). On a machine shared with other jobs every figure is "under
load": compare sides within one run only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BUSY = "while True: pass"


def _child(py: str, side: str, model: str, threads: int, n_gen: int, env: dict) -> dict:
    cmd = [py, str(HERE / "bench_cpu.py"), model, "--side", side, "--threads", str(threads),
           "--n-prompt", "16", "--n-gen", str(n_gen)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def _start_busy(n: int) -> list[subprocess.Popen]:
    procs = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(n)]
    time.sleep(0.5)  # let them take their cores
    return procs


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


def _policy_env(policy: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if policy != "default":
        for item in policy.split(","):
            key, _, value = item.partition("=")
            env[key] = value
    return env


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--busy", type=int, default=1, help="competing busy processes")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--n-gen", type=int, default=32)
    ap.add_argument("--policy", action="append",
                    help="localllm's OpenMP setting: default, or VAR=VALUE[,VAR=VALUE] "
                    "(repeatable; default: default and OMP_WAIT_POLICY=PASSIVE)")
    ap.add_argument("--llama-python", help="python with llama_cpp (omit: localllm only)")
    ap.add_argument("--json", help="write all runs and medians to this file")
    a = ap.parse_args()
    policies = a.policy or ["default", "OMP_WAIT_POLICY=PASSIVE"]
    sides = [(f"localllm {p}", sys.executable, "ours", _policy_env(p)) for p in policies]
    if a.llama_python:
        sides.append(("llama.cpp", a.llama_python, "llama", dict(os.environ)))
    runs: dict[str, dict[str, list[float]]] = {name: {"idle": [], "busy": []}
                                               for name, *_ in sides}
    busy: list[subprocess.Popen] = []
    try:
        for r in range(a.rounds):
            for state in (("idle", "busy") if r % 2 == 0 else ("busy", "idle")):
                busy = _start_busy(a.busy) if state == "busy" else []
                try:
                    order = sides if r % 2 == 0 else sides[::-1]
                    for name, py, side, env in order:
                        res = _child(py, side, a.model, a.threads, a.n_gen, env)
                        runs[name][state].append(res["tg"])
                        print(f"round {r} {state:4} {name:36} tg{a.n_gen} {res['tg']:8.2f} "
                              f"tok/s  (CPU time: {res['tg_cpu']:8.2f} tok/s)", flush=True)
                finally:
                    _stop(busy)
                    busy = []
    finally:
        _stop(busy)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"\nmedians ({a.threads} threads, {a.busy} busy process(es); load average "
          f"{load:.1f} at the end):")
    med = {}
    for name, states in runs.items():
        idle, hot = statistics.median(states["idle"]), statistics.median(states["busy"])
        med[name] = {"idle": idle, "busy": hot, "kept": hot / idle}
        print(f"  {name:36} idle {idle:8.2f}  busy {hot:8.2f} tok/s  busy/idle {hot / idle:5.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"runs": runs, "medians": med, "threads": a.threads, "busy": a.busy}, f,
                      indent=1)


if __name__ == "__main__":
    main()
