"""Where a CPU decode step goes: the native GEMVs versus everything else.

    .venv/bin/python bench/profile_decode.py [MODEL] --threads 1 --rounds 5 [--ops torch]

Loads the model (default: the registry's ``gemma3-270m``) on the CPU, prefills
``--n-prompt`` tokens, then, in each of ``--rounds`` rounds, times ``--steps`` one-token
steps (``Session.eval([tok])``) and replays the step's matrix products alone (the
``localllm.cpu.qmatmul`` calls of one step recorded once, same inputs, same weights).
Printed in ms/token, medians over the rounds (interleaved, so a shared machine's load hits
both alike), in process CPU time (steadier than wall time when other jobs share the cores;
with several threads it includes their spinning) and in wall time: the step, its GEMVs,
and the rest (norms, RoPE, attention, residual adds, activations, the KV write, the
logits' argmax and the Python between them). ``--ops torch``
runs the torch compositions (``TorchOps``) around the same GEMVs instead of the fused native
ops (``NativeOps``). ``--profile`` adds torch.profiler's operator table over one round.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--n-prompt", type=int, default=64)
    ap.add_argument("--ops", choices=["auto", "torch"], default="auto",
                    help="torch: the torch compositions (TorchOps) around the same native GEMV")
    ap.add_argument("--profile", action="store_true", help="print torch.profiler's table")
    a = ap.parse_args()

    import torch

    torch.set_num_threads(a.threads)
    from localllm import cpu
    from localllm.runtime.session import Session, load_model

    path = a.model
    if path is None:
        from localllm.registry import load_registry

        path = str(load_registry().resolve("gemma3-270m")[0])
    m = load_model(path, device="cpu", progress=False)
    if a.ops == "torch":
        from localllm.backends.dense import TorchOps

        m.model.ops = TorchOps()
    n_ctx = a.n_prompt + (a.rounds + 2) * a.steps + 8
    s = Session(m, ctx_size=n_ctx, batch_size=a.n_prompt)
    prompt = [(1000 + 7 * i) % m.tokenizer.n_vocab for i in range(a.n_prompt)]
    tok = int(s.eval(prompt).argmax())
    for _ in range(4):  # warm-up
        tok = int(s.eval([tok]).argmax())

    calls = []  # one step's products, recorded through localllm.cpu.qmatmul
    real = cpu.qmatmul

    def record(x, w, out=None, **kw):
        calls.append((x.clone(), w, kw))
        return real(x, w, out, **kw)

    cpu.qmatmul = record
    tok = int(s.eval([tok]).argmax())
    cpu.qmatmul = real

    def replay():
        for x, w, kw in calls:
            real(x, w, **kw)

    def timed(fn) -> tuple[float, float]:  # (wall, process CPU) ms per step
        w0, c0 = time.perf_counter(), time.process_time()
        for _ in range(a.steps):
            fn()
        return ((time.perf_counter() - w0) / a.steps * 1e3,
                (time.process_time() - c0) / a.steps * 1e3)

    def step():
        nonlocal tok
        tok = int(s.eval([tok]).argmax())

    steps, gemvs = [], []
    for _ in range(a.rounds):
        steps.append(timed(step))
        gemvs.append(timed(replay))
    print(f"backend {m.backend}, ops {type(m.model.ops).__name__}, {a.threads} thread(s), "
          f"{len(calls)} products per step, medians of {a.rounds} rounds of {a.steps} steps")
    for i, what in ((1, "CPU time"), (0, "wall")):  # CPU time: steadier on a shared machine
        st, gv = statistics.median(x[i] for x in steps), statistics.median(x[i] for x in gemvs)
        rest = statistics.median(x[i] - y[i] for x, y in zip(steps, gemvs))
        print(f"  {what:8}: decode step {st:6.2f} ms/token   GEMVs {gv:6.2f}   rest {rest:6.2f}")
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(a.steps):
                tok = int(s.eval([tok]).argmax())
        events = prof.key_averages()
        n_ops = sum(e.count for e in events if e.key.startswith(("aten::", "localllm_cpu::")))
        print(f"  operator calls per token: {n_ops / a.steps:.0f}")
        print(events.table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
