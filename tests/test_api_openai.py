"""The OpenAI-shaped Python API (``LLM.create_chat_completion`` / ``create_completion``), the
prefix cache and its files (``Session.save``/``load``, ``run --prompt-cache``), JSON
completion within the token budget, and tool-call parsing. Tiny random models: content
does not matter here; shapes are checked with the ``openai`` package's own types."""

from __future__ import annotations

import json
import threading

import jsonschema
import pytest
import torch
from cli_helpers import assert_one_line_error, run_cli
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from tiny_model import write_tiny_gguf

from localllm import LLM
from localllm.chat.template import select_template
from localllm.chat.tools import (
    fallback_messages,
    forced_tool_schema,
    parse_tool_calls,
    template_knows_tools,
    template_messages,
)
from localllm.errors import LocalLLMError, ParameterError
from localllm.grammar.budget import shortest_completion, strict_schema
from localllm.grammar.constraint import GrammarConstraint

HI = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("api")
    return (write_tiny_gguf(d / "a.gguf", context_length=512),
            write_tiny_gguf(d / "b.gguf", context_length=512, seed=1))


@pytest.fixture(scope="module")
def tiny(paths):
    return LLM(paths[0], device="cpu", ctx_size=512)


# ---- shapes --------------------------------------------------------------------------------------
def test_chat_completion_is_openai_shaped(tiny):
    r = tiny.create_chat_completion(HI, max_tokens=5, temperature=0, logprobs=True,
                                    top_logprobs=3)
    c = ChatCompletion.model_validate(r)
    assert c.choices[0].finish_reason == "length"
    assert c.usage.completion_tokens == 5 and c.usage.total_tokens == c.usage.prompt_tokens + 5
    content = c.choices[0].logprobs.content
    assert len(content) == 5 and all(len(t.top_logprobs) == 3 for t in content)
    assert "".join(t.token for t in content) == c.choices[0].message.content
    assert all(t.logprob <= 0 for t in content)


def test_streams_match_whole_replies(tiny):
    whole = tiny.create_chat_completion(HI, max_tokens=6, temperature=0)
    chunks = list(tiny.create_chat_completion(HI, max_tokens=6, temperature=0, stream=True,
                                              stream_options={"include_usage": True}))
    for ch in chunks:
        ChatCompletionChunk.model_validate(ch)
    text = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    done = tiny.create_completion("the", max_tokens=6, temperature=0)
    Completion.model_validate(done)
    parts = list(tiny.create_completion("the", max_tokens=6, temperature=0, stream=True))
    Completion.model_validate(parts[-1])  # OpenAI's type allows no null finish_reason
    assert all(p["choices"][0]["finish_reason"] is None for p in parts[:-1])
    assert "".join(p["choices"][0]["text"] for p in parts) == done["choices"][0]["text"]
    assert parts[-1]["choices"][0]["finish_reason"] == "length"


def test_completion_echo_and_logprobs(tiny):
    r = tiny.create_completion("the", max_tokens=3, temperature=0, echo=True, logprobs=2)
    choice = Completion.model_validate(r).choices[0]
    assert choice.text.startswith("the")
    lp = choice.logprobs
    assert lp.text_offset[0] == len("the") and len(lp.tokens) == 3
    assert all(len(top) <= 2 for top in lp.top_logprobs)


@pytest.mark.parametrize(("kwargs", "fragment"), [
    ({"frobnicate": 1}, "'frobnicate'"),
    ({"max_tokens": 2, "top_p": 0}, "top_p"),
    ({"max_tokens": 2, "logit_bias": {"x": 1}}, "logit_bias"),
    ({"max_tokens": 2, "n": 2}, "n: must be 1"),
    ({"max_tokens": 2, "response_format": {"type": "xml"}}, "response_format"),
    ({"max_tokens": 2, "stop": [1]}, "stop"),
])
def test_bad_keywords_raise_parameter_error(tiny, kwargs, fragment):
    with pytest.raises(ParameterError, match=fragment.replace("(", r"\(")):
        tiny.create_completion("the", **kwargs)


@pytest.mark.parametrize("messages", [[], "hi", [{"role": "robot", "content": "x"}],
                                      [{"role": "user", "content": 3}]])
def test_bad_messages_raise_parameter_error(tiny, messages):
    with pytest.raises(ParameterError, match="messages"):
        tiny.create_chat_completion(messages, max_tokens=1)


def test_sampler_params_by_llama_names_change_the_output(tiny):
    base = tiny.create_completion("the", max_tokens=4, temperature=0)["choices"][0]["text"]
    first = tiny.tokenize(base, add_bos=False)[0]
    biased = tiny.create_completion("the", max_tokens=4, temperature=0,
                                    logit_bias={str(first): -100.0})["choices"][0]["text"]
    assert tiny.tokenize(biased, add_bos=False)[0] != first
    r = tiny.create_completion("the", max_tokens=4, temperature=0, repeat_penalty=1.3,
                               typical_p=0.9, dry_multiplier=0.5, mirostat_mode=0)
    assert r["choices"][0]["finish_reason"] == "length"


