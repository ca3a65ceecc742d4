"""``localllm bench``: prefill and decode speed on one device, llama-bench style.

pp: prompt processing of ``n_prompt`` tokens from an empty cache (tokens/s).
tg: generation of ``n_gen`` tokens one at a time (greedy) after an 8-token prompt (tokens/s).
TTFT: from the start of a ``n_prompt``-token prompt to the first token id on the host.
Figures are medians over ``repetitions`` runs after one warm-up; peak memory is the
process's peak RSS on the CPU, or torch's peak allocation on CUDA.

Model-bandwidth utilization (MBU) is the decode step's memory traffic over the device's
peak bandwidth: (weight bytes read per token + KV cache bytes read per token) / time per
token / peak. Weight bytes are those of the tensors the runtime holds (float16 matrices on
the CPU; quantized blocks where a runtime keeps them), without the input-embedding table,
of which a decode step reads one row (unless it is tied to the output projection); the KV
bytes are the mean over the generated positions.

When ``llama_cpp`` (llama-cpp-python) is importable, the same file is timed through it on
the same device and thread count, with the same token ids and the same protocol, and the
ratios ours / llama.cpp are printed. It is never required.
"""

from __future__ import annotations

import gc
import json
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ..errors import ParameterError
from ..memory import RING_SLACK
from ..models import memory_layout

TG_PROMPT = 8  # tokens evaluated before the timed generation

# Peak DRAM/HBM bandwidth in GB/s (1e9 bytes/s) by device-name substring, most specific
# first (vendor data sheets). ``--peak-bandwidth`` overrides it.
PEAK_BANDWIDTH_GBPS: tuple[tuple[str, float], ...] = (
    ("H200", 4800.0),
    ("H100 NVL", 3900.0),
    ("H100 PCIe", 2000.0),
    ("H100", 3350.0),  # SXM5 80GB HBM3
    ("GH200", 4000.0),
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0),  # 40GB SXM4 / PCIe
    ("L40S", 864.0),
    ("L40", 864.0),
    ("L4", 300.0),
    ("A10G", 600.0),
    ("A10", 600.0),
    ("RTX 5090", 1792.0),
    ("RTX 4090", 1008.0),
    ("RTX 4080", 717.0),
    ("RTX 3090", 936.0),
    ("V100", 900.0),
    ("T4", 320.0),
)


def peak_bandwidth_gbps(device_name: str) -> float | None:
    """Peak memory bandwidth (GB/s) of a GPU from its name, or None when unknown."""
    for key, gbps in PEAK_BANDWIDTH_GBPS:
        if key.lower() in device_name.lower():
            return gbps
    return None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# ---- the two runners ----------------------------------------------------------------------
def time_protocol(eval_last: Callable[[list[int]], int], reset: Callable[[], None],
                  prompt: list[int], n_gen: int, repetitions: int,
                  sync: Callable[[], None] = lambda: None,
                  on_run: Callable[[int, int], None] | None = None) -> dict:
    """Time one engine. ``eval_last(ids)`` appends ids and returns the greedy next token.

    Returns medians: ``pp`` and ``tg`` (tokens/s), ``ttft_ms`` (prompt -> first token id).
    The first of ``repetitions + 1`` runs is a warm-up and is discarded. ``on_run(i, n)`` is
    called before run i of n (0: the warm-up).
    """
    pp, ttft, tg = [], [], []
    for rep in range(repetitions + 1):
        if on_run is not None:
            on_run(rep, repetitions + 1)
        reset()
        sync()
        t0 = time.perf_counter()
        eval_last(prompt)
        t1 = time.perf_counter()
        reset()
        token = eval_last(prompt[:TG_PROMPT])
        sync()
        t2 = time.perf_counter()
        for _ in range(n_gen):
            token = eval_last([token])
        t3 = time.perf_counter()
        if rep:
            pp.append(len(prompt) / (t1 - t0))
            ttft.append(1e3 * (t1 - t0))
            tg.append(n_gen / (t3 - t2))
    return {"pp": _median(pp), "tg": _median(tg), "ttft_ms": _median(ttft)}


