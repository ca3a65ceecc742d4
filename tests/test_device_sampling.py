"""The fused device chain: same tokens as the step-by-step chain, eligibility, one host read."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from localllm.errors import LocalLLMError
from localllm.sampling.chain import SamplingParams, build_sampler
from localllm.sampling.device import DeviceChain, softmax_front

DATA = Path(__file__).parent / "data" / "sampling"
INF = float("inf")


@pytest.fixture(autouse=True)
def fused_on_cpu(monkeypatch):
    """The top_k path runs on CPU logits only when asked (it is slower there than the chain)."""
    monkeypatch.setattr(DeviceChain, "on_cpu", True)


def pair(params: SamplingParams):
    """(fused chain, reference chain) built from the same params (same seed)."""
    fused, ref = build_sampler(params, None), build_sampler(params, None)
    ref.device_chain = None  # forces the step-by-step chain
    return fused, ref


def draw(chain, logits: torch.Tensor):
    try:
        return chain.sample(logits), chain.last_trace.processed_logprob
    except LocalLLMError:
        return "masked", None


def assert_same_draws(params: SamplingParams, logits: torch.Tensor, n: int = 20) -> None:
    fused, ref = pair(params)
    assert fused.device_chain is not None and fused.device_chain.handles(logits)
    # Both log-probs are float32 differences of numbers of the size of the largest processed
    # logit: they agree to a few of its ulps.
    finite = [abs(b) for b in params.logit_bias.values() if b > -INF]
    scale = float(logits[logits > -INF].abs().max()) + max(finite, default=0.0)
    scale /= params.temp if params.temp > 0 else 1.0
    for i in range(n):
        (a, la), (b, lb) = draw(fused, logits), draw(ref, logits)
        assert a == b, f"draw {i}: fused {a}, reference {b} ({params})"
        if la is not None:
            assert la == pytest.approx(lb, abs=1e-6 * max(1.0, scale))


def random_case(seed: int, *, ties: bool, heavy_mask: bool) -> tuple[SamplingParams, torch.Tensor]:
    r = random.Random(seed)
    n = r.randint(1000, 5000)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 3
    if ties:
        x = (x * 2).round() / 2  # many exactly equal logits
    if heavy_mask:  # fewer finite logits than top_k often
        x[torch.randperm(n, generator=g)[: n - r.randint(0, 120)]] = -INF
    else:
        x[torch.randint(0, n, (r.randint(0, 50),), generator=g)] = -INF
    bias = {r.randrange(n): r.choice([-INF, -2.0, 3.0, 10.0]) for _ in range(r.randint(0, 8))}
    params = SamplingParams(
        seed=seed, top_k=r.randint(1, 100), top_p=r.choice([1.0, r.uniform(0.01, 1.0)]),
        min_p=r.choice([0.0, r.uniform(0.0, 0.5)]), temp=r.choice([0.0, 0.3, 0.8, 1.5]),
        min_keep=r.randint(0, 1) if ties else r.randint(0, 5), logit_bias=bias)
    return params, x


@pytest.mark.parametrize("block", range(4))
def test_same_tokens_as_the_reference_chain(block):
    for seed in range(block * 25, block * 25 + 25):
        assert_same_draws(*random_case(seed, ties=False, heavy_mask=seed % 2 == 0))


def test_same_tokens_with_tied_logits():
    # Ties are broken by torch.topk exactly as in the reference while the top-k candidates are
    # all finite (the same call on the same vector) and min_keep does not top up.
    for seed in range(100, 140):
        assert_same_draws(*random_case(seed, ties=True, heavy_mask=False))


def test_same_tokens_on_real_model_logits():
    # The golden rows: the default model's real next-token logits (3000 largest, rest -inf).
    g = json.loads((DATA / "golden.json").read_text())
    z = np.load(DATA / "logits.npz")
    for r in range(len(g["rows"])):
        keep = z["ids"][r] >= 0
        row = torch.full((g["n_vocab"],), -INF)
        row[torch.from_numpy(z["ids"][r][keep].astype(np.int64))] = torch.from_numpy(
            z["logits"][r][keep])
        for params in (SamplingParams(seed=r), SamplingParams(seed=r, temp=1.0, top_k=64, min_p=0),
                       SamplingParams(seed=r, temp=0.0), SamplingParams(seed=r, top_k=300),
                       SamplingParams(seed=r, top_p=0.5, min_keep=3, min_p=0.2)):
            assert_same_draws(params, row, n=30)


def test_nucleus_beyond_256_and_4096():
    # top_p sorts the top 256 probabilities, then 4096, then all: each stage must agree.
    flat = torch.randn(20000, generator=torch.Generator().manual_seed(0)) * 0.1
    for top_p in (0.5, 0.99, 0.99999):
        for k in (300, 5000, 12000):
            params = SamplingParams(seed=k, top_k=k, top_p=top_p, min_p=0.0, min_keep=2)
            assert_same_draws(params, flat, n=10)


def test_softmax_front_matches_the_compacted_softmax():
    g = torch.Generator().manual_seed(0)
    for size in (1, 5, 7, 8, 12, 15, 16, 17, 40, 64, 300):
        for n in range(0 if size > 1 else 1, size + 1):
            x = torch.randn(size, generator=g) * 3
            x[n:] = -INF
            got = softmax_front(x, torch.tensor(n))
            if n:
                assert torch.equal(got[:n], torch.softmax(x[:n], 0))
                assert torch.equal(got[n:], torch.zeros(size - n))


# ---- eligibility --------------------------------------------------------------------------------
@pytest.mark.parametrize("kw", [
    {}, {"temp": 0.0}, {"temp": 1.0, "top_k": 64, "top_p": 0.95, "min_p": 0.0},
    {"top_k": 0, "temp": 0.0, "top_p": 1.0}, {"logit_bias": {3: -INF, 4: 2.0}},
    {"xtc_probability": 0.5, "xtc_threshold": 0.6}, {"penalty_last_n": 0, "penalty_repeat": 1.3},
    {"samplers": ["top_k", "temperature"]}, {"samplers": ["min_p", "top_k", "top_p", "temperature"],
                                               "min_p": 0.0},
])
def test_eligible(kw):
    assert isinstance(build_sampler(SamplingParams(seed=1, **kw), None).device_chain, DeviceChain)


class TinyVocab:
    """Four tokens 'a', 'b', ':', 'c' (DRY reads token texts; ':' is a sequence breaker)."""

    n_vocab = 4
    eog_ids = frozenset()
    words = ("a", "b", ":", "c")

    def token_bytes(self, i: int) -> bytes:
        return self.words[i].encode()

    def encode(self, text: str, *, add_bos=None, special=False) -> list[int]:
        return [self.words.index(ch) for ch in text if ch in self.words]


@pytest.mark.parametrize("kw", [
    {"penalty_repeat": 1.1}, {"penalty_freq": 0.5}, {"penalty_present": 0.5},
    {"dry_multiplier": 0.8}, {"mirostat": 2}, {"mirostat": 1}, {"typ_p": 0.9},
    {"xtc_probability": 0.5}, {"top_n_sigma": 1.0}, {"top_k": 0}, {"top_k": 0, "temp": 0.0},
    {"dynatemp_range": 0.5}, {"n_probs": 5}, {"samplers": ["top_k", "top_p"]},
    {"samplers": ["top_p", "top_k", "temperature"]},
    {"samplers": ["top_k", "temperature", "top_k", "temperature"]},
])
def test_ineligible_falls_back(kw):
    chain = build_sampler(SamplingParams(seed=1, **kw), TinyVocab())
    assert chain.device_chain is None
    assert chain.sample(torch.tensor([0.0, 3.0, 1.0, 2.0])) in range(4)


def test_top_k_path_is_off_on_cpu_by_default(monkeypatch):
    monkeypatch.setattr(DeviceChain, "on_cpu", False)
    chain = build_sampler(SamplingParams(seed=1), None)
    assert not chain.device_chain.handles(torch.zeros(100))
    assert torch.zeros(100, device="meta").device.type != "cpu"
    assert chain.device_chain.handles(torch.zeros(100, device="meta"))
    argmax = build_sampler(SamplingParams(seed=1, top_k=0, top_p=1.0, temp=0.0), None)
    assert argmax.device_chain.handles(torch.zeros(100))


def test_grammar_falls_back():
    class AllowAll:
        def is_allowed(self, token):
            return True

    assert build_sampler(SamplingParams(), None, constraint=AllowAll()).device_chain is None


def test_top_k_not_truncating_the_vocabulary_uses_the_reference():
    chain = build_sampler(SamplingParams(seed=1, top_k=10), None)
    assert not chain.device_chain.handles(torch.zeros(10))
    assert chain.device_chain.handles(torch.zeros(11))
    greedy = build_sampler(SamplingParams(seed=1, top_k=10, temp=0.0, top_p=1.0), None)
    assert greedy.device_chain.handles(torch.zeros(10))  # k >= n_vocab: a plain argmax
    assert chain.sample(torch.tensor([0.0, 5.0, 1.0])) in range(3)


# ---- one host read ------------------------------------------------------------------------------
class SyncCounter(TorchDispatchMode):
    """Counts the ops that read device data on the host or need a data-dependent shape."""

    def __init__(self) -> None:
        super().__init__()
        self.counts = {"scalar": 0, "nonzero": 0, "masked_select": 0, "bool_index": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name == "_local_scalar_dense":
            self.counts["scalar"] += 1
        elif name in ("nonzero", "nonzero_static", "argwhere"):
            self.counts["nonzero"] += 1
        elif name == "masked_select":
            self.counts["masked_select"] += 1
        elif name in ("index", "index_put", "index_put_"):
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices):
                self.counts["bool_index"] += 1
        return func(*args, **(kwargs or {}))


def test_the_counter_sees_host_reads():
    x = torch.randn(10)
    with SyncCounter() as c:
        float(x.max())
        x[x > 0].sum().item()
        (x > 0).nonzero()
    assert c.counts == {"scalar": 2, "nonzero": 1, "masked_select": 0, "bool_index": 1}


@pytest.mark.parametrize("kw", [
    {}, {"temp": 0.0}, {"temp": 1.0, "top_k": 64, "min_p": 0.0, "min_keep": 3},
    {"top_k": 0, "temp": 0.0, "top_p": 1.0, "logit_bias": {2: -INF}},
    {"top_k": 300, "top_p": 0.999, "logit_bias": {5: 1.0}},
])
def test_one_host_read_per_token(kw):
    chain = build_sampler(SamplingParams(seed=3, **kw), None)
    logits = torch.randn(5000, generator=torch.Generator().manual_seed(0)) * 3
    for _ in range(3):
        with SyncCounter() as c:
            chain.sample(logits)
        assert c.counts == {"scalar": 1, "nonzero": 0, "masked_select": 0, "bool_index": 0}


def test_reference_chain_does_sync():
    # The counter is not blind to the path it guards against.
    chain = build_sampler(SamplingParams(seed=3), None)
    chain.device_chain = None
    with SyncCounter() as c:
        chain.sample(torch.randn(5000))
    assert c.counts["scalar"] + c.counts["nonzero"] + c.counts["bool_index"] > 1


# ---- everything masked --------------------------------------------------------------------------
@pytest.mark.parametrize("kw", [{}, {"temp": 0.0}, {"top_k": 0, "temp": 0.0, "top_p": 1.0}])
def test_every_candidate_masked_raises(kw):
    n = 50
    params = SamplingParams(seed=1, logit_bias={i: -INF for i in range(n)}, **kw)
    fused, ref = pair(params)
    assert fused.device_chain is not None
    for chain in (fused, ref):
        with pytest.raises(LocalLLMError, match="no token can be sampled"):
            chain.sample(torch.randn(n))


def test_masked_then_sampling_continues_in_step():
    # A failed draw consumes no generator state in either path, so later draws still agree.
    params = SamplingParams(seed=7, top_k=5)
    fused, ref = pair(params)
    good, bad = torch.randn(100), torch.full((100,), -INF)
    for logits in (good, bad, good, bad, good):
        assert draw(fused, logits)[0] == draw(ref, logits)[0]
    assert math.isfinite(fused.last_trace.processed_logprob)
