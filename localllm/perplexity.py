"""Perplexity with llama-perplexity's method (llama.cpp ``tools/perplexity/perplexity.cpp``).

The text is tokenized once (with BOS), cut into non-overlapping chunks of ``n_ctx`` tokens;
each chunk is evaluated from an empty cache with its first token replaced by BOS, and the
negative log-likelihoods of the tokens at positions ``n_ctx/2 .. n_ctx-2`` predicting the next
one are accumulated. PPL = exp(mean NLL); the error is llama.cpp's: the standard error of the
mean NLL propagated through exp.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import LocalLLMError


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


def perplexity_chunks(
    llm, tokens: Sequence[int], n_ctx: int, *, max_chunks: int = -1, batch_size: int = 512
) -> Iterator[tuple[int, torch.Tensor]]:
    """Evaluate each chunk; yields (chunk index, NLL of its scored positions)."""
    session = llm.session(ctx_size=n_ctx)
    session.batch_size = batch_size
    bos = llm.tokenizer.bos_id
    first = n_ctx // 2
    for i, (start, end) in enumerate(chunk_token_ranges(len(tokens), n_ctx, max_chunks)):
        chunk = list(tokens[start:end])
        if bos is not None and llm.tokenizer.add_bos:
            chunk[0] = bos
        session.reset()
        logits = session.eval(chunk, all_logits=True, logits_start=first)  # (n_ctx-first, V)
        yield i, scored_nll(logits, chunk[first:])


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


def perplexity_cli(model, file: Path, *, ctx_size: int, batch_size: int, chunks: int,
                   device: str) -> None:
    """``localllm perplexity``: running estimate per chunk, then ``PPL = x +/- y``."""
    import sys

    from .api import LLM

    try:
        text = Path(file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise LocalLLMError(f"-f {file}: cannot read: {e}") from None
    llm = LLM(model, device=device, ctx_size=ctx_size, batch_size=min(batch_size, ctx_size))
    tokens = llm.tokenize(text, add_bos=True)
    ranges = chunk_token_ranges(len(tokens), ctx_size, chunks)
    print(f"perplexity: {len(tokens)} tokens, {len(ranges)} chunks of {ctx_size}", file=sys.stderr)
    nlls = []
    for i, nll in perplexity_chunks(llm, tokens, ctx_size, max_chunks=chunks,
                                    batch_size=min(batch_size, ctx_size)):
        nlls.append(nll)
        running = math.exp(torch.cat(nlls).mean().item())
        print(f"[{i + 1}]{running:.4f},", end="", flush=True)
    res = summarize(torch.cat(nlls), len(nlls))
    print(f"\nFinal estimate: PPL = {res.ppl:.4f} +/- {res.ppl_error:.5f}")
