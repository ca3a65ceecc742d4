"""Speculative decoding (issue #30 item 1): n-gram and draft-model guesses verified in one
batched forward by the one decode loop. The sampler sees the same logits and history as in
plain decoding and draws the same random numbers, so the output is the same token for token —
checked exactly on float32 models and on the default model's native int8 path (where a batched
forward equals one-token steps bit for bit), for greedy and seeded sampling, with good, bad and
adversarial guesses; and statistically, with independent random numbers on each side."""

from __future__ import annotations

import collections
import random

import pytest
import torch
from cli_helpers import run_cli
from tiny_model import write_tiny_gguf

from localllm import LLM
from localllm.errors import ParameterError
from localllm.runtime.generate import Timings, generate_tokens
from localllm.runtime.session import Session, load_model
from localllm.runtime.speculative import NgramDrafter, check_draft_vocabulary
from localllm.sampling.chain import SamplingParams, build_sampler


# ---- the n-gram drafter ---------------------------------------------------------------------------
def test_ngram_drafter_proposes_what_followed_the_latest_match():
    d = NgramDrafter(3)
    ctx = [1, 2, 3, 4, 5, 9, 1, 2, 3]
    assert d.propose(ctx, 4) == [4, 5, 9, 1]  # "1 2 3" occurred at 0: 4 5 9 1 followed
    ctx += [4, 7, 2, 3]
    # "7 2 3" and "4 7 ..." never occurred; "2 3" did, latest at 7 (followed by 4, 7, 2 ...)
    assert d.propose(ctx, 3) == [4, 7, 2]
    assert d.propose([5, 6, 7], 3) == []  # a new context: the index is rebuilt, no match
    assert NgramDrafter(1).propose([8, 1, 8], 2) == [1]  # a 1-token match: 1 guess
    assert NgramDrafter(2, 1).propose([4, 8, 1, 5, 6, 7, 8, 1], 5) == [5, 6, 7]  # 2: 3 guesses
    assert NgramDrafter(3).propose([8, 1, 8], 2) == []  # n_min 2: single tokens do not count
    with pytest.raises(ParameterError):
        NgramDrafter(0)


def test_ngram_index_matches_a_scan_on_random_contexts():
    rng = random.Random(3)

    def scan(ctx, n_max, n_min, k):
        for n in range(min(n_max, len(ctx)), n_min - 1, -1):
            key = ctx[-n:]
            for j in range(len(ctx) - n - 1, -1, -1):  # latest earlier occurrence
                if ctx[j:j + n] == key:
                    return ctx[j + n:j + n + min(k, 2 ** n - 1)]
        return []

    for _ in range(200):
        d = NgramDrafter(4, 1)
        ctx = [rng.randrange(6) for _ in range(rng.randrange(1, 20))]
        for _ in range(5):  # grown a few tokens at a time, as generation does
            assert d.propose(ctx, 5) == scan(ctx, 4, 1, 5), ctx
            ctx = ctx + [rng.randrange(6) for _ in range(rng.randrange(1, 4))]


# ---- exactness --------------------------------------------------------------------------------------
class Adversary:
    """Guesses random tokens (almost always wrong), or the last token repeated."""

    def __init__(self, n_vocab: int, seed: int = 0) -> None:
        self.rng, self.n_vocab = random.Random(seed), n_vocab

    def propose(self, context, k):
        if self.rng.random() < 0.3:
            return [context[-1]] * k
        return [self.rng.randrange(self.n_vocab) for _ in range(self.rng.randrange(k + 1))]


@pytest.fixture(scope="module")
def exact(tmp_path_factory):
    """A float32 tiny model: batched forwards equal one-token steps bit for bit."""
    path = write_tiny_gguf(tmp_path_factory.mktemp("spec") / "tiny.gguf", context_length=512)
    return load_model(path, device="cpu", progress=False, dtype=torch.float32)


def _tokens(loaded, prompt, drafter, *, temp, seed, n=40, draft_max=7):
    s = Session(loaded, ctx_size=512)
    sampler = build_sampler(SamplingParams(temp=temp, seed=seed, top_k=0, min_p=0.0,
                                           top_p=1.0), loaded.tokenizer)
    t = Timings()
    out = [st.token for st in generate_tokens(s, prompt, sampler, n_predict=n, timings=t,
                                              drafter=drafter, draft_max=draft_max)]
    return out, t, s