def _ours(llm, prompt: list[int], n_gen: int, repetitions: int, on_run=None) -> dict:
    session = llm.session()

    def eval_last(ids: list[int]) -> int:
        return int(session.eval(ids).argmax())  # the host sync: one token id

    return time_protocol(eval_last, session.reset, prompt, n_gen, repetitions,
                         lambda: _sync(llm.device), on_run)


def _batch_threads() -> int:
    from ..cpu.threads import current_counts

    counts = current_counts()
    return counts.threads_batch if counts is not None else torch.get_num_threads()


def llama_cpp_figures(path: Path, prompt: list[int], n_gen: int, repetitions: int, *,
                      device: torch.device, threads: int, ctx_size: int,
                      threads_batch: int | None = None,
                      on_run: Callable[[int, int], None] | None = None,
                      cache_types: tuple | None = None) -> dict | str:
    """The same protocol through llama-cpp-python, or a one-line reason it was not run.
    ``cache_types``: the K and V :class:`~localllm.memory.CacheType` of our run, given to
    llama.cpp as ``type_k`` / ``type_v`` (with ``flash_attn``, which its quantized V cache
    needs)."""
    try:
        import llama_cpp
        import numpy as np
    except ImportError:
        return "llama-cpp-python is not installed"
    gpu = device.type == "cuda"
    if gpu and not llama_cpp.llama_supports_gpu_offload():
        return "llama-cpp-python was built without GPU support"
    try:
        llm = llama_cpp.Llama(
            model_path=str(path), n_ctx=ctx_size, n_batch=len(prompt), n_ubatch=len(prompt),
            n_gpu_layers=-1 if gpu else 0, n_threads=threads,
            n_threads_batch=threads_batch or threads,
            logits_all=False, verbose=False, **_llama_cache_args(cache_types))
    except (ValueError, RuntimeError, OSError) as e:  # what llama_cpp's loader raises
        return f"llama.cpp could not load {path.name}: {e}"

    n_vocab = llm.n_vocab()

    def eval_last(ids: list[int]) -> int:
        llm.eval(ids)
        # llama_get_logits_ith waits for the (possibly asynchronous) decode to finish;
        # without logits_all, llama-cpp-python itself keeps no logits.
        logits = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(logits, shape=(n_vocab,))))

    try:
        figures = time_protocol(eval_last, llm.reset, prompt, n_gen, repetitions,
                                on_run=on_run)
    finally:
        llm.close()
    figures["version"] = getattr(llama_cpp, "__version__", "?")
    return figures


# ---- bytes per token ----------------------------------------------------------------------
def weight_bytes_per_token(loaded) -> int:
    """Bytes of weights a decode step reads from a :class:`~localllm.runtime.session.LoadedModel`:
    every tensor as the runtime stores it (quantized blocks on the Triton and native
    backends, except the tensors they had to dequantize; float16 matrices on the torch
    backend), without the input embedding table unless it is also the output projection
    (one row of it is read)."""
    from ..runtime.resources import stored_bytes

    quantized = getattr(loaded, "backend", "torch") in ("triton", "native")
    dequantized = {f.split(" ")[0] for f in getattr(loaded, "fallbacks", None) or ()}
    tensors = loaded.gguf.tensors
    tied = "output.weight" not in tensors
    return sum(stored_bytes(t, quantized and name not in dequantized)
               for name, t in tensors.items() if tied or name != "token_embd.weight")


def _llama_cache_args(cache_types: tuple | None) -> dict:
    """llama-cpp-python's keywords for our KV cache types (none for the float default)."""
    if cache_types is None:
        return {}
    return {"type_k": int(cache_types[0].ggml), "type_v": int(cache_types[1].ggml),
            "flash_attn": True}


