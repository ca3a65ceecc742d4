"""Perplexity (llama-perplexity's method), KL divergence and the quant comparison, on tiny
random-weights models (the reference figure on the real model is in test_reference.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from localllm import LLM
from localllm.errors import LocalLLMError
from localllm.eval import kld as K
from localllm.eval.perplexity import (
    chunk_logits,
    chunk_token_ranges,
    evaluate,
    perplexity,
    summarize,
)

WORDS = ["the", "and", "of", "a", "is", "that", "tea", "hat", "then", "this", "an", "ant"]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models: one torch thread is faster than two spinning OpenMP threads."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _text(n_words: int, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), n_words))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tiny_model import write_tiny_gguf

    # llama: no embedding scaling, so random weights give moderate logits (PPL ~ 10^3)
    path = write_tiny_gguf(tmp_path_factory.mktemp("ppl") / "tiny.gguf", "llama")
    # float32: one-token and batched products agree to float rounding (the identities below)
    return LLM(path, device="cpu", ctx_size=256, dtype=torch.float32)


def test_chunk_ranges_and_minimum_length():
    assert chunk_token_ranges(100, 16) == [(16 * i, 16 * (i + 1)) for i in range(6)]
    assert chunk_token_ranges(100, 16, max_chunks=2) == [(0, 16), (16, 32)]
    with pytest.raises(LocalLLMError, match="needs at least 64"):
        chunk_token_ranges(63, 32)


def test_perplexity_equals_direct_computation(tiny):
    n_ctx, n_chunks = 16, 2
    text = _text(40)
    tokens = tiny.tokenize(text)
    assert len(tokens) >= 2 * n_ctx
    res = perplexity(tiny, text, n_ctx=n_ctx, max_chunks=n_chunks)
    nlls = []
    for start, end in chunk_token_ranges(len(tokens), n_ctx, n_chunks):
        chunk = tokens[start:end]
        chunk[0] = tiny.tokenizer.bos_id  # every chunk starts with BOS
        for j in range(n_ctx // 2, n_ctx - 1):  # positions n_ctx/2 .. n_ctx-2 are scored
            logp = torch.log_softmax(tiny.logits(chunk[: j + 1]).double(), -1)
            nlls.append(-logp[chunk[j + 1]].item())
    nll = np.array(nlls)
    assert res.n_scored == len(nlls) == n_chunks * (n_ctx - 1 - n_ctx // 2)
    assert res.nll_mean == pytest.approx(nll.mean(), rel=1e-5)
    assert res.ppl == pytest.approx(math.exp(nll.mean()), rel=1e-4)
    err = math.sqrt(nll.var() / (len(nll) - 1))  # llama.cpp's standard error of the mean NLL
    assert res.ppl_error == pytest.approx(res.ppl * err, rel=1e-3)
    # prefill split into batches scores the same positions (up to float rounding)
    split = perplexity(tiny, text, n_ctx=n_ctx, max_chunks=n_chunks, batch_size=5)
    assert split.ppl == pytest.approx(res.ppl, rel=1e-3)


def test_scored_positions(tiny):
    tokens = tiny.tokenize(_text(40))
    out = list(chunk_logits(tiny, tokens, 16, max_chunks=1))
    assert len(out) == 1
    i, logits, targets = out[0]
    assert i == 0 and logits.shape == (7, tiny.tokenizer.n_vocab)
    assert targets == tokens[9:16]


def test_summarize_formula():
    nll = torch.tensor([1.0, 2.0, 3.0, 6.0], dtype=torch.float64)
    r = summarize(nll, 1)
    assert r.ppl == pytest.approx(math.exp(3.0))
    assert r.ppl_error == pytest.approx(math.exp(3.0) * math.sqrt(3.5 / 3))


def test_kld_of_a_model_against_itself_is_zero(tiny, tmp_path):
    tokens = tiny.tokenize(_text(60))
    base = evaluate(tiny, tokens, 16, keep_top_k=8)
    path = tmp_path / "base.npz"
    K.save_base(path, K.BaseFile(np.asarray(tokens, np.int32), 16, "v", "tiny", base.dists))
    loaded = K.load_base(path)
    again = evaluate(tiny, loaded.tokens.tolist(), loaded.n_ctx, base=loaded.chunks)
    s = K.summarize(again.comparisons)
    assert s.kld == (0.0, 0.0) and s.kld_max == 0.0
    assert s.same_top[0] == 1.0 and s.dp[0] == 0.0
    assert s.ratio[0] == pytest.approx(1.0)
    assert again.result.ppl == pytest.approx(base.result.ppl)
    assert "Mean    KLD:   0.000000" in K.format_report(s)


def test_kld_against_a_different_model_is_positive(tiny, tmp_path):
    from localllm.quantize.convert import quantize_gguf

    q = tmp_path / "q4.gguf"
    quantize_gguf(tiny.path, q, "Q4_0")
    tokens = tiny.tokenize(_text(60))
    base = evaluate(tiny, tokens, 16, keep_top_k=16)
    other = evaluate(LLM(q, device="cpu", ctx_size=256), tokens, 16, base=base.dists)
    s = K.summarize(other.comparisons)
    assert s.kld[0] > 0 and s.kld_min >= -1e-6
    assert 0.0 <= s.same_top[0] <= 1.0
    assert s.ppl_base[0] == pytest.approx(base.result.ppl)


def test_base_file_errors(tmp_path):
    bad = tmp_path / "x.npz"
    bad.write_bytes(b"nope")
    with pytest.raises(LocalLLMError, match="--kl-divergence-base"):
        K.load_base(bad)
    with pytest.raises(LocalLLMError, match="--kl-divergence-base"):
        K.load_base(tmp_path / "missing.npz")


def _cli(args):
    from typer.testing import CliRunner

    from localllm.cli.app import app

    return CliRunner().invoke(app, args)


def test_cli_kl_divergence_and_vocab_mismatch(tiny, tiny_model_path, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(_text(60))
    base = tmp_path / "base.npz"
    res = _cli(["perplexity", str(tiny.path), "-f", str(text), "-c", "16",
                "--kl-divergence-base", str(base), "--kl-top-k", "8"])
    assert res.exit_code == 0, res.output
    assert "Final estimate: PPL = " in res.output and base.exists()
    res = _cli(["perplexity", str(tiny.path), "--kl-divergence-base", str(base),
                "--kl-divergence"])
    assert res.exit_code == 0, res.output
    assert "Same top p:  100.000" in res.output and "Mean    KLD:   0.000000" in res.output
    other = tiny_model_path("qwen2")  # a different vocabulary (byte-level BPE)
    res = _cli(["perplexity", str(other), "--kl-divergence-base", str(base),
                "--kl-divergence"])
    assert res.exit_code != 0 and "vocabulary" in str(res.exception)


def test_cli_text_too_short(tiny, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("the and of")
    res = _cli(["perplexity", str(tiny.path), "-f", str(text), "-c", "16"])
    assert res.exit_code != 0 and "needs at least 32" in str(res.exception)


def test_compare_two_quant_levels(tiny_model_path, tmp_path, capsys):
    from localllm.eval.compare import run_compare
    from localllm.quantize.convert import quantize_gguf

    src = tiny_model_path("llama", d_model=256, n_heads=4, head_dim=64, ffn_dim=512,
                          context_length=64)
    q8, q4 = tmp_path / "m-Q8_0.gguf", tmp_path / "m-Q4_K_M.gguf"
    quantize_gguf(src, q8, "Q8_0")
    quantize_gguf(src, q4, "Q4_K_M")
    plot = tmp_path / "plot.png"
    rows = run_compare([str(q8), str(q4)], _text(60), n_ctx=16, batch_size=16, max_chunks=2,
                       device="cpu", plot=plot, decode_tokens=4)
    assert [r.name for r in rows] == ["m-Q8_0.gguf", "m-Q4_K_M.gguf"]
    assert rows[0].dppl_pct == 0.0 and rows[0].kld == 0.0 and rows[0].same_top == 1.0
    assert rows[1].kld > 0 and rows[1].bpw < rows[0].bpw
    assert all(r.decode_tps > 0 and r.ppl > 0 for r in rows)
    out = capsys.readouterr().out
    assert "m-Q4_K_M.gguf" in out and "same top-1" in out
    pytest.importorskip("matplotlib")
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_rejects_different_vocabularies(tiny_model_path):
    from localllm.eval.compare import run_compare

    with pytest.raises(LocalLLMError, match="vocabulary"):
        run_compare([str(tiny_model_path("gemma3")), str(tiny_model_path("qwen2"))],
                    _text(60), n_ctx=16, batch_size=16, max_chunks=1, device="cpu", plot=None,
                    decode_tokens=2)
