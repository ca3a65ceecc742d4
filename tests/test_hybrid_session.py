"""Prefix reuse on hybrid models (issue #27 item 3): a recurrent state cannot drop its last
tokens, so a later prompt sharing a prefix restores the nearest context checkpoint at or
below the common prefix and recomputes only from there; ``Session.save``/``load`` and
``run --prompt-cache`` carry the checkpoint one token before the end of the prompt, so the
same prompt again recomputes one token. The results equal a fresh evaluation.

The models are the granitehybrid fixture (Mamba2 and attention layers) and the qwen35 one
(gated delta-nets and attention), tests/families.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from cli_helpers import run_cli
from families import write_family

from localllm import LLM
from localllm.runtime.generate import prefill
from localllm.runtime.session import CHECKPOINT_INTERVAL, Session, load_model


@pytest.fixture(scope="module", params=["granitehybrid", "qwen35"])
def path(request, tmp_path_factory):
    return write_family(request.param, tmp_path_factory.mktemp("hybrid-session"))


@pytest.fixture(scope="module")
def model(path):
    # float32 matrices: a recomputed suffix and a fresh evaluation agree to float rounding
    return load_model(path, device="cpu", progress=False, backend="torch", dtype=torch.float32)


def _tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(4, 316, n).tolist()


def _forwarded(model, monkeypatch) -> list[int]:
    """The token counts of the model's forwards from now on."""
    counts: list[int] = []
    forward = model.model.forward

    def spy(tokens, *args, **kwargs):
        counts.append(int(tokens.shape[0]))
        return forward(tokens, *args, **kwargs)

    monkeypatch.setattr(model.model, "forward", spy)
    return counts


def test_prefix_reuse_restores_the_nearest_checkpoint(model, monkeypatch):
    first = _tokens(300, 1)
    second = first[:280] + _tokens(20, 2)
    s = Session(model, ctx_size=512)
    s.eval(first)
    assert s.memory.restorable(280) == CHECKPOINT_INTERVAL  # the checkpoint at 256
    counts = _forwarded(model, monkeypatch)
    logits, reused = prefill(s, second)
    assert reused == CHECKPOINT_INTERVAL and sum(counts) == len(second) - CHECKPOINT_INTERVAL
    fresh = Session(model, ctx_size=512)
    expected = fresh.eval(second)
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    for ours, theirs in zip(s.memory, fresh.memory):
        for a, b in zip(ours.state().values(), theirs.state().values()):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    # without checkpoints the state can only go back to the start
    bare = Session(model, ctx_size=512, checkpoints=0)
    bare.eval(first)
    assert bare.memory.restorable(280) == 0


def test_save_load_keeps_the_checkpoint_before_the_end(model, tmp_path, monkeypatch):
    prompt = _tokens(40, 3)
    s = Session(model, ctx_size=512)
    s.eval(prompt)
    s.save(tmp_path / "p.st")
    expected = s.eval([7])
    loaded = Session(model, ctx_size=512)
    loaded.load(tmp_path / "p.st")
    assert loaded.tokens == prompt
    assert torch.equal(loaded.eval([7]), expected)  # the state itself round-trips
    again = Session(model, ctx_size=512)
    again.load(tmp_path / "p.st")
    counts = _forwarded(model, monkeypatch)
    logits, reused = prefill(again, prompt)  # the same prompt: its last token recomputed
    assert reused == len(prompt) - 1 and counts == [1]
    torch.testing.assert_close(logits, Session(model, ctx_size=512).eval(prompt),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["nemotron_h", "lfm2", "falcon-h1", "qwen35"])
def test_static_decode_steps_equal_ordinary_ones(family, tmp_path):
    """The one-token step with a device-held position (CUDA graphs' path, eager here) on
    each memory plan: FFN-only layers, convolution states, two memories per layer, a
    delta-net state."""
    m = load_model(write_family(family, tmp_path), device="cpu", progress=False,
                   backend="torch", dtype=torch.float32)
    prompt = _tokens(30, 4)
    plain, static = Session(m, ctx_size=64), Session(m, ctx_size=64, static_decode=True)
    plain.eval(prompt)
    static.eval(prompt)
    for tok in _tokens(4, 5):
        torch.testing.assert_close(static.eval([tok]), plain.eval([tok]), rtol=1e-5, atol=1e-5)


def test_api_prefix_cache_and_run_prompt_cache(path, tmp_path, monkeypatch, capsys):
    llm = LLM(path, device="cpu", ctx_size=512)
    prompt = _tokens(300, 6)
    cold = llm.create_completion(prompt, max_tokens=4, temperature=0, cache_prompt=False)
    llm.create_completion(prompt[:290] + _tokens(5, 7), max_tokens=2, temperature=0)
    warm = llm.create_completion(prompt, max_tokens=4, temperature=0)
    # a checkpoint below the common prefix of 290: 256, or 289, the one the second call
    # took while recomputing up to its prefix
    assert CHECKPOINT_INTERVAL <= warm["usage"]["prompt_tokens_details"]["cached_tokens"] < 290
    assert warm["choices"][0]["text"] == cold["choices"][0]["text"]

    cache = tmp_path / "p.cache"
    text = "the quick brown fox jumps over the lazy dog"
    args = ("run", str(path), text, "-n", "3", "--temp", "0", "--device", "cpu",
            "--prompt-cache", str(cache), "-v")
    code, out1, err = run_cli(monkeypatch, capsys, *args)
    assert code == 0 and cache.is_file() and "prompt cache: 0 of" in err
    code, out2, err = run_cli(monkeypatch, capsys, *args)
    n = len(llm.tokenize(text))
    assert code == 0 and f"prompt cache: {n - 1} of {n}" in err and out1 == out2


def test_ctx_checkpoints_bounds_what_a_prefix_restores(path, monkeypatch, capsys):
    """``LLM(ctx_checkpoints=0)`` / ``--ctx-checkpoints 0`` keeps no checkpoint: a shared
    prefix is recomputed from the start (llama.cpp's ``--ctx-checkpoints``); out of range is
    one error naming the flag."""
    prompt = _tokens(300, 8)
    for n, cached in ((0, lambda c: c == 0), (8, lambda c: c >= CHECKPOINT_INTERVAL)):
        llm = LLM(path, device="cpu", ctx_size=512, ctx_checkpoints=n)
        llm.create_completion(prompt, max_tokens=1, temperature=0)
        warm = llm.create_completion(prompt[:290] + _tokens(5, 9), max_tokens=1, temperature=0)
        assert cached(warm["usage"]["prompt_tokens_details"]["cached_tokens"]), n
    code, out, err = run_cli(monkeypatch, capsys, "run", str(path), "hi", "-n", "1",
                             "--device", "cpu", "--ctx-checkpoints", "-1")
    assert code == 1 and err.count("\n") == 1 and "--ctx-checkpoints" in err and not out
