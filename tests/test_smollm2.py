"""smollm2-135m-instruct against llama.cpp's recorded outputs (tests/data/smollm2).

The model is not part of the test environment: tests never use the network, so they run
only where it has been pulled (``localllm pull smollm2-135m-instruct``; ``$LOCALLLM_CACHE``
picks the cache) and skip otherwise. Tokenization and the chat template only read the GGUF's
metadata; the model's outputs (next-token KL, teacher-forced greedy, perplexity at ctx 512)
are ``slow``, with the default model's thresholds.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from localllm import hub
from localllm.registry import PROJECT_MODELS, load_registry

DATA = Path(__file__).parent / "data" / "smollm2"
NAME = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def model_path() -> Path:
    source = load_registry([PROJECT_MODELS]).models[NAME].wheel_source
    if hub.state(source) != "pulled":
        pytest.skip(f"{NAME} is not pulled (localllm pull {NAME}) in {hub.cache_dir()}")
    return hub.cached_path(source)


@pytest.fixture(scope="module")
def reference() -> dict:
    return json.loads((DATA / "reference.json").read_text())


@pytest.fixture(scope="module")
def metadata(model_path) -> dict:
    from localllm.gguf.file import open_gguf

    return open_gguf(model_path).metadata


@pytest.fixture(scope="module")
def tokenizer(metadata):
    from localllm.tokenizer import Tokenizer

    return Tokenizer(metadata)


@pytest.fixture(scope="module")
def smollm(model_path):
    from localllm import LLM

    return LLM(str(model_path), device="cpu", ctx_size=2048)


def test_tokenizer_matches_llamacpp(tokenizer, reference):
    assert tokenizer.pre == "smollm"
    assert tokenizer.add_bos == reference["add_bos"]
    assert tokenizer.eog_ids == set(reference["eog"])
    for case in reference["tokenize"]:
        text = case["text"]
        assert tokenizer.encode(text, add_bos=False) == case["plain"], text
        assert tokenizer.encode(text) == case["add_special"], text
        assert tokenizer.encode(text, special=True) == case["parse_special"], text


def test_metadata_chat_template_renders_as_llamacpp_jinja(metadata, tokenizer, reference):
    from localllm.chat.template import select_template

    template = select_template(metadata)
    assert template.name == "tokenizer.chat_template"
    for case in reference["chat"]:
        assert template.render(case["messages"]) == case["jinja"]
        assert template.encode(tokenizer, case["messages"]) == case["ids"]


def test_chat_ends_at_the_end_of_turn_token(tokenizer):
    im_end = tokenizer.encode("<|im_end|>", add_bos=False, special=True)
    assert len(im_end) == 1 and im_end[0] in tokenizer.eog_ids


@pytest.mark.slow
def test_next_token_distribution_matches_llama_cpp(smollm, reference):
    ref_logprobs = torch.from_numpy(np.load(DATA / "last_logprobs.npy").astype(np.float64))
    kls = []
    for i, p in enumerate(reference["prompts"]):
        ours = torch.log_softmax(smollm.logits(p["prompt_ids"]).double().cpu(), -1)
        ref = ref_logprobs[i]
        margin = p["top20_logprobs"][0] - p["top20_logprobs"][1]
        if margin >= 0.25:  # a near-tie may go either way under float16 weights
            assert int(ours.argmax()) == p["top20_ids"][0], p["prompt"]
        kls.append(float((ref.exp() * (ref - ours)).sum()))
    assert np.mean(kls) <= 0.02, kls


@pytest.mark.slow
def test_teacher_forced_greedy_agrees_where_llama_cpp_is_decisive(smollm, reference):
    checked = 0
    for p in reference["prompts"]:
        ids = p["prompt_ids"] + p["greedy_48_ids"]
        session = smollm.session()
        logits = session.eval(ids[:-1], all_logits=True)[len(p["prompt_ids"]) - 1:]
        for j, (tok, lp1, _, lp2) in enumerate(p["teacher_forced_top2"]):
            if lp1 - lp2 >= 0.25:
                assert int(logits[j].argmax()) == tok, (p["prompt"], j)
                checked += 1
    assert checked >= 100


@pytest.mark.slow
def test_perplexity_matches_llama_cpp(smollm):
    from localllm.eval.perplexity import perplexity

    ref = json.loads((DATA / "perplexity-gpl3-ctx512.json").read_text())
    text = (Path(__file__).parent / "data" / "reference" / ref["text"]).read_text()
    res = perplexity(smollm, text, n_ctx=ref["n_ctx"])
    print(f"perplexity {res.ppl:.4f} (llama.cpp {ref['ppl']:.4f})")
    assert res.n_chunks == ref["n_chunks"] and res.n_scored == ref["scored"]
    assert abs(res.ppl / ref["ppl"] - 1) < 0.01, res.ppl


@pytest.mark.slow
def test_repl_two_turns_stop_at_end_of_turn_and_reuse_the_cache(smollm):
    """The chat REPL on a model trained to chat: each reply ends at <|im_end|> (well before
    the n_predict cap), names the right city, and the second turn reuses the first's KV."""
    import io

    from rich.console import Console

    from localllm.cli.repl import ChatREPL

    repl = ChatREPL(smollm, console=Console(file=io.StringIO(), width=120, color_system=None),
                    params=smollm.sampling_params(temp=0.0), n_predict=200)
    assert repl.template.name == "tokenizer.chat_template"
    repl.handle_line("What is the capital of France? Answer in one word.")
    first = repl.messages[-1]
    assert first["role"] == "assistant" and "Paris" in first["content"]
    first_prompt = repl.stats.prompt_evaluated
    replied = len(smollm.tokenize(first["content"], add_bos=False))
    assert replied < 200  # stopped by the end-of-turn token, not the cap
    repl.handle_line("And the capital of Italy?")
    assert "Rome" in repl.messages[-1]["content"]
    assert repl.stats.prompt_reused >= first_prompt