@pytest.mark.parametrize("temp, seed", [(0.0, 0), (1.0, 1), (1.0, 2), (0.7, 3)])
def test_same_tokens_with_and_without_guesses(exact, temp, seed):
    rng = random.Random(seed)
    n_vocab = exact.tokenizer.n_vocab
    base = [rng.randrange(4, n_vocab) for _ in range(6)]
    prompt = base * 4  # repeats: the n-gram drafter finds matches
    plain, _, _ = _tokens(exact, prompt, None, temp=temp, seed=seed)
    for drafter in (NgramDrafter(3), NgramDrafter(1), Adversary(n_vocab, seed)):
        got, t, s = _tokens(exact, prompt, drafter, temp=temp, seed=seed)
        assert got == plain, type(drafter).__name__
        assert t.extra["draft_tokens"] > 0
        # the session holds exactly what plain decoding evaluated: no rejected guess left
        assert s.tokens == prompt + plain[:-1]


def test_a_good_drafter_saves_forwards(exact):
    """Greedy on a prompt that repeats: most n-gram guesses are taken."""
    rng = random.Random(9)
    prompt = [rng.randrange(4, exact.tokenizer.n_vocab) for _ in range(8)] * 6
    plain, _, _ = _tokens(exact, prompt, None, temp=0.0, seed=0, n=60)
    got, t, _ = _tokens(exact, prompt, NgramDrafter(3), temp=0.0, seed=0, n=60)
    assert got == plain
    accepted = t.extra["draft_accepted"]
    forwards = len(got) - 1 - accepted  # one-token steps replaced by accepted guesses
    assert accepted > 0 and forwards < len(got) - 1


def test_guesses_stop_at_the_context_end(exact):
    prompt = [5, 6, 7, 8] * 12
    s = Session(exact, ctx_size=64)
    sampler = build_sampler(SamplingParams(temp=0.0), exact.tokenizer)
    steps = list(generate_tokens(s, prompt, sampler, drafter=NgramDrafter(2), draft_max=16))
    assert steps[-1].finish_reason in ("ctx", "eog") and s.n_past <= 64


def test_sampled_tokens_follow_the_plain_distribution(exact):
    """Distribution preservation measured, not assumed: 400 sampled continuations with
    guesses (a drafter that is right a third of the time) and 400 without, each side with
    its own seeds. At each of the first four positions the two samples' token counts pass a
    two-sample chi-square test (p > 0.001; a verifier that kept wrong guesses, or drew the
    token after a rejection from the wrong distribution, fails it)."""
    prompt = [7, 11, 13, 7, 11]
    # the random model's logits span about 40 nats: a high temperature spreads the top six
    params = {"temp": 30.0, "top_k": 6, "min_p": 0.0, "top_p": 1.0}

    class Sometimes:  # the plain argmax continuation a third of the time, else a wrong token
        def __init__(self, seed):
            self.rng = random.Random(seed)

        def propose(self, context, k):
            return [self.rng.choice([context[-1], 5, 9]) for _ in range(k)]

    def sample(seed, drafter):
        s = Session(exact, ctx_size=64)
        sampler = build_sampler(SamplingParams(seed=seed, **params), exact.tokenizer)
        return [st.token for st in generate_tokens(s, prompt, sampler, n_predict=4,
                                                   drafter=drafter, draft_max=3)]

    plain = [sample(seed, None) for seed in range(400)]
    spec = [sample(10_000 + seed, Sometimes(seed)) for seed in range(400)]
    for pos in range(4):
        a = collections.Counter(x[pos] for x in plain if len(x) > pos)
        b = collections.Counter(x[pos] for x in spec if len(x) > pos)
        na, nb = sum(a.values()), sum(b.values())
        assert na > 300 and nb > 300
        cats = [c for c in a.keys() | b.keys() if a[c] + b[c] >= 10]  # the rest pooled
        rest = (na - sum(a[c] for c in cats), nb - sum(b[c] for c in cats))
        pairs = [(a[c], b[c]) for c in cats] + ([rest] if sum(rest) else [])
        ka, kb = (nb / na) ** 0.5, (na / nb) ** 0.5
        stat = sum((ka * x - kb * y) ** 2 / (x + y) for x, y in pairs)
        df = len(pairs) - 1
        p = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                          torch.tensor(stat / 2, dtype=torch.float64)))
        assert df >= 2 and p > 1e-3, (pos, stat, df, p)


# ---- the draft model ------------------------------------------------------------------------------
def test_draft_model_gives_the_same_tokens(tmp_path):
    target = write_tiny_gguf(tmp_path / "target.gguf", seed=1, context_length=512)
    draft = write_tiny_gguf(tmp_path / "draft.gguf", seed=2, n_layers=1, context_length=512)
    plain = LLM(target, device="cpu", ctx_size=512)
    spec = LLM(target, device="cpu", ctx_size=512, draft_model=str(draft), draft_max=4,
               draft_p_min=0.0)
    for seed in range(3):
        kw = {"n_predict": 24, "temp": 0.8 if seed else 0.0, "seed": seed}
        a = [s.token for s in plain.stream("the and of the", **kw)]
        gen = spec.stream("the and of the", **kw)
        b = [s.token for s in gen]
        assert a == b
        assert gen.timings.extra["draft_tokens"] > 0


