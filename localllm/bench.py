"""``localllm bench``: prefill and decode speed on one device, llama-bench style.

pp: prompt processing of ``n_prompt`` tokens from an empty cache (tokens/s).
tg: generation of ``n_gen`` tokens one at a time after a short prompt (tokens/s).
Figures are medians over ``repetitions`` runs after one warm-up; peak memory is the
process's peak RSS on the CPU, or torch's peak allocation on CUDA.
"""

from __future__ import annotations

import resource
import statistics
import time

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_bench(model, *, n_prompt: int, n_gen: int, repetitions: int, device: str) -> dict:
    """Measure and print pp/tg/TTFT/peak memory; returns the figures."""
    from .api import LLM

    llm = LLM(model, device=device, ctx_size=max(n_prompt, n_gen + 16) + 8,
              batch_size=max(n_prompt, 1))
    dev = llm.device
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, llm.tokenizer.n_vocab - 100, (n_prompt,), generator=gen).tolist()
    session = llm.session()
    pp, tg = [], []
    for rep in range(repetitions + 1):
        session.reset()
        _sync(dev)
        t0 = time.perf_counter()
        logits = session.eval(prompt)
        _sync(dev)
        t_pp = time.perf_counter() - t0
        session.reset()
        logits = session.eval(prompt[:8])
        token = int(logits.argmax())
        _sync(dev)
        t0 = time.perf_counter()
        for _ in range(n_gen):
            token = int(session.eval([token]).argmax())
        _sync(dev)
        t_tg = time.perf_counter() - t0
        if rep:  # the first run warms caches and allocators
            pp.append(n_prompt / t_pp)
            tg.append(n_gen / t_tg)
    if dev.type == "cuda":
        peak = torch.cuda.max_memory_allocated() / 2**20
        mem = f"peak GPU memory {peak:.0f} MiB"
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        mem = f"peak RSS {peak:.0f} MiB"
    res = {"pp": statistics.median(pp), "tg": statistics.median(tg), "peak_mib": peak,
           "ttft_ms": 1e3 * n_prompt / statistics.median(pp), "device": str(dev),
           "threads": torch.get_num_threads()}
    print(f"model {llm.path.name} on {dev} ({torch.get_num_threads()} threads)")
    print(f"pp{n_prompt}: {res['pp']:.1f} tok/s   tg{n_gen}: {res['tg']:.1f} tok/s   "
          f"TTFT({n_prompt}) {res['ttft_ms']:.0f} ms   {mem}")
    return res
