"""Soak (issue 8): a long chat session with many context shifts, on a tiny random model.

The driver is bench/soak.py's (the real-model run is ``python bench/soak.py``); here ~2,000
tokens at a 96-token context shift the window every few turns, and the run must end with no
error, the KV tensors never reallocated, bounded RSS, and a cache that still holds exactly
the tokens of the conversation's window.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

SOAK_PATH = Path(__file__).resolve().parents[1] / "bench" / "soak.py"


@pytest.fixture(scope="module")
def soak_mod():
    spec = importlib.util.spec_from_file_location("localllm_bench_soak", SOAK_PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def one_thread():
    """One torch thread: on a loaded 2-core machine, two threads of tiny matrix products
    wait on each other at every barrier (milliseconds per product instead of microseconds)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# Words of the tiny vocabulary (tests/tiny_model.py), so that messages are a few tokens each.
MESSAGES = ("the tale", "and the sand is hot", "a tea of the sea", "is the cat in", "the end")


def test_rss_reader(soak_mod):
    import mmap

    size = 64 * 2**20
    # A fresh anonymous mapping: malloc could hand back freed pages that are resident already.
    block = mmap.mmap(-1, size)
    before = soak_mod.rss_bytes()
    for offset in range(0, size, 4096):  # touched pages count in the RSS
        block[offset] = 1
    assert soak_mod.rss_bytes() - before > 48 * 2**20
    block.close()


@pytest.mark.parametrize("arch", ["gemma3", "llama"])  # ring (sliding-window) and plain caches
def test_soak_tiny_model_with_context_shifts(soak_mod, tiny_model_path, one_thread, arch):
    from localllm import LLM

    llm = LLM(tiny_model_path(arch), device="cpu", ctx_size=96)
    res, repl = soak_mod.soak(llm, n_tokens=2000, ctx_size=96, n_predict=24, temp=1.0,
                              seed=7, system="the sea", warmup=3,
                              messages=MESSAGES)
    assert res.errors == []
    assert "full" not in res.finishes  # every reply fitted after shifting
    assert res.tokens >= 2000
    assert res.shifts > 10 and res.dropped >= res.shifts
    assert res.cache_stable
    assert res.kv_bytes > 0
    # 2,000 tokens of a model this small allocate nothing lasting: a leak of per-token
    # tensors or a reallocated cache would show here
    assert res.rss_growth < 64 * 2**20, res.report()
    assert len(res.rss) == res.replies
    assert repl.session.ctx_size == 96 and len(repl.session.tokens) <= 96
    # the cache holds exactly the window's prompt (nothing silently corrupted) ...
    prompt = repl._encode(repl.window()[:-1])
    assert repl.session.tokens[: len(prompt)] == prompt
    # ... and its contents give the logits a fresh evaluation of those tokens gives
    tokens = list(repl.session.tokens)
    fresh = llm.session(ctx_size=96)
    fresh.eval(tokens[:-1])
    repl.session.truncate(len(tokens) - 1)
    got, want = repl.session.eval(tokens[-1:]), fresh.eval(tokens[-1:])
    assert torch.allclose(got, want, atol=0.05), (got - want).abs().max()
    assert res.ok(64 * 2**20)
    assert "errors           : 0" in res.report()
