"""Options several commands share, and what they set up (``-t`` / ``-tb``)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Annotated, Any

import typer

from .terminal import say

ThreadsOpt = Annotated[int | None, typer.Option(
    "--threads", "-t", help="CPU threads for generation (default: physical cores; at most 512)")]
ThreadsBatchOpt = Annotated[int | None, typer.Option(
    "--threads-batch", "-tb", help="CPU threads for prompt batches (default: --threads)")]


def apply_threads(threads: int | None, threads_batch: int | None = None) -> int:
    """``-t`` / ``-tb`` of a command: sets them (:func:`localllm.cpu.threads.set_threads`,
    which clamps them to 512 as llama.cpp does), with one ``note:`` line on stderr per count
    clamped; returns the count for one-token steps.

    Raises:
        ParameterError: a count below 1.
    """
    from ..cpu.threads import MAX_THREADS, set_threads, thread_counts

    counts = thread_counts(threads, threads_batch)
    for flag in counts.clamped:
        asked = threads if flag.startswith("-t/") else threads_batch
        say(f"note: {flag} {asked} is more than {MAX_THREADS} (llama.cpp's bound): using "
            f"{MAX_THREADS}")
    return set_threads(threads, threads_batch)


def prefer_passive_openmp_wait(environ=None, *, load: float | None = None,
                               cores: int | None = None) -> bool:
    """Let idle OpenMP threads sleep instead of spin (``OMP_WAIT_POLICY=PASSIVE``) when the
    machine is already busy at start — its 1-minute load average (``load``) at or above its
    usable cores (``cores``) — unless the user chose (``OMP_WAIT_POLICY``,
    ``GOMP_SPINCOUNT``). Returns whether it set the policy.

    GNU libgomp's default spins about 300,000 iterations at every barrier before sleeping.
    With a core taken by another process, our spinning threads take time from it and from our
    own working thread: 2-thread decode kept 0.24-0.30 of its idle speed beside one busy
    process, llama.cpp 0.39, and 1.28 with the passive policy (``bench/bench_contention.py``,
    2026-11-26). On an idle machine the passive policy halves 2-thread decode instead (18.7
    against 39.5 tokens/s, same run: each of a token's hundreds of parallel loops wakes a
    sleeping thread), so it is chosen only when the cores are taken; no spin count served
    both (2,000: 25 idle / 20 busy; 20,000: as the default). libgomp reads the variable once,
    when torch loads it: this must run before ``import torch``.
    """
    import os

    environ = os.environ if environ is None else environ
    if any(k in environ for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")):
        return False
    if load is None:
        try:
            load = os.getloadavg()[0]
        except OSError:
            return False
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 1)
    if load < cores:
        return False
    environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return True


def option_group(param: str, options: list[tuple[str, Any, Any]],
                 build: Callable[[dict[str, Any]], Any]) -> Callable[[Callable], Callable]:
    """Decorator: append a group of typer options to a command's signature and hand the
    command one argument ``param`` built from them.

    Args:
        param: the command's parameter that receives ``build(values)``.
        options: (parameter name, default, annotation with its ``typer.Option``) per flag.
        build: turns {parameter name: value given or default} into the argument.
    """
    names = [name for name, _, _ in options]

    def decorate(func: Callable) -> Callable:
        sig = inspect.signature(func, eval_str=True)
        if param not in sig.parameters:
            raise TypeError(f"{func.__name__} has no {param!r} parameter")
        params = [p for p in sig.parameters.values() if p.name != param]
        clash = {p.name for p in params} & set(names)
        if clash:
            raise TypeError(f"{func.__name__} already has parameters {sorted(clash)}")
        added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default,
                                   annotation=ann) for name, default, ann in options]
        var_kw = [p for p in params if p.kind is inspect.Parameter.VAR_KEYWORD]
        rest = [p for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD]
        new_sig = sig.replace(parameters=rest + added + var_kw)

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            kwargs[param] = build({name: kwargs.pop(name) for name in names if name in kwargs})
            return func(*args, **kwargs)

        wrapper.__signature__ = new_sig  # type: ignore[attr-defined]
        wrapper.__annotations__ = {p.name: p.annotation for p in new_sig.parameters.values()
                                   if p.annotation is not inspect.Parameter.empty}
        if new_sig.return_annotation is not inspect.Signature.empty:
            wrapper.__annotations__["return"] = new_sig.return_annotation
        del wrapper.__wrapped__  # typer must see the new signature, not the wrapped one
        return wrapper

    return decorate


_SPEC = "Speculative decoding"


def _spec_opt(*names: str, help: str) -> Any:
    return typer.Option(*names, help=help, rich_help_panel=_SPEC, show_default=False)


# llama.cpp's flags (common/arg.cpp); the defaults are localllm.api.schema.LLMOptions'.
SPECULATIVE_OPTIONS: list[tuple[str, Any, Any]] = [
    ("draft_model", None, Annotated[str | None, _spec_opt(
        "--model-draft", "-md", help="draft model (name or .gguf path, same vocabulary) that "
        "guesses tokens for the model to verify in one step")]),
    ("spec_ngram", None, Annotated[int | None, _spec_opt(
        "--spec-ngram", help="guess tokens by looking up the last N tokens earlier in the "
        "context (prompt lookup; no draft model)")]),
    ("draft_max", None, Annotated[int | None, _spec_opt(
        "--draft-max", help="most tokens guessed per step (default 7)")]),
    ("draft_min", None, Annotated[int | None, _spec_opt(
        "--draft-min", help="fewest guesses worth verifying (default 0)")]),
    ("draft_p_min", None, Annotated[float | None, _spec_opt(
        "--draft-p-min", help="the draft model stops guessing below this probability "
        "(default 0.8)")]),
]


def speculative_options(func: Callable) -> Callable:
    """Decorator: the speculative-decoding flags, handed to ``func`` as ``speculative``: a
    dict of the ``LLM(...)`` keywords the user gave."""
    return option_group("speculative", SPECULATIVE_OPTIONS,
                        lambda values: {k: v for k, v in values.items() if v is not None})(func)


_KV = "KV cache"

# llama.cpp's -ctk / -ctv (common/arg.cpp); checked by LLM(type_k=..., type_v=...).
CACHE_OPTIONS: list[tuple[str, Any, Any]] = [
    ("cache_type_k", None, Annotated[str | None, typer.Option(
        "--cache-type-k", "-ctk", rich_help_panel=_KV, show_default=False,
        help="KV cache type of the keys: f32, f16, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0, "
        "q5_1 (default: f16; f32 on the CPU's torch path)")]),
    ("cache_type_v", None, Annotated[str | None, typer.Option(
        "--cache-type-v", "-ctv", rich_help_panel=_KV, show_default=False,
        help="KV cache type of the values (the same types)")]),
    ("ctx_checkpoints", None, Annotated[int | None, typer.Option(
        "--ctx-checkpoints", rich_help_panel=_KV, show_default=False,
        help="context checkpoints of a recurrent state kept per sequence, 0-1024 (default: "
        "8): more lets a shared prefix restore closer to its end, each costs one state")]),
]


def cache_options(func: Callable) -> Callable:
    """Decorator: ``-ctk/--cache-type-k`` and ``-ctv/--cache-type-v``, handed to ``func`` as
    and ``--ctx-checkpoints``, handed to ``func`` as ``kv_cache``: a dict of the ``LLM(...)``
    keywords the user gave (``type_k``, ``type_v``, ``ctx_checkpoints``)."""
    def build(values: dict[str, Any]) -> dict[str, Any]:
        from ..errors import ParameterError
        from ..memory import cache_type

        given = {key: values[name] for key, name in (("type_k", "cache_type_k"),
                                                     ("type_v", "cache_type_v"))
                 if values.get(name) is not None}
        for key, value in given.items():  # refused before any work, in one line
            cache_type(value, "--cache-type-k" if key == "type_k" else "--cache-type-v")
        n = values.get("ctx_checkpoints")
        if n is not None:
            if not 0 <= n <= 1024:
                raise ParameterError(f"--ctx-checkpoints must be in [0, 1024], got {n}")
            given["ctx_checkpoints"] = n
        return given

    return option_group("kv_cache", CACHE_OPTIONS, build)(func)
