"""CPU prefill/decode against llama.cpp on the same file, interleaved, one process per run.

    .venv/bin/python bench/bench_cpu.py MODEL.gguf --threads 1 2 --rounds 3 \
        --llama-python /path/to/venv-with-llama_cpp/bin/python

Each round runs, per thread count, one localllm process and one llama.cpp process (in that
order, alternately), each timing pp (one batch of ``--n-prompt`` tokens) and tg (``--n-gen``
one-token steps, greedy) after one warm-up pass, and reporting its peak RSS. Medians over the
rounds and the ratio localllm / llama.cpp are printed (and written as JSON with --json).
The llama.cpp side imports only llama_cpp and numpy (no torch, no localllm).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time


def _rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _protocol(eval_last, reset, prompt, n_gen) -> dict:
    """pp and tg in tokens per second of wall time, and (``pp_cpu``, ``tg_cpu``) per second
    of the process's CPU time, all threads: on a machine shared with other jobs the CPU time
    a token costs moves much less than the wall time."""
    eval_last(prompt[:16])  # warm-up
    reset()
    t0, c0 = time.perf_counter(), time.process_time()
    tok = eval_last(prompt)
    t1, c1 = time.perf_counter(), time.process_time()
    for _ in range(n_gen):
        tok = eval_last([tok])
    t2, c2 = time.perf_counter(), time.process_time()
    return {"pp": len(prompt) / (t1 - t0), "tg": n_gen / (t2 - t1),
            "pp_cpu": len(prompt) / max(c1 - c0, 1e-9), "tg_cpu": n_gen / max(c2 - c1, 1e-9)}


def side_ours(path: str, threads: int, n_prompt: int, n_gen: int, backend: str) -> dict:
    from localllm.cpu.threads import set_threads
    from localllm.runtime.session import Session, load_model

    set_threads(threads)  # as the command line does (LOCALLLM_ADAPTIVE_THREADS=0: fixed)

    t0 = time.perf_counter()
    m = load_model(path, device="cpu", progress=False, backend=backend)
    load = time.perf_counter() - t0
    s = Session(m, ctx_size=n_prompt + n_gen + 32, batch_size=n_prompt)
    prompt = [(1000 + 7 * i) % m.tokenizer.n_vocab for i in range(n_prompt)]
    res = _protocol(lambda ids: int(s.eval(ids).argmax()), s.reset, prompt, n_gen)
    return res | {"load_s": load, "rss_mb": _rss_mb(), "backend": m.backend}


def side_llama(path: str, threads: int, n_prompt: int, n_gen: int) -> dict:
    import llama_cpp
    import numpy as np

    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model_path=path, n_ctx=n_prompt + n_gen + 32, n_batch=n_prompt,
                          n_ubatch=n_prompt, n_gpu_layers=0, n_threads=threads,
                          n_threads_batch=threads, logits_all=False, verbose=False)
    load = time.perf_counter() - t0
    n_vocab = llm.n_vocab()
    prompt = [(1000 + 7 * i) % n_vocab for i in range(n_prompt)]

    def eval_last(ids):
        llm.eval(ids)
        logits = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(logits, shape=(n_vocab,))))

    res = _protocol(eval_last, llm.reset, prompt, n_gen)
    return res | {"load_s": load, "rss_mb": _rss_mb(), "version": llama_cpp.__version__}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--n-prompt", type=int, default=512)
    ap.add_argument("--n-gen", type=int, default=128)
    ap.add_argument("--backend", default="auto", help="localllm backend (auto, native, torch)")
    ap.add_argument("--llama-python", help="python with llama_cpp (omit: localllm only)")
    ap.add_argument("--side", choices=["ours", "llama"], help=argparse.SUPPRESS)
    ap.add_argument("--json", help="write all runs and medians to this file")
    a = ap.parse_args()
    if a.side == "ours":
        print(json.dumps(side_ours(a.model, a.threads[0], a.n_prompt, a.n_gen, a.backend)))
        return
    if a.side == "llama":
        print(json.dumps(side_llama(a.model, a.threads[0], a.n_prompt, a.n_gen)))
        return
    sides = [("localllm", sys.executable)] + ([("llama.cpp", a.llama_python)]
                                              if a.llama_python else [])
    runs: dict = {}
    for r in range(a.rounds):
        for t in a.threads:
            for name, py in sides:
                side = "ours" if name == "localllm" else "llama"
                cmd = [py, __file__, a.model, "--side", side, "--threads", str(t),
                       "--n-prompt", str(a.n_prompt), "--n-gen", str(a.n_gen),
                       "--backend", a.backend]
                out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
                res = json.loads(out.strip().splitlines()[-1])
                runs.setdefault(f"{name} t={t}", []).append(res)
                print(f"round {r} {name:9} t={t}: pp{a.n_prompt} {res['pp']:8.1f} tok/s  "
                      f"tg{a.n_gen} {res['tg']:7.2f} tok/s  load {res['load_s']:.2f} s  "
                      f"RSS {res['rss_mb']:.0f} MB", flush=True)
    med = {k: {f: statistics.median(x[f] for x in v) for f in ("pp", "tg", "load_s", "rss_mb")}
           for k, v in runs.items()}
    print("\nmedians:")
    for t in a.threads:
        ours = med[f"localllm t={t}"]
        line = f"t={t}: localllm pp {ours['pp']:.1f} tg {ours['tg']:.2f} RSS {ours['rss_mb']:.0f} MB"
        if a.llama_python:
            ll = med[f"llama.cpp t={t}"]
            line += (f" | llama.cpp pp {ll['pp']:.1f} tg {ll['tg']:.2f} RSS {ll['rss_mb']:.0f} MB"
                     f" | ratio pp x{ours['pp'] / ll['pp']:.2f} tg x{ours['tg'] / ll['tg']:.2f}")
        print(line)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"runs": runs, "medians": med}, f, indent=1)


if __name__ == "__main__":
    main()
