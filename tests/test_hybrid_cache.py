"""The prefix cache on a hybrid model (issue #27, item 3): the recurrent state cannot be
truncated, so the session keeps context checkpoints (every CHECKPOINT_INTERVAL tokens of a
prefill and one token before its end) and a later prompt sharing a prefix restores the
nearest one at or below the common prefix instead of recomputing it; the API's prefix reuse,
``run --prompt-cache`` and ``Session.save/load`` work on it. The tiny ``qwen35`` fixture
model (tests/families.py: three gated delta-nets and one attention layer)."""

from __future__ import annotations

import pytest
import torch
from cli_helpers import run_cli
from families import write_family

from localllm import LLM
from localllm.runtime.session import CHECKPOINT_INTERVAL


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_family("qwen35", tmp_path_factory.mktemp("hybrid"))


def counted(llm: LLM, monkeypatch) -> list[int]:
    """The number of tokens of each forward pass of ``llm``'s model from now on."""
    calls: list[int] = []
    forward = llm.loaded.model.forward

    def spy(tokens, *args, **kwargs):
        calls.append(int(tokens.shape[0]))
        return forward(tokens, *args, **kwargs)

    monkeypatch.setattr(llm.loaded.model, "forward", spy)
    return calls


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(4, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_shared_prefix_restores_a_checkpoint(path, monkeypatch):
    """A second prompt sharing 400 tokens with the first restores the checkpoint at 256 and
    evaluates only the rest, with the logits of a cold evaluation."""
    llm = LLM(path, device="cpu", ctx_size=512)
    prefix, first, second = ids(400, 1), ids(20, 2), ids(20, 3)
    llm.create_completion(prefix + first, max_tokens=2, temperature=0)
    calls = counted(llm, monkeypatch)
    r = llm.create_completion(prefix + second, max_tokens=1, temperature=0, logprobs=5)
    restored = 400 // CHECKPOINT_INTERVAL * CHECKPOINT_INTERVAL
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == restored
    assert sum(calls) == 420 - restored
    cold = LLM(path, device="cpu", ctx_size=512).create_completion(
        prefix + second, max_tokens=1, temperature=0, logprobs=5, cache_prompt=False)
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert cold["choices"][0]["text"] == r["choices"][0]["text"]
    warm_lp = r["choices"][0]["logprobs"]["top_logprobs"][0]
    cold_lp = cold["choices"][0]["logprobs"]["top_logprobs"][0]
    assert warm_lp.keys() == cold_lp.keys()
    for k in warm_lp:
        assert warm_lp[k] == pytest.approx(cold_lp[k], abs=1e-3)


def test_next_turn_restores_the_prompt_end_checkpoint(path, monkeypatch):
    """A conversation's next prompt (the previous prompt, the reply, a new message) goes back
    to the checkpoint one token before the previous prompt's end."""
    llm = LLM(path, device="cpu", ctx_size=512)
    prompt = ids(300, 4)
    reply = llm.create_completion(prompt, max_tokens=4, temperature=0)
    tokens = llm.tokenize(reply["choices"][0]["text"], add_bos=False)
    calls = counted(llm, monkeypatch)
    nxt = prompt + tokens + ids(10, 5)
    r = llm.create_completion(nxt, max_tokens=1, temperature=0)
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt) - 1
    assert sum(calls) == len(nxt) - (len(prompt) - 1)


def test_without_checkpoints_the_prefix_is_recomputed(path, monkeypatch):
    llm = LLM(path, device="cpu", ctx_size=512, ctx_checkpoints=0)
    prefix = ids(300, 6)
    llm.create_completion(prefix + ids(5, 7), max_tokens=1, temperature=0)
    calls = counted(llm, monkeypatch)
    r = llm.create_completion(prefix + ids(5, 8), max_tokens=1, temperature=0)
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert sum(calls) == 305


def test_checkpoint_memory_is_bounded(path):
    """At most ctx_checkpoints copies of the recurrent state, the oldest dropped."""
    llm = LLM(path, device="cpu", ctx_size=512, ctx_checkpoints=1)
    session = llm.session()
    session.eval(ids(500, 9))  # checkpoints at 256, then 499 (256 dropped)
    state = llm.loaded.memory_layout[0].nbytes(1, 4)
    recurrent = [m for m in session.memory if m.cheap_rewind is False]
    assert recurrent and all(len(m.checkpoints.items) == 1 for m in recurrent)
    assert sum(m.nbytes for m in recurrent) == 2 * state * len(recurrent)
    assert session.memory.restorable(400) == 0
    assert session.memory.restorable(499) == 499


def test_session_save_load_continues_the_recurrence(path, tmp_path):
    llm = LLM(path, device="cpu", ctx_size=512)
    a, b = ids(280, 10), ids(3, 11)
    s = llm.session()
    s.eval(a)
    s.save(tmp_path / "s.st")
    expected = s.eval(b)
    t = llm.session()
    t.load(tmp_path / "s.st")
    assert t.tokens == a
    torch.testing.assert_close(t.eval(b), expected, rtol=0, atol=0)


def test_run_prompt_cache_on_a_hybrid(path, tmp_path, monkeypatch, capsys):
    """``run --prompt-cache`` twice with one prompt: the second run evaluates its last token
    only (the file holds the state before it: the prompt's last checkpoint)."""
    cache = tmp_path / "p.cache"
    prompt = " ".join(["the cat sat on the mat"] * 12)
    args = ("run", str(path), prompt, "-n", "3", "--temp", "0", "--device", "cpu",
            "--prompt-cache", str(cache), "-v")
    code, out1, err = run_cli(monkeypatch, capsys, *args)
    assert code == 0 and cache.is_file() and "prompt cache: 0 of" in err, err
    code, out2, err = run_cli(monkeypatch, capsys, *args)
    n = len(LLM(path, device="cpu").tokenize(prompt))
    assert code == 0 and f"prompt cache: {n - 1} of {n}" in err and out1 == out2


@pytest.mark.parametrize("command", ["run", "chat", "serve", "bench"])
def test_ctx_checkpoints_flag(command, monkeypatch, capsys):
    """``--ctx-checkpoints`` on every command that holds sequences; a negative count is one
    error line naming the flag; its default is the library's."""
    from localllm.memory import DEFAULT_CHECKPOINTS

    code, out, _ = run_cli(monkeypatch, capsys, command, "--help")
    assert code == 0 and "--ctx-checkpoints" in out
    assert DEFAULT_CHECKPOINTS == 8  # the CLI's literal default (it imports no torch)


def test_negative_ctx_checkpoints_is_one_error_line(path, monkeypatch, capsys):
    from cli_helpers import assert_one_line_error

    code, _, err = run_cli(monkeypatch, capsys, "run", str(path), "hi", "-n", "1",
                           "--ctx-checkpoints", "-1")
    assert_one_line_error(code, err, "--ctx-checkpoints")