def test_stop_string_and_finish_reason(tiny):
    text = tiny.create_completion("the and", max_tokens=10, temperature=0)["choices"][0]["text"]
    stop = text[3:5]
    r = tiny.create_completion("the and", max_tokens=10, temperature=0, stop=stop)
    assert r["choices"][0]["text"] == text[: text.index(stop)]
    assert r["choices"][0]["finish_reason"] == "stop"


# ---- prefix cache --------------------------------------------------------------------------------
def test_consecutive_calls_reuse_the_common_prefix(tiny):
    prefix = "the and of the is " * 6
    tiny.create_completion(prefix + "a", max_tokens=2, temperature=0)
    r = tiny.create_completion(prefix + "i", max_tokens=2, temperature=0)
    n_prefix = len(tiny.tokenize(prefix))
    cached = r["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert n_prefix - 2 <= cached < r["usage"]["prompt_tokens"]
    fresh = tiny.create_completion(prefix + "i", max_tokens=2, temperature=0, cache_prompt=False)
    assert fresh["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert fresh["choices"][0]["text"] == r["choices"][0]["text"]


def test_one_generation_at_a_time(tiny):
    stream = tiny.create_completion("the", max_tokens=3, stream=True)
    next(stream)
    with pytest.raises(LocalLLMError, match="still open"):
        tiny.create_completion("the", max_tokens=1)
    stream.close()  # releases the lock
    results = []

    def call():
        results.append(tiny.create_completion("the", max_tokens=3, temperature=0))

    threads = [threading.Thread(target=call) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == 3 and len({r["choices"][0]["text"] for r in results}) == 1


def test_session_save_load_round_trip(tiny, tmp_path):
    ids = tiny.tokenize("the and of the is a the " * 40)  # past the sliding window's ring
    s = tiny.session()
    s.eval(ids)
    s.save(tmp_path / "cache.st")
    expected = s.eval([20])
    fresh = tiny.session()
    fresh.load(tmp_path / "cache.st")
    assert fresh.tokens == ids
    assert torch.equal(fresh.eval([20]), expected)


def test_session_load_refuses_other_models_and_geometry(tiny, paths, tmp_path):
    s = tiny.session()
    s.eval(tiny.tokenize("the and"))
    s.save(tmp_path / "a.st")
    other = LLM(paths[1], device="cpu", ctx_size=512)
    with pytest.raises(LocalLLMError, match="another model"):
        other.session().load(tmp_path / "a.st")
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(tmp_path / "a.st"), framework="pt") as f:
        meta = f.metadata()
    save_file(load_file(str(tmp_path / "a.st")), str(tmp_path / "g.st"),
              metadata={**meta, "caches": meta["caches"].replace("x", "x7", 1)})
    with pytest.raises(LocalLLMError, match="geometry"):
        tiny.session().load(tmp_path / "g.st")
    (tmp_path / "junk.st").write_bytes(b"\x00" * 100)
    with pytest.raises(LocalLLMError, match="cannot read"):
        tiny.session().load(tmp_path / "junk.st")
    s.eval(tiny.tokenize("the and of the is a", add_bos=False))
    s.save(tmp_path / "long.st")
    with pytest.raises(LocalLLMError, match="do not fit"):
        tiny.session(ctx_size=s.n_past - 1).load(tmp_path / "long.st")


def test_run_prompt_cache(paths, tmp_path, monkeypatch, capsys):
    cache = tmp_path / "p.cache"
    prompt = "the and of the is a"
    args = ("run", str(paths[0]), prompt, "-n", "3", "--temp", "0", "--device", "cpu",
            "--prompt-cache", str(cache), "-v")
    code, out1, err = run_cli(monkeypatch, capsys, *args)
    assert code == 0 and cache.is_file() and "prompt cache: 0 of" in err
    code, out2, err = run_cli(monkeypatch, capsys, *args)
    n = len(LLM(paths[0], device="cpu").tokenize(prompt))
    assert code == 0 and f"prompt cache: {n - 1} of {n}" in err and out1 == out2
    code, _, err = run_cli(monkeypatch, capsys, "run", str(paths[1]), prompt, "-n", "1",
                           "--device", "cpu", "--prompt-cache", str(cache))
    assert_one_line_error(code, err, "another model")


# ---- structured output ---------------------------------------------------------------------------
ORDER = {"type": "object", "properties": {
    "id": {"type": "integer"},
    "items": {"type": "array", "items": {"type": "object", "properties": {
        "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}},
        "required": ["sku", "qty"]}},
    "paid": {"type": "boolean"},
    "note": {"type": "string", "enum": ["rush", "standard"]}},
    "required": ["id", "items", "paid"]}
SAMPLES = [
    (ORDER, {"id": -12, "items": [{"sku": "a\"b\\c\u00e9", "qty": 3}, {"sku": "", "qty": 10}],
             "paid": True, "note": "rush"}),
    (ORDER, {"id": 0, "items": [], "paid": False}),
    ({"type": "array", "items": {"type": "number"}, "minItems": 2}, [1.5e3, -0.25, 7]),
    ({}, {"a": [1, {"b": None}], "c": "x"}),
    ({"type": "object", "properties": {"t": {"type": "array", "prefixItems": [
        {"type": "string"}, {"type": "integer", "minimum": 5}], "minItems": 2}},
      "required": ["t"]}, {"t": ["q", 9]}),
]


@pytest.mark.parametrize(("schema", "value"), SAMPLES)
def test_shortest_completion_of_every_prefix_validates(schema, value, tiny):
    schema = strict_schema(schema) if schema else schema
    text = json.dumps(value, ensure_ascii=False, separators=(", ", ": "))
    constraint = GrammarConstraint.from_json_schema(schema, tiny.tokenizer)
    for i in range(len(text) + 1):
        completion = shortest_completion(schema, text[:i])
        assert completion is not None, text[:i]
        whole = text[:i] + completion
        jsonschema.validate(json.loads(whole), schema)
        assert constraint.matches(whole), whole  # the grammar accepts it too
    assert shortest_completion(schema, text) == ""


def test_strict_schema_closes_objects():
    s = strict_schema(ORDER)
    assert s["additionalProperties"] is False
    assert s["properties"]["items"]["items"]["additionalProperties"] is False
    assert "additionalProperties" not in ORDER


@pytest.mark.parametrize("max_tokens", [40, 90])
def test_json_schema_completes_within_max_tokens(tiny, max_tokens):
    for seed in (1, 2):
        r = tiny.create_chat_completion(
            HI, max_tokens=max_tokens, seed=seed, temperature=1.5,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "o", "schema": ORDER, "strict": True}})
        jsonschema.validate(json.loads(r["choices"][0]["message"]["content"]), ORDER)
        assert r["usage"]["completion_tokens"] <= max_tokens


def test_run_json_schema_completes_within_n_predict(paths, tmp_path, monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, "run", str(paths[0]), "order:", "-n", "60",
                             "--device", "cpu", "--seed", "3", "--json-schema", json.dumps(ORDER))
    assert code == 0, err
    jsonschema.validate(json.loads(out), ORDER)


# ---- tools ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    '<|python_tag|>{"name": "get_weather", "arguments": {"city": "Paris"}}',
    '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    '```tool_call\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```',
])
def test_parse_tool_call_formats(text):
    content, calls = parse_tool_calls(text, TOOLS)
    assert content is None and len(calls) == 1
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"


