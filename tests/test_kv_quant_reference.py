"""Quantized KV caches of the default model against llama.cpp with the same cache types
(``tests/data/kvcache/gemma3-270m-kv.npz``, recorded by ``tests/data/kvcache/record.py``
through llama-cpp-python's ``type_k`` / ``type_v`` with flash attention).

The issue's bound: KL(llama.cpp || ours) <= 0.01 with q8_0 caches, and perplexity within 1%
of llama.cpp's with the same setting. q4_0's figures are printed (``pytest -s``) and held to
looser bounds. KL is over each position's top 1024 tokens of llama.cpp's distribution with
the rest merged into one outcome (the recording keeps those; they hold all but a sliver of
the mass). The recorded perplexity covers the first 4 chunks of 512 tokens of gpl-3.txt."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import DEFAULT_MODEL

pytestmark = pytest.mark.slow

FIXTURE = Path(__file__).resolve().parent / "data" / "kvcache" / "gemma3-270m-kv.npz"


@pytest.fixture(scope="module")
def recorded():
    return dict(np.load(FIXTURE))


def merged_kl(ref_ids: np.ndarray, ref_lp: np.ndarray, ours: torch.Tensor) -> np.ndarray:
    """KL(ref || ours) per row over the recorded top tokens plus one merged tail outcome:
    ref_ids / ref_lp (n, k), ours (n, n_vocab) log-probs."""
    q = ours.double().numpy()
    lq = np.take_along_axis(q, ref_ids.astype(np.int64), -1)
    lp = ref_lp.astype(np.float64)
    p = np.exp(lp)
    tail_p = np.clip(1.0 - p.sum(-1), 1e-12, None)
    tail_q = np.clip(1.0 - np.exp(lq).sum(-1), 1e-12, None)
    return (p * (lp - lq)).sum(-1) + tail_p * np.log(tail_p / tail_q)


def _ours(name: str):
    from localllm import LLM

    return LLM(DEFAULT_MODEL, device="cpu", ctx_size=1024, type_k=name, type_v=name)


def _kl(llm, recorded, name: str) -> list[float]:
    out = []
    for p in range(2):
        ids = recorded[f"prompt{p}_ids"].tolist()
        ref_ids, ref_lp = recorded[f"{name}_p{p}_ids"], recorded[f"{name}_p{p}_logprobs"]
        n = ref_ids.shape[0]
        logits = llm.session().eval(ids, all_logits=True, logits_start=len(ids) - n)
        ours = torch.log_softmax(logits.double(), -1)
        out.append(float(merged_kl(ref_ids, ref_lp, ours).mean()))
    return out


def _ppl(llm) -> float:
    from localllm.eval.perplexity import perplexity

    text = (FIXTURE.parent.parent / "reference" / "gpl-3.txt").read_text(encoding="utf-8")
    return perplexity(llm, text, n_ctx=512, max_chunks=4).ppl


# q4_0's own noise is large: llama.cpp's q4_0 is at KL 0.09-0.12 from its own f16 cache on
# these prompts (recorded), so ours, quantizing independently, is held to a loose bound.
@pytest.mark.parametrize("name,kl_bound,ppl_bound", [("q8_0", 0.01, 0.01),
                                                     ("q4_0", 0.3, 0.05)])
def test_quantized_cache_matches_llama_cpp(recorded, name, kl_bound, ppl_bound):
    llm = _ours(name)
    assert llm.loaded.backend == "native"  # the native decode attention over the blocks
    kls = _kl(llm, recorded, name)
    ppl, ref_ppl = _ppl(llm), float(recorded[f"{name}_ppl"])
    print(f"\n{name}: KL(llama.cpp || ours) short prompt {kls[0]:.5f}, 900 tokens "
          f"{kls[1]:.5f}; PPL ours {ppl:.4f} llama.cpp {ref_ppl:.4f} "
          f"({100 * (ppl / ref_ppl - 1):+.2f}%)")
    assert all(math.isfinite(k) and k <= kl_bound for k in kls), kls
    assert abs(ppl / ref_ppl - 1) <= ppl_bound, (ppl, ref_ppl)


def test_quantized_decode_steps_match_llama_cpp(recorded):
    """The last recorded positions of the short prompt evaluated one token at a time (the
    native decode attention over q8_0 blocks, not the prefill's torch attention)."""
    llm = _ours("q8_0")
    ids = recorded["prompt0_ids"].tolist()
    ref_ids, ref_lp = recorded["q8_0_p0_ids"], recorded["q8_0_p0_logprobs"]
    n = min(8, ref_ids.shape[0])
    session = llm.session()
    session.eval(ids[: len(ids) - n])
    rows = [session.eval([t]) for t in ids[len(ids) - n:]]
    ours = torch.log_softmax(torch.stack(rows).double(), -1)
    kl = merged_kl(ref_ids[-n:], ref_lp[-n:], ours)
    print(f"\nq8_0 decode steps: KL(llama.cpp || ours) mean {kl.mean():.5f} max {kl.max():.5f}")
    assert kl.mean() <= 0.01, kl
