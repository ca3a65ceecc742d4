"""Where a CPU decode step goes: torch.profiler over one-token steps of a ``Session``.

    .venv/bin/python bench/profile_decode.py [MODEL] --threads 1 --steps 32

Loads the model (default: the registry's ``gemma3-270m``), prefills ``--n-prompt`` tokens,
runs ``--warmup`` one-token steps, then profiles ``--steps`` more and prints ms/token:
the wall time per step, the native GEMV's share (``localllm_cpu::gemv``), and the rest
(norms, RoPE, attention, residual adds, activations, KV writes and the Python between them),
followed by the top operators by self CPU time. Numbers on a shared machine are noisy:
take the median of several runs.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--n-prompt", type=int, default=64)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--rows", type=int, default=15, help="operators listed")
    a = ap.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(a.threads)
    from localllm.runtime.session import Session, load_model

    path = a.model
    if path is None:
        from localllm.registry import load_registry

        path = str(load_registry().resolve("gemma3-270m")[0])
    m = load_model(path, device="cpu", progress=False, backend=a.backend)
    s = Session(m, ctx_size=a.n_prompt + a.warmup + 2 * a.steps + 8, batch_size=a.n_prompt)
    prompt = [(1000 + 7 * i) % m.tokenizer.n_vocab for i in range(a.n_prompt)]
    tok = int(s.eval(prompt).argmax())
    for _ in range(a.warmup):
        tok = int(s.eval([tok]).argmax())
    walls = []
    for _ in range(a.steps):  # unprofiled wall time
        t0 = time.perf_counter()
        tok = int(s.eval([tok]).argmax())
        walls.append(time.perf_counter() - t0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(a.steps):
            tok = int(s.eval([tok]).argmax())
    events = prof.key_averages()
    gemv = sum(e.self_cpu_time_total for e in events if e.key == "localllm_cpu::gemv")
    wall = statistics.median(walls) * 1e3
    gemv_ms = gemv / 1e3 / a.steps
    n_ops = sum(e.count for e in events if e.key.startswith(("aten::", "localllm_cpu::")))
    print(f"backend {m.backend}, {a.threads} thread(s), {a.steps} steps")
    print(f"decode step (median wall, unprofiled): {wall:.2f} ms/token")
    print(f"native GEMV (profiled, self time):     {gemv_ms:.2f} ms/token")
    print(f"the rest (wall - GEMV):                {wall - gemv_ms:.2f} ms/token")
    print(f"operator calls per token:              {n_ops / a.steps:.0f}")
    print(events.table(sort_by="self_cpu_time_total", row_limit=a.rows))


if __name__ == "__main__":
    main()