def kv_bytes_per_token(args, start: int, n_gen: int, ring_slack: int, itemsize: int,
                       types: tuple | None = None) -> int:
    """Mean memory bytes a decode step reads over positions ``start .. start+n_gen-1``: per
    layer its ``memory_layout`` spec's ``step_bytes`` (K and V of ``itemsize``-byte elements,
    or of the K and V cache ``types``, over the live cells, sliding-window layers at most
    their ring of window + slack cells; recurrent layers their state)."""
    layout = memory_layout(args)
    total = sum(spec.step_bytes(pos, itemsize, ring_slack, types)
                for pos in range(start, start + n_gen) for spec in layout)
    return total // max(n_gen, 1)


def _gpu_driver() -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else None


# ---- the command --------------------------------------------------------------------------
def run_bench(model, *, n_prompt: int = 512, n_gen: int = 128, repetitions: int = 3,
              device: str = "auto", synthetic: str | None = None, quant: str = "Q4_K_M",
              threads: int | None = None, threads_batch: int | None = None,
              peak_bandwidth: float | None = None, llama_cpp: bool = True, as_json: bool = False,
              progress: Callable[..., None] | None = None, print_result: bool = True,
              kv_cache: dict | None = None, speculative: dict | None = None) -> dict:
    """Measure pp/tg/TTFT/peak memory/bandwidth (and llama.cpp's, when available); print them
    as text, or as one JSON line with ``as_json``. Returns the figures.

    Args:
        model: models.toml name or .gguf path (ignored with ``synthetic``).
        synthetic: a geometry of :mod:`localllm.models.synthetic` (``llama3-8b`` ...): bench a
            random-weights file of that shape, quantized with recipe ``quant``.
        threads: torch (and llama.cpp) CPU threads (default: torch's current setting).
        threads_batch: threads for the prompt batch (pp; default: ``threads``), as
            llama.cpp's ``n_threads_batch`` (:func:`localllm.cpu.threads.set_threads`).
        peak_bandwidth: the device's peak memory bandwidth in GB/s (default: looked up by
            GPU name; none on the CPU).
        progress: ``progress(step, completed=None, total=None)`` as each step starts and
            goes on (writing the synthetic file, loading, each timed run); the CLI shows it.
        print_result: print the figures (False: only return them).
        kv_cache: ``LLM(...)``'s ``type_k`` / ``type_v`` (``-ctk`` / ``-ctv``); llama.cpp
            runs with the same types (and flash attention) when any is given.
        speculative: ``LLM(...)``'s speculative-decoding keywords (``spec_ngram``,
            ``draft_model`` ...): ``tg_spec`` is then the decode speed of ``n_gen`` greedy
            tokens through the decode loop with guessing, after the same prompt (random
            tokens, where prompt lookup rarely finds a match: ``bench/bench_speculative.py``
            times copy-heavy tasks), with ``draft_tokens`` and ``draft_accepted``.
    Raises:
        ParameterError: a count or bandwidth out of range, an unknown synthetic name or quant.
        LocalLLMError: model loading errors (see :class:`localllm.LLM`); for ``synthetic``,
            before its file is written: the model would not fit in the device's free memory
            at bench time, or the disk has not room for the file.
    """
    def say(step: str, completed: int | None = None, total: int | None = None) -> None:
        if progress is not None:
            progress(step, completed, total)

    from ..api import LLM

    if n_prompt < TG_PROMPT or n_gen < 1 or repetitions < 1:
        raise ParameterError(f"--n-prompt must be >= {TG_PROMPT}, --n-gen and --repetitions "
                             f">= 1 (got {n_prompt}, {n_gen}, {repetitions})")
    if peak_bandwidth is not None and peak_bandwidth <= 0:
        raise ParameterError(f"--peak-bandwidth must be > 0 GB/s, got {peak_bandwidth}")
    if threads is not None or threads_batch is not None:
        from ..cpu.threads import set_threads

        set_threads(threads, threads_batch)  # clamped to MAX_THREADS; < 1 is ParameterError
    ctx_size = max(n_prompt, TG_PROMPT + n_gen) + 8
    if synthetic is not None:
        from ..models.synthetic import synthetic_model
        from ..runtime.session import resolve_device

        target = resolve_device(device)
        model = synthetic_model(
            synthetic, quant,
            before_write=lambda g, tensors: check_synthetic_memory(g, tensors, target, ctx_size),
            progress=lambda done, total: say(f"writing synthetic {synthetic} {quant}", done,
                                             total))
    say("loading the model")
    llm = LLM(model, device=device, ctx_size=ctx_size, batch_size=n_prompt,
              progress=False if progress is not None else None, **(kv_cache or {}),
              **(speculative or {}))
    types = None
    if kv_cache:  # the session's types (one of them may be the float default)
        types = llm.session(ctx_size=1).cache_types
    dev = llm.device
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, llm.tokenizer.n_vocab - 100, (n_prompt,), generator=gen).tolist()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    res: dict = {"model": llm.path.name, "synthetic": synthetic,
                 "quant": quant if synthetic else None, "device": str(dev),
                 "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                 "threads": torch.get_num_threads(), "threads_batch": _batch_threads(),
                 "n_prompt": n_prompt, "n_gen": n_gen,
                 "repetitions": repetitions, "torch": torch.__version__,
                 "backend": getattr(llm.loaded, "backend", "torch"),
                 "cache_types": [t.name for t in types] if types else None}
    res.update(_ours(llm, prompt, n_gen, repetitions, on_run=lambda i, n: say(
        f"localllm: pp{n_prompt} + tg{n_gen}, " + ("warm-up" if i == 0 else f"run {i}"), i, n)))
    if llm.speculation.enabled:
        say(f"localllm: tg{n_gen} with {llm.speculation.describe()}")
        gen = llm.stream(prompt, n_predict=n_gen, temp=0.0, ignore_eos=True)
        n = sum(1 for _ in gen)
        t = gen.timings
        res["tg_spec"] = (n - 1) / t.generate_seconds if n > 1 and t.generate_seconds else 0.0
        res["draft_tokens"] = t.extra.get("draft_tokens", 0)
        res["draft_accepted"] = t.extra.get("draft_accepted", 0)
        res["speculative"] = llm.speculation.describe()
    if dev.type == "cuda":
        res["peak_mib"] = torch.cuda.max_memory_allocated(dev) / 2**20
        res["cuda"] = torch.version.cuda
        res["driver"] = _gpu_driver()
    else:
        res["peak_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    w_bytes = weight_bytes_per_token(llm.loaded)
    kv_bytes = kv_bytes_per_token(llm.args, TG_PROMPT, n_gen, RING_SLACK,
                                  llm.loaded.kv_dtype.itemsize, types)
    res["weight_bytes_per_token"] = w_bytes
    res["kv_bytes_per_token"] = kv_bytes
    res["achieved_gbps"] = (w_bytes + kv_bytes) * res["tg"] / 1e9
    peak = peak_bandwidth or (peak_bandwidth_gbps(res["device_name"])
                              if dev.type == "cuda" else None)
    res["peak_bandwidth_gbps"] = peak
    res["mbu"] = res["achieved_gbps"] / peak if peak else None
    path = llm.path
    del llm
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    if llama_cpp:
        say("llama.cpp: loading")
        ref = llama_cpp_figures(path, prompt, n_gen, repetitions, device=dev,
                                threads=res["threads"], threads_batch=res["threads_batch"],
                                ctx_size=ctx_size, cache_types=types,
                                on_run=lambda i, n: say(
                                    f"llama.cpp: pp{n_prompt} + tg{n_gen}, "
                                    + ("warm-up" if i == 0 else f"run {i}"), i, n))
        if isinstance(ref, dict):
            res["llama_cpp"] = ref
            res["ratio_pp"] = res["pp"] / ref["pp"]
            res["ratio_tg"] = res["tg"] / ref["tg"]
        else:
            res["llama_cpp"] = None
            res["llama_cpp_skipped"] = ref
    if print_result:
        if as_json:
            print(json.dumps(res), flush=True)
        else:
            print_figures(res)
    return res


def check_synthetic_memory(geometry, tensors, device: torch.device, ctx_size: int) -> None:
    """Refuse, before a synthetic file is written, a model that would not fit in ``device``'s
    free memory when benched (its weights as the runtime holds them + the KV cache).

    Raises:
        LocalLLMError: one line with the memory needed and free (``LOCALLLM_SKIP_MEMORY_CHECK=1``
            skips the check, as for any load).
    """
    import os

    from ..errors import LocalLLMError
    from ..models.synthetic import geometry_args
    from ..runtime.resources import (
        SKIP_ENV,
        format_bytes,
        free_memory,
        kv_cache_bytes,
        stored_bytes,
    )

    if os.environ.get(SKIP_ENV, "") not in ("", "0"):
        return

    quantized = device.type == "cuda"
    # the memories from the architecture's own args (a hybrid's recurrent layers and states
    # are in its ModelArgs, not in the Geometry)
    need = (sum(stored_bytes(t, quantized) for t in tensors)
            + kv_cache_bytes(geometry_args(geometry), ctx_size, device))
    free = free_memory(device)
    if free is not None and need > free:
        raise LocalLLMError(
            f"--synthetic {geometry.name}: benching it needs {format_bytes(need)} on "
            f"{device.type} but {format_bytes(free)} is free; nothing was written (set "
            f"{SKIP_ENV}=1 to try anyway)")


def print_figures(res: dict, file=None) -> None:
    """The human-readable summary of :func:`run_bench`'s figures."""
    out = file or sys.stdout
    what = f"synthetic {res['synthetic']} {res['quant']}" if res["synthetic"] else res["model"]
    mem = "peak GPU memory" if res["device"].startswith("cuda") else "peak RSS"
    batch = res.get("threads_batch", res["threads"])
    threads = f"{res['threads']} threads" + (f", {batch} for pp" if batch != res["threads"] else "")
    print(f"model {what} on {res['device_name']} ({threads}, {res['backend']} backend)", file=out)
    print(f"pp{res['n_prompt']}: {res['pp']:.1f} tok/s   tg{res['n_gen']}: {res['tg']:.1f} tok/s"
          f"   TTFT({res['n_prompt']}) {res['ttft_ms']:.0f} ms   {mem} {res['peak_mib']:.0f} MiB",
          file=out)
    line = (f"decode reads {res['weight_bytes_per_token'] / 2**20:.1f} MiB weights + "
            f"{res['kv_bytes_per_token'] / 2**20:.1f} MiB KV per token: "
            f"{res['achieved_gbps']:.1f} GB/s")
    if res["mbu"] is not None:
        line += f" = {100 * res['mbu']:.1f}% of {res['peak_bandwidth_gbps']:.0f} GB/s (MBU)"
    print(line, file=out)
    if "tg_spec" in res:
        print(f"speculative ({res['speculative']}): tg{res['n_gen']} {res['tg_spec']:.1f} tok/s, "
              f"{res['draft_accepted']} of {res['draft_tokens']} guesses accepted", file=out)
    ref = res.get("llama_cpp")
    if ref:
        print(f"llama.cpp {ref['version']}: pp{res['n_prompt']} {ref['pp']:.1f} tok/s   "
              f"tg{res['n_gen']} {ref['tg']:.1f} tok/s   TTFT {ref['ttft_ms']:.0f} ms", file=out)
        print(f"ours / llama.cpp: pp x{res['ratio_pp']:.2f}   tg x{res['ratio_tg']:.2f}", file=out)
    elif res.get("llama_cpp_skipped"):
        print(f"llama.cpp comparison skipped: {res['llama_cpp_skipped']}", file=out)