@pytest.mark.parametrize("text", ["It is sunny.", '{"name": "other", "arguments": {}}',
                                  "<tool_call>not json</tool_call>"])
def test_text_without_known_calls_stays_content(text):
    assert parse_tool_calls(text, TOOLS) == (text, [])


def test_forced_tool_schema():
    named = forced_tool_schema(TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "x"}}, named)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "nope", "arguments": {"city": "x"}}, named)
    assert forced_tool_schema(TOOLS, "auto") is None
    with pytest.raises(ParameterError, match="'nope'"):
        forced_tool_schema(TOOLS, {"type": "function", "function": {"name": "nope"}})


@pytest.mark.parametrize(("name", "turn"), [
    ("chatml", ("<|im_start|>assistant", "<|im_end|>")),
    ("llama3", ("assistant<|end_header_id|>", "<|eot_id|>")),
    ("mistral", ("[/INST]", "[TOOL_RESULTS]")),
    ("gemma", ("<start_of_turn>model", "<end_of_turn>")),
])
def test_tool_messages_round_trip_through_templates(name, turn):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]
    text = select_template({}, name).render(template_messages(messages), tools=TOOLS)
    assert '"city": "Paris"' in text and "21 degrees" in text and "get_weather" in text
    # The assistant turn the template wrote parses back into the same call.
    start = text.index(turn[0]) + len(turn[0])
    _, calls = parse_tool_calls(text[start: text.index(turn[1], start)], TOOLS)
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"}]


def test_named_tool_choice_in_the_api(tiny):
    r = tiny.create_chat_completion(
        HI, tools=TOOLS, max_tokens=80, tool_choice={"type": "function",
                                                     "function": {"name": "get_weather"}})
    choice = ChatCompletion.model_validate(r).choices[0]
    assert choice.finish_reason == "tool_calls"
    args = json.loads(choice.message.tool_calls[0].function.arguments)
    jsonschema.validate(args, TOOLS[0]["function"]["parameters"])


def test_templates_without_tools_get_the_fallback():
    # A template that knows nothing of tools and insists on alternating user/assistant turns.
    source = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
              "{{ raise_exception('roles must alternate') }}{% endif %}"
              "<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}")
    assert not template_knows_tools(source)
    assert template_knows_tools(select_template({}, "chatml").source)
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = template_messages([
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "21 degrees"}])
    out = fallback_messages(messages, TOOLS)
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.")
    assert "get_weather" in out[0]["content"] and "tool_call" in out[0]["content"]
    text = select_template({}, source).render(out[1:])  # renders: roles alternate
    _, calls = parse_tool_calls(out[2]["content"], TOOLS)
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert "tool_response" in text and "21 degrees" in text


def test_text_parts_become_one_string():
    parts = [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]
    assert template_messages([{"role": "user", "content": parts}]) == [
        {"role": "user", "content": "Hello, world"}]
