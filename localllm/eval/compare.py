"""``localllm perplexity --compare A.gguf B.gguf ...``: what each quant level costs and buys.

Every model scores the same text with llama-perplexity's method; the first is the reference
for ΔPPL, KL divergence and same-top-1 (its top-k distributions are kept in memory, see
:mod:`localllm.eval.kld`). Decode speed is measured with a short greedy generation. Output: a rich
table on stdout and a PNG plot of PPL against bits per weight (needs matplotlib, the ``plot``
extra; without it a one-line notice is printed instead).
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..atomic import atomic_output
from ..errors import LocalLLMError
from . import kld as K

DECODE_TOKENS = 32


@dataclass
class CompareRow:
    """One model of the comparison (sizes in bytes, PPL figures, KLD in nats)."""

    name: str
    file_bytes: int
    bpw: float
    ppl: float
    ppl_err: float
    dppl_pct: float
    kld: float | None
    kld_err: float | None
    same_top: float | None
    decode_tps: float


def bits_per_weight(llm) -> float:
    """8 x (bytes of all tensors) / (their element count), as llama.cpp reports BPW."""
    tensors = llm.loaded.gguf.tensors.values()
    return 8.0 * sum(t.n_bytes for t in tensors) / max(sum(t.n_elements for t in tensors), 1)


def decode_speed(llm, prompt: list[int], n: int = DECODE_TOKENS) -> float:
    """Greedy decode tokens per second after ``prompt`` (one token per forward): the inverse
    of the median time per token, after two warm-up tokens (robust to a busy machine)."""
    session = llm.session(ctx_size=len(prompt) + n + 3)
    logits = session.eval(prompt)
    times = []
    for _ in range(n + 2):
        t0 = time.perf_counter()
        logits = session.eval([int(logits.argmax())])
        times.append(time.perf_counter() - t0)
    return 1.0 / statistics.median(times[2:])


def run_compare(models: list[str], text: str, *, n_ctx: int, batch_size: int, max_chunks: int,
                device: str, plot: Path | None, decode_tokens: int = DECODE_TOKENS
                ) -> list[CompareRow]:
    """Evaluate every model, print the table and write the plot. Returns the rows.

    ``decode_tokens``: greedy tokens generated per model to measure decode speed.

    Raises:
        LocalLLMError: a model's vocabulary differs from the first's; the text is shorter
            than 2 x n_ctx tokens.
    """
    from ..gguf.file import open_gguf
    from ..registry import load_registry
    from .perplexity import evaluate, load_for_eval

    vocabs = [K.vocab_fingerprint(open_gguf(load_registry().resolve(m)[0]).metadata.get(
        "tokenizer.ggml.tokens", [])) for m in models]  # headers only: fail before any work
    for model, vocab in zip(models[1:], vocabs[1:], strict=True):
        if vocab != vocabs[0]:
            raise LocalLLMError(f"{model}: its vocabulary differs from {models[0]}'s; "
                                "--compare needs models of the same vocabulary")
    rows: list[CompareRow] = []
    base_dists = None
    base_ppl = None
    tokens = None
    for i, model in enumerate(models):
        llm = load_for_eval(model, device, n_ctx, batch_size)
        if tokens is None:
            tokens = llm.tokenize(text, add_bos=True)
        ev = evaluate(llm, tokens, n_ctx, max_chunks=max_chunks, batch_size=batch_size,
                      keep_top_k=K.DEFAULT_TOP_K if i == 0 else 0,
                      base=base_dists if i > 0 else None, label=f"{Path(model).name}")
        res = ev.result
        kld = same = None
        if i == 0:
            base_dists, base_ppl = ev.dists, res.ppl
            kld, same = (0.0, 0.0), (1.0, 0.0)
        else:
            s = K.summarize(ev.comparisons)
            kld, same = s.kld, s.same_top
        rows.append(CompareRow(
            Path(str(model)).name, llm.path.stat().st_size, bits_per_weight(llm), res.ppl,
            res.ppl_error, 100.0 * (res.ppl / base_ppl - 1.0), kld[0], kld[1], same[0],
            decode_speed(llm, tokens[:16], decode_tokens)))
        print(f"{rows[-1].name}: PPL = {res.ppl:.4f} +/- {res.ppl_error:.5f}", file=sys.stderr)
        del llm
        gc.collect()
    print_table(rows)
    if plot is not None:
        write_plot(rows, plot)
    return rows


def print_table(rows: list[CompareRow]) -> None:
    """One rich table row per model, on stdout."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title="perplexity comparison (reference: first row)")
    for col in ("model", "size MiB", "bpw", "PPL", "ΔPPL %", "KLD", "same top-1 %", "tok/s"):
        t.add_column(col, justify="left" if col == "model" else "right", no_wrap=True)
    for r in rows:
        t.add_row(r.name, f"{r.file_bytes / 2**20:.1f}", f"{r.bpw:.2f}",
                  f"{r.ppl:.4f} ± {r.ppl_err:.4f}", f"{r.dppl_pct:+.2f}",
                  "-" if r.kld is None else f"{r.kld:.5f} ± {r.kld_err:.5f}",
                  "-" if r.same_top is None else f"{100 * r.same_top:.2f}",
                  f"{r.decode_tps:.1f}")
    console = Console()
    if not console.is_terminal:  # a pipe or file: do not squeeze the table into 80 columns
        console = Console(width=160)
    console.print(t)


def write_plot(rows: list[CompareRow], path: Path) -> bool:
    """PNG of PPL (with error bars) against bits per weight; False (and a notice) without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("notice: matplotlib is not installed (pip install 'localllm[plot]'); no plot",
              file=sys.stderr)
        return False
    rows = sorted(rows, key=lambda r: r.bpw)  # the line joins the points by bits per weight
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.errorbar([r.bpw for r in rows], [r.ppl for r in rows], yerr=[r.ppl_err for r in rows],
                fmt="o-", capsize=3)
    for r in rows:
        ax.annotate(r.name, (r.bpw, r.ppl), textcoords="offset points", xytext=(4, 4),
                    fontsize=8)
    ax.set_xlabel("bits per weight")
    ax.set_ylabel("perplexity")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    try:
        with atomic_output(path, "--plot") as tmp:
            fig.savefig(tmp, dpi=120, format="png", metadata={
                "Description": "bpw,ppl: " + " ".join(f"{r.bpw:.4f},{r.ppl:.4f}" for r in rows)})
    finally:
        plt.close(fig)
    print(f"plot: {path}", file=sys.stderr)
    return True
