"""The core of the Python API (issue #25 item 4): one generation path, ``LLM.prepare`` ->
``GenerationRequest`` -> ``LLM.stream`` -> ``Generation`` under the LLM's lock, with the
generation's own timings; the OpenAI-shaped layer and the server on top of it, using public
names only. Tiny random models: the text does not matter here."""

from __future__ import annotations

import ast
import json
import threading
import time
from pathlib import Path

import jsonschema
import pytest
from tiny_model import write_tiny_gguf

from localllm import LLM
from localllm.api import Generation, GenerationRequest, GenerationTimeout
from localllm.errors import LocalLLMError, ParameterError

REPO = Path(__file__).resolve().parents[1]
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_tiny_gguf(tmp_path_factory.mktemp("core") / "tiny.gguf", context_length=1024)
    return LLM(path, device="cpu", ctx_size=1024)


def test_prepare_once_stream_once(tiny):
    request = tiny.prepare("the and", n_predict=4, temp=0.0, stop="zzz")
    assert isinstance(request, GenerationRequest)
    assert request.ids == tiny.tokenize("the and") and request.stop == ("zzz",)
    gen = tiny.stream(request)
    assert isinstance(gen, Generation) and gen.sampler is None  # nothing ran yet
    steps = list(gen)
    assert len(steps) == 4 and gen.finish_reason == "length" and gen.sampler is not None
    assert [s.token for s in steps] == [s.token for s in tiny.stream("the and", n_predict=4,
                                                                       temp=0.0)]
    with pytest.raises(ParameterError, match="already run"):
        tiny.stream(request)
    with pytest.raises(ParameterError, match="no other arguments"):
        tiny.stream(tiny.prepare("the"), n_predict=3)


def test_prepare_checks_everything_before_running(tiny):
    for kwargs, message in [({"n_predict": -7}, "n_predict"), ({"time_limit": 0}, "time_limit"),
                            ({"cancel": True}, "cancel"), ({"top_k": 2**40}, "32-bit"),
                            ({"grammar": "root ::= ("}, "grammar")]:
        with pytest.raises(LocalLLMError, match=message):
            tiny.prepare("the", **kwargs)
    with pytest.raises(LocalLLMError, match="context holds 1024"):
        tiny.prepare([10] * 1100)


def test_each_generation_has_its_own_timings(tiny):
    assert not hasattr(tiny, "last_timings")  # no shared figures to read afterwards
    prompt = "the and of the is " * 5
    first = tiny.stream(prompt, n_predict=3, temp=0.0, cache_prompt=False)
    second = tiny.stream(prompt + "a", n_predict=5, temp=0.0, cache_prompt=True)
    list(first)
    list(second)
    assert first.timings.generated_tokens == 3 and second.timings.generated_tokens == 5
    assert first.timings.reused_tokens == 0
    assert second.timings.reused_tokens >= len(tiny.tokenize(prompt)) - 2
    assert second.timings.prompt_tokens + second.timings.reused_tokens == \
        len(tiny.tokenize(prompt + "a"))


def test_openai_results_carry_their_own_usage_and_timings_across_threads(tiny):
    results: dict[int, dict] = {}

    def call(i: int) -> None:
        results[i] = tiny.create_completion("the " * (i + 1), max_tokens=2 + i, temperature=0,
                                            ignore_eos=True, cache_prompt=False)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i, r in results.items():
        t, usage = r["timings"], r["usage"]
        assert t["predicted_n"] == usage["completion_tokens"] == 2 + i
        assert t["prompt_n"] + t["cache_n"] == usage["prompt_tokens"]
    chunks = list(tiny.create_chat_completion(HI, max_tokens=3, stream=True, ignore_eos=True))
    assert chunks[-1]["timings"]["predicted_n"] == chunks[-1]["usage"]["completion_tokens"] == 3


def test_cancel_from_another_thread(tiny):
    gen = tiny.stream("the", n_predict=-1, ignore_eos=True)
    got = []
    worker = threading.Thread(target=lambda: got.extend(gen))
    worker.start()
    while len(got) < 3:
        time.sleep(0.01)
    gen.cancel()
    worker.join(60)
    assert not worker.is_alive() and gen.finish_reason == "cancelled"
    assert len(got) < tiny.ctx_size - 2
    assert len(list(tiny.stream("the", n_predict=2))) == 2  # the LLM is free


def test_time_limit(tiny):
    gen = tiny.stream("the", n_predict=-1, ignore_eos=True, time_limit=0.3)
    with pytest.raises(GenerationTimeout, match="time limit"):
        for _ in gen:
            time.sleep(0.05)
    assert len(list(tiny.stream("the", n_predict=2))) == 2


def test_closing_a_generation_releases_the_llm(tiny):
    with tiny.stream("the", n_predict=50) as gen:
        next(gen)
        with pytest.raises(LocalLLMError, match="still open in this thread"):
            next(tiny.stream("the", n_predict=1))
    assert len(list(tiny.stream("the", n_predict=1))) == 1
    next(iter(tiny.generate("the", n_predict=50)))  # abandoned generator: closed when dropped
    assert len(list(tiny.stream("the", n_predict=1))) == 1


def test_json_budget_is_set_up_once_for_every_front_end(tiny):
    schema = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}},
              "required": ["a", "b"]}
    text = "".join(tiny.generate("x", json_schema=schema, n_predict=25, temp=1.5, seed=3))
    jsonschema.validate(json.loads(text), schema)
    r = tiny.create_chat_completion(HI, max_tokens=25, temperature=1.5, seed=3, response_format={
        "type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    jsonschema.validate(json.loads(r["choices"][0]["message"]["content"]), schema)


def test_positional_and_keyword_prompt(tiny):
    a = tiny.create_completion("the", max_tokens=2, temperature=0)["choices"][0]["text"]
    b = tiny.create_completion(prompt="the", max_tokens=2, temperature=0)["choices"][0]["text"]
    assert a == b
    with pytest.raises(ParameterError, match="given twice"):
        tiny.create_completion("the", prompt="the")
    with pytest.raises(ParameterError, match="prompt: required"):
        tiny.create_completion(max_tokens=2)


FRONT_ENDS = ["localllm/server/app.py", "localllm/cli/repl.py", "localllm/cli/serve.py",
              "localllm/cli/chat.py", "localllm/chat/conversation.py",
              "localllm/api/completions.py"]


@pytest.mark.parametrize("path", FRONT_ENDS)
def test_front_ends_use_public_names_of_the_llm(path):
    """The server, the REPL and the OpenAI layer reach the LLM through public methods only
    (they used to call ``llm._shared_session()`` and read ``llm.last_timings``)."""
    tree = ast.parse((REPO / path).read_text())
    private = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                and not node.attr.startswith("__"):
            owner = node.value
            name = owner.id if isinstance(owner, ast.Name) else (
                owner.attr if isinstance(owner, ast.Attribute) else "")
            if name == "llm":
                private.append(f"line {node.lineno}: llm.{node.attr}")
    assert not private, private


def test_a_drafter_goes_through_the_request(tiny):
    """Speculative decoding (runtime/speculative.py) is one more field of the request: the
    same tokens, some of them drafted."""
    from localllm.runtime.speculative import NgramDrafter

    prompt = "the and of the and of the"
    plain = [s.token for s in tiny.stream(prompt, n_predict=30, temp=0.0)]
    gen = tiny.stream(prompt, n_predict=30, temp=0.0, drafter=NgramDrafter())
    assert [s.token for s in gen] == plain
    assert gen.timings.extra["draft_tokens"] > 0
