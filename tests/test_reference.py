"""The real default model against llama.cpp's recorded outputs (tests/data/reference)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import REFERENCE_DIR

pytestmark = pytest.mark.slow


def test_next_token_distribution_matches_llama_cpp(any_llm, reference):
    llm = any_llm
    ref_logprobs = torch.from_numpy(np.load(REFERENCE_DIR / "last_logprobs.npy"))
    kls = []
    for i, p in enumerate(reference["prompts"]):
        ours = torch.log_softmax(llm.logits(p["prompt_ids"]).double().cpu(), -1)
        ref = ref_logprobs[i].double()
        assert int(ours.argmax()) == int(ref.argmax()) == p["top20_ids"][0]
        kls.append(float((ref.exp() * (ref - ours)).sum()))
    assert np.mean(kls) <= 0.02, kls


def test_teacher_forced_greedy_agrees_where_llama_cpp_is_decisive(any_llm, reference):
    llm = any_llm
    for p in reference["prompts"]:
        ids = p["prompt_ids"] + p["greedy_48_ids"]
        session = llm.session()
        logits = session.eval(ids[:-1], all_logits=True)[len(p["prompt_ids"]) - 1 :]
        checked = 0
        for j, (tok, lp1, _, lp2) in enumerate(p["teacher_forced_top2"]):
            if lp1 - lp2 >= 0.25:
                assert int(logits[j].argmax()) == tok, (p["prompt"], j)
                checked += 1
        assert checked >= 30


def test_greedy_generation_from_the_api(any_llm, reference):
    llm = any_llm
    p = reference["prompts"][0]
    text = "".join(llm.generate(p["prompt"], n_predict=8, temp=0.0))
    assert text == llm.detokenize(p["greedy_48_ids"][:8])


def test_perplexity_matches_llama_cpp(any_llm):
    from localllm.eval.perplexity import perplexity

    llm = any_llm

    ref = json.loads((REFERENCE_DIR / "perplexity-gpl3-ctx512.json").read_text())
    text = (REFERENCE_DIR.parent / ref["text"]).read_text()
    res = perplexity(llm, text, n_ctx=ref["n_ctx"])
    assert res.n_chunks == ref["n_chunks"] and res.n_scored == ref["scored"]
    assert abs(res.ppl / ref["ppl"] - 1) < 0.01, res.ppl
