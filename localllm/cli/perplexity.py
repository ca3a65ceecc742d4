"""``localllm perplexity``: perplexity, KL divergence against a base model, and quant comparison.

Modes (flags follow llama-perplexity, ``tools/perplexity/perplexity.cpp``):

- ``perplexity MODEL -f TEXT``: running estimate per chunk, then ``Final estimate: PPL = x +/- y``;
- ``... --kl-divergence-base BASE.npz``: the same, and saves the model's next-token
  distributions (:mod:`localllm.eval.kld`) for later comparisons;
- ``perplexity QMODEL --kl-divergence-base BASE.npz --kl-divergence``: the text's tokens and
  n_ctx come from the base file; prints PPL(Q) vs PPL(base), KLD, Δp and same-top-p sections;
- ``perplexity -f TEXT --compare A.gguf B.gguf ...``: a table (size, bits per weight, PPL ± err,
  ΔPPL %, KLD vs A, same top-1 %, decode tok/s) and, with ``--plot FILE``, a PNG plot of PPL
  against bits per weight (points joined in order of bits per weight).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from ..atomic import read_bounded
from ..errors import LocalLLMError

if TYPE_CHECKING:  # the evaluation imports torch: only when the command runs
    from ..eval.perplexity import PerplexityResult

# kld.DEFAULT_TOP_K, spelled out so that building the CLI does not import torch
# (tests/test_newcomer.py checks that they agree).
DEFAULT_KL_TOP_K = 32


MAX_TEXT_BYTES = 64 << 20  # the text to score, as a prompt (wikitext-2's test split: 1.3 MB)


def _read_text(file: Path | None) -> str:
    """The text of ``-f FILE``: at most :data:`MAX_TEXT_BYTES` (``-f /dev/zero`` would never
    end), UTF-8.

    Raises:
        LocalLLMError: no file, unreadable, too long or not UTF-8.
    """
    if file is None:
        raise LocalLLMError("no text: give -f FILE")
    data = read_bounded(file, MAX_TEXT_BYTES, f"-f {file}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise LocalLLMError(f"-f {file}: not valid UTF-8 (byte {e.start})") from None


def _vocab_of(llm) -> str:
    from ..eval import kld as K

    return K.vocab_fingerprint(llm.metadata.get("tokenizer.ggml.tokens", []))


def _final_line(res: PerplexityResult) -> str:
    return f"Final estimate: PPL = {res.ppl:.4f} +/- {res.ppl_error:.5f}"


def perplexity_command(
    models: Annotated[list[str] | None, typer.Argument(
        help="model name or .gguf path (several with --compare; default: gemma3-270m)",
        show_default=False)] = None,
    file: Annotated[Path | None, typer.Option("--file", "-f", help="text file to score")] = None,
    ctx_size: Annotated[int, typer.Option("--ctx-size", "-c", help="tokens per chunk")] = 512,
    batch_size: Annotated[int, typer.Option("--batch-size", "-b", help="prefill chunk")] = 2048,
    chunks: Annotated[int, typer.Option("--chunks", help="most chunks to score (-1: all)")] = -1,
    device: Annotated[str, typer.Option("--device", help="auto, cpu or cuda")] = "auto",
    threads: Annotated[int | None, typer.Option(
        "--threads", "-t", help="CPU threads (default: physical cores; at most 512)")] = None,
    threads_batch: Annotated[int | None, typer.Option(
        "--threads-batch", "-tb", help="CPU threads for batches (default: --threads)")] = None,
    kl_base: Annotated[Path | None, typer.Option(
        "--kl-divergence-base", help="file of the base model's distributions (.npz): "
        "written, or read with --kl-divergence")] = None,
    kl_divergence: Annotated[bool, typer.Option(
        "--kl-divergence", help="compare MODEL with --kl-divergence-base")] = False,
    kl_top_k: Annotated[int, typer.Option(
        "--kl-top-k", help="top-k log-probs kept per token in the base file")] = DEFAULT_KL_TOP_K,
    compare: Annotated[bool, typer.Option(
        "--compare", help="compare the MODELS (the first is the reference)")] = False,
    plot: Annotated[Path | None, typer.Option(
        "--plot", help="write a PNG of PPL against bits per weight to FILE (with --compare)",
        show_default=False)] = None,
    kv_cache=None,
) -> None:
    """Perplexity of a text with llama-perplexity's method; KL divergence; quant comparison."""
    import numpy as np

    from ..atomic import check_output_path
    from ..eval import kld as K
    from ..eval.perplexity import chunk_token_ranges, evaluate, load_for_eval
    from .options import apply_threads

    apply_threads(threads, threads_batch)
    models = list(models or [])
    if plot is not None and not compare:
        raise LocalLLMError("--plot draws the --compare table: use it with --compare")
    if plot is not None:  # refused before the work, not after it
        check_output_path(plot, "--plot")
    if kl_base is not None and not kl_divergence:
        check_output_path(kl_base, "--kl-divergence-base")
    if compare:
        from ..eval.compare import run_compare

        if len(models) < 2:
            raise LocalLLMError("--compare needs at least two models")
        run_compare(models, _read_text(file), n_ctx=ctx_size, batch_size=batch_size,
                    max_chunks=chunks, device=device, plot=plot)
        return
    if len(models) > 1:
        raise LocalLLMError(f"one model expected, got {len(models)} (use --compare)")
    model = models[0] if models else None
    if kl_divergence:
        if kl_base is None:
            raise LocalLLMError("--kl-divergence needs --kl-divergence-base FILE")
        base = K.load_base(kl_base)
        llm = load_for_eval(model, device, base.n_ctx, batch_size, kv_cache)
        if _vocab_of(llm) != base.vocab:
            raise LocalLLMError(f"{llm.path.name}: its vocabulary differs from the base model's "
                                f"({base.model}) in {kl_base}")
        K.check_vocab(base, llm.tokenizer.n_vocab, f"--kl-divergence-base {kl_base}")
        print(f"kl-divergence: {len(base.tokens)} tokens, {len(base.chunks)} chunks of "
              f"{base.n_ctx} (base: {base.model})", file=sys.stderr)
        ev = evaluate(llm, base.tokens.tolist(), base.n_ctx, max_chunks=len(base.chunks),
                      batch_size=batch_size, base=base.chunks, label="kl-divergence", echo=True)
        print(_final_line(ev.result))
        print()
        print(K.format_report(K.summarize(ev.comparisons)))
        return
    if kl_top_k < 1:
        raise LocalLLMError(f"--kl-top-k {kl_top_k}: must be at least 1")
    text = _read_text(file)
    llm = load_for_eval(model, device, ctx_size, batch_size, kv_cache)
    tokens = llm.tokenize(text, add_bos=True)
    n = len(chunk_token_ranges(len(tokens), ctx_size, chunks))
    print(f"perplexity: {len(tokens)} tokens, {n} chunks of {ctx_size}", file=sys.stderr)
    ev = evaluate(llm, tokens, ctx_size, max_chunks=chunks, batch_size=batch_size,
                  keep_top_k=kl_top_k if kl_base is not None else 0, echo=True)
    print(_final_line(ev.result))
    n_tok = ev.result.n_chunks * ctx_size
    print(f"{ev.seconds:.2f} s, {n_tok / ev.seconds:.1f} tokens per second", file=sys.stderr)
    if kl_base is not None:
        K.save_base(kl_base, K.BaseFile(np.asarray(tokens, dtype=np.int32),
                                        ctx_size, _vocab_of(llm), llm.path.name, ev.dists))
        print(f"saved base distributions (top {kl_top_k}) to {kl_base}", file=sys.stderr)
