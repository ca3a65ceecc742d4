"""Perplexity with llama-perplexity's method (llama.cpp ``tools/perplexity/perplexity.cpp``).

The text is tokenized once (with BOS), cut into non-overlapping chunks of ``n_ctx`` tokens;
each chunk is evaluated from an empty cache with its first token replaced by BOS, and the
negative log-likelihoods of the tokens at positions ``n_ctx/2 .. n_ctx-2`` predicting the next
one are accumulated. PPL = exp(mean NLL); the error is llama.cpp's: the standard error of the
mean NLL propagated through exp.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ..errors import LocalLLMError
from . import kld as K


@dataclass
class PerplexityResult:
    """Final figures: ``ppl`` ± ``ppl_error``, over ``n_scored`` tokens in ``n_chunks`` chunks."""

    ppl: float
    ppl_error: float
    nll_mean: float
    n_chunks: int
    n_scored: int


def chunk_token_ranges(n_tokens: int, n_ctx: int, max_chunks: int = -1) -> list[tuple[int, int]]:
    """(start, end) token ranges of the chunks llama-perplexity scores.

    Raises:
        LocalLLMError: fewer than 2 * n_ctx tokens.
    """
    if n_tokens < 2 * n_ctx:
        raise LocalLLMError(
            f"the text has {n_tokens} tokens; perplexity at --ctx-size {n_ctx} needs at least "
            f"{2 * n_ctx}"
        )
    n_chunks = n_tokens // n_ctx
    if max_chunks > 0:
        n_chunks = min(n_chunks, max_chunks)
    return [(i * n_ctx, (i + 1) * n_ctx) for i in range(n_chunks)]


def scored_nll(logits: torch.Tensor, tokens: Sequence[int]) -> torch.Tensor:
    """NLL (nats) of ``tokens[j+1]`` under ``logits[j]`` for j = 0 .. len(tokens)-2.

    logits: (n, n_vocab) float32 for the positions of ``tokens`` -> (n - 1,) float64.
    """
    target = torch.tensor(tokens[1:], dtype=torch.long, device=logits.device)
    logp = torch.log_softmax(logits[:-1].double(), dim=-1)
    return -logp.gather(1, target[:, None])[:, 0].cpu()


def chunk_logits(
    llm, tokens: Sequence[int], n_ctx: int, *, max_chunks: int = -1, batch_size: int = 512
) -> Iterator[tuple[int, torch.Tensor, list[int]]]:
    """Evaluate each chunk from an empty cache (first token replaced by BOS).

    Yields (chunk index, logits (n_ctx - n_ctx//2 - 1, n_vocab) float32 of the scored
    positions n_ctx/2 .. n_ctx-2, the tokens they predict (same length)).
    """
    session = llm.session(ctx_size=n_ctx)
    session.batch_size = batch_size
    bos = llm.tokenizer.bos_id
    first = n_ctx // 2
    for i, (start, end) in enumerate(chunk_token_ranges(len(tokens), n_ctx, max_chunks)):
        chunk = [int(t) for t in tokens[start:end]]
        if bos is not None and llm.tokenizer.add_bos:
            chunk[0] = bos
        session.reset()
        logits = session.eval(chunk, all_logits=True, logits_start=first)  # (n_ctx-first, V)
        yield i, logits[:-1], chunk[first + 1:]


def perplexity_chunks(
    llm, tokens: Sequence[int], n_ctx: int, *, max_chunks: int = -1, batch_size: int = 512
) -> Iterator[tuple[int, torch.Tensor]]:
    """Evaluate each chunk; yields (chunk index, NLL of its scored positions)."""
    for i, logits, targets in chunk_logits(llm, tokens, n_ctx, max_chunks=max_chunks,
                                           batch_size=batch_size):
        yield i, nll_of(logits, targets)


def nll_of(logits: torch.Tensor, targets: Sequence[int]) -> torch.Tensor:
    """NLL (nats) of ``targets[j]`` under ``logits[j]``: (n, V) -> (n,) float64 on the CPU."""
    target = torch.tensor(list(targets), dtype=torch.long, device=logits.device)
    logp = torch.log_softmax(logits.double(), dim=-1)
    return -logp.gather(1, target[:, None])[:, 0].cpu()


def summarize(nll: torch.Tensor, n_chunks: int) -> PerplexityResult:
    """PPL and its error from all scored NLLs (llama.cpp's formula)."""
    n = nll.numel()
    mean = nll.mean().item()
    mean2 = (nll * nll).mean().item()
    err = math.sqrt(max(mean2 - mean * mean, 0.0) / max(n - 1, 1))
    ppl = math.exp(mean)
    return PerplexityResult(ppl, ppl * err, mean, n_chunks, n)


def perplexity(llm, text: str, *, n_ctx: int = 512, max_chunks: int = -1,
               batch_size: int = 512) -> PerplexityResult:
    """Perplexity of ``text`` (see the module docstring)."""
    tokens = llm.tokenize(text, add_bos=True)
    nlls = [nll for _, nll in perplexity_chunks(llm, tokens, n_ctx, max_chunks=max_chunks,
                                                batch_size=batch_size)]
    return summarize(torch.cat(nlls), len(nlls))


@dataclass
class Evaluation:
    """One model over one text: PPL, and optionally its distributions or a comparison."""

    result: PerplexityResult
    running: list[float]
    dists: list[K.ChunkDistributions] = field(default_factory=list)
    comparisons: list[K.ChunkComparison] = field(default_factory=list)
    seconds: float = 0.0


@contextmanager
def _progress(total: int, label: str):
    """A rich progress bar with ETA on stderr (only drawn when stderr is a terminal)."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    console = Console(file=sys.stderr)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                  console=console, transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task(label, total=total)

        def update(i: int, ppl: float) -> None:
            bar.update(task, completed=i, description=f"{label} [PPL {ppl:.4f}]")

        yield update


def evaluate(llm, tokens, n_ctx: int, *, max_chunks: int = -1, batch_size: int = 512,
             keep_top_k: int = 0, base: list[K.ChunkDistributions] | None = None,
             label: str = "perplexity", echo: bool = False) -> Evaluation:
    """Score ``tokens`` in chunks (llama-perplexity's rules, see :mod:`localllm.eval.perplexity`).

    keep_top_k > 0 keeps the top-k distributions (for a base file or a comparison); ``base``
    compares each chunk with the base's. ``echo`` prints the running estimate ``[i]ppl,``.
    Raises LocalLLMError when the text is shorter than 2 * n_ctx tokens.
    """
    n_chunks = len(chunk_token_ranges(len(tokens), n_ctx, max_chunks))
    ev = Evaluation(PerplexityResult(math.nan, math.nan, math.nan, 0, 0), [])
    nlls: list[torch.Tensor] = []
    t0 = time.perf_counter()
    with _progress(n_chunks, label) as update:
        for i, logits, targets in chunk_logits(llm, tokens, n_ctx, max_chunks=max_chunks,
                                               batch_size=batch_size):
            nlls.append(nll_of(logits, targets))
            if keep_top_k:
                ev.dists.append(K.distributions(logits, targets, keep_top_k))
            if base is not None:
                ev.comparisons.append(K.compare(logits, targets, base[i]))
            running = math.exp(torch.cat(nlls).mean().item())
            ev.running.append(running)
            update(i + 1, running)
            if echo:
                print(f"[{i + 1}]{running:.4f},", end="", flush=True)
    if echo:
        print()
    ev.seconds = time.perf_counter() - t0
    ev.result = summarize(torch.cat(nlls), len(nlls))
    return ev


def load_for_eval(model, device: str, n_ctx: int, batch_size: int,
                  kv_cache: dict | None = None):
    """The model for a perplexity run (``kv_cache``: LLM's ``type_k`` / ``type_v``)."""
    from ..api import LLM  # the API imports the runtime: only when a model is loaded

    return LLM(model, device=device, ctx_size=n_ctx, batch_size=min(batch_size, n_ctx),
               **(kv_cache or {}))