def test_draft_vocabulary_must_match(tmp_path):
    gemma = load_model(write_tiny_gguf(tmp_path / "a.gguf"), device="cpu", progress=False)
    qwen = load_model(write_tiny_gguf(tmp_path / "b.gguf", "qwen3"), device="cpu",
                      progress=False)
    with pytest.raises(ParameterError, match="vocabulary"):
        check_draft_vocabulary(gemma.tokenizer, qwen.tokenizer)
    check_draft_vocabulary(gemma.tokenizer, gemma.tokenizer)


# ---- the command line -----------------------------------------------------------------------------
def test_cli_flags(tmp_path, monkeypatch, capsys):
    path = write_tiny_gguf(tmp_path / "t.gguf", context_length=512)
    code, out, err = run_cli(monkeypatch, capsys, "run", str(path), "the and of the and of the",
                             "-n", "12", "--temp", "0", "--spec-ngram", "2", "--verbose")
    assert code == 0, err
    assert "speculative decoding: n-gram lookup" in err and "draft acceptance" in err
    code, plain, err = run_cli(monkeypatch, capsys, "run", str(path),
                               "the and of the and of the", "-n", "12", "--temp", "0")
    assert code == 0 and plain == out
    other = write_tiny_gguf(tmp_path / "q.gguf", "qwen3")
    for args, message in [(["--model-draft", str(other)], "vocabulary"),
                          (["--draft-min", "5", "--draft-max", "2", "--spec-ngram", "2"],
                           "draft-min"),
                          (["--spec-ngram", "-1"], "spec-ngram")]:
        code, _, err = run_cli(monkeypatch, capsys, "run", str(path), "hi", "-n", "2", *args)
        assert code == 1 and err.startswith("error:") and message in err, err
        assert len(err.strip().splitlines()) == 1


# ---- the default model on the native CPU path (int8 GEMV, native attention) -----------------
COPY_HEAVY = [
    ("def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + "
     "fibonacci(n - 2)\n\nThe same function with a loop:\n"),
    '{"name": "Ada", "age": 36, "langs": ["en", "fr"]}\nThe same JSON, pretty-printed:\n',
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Once upon a time, in a small village by the sea, there lived",
    "List of prime numbers: 2, 3, 5, 7, 11, 13,",
    "Paris is the capital of France. Berlin is the capital of",
    "import numpy as np\nimport torch\n\nx = np.zeros((3, 4))\ny = torch.from_numpy(x)\n",
    "Q: What is the boiling point of water?\nA:",
    "The mitochondria is the powerhouse of the cell. It",
    "1. Preheat the oven.\n2. Mix flour and sugar.\n3.",
    "SELECT name, age FROM users WHERE age > 30 ORDER BY",
    "In 1492, Columbus sailed the ocean blue. In",
    "for i in range(10):\n    print(i)\nfor j in range(10):\n",
    "Dear Sir or Madam,\n\nI am writing to",
    "The theory of relativity, proposed by Albert Einstein,",
    "<html>\n<head>\n<title>Test</title>\n</head>\n<body>\n",
    "Roses are red, violets are blue,",
    "A B C D E F G H I J K",
    "The answer is 42. The answer is",
    "Photosynthesis converts light energy into",
]


@pytest.mark.parametrize("i", range(len(COPY_HEAVY)))
def test_default_model_greedy_equals_plain_decoding(llm, i):
    """Issue #30's check on the default model (Q4_K_M, native CPU backend): greedy output with
    n-gram guesses (and, every fourth prompt, adversarial ones) is token for token the plain
    output. A verification batch runs the int8 GEMV and the native attention over 2-8 tokens;
    both sum each token's products as a one-token step does."""
    prompt = llm.tokenizer.encode(COPY_HEAVY[i])
    plain, _, _ = _tokens(llm.loaded, prompt, None, temp=0.0, seed=0, n=32)
    drafter = Adversary(llm.loaded.tokenizer.n_vocab, i) if i % 4 == 3 else NgramDrafter(3)
    got, t, _ = _tokens(llm.loaded, prompt, drafter, temp=0.0, seed=0, n=32)
    assert got == plain
    assert t.extra["draft_tokens"] > 0 or i % 4 != 3
