"""JSON within the token budget, for every schema (issue 32), and the key and number rules.

Every output is checked with independent parsers: ``json`` (duplicate keys and NaN/Infinity
refused by hooks) and ``jsonschema``; completions are also checked with llguidance. Fast
tests drive the constraint with random logits over a byte-level tokenizer (the most
adversarial "model": any byte at any time) and a tiny random model through the CLI, the
Python API, forced tool calls and the server; the ``slow`` property test generates with the
default model.
"""

from __future__ import annotations

import json
import random

import jsonschema
import openai
import pytest
import torch
from cli_helpers import run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from json_schemas import check_output, random_schema
from test_grammar import ByteTokenizer
from test_server import Server
from tiny_model import write_tiny_gguf

from localllm import LLM
from localllm.chat.tools import forced_tool_schema
from localllm.errors import GrammarError
from localllm.grammar.budget import BudgetedConstraint, shortest_completion
from localllm.grammar.constraint import GrammarConstraint
from localllm.grammar.cursor import OK, JsonCursor
from localllm.grammar.schema import Schemas, finish_number, numbers_in_range

# The order-like schema of the issue: no additionalProperties, so the model may add any.
ORDER = {"type": "object", "properties": {
    "order_id": {"type": "integer"},
    "items": {"type": "array", "items": {"type": "object", "properties": {
        "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}},
        "required": ["sku", "qty"]}},
    "paid": {"type": "boolean"}},
    "required": ["order_id", "items", "paid"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"},
                                         "days": {"type": "integer", "minimum": 1}},
        "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "convert", "parameters": {
        "type": "object", "properties": {"amount": {"type": "number"}},
        "required": ["amount"]}}},
]
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tok() -> ByteTokenizer:
    return ByteTokenizer()


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("budget") / "tiny.gguf", context_length=2048)


@pytest.fixture(scope="module")
def tiny(tiny_path):
    return LLM(tiny_path, device="cpu", ctx_size=2048)


def generate(tok, schema, budget: int, seed: int, temp: float = 1.5) -> tuple[bytes, object]:
    """Sample with random logits through the sampler chain's protocol (fast path: draw,
    ``is_allowed``; else ``apply`` and draw again), as llama.cpp's sampler does."""
    c = BudgetedConstraint(GrammarConstraint.from_json_schema(schema, tok), schema, budget)
    g = torch.Generator().manual_seed(seed)
    out = b""
    for _ in range(budget):
        logits = torch.randn(tok.n_vocab, generator=g) * 3
        t = int(torch.multinomial(torch.softmax(logits / temp, -1), 1, generator=g))
        if not c.is_allowed(t):
            c.apply(logits)
            t = int(torch.multinomial(torch.softmax(logits / temp, -1), 1, generator=g))
        c.accept(t)
        out += tok.token_bytes(t)
        if c.is_finished():
            break
    return out, c


def tokens_of(llm):
    return lambda text: llm.tokenize(text, add_bos=False)


def smallest_tokens(schema, encode) -> int:
    """Tokens of the smallest value, itself checked by jsonschema first (the oracle)."""
    value = Schemas(schema).minimal(schema)
    assert check_output(value.decode(), schema) is None, value
    return len(encode(value.decode()))


# ---- the property, on random logits ----------------------------------------------------------
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(0, 2**32 - 1), extra=st.integers(0, 200), seed=st.integers(0, 2**16),
       temp=st.sampled_from([0.5, 1.0, 2.0]))
def test_random_schemas_finish_within_any_budget(tok, n, extra, seed, temp):
    schema = random_schema(random.Random(n))
    budget = smallest_tokens(schema, tok.encode) + extra
    out, _ = generate(tok, schema, budget, seed, temp)
    assert check_output(out.decode("utf-8", errors="replace"), schema) is None, (out, schema)


def test_budget_below_the_smallest_value_ends_short(tok):
    # The steering cannot make room that is not there: the output is cut, not invalid JSON
    # passed off as complete.
    small = smallest_tokens(ORDER, tok.encode)
    out, c = generate(tok, ORDER, small - 3, 0)
    assert not c.is_accepting() and len(out) <= small - 3


@pytest.mark.parametrize("seed", range(6))
def test_the_issue_schema_at_its_smallest_budget(tok, seed):
    budget = smallest_tokens(ORDER, tok.encode)
    out, _ = generate(tok, ORDER, budget, seed)
    assert check_output(out.decode(), ORDER) is None, out


# ---- completions from the parse state --------------------------------------------------------
CASES = [
    (ORDER, {"order_id": -12, "items": [{"sku": "a\"b\\c\u00e9\n", "qty": 3, "x": [1, None]}],
             "paid": True, "used": {"k": [2.5, "v"]}}),
    ({"type": "object", "properties": {"a": {"type": "integer", "minimum": 50, "maximum": 100},
                                       "b": {"type": "number", "minimum": 0.5,
                                             "maximum": 0.7},
                                       "c": {"enum": ["rush", "standard", 10, None]}},
      "required": ["a", "c"], "additionalProperties": False}, {"a": 77, "b": 0.65, "c": 10}),
    ({"type": "array", "items": {"type": "string", "minLength": 3}, "minItems": 2},
     ["abcd", "\u4e2d\u6587\u5b57"]),
    ({"anyOf": [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                  "arguments": t["function"]["parameters"]},
                 "required": ["name", "arguments"], "additionalProperties": False}
                for t in TOOLS]}, {"name": "convert", "arguments": {"amount": -1.25e2}}),
    ({"type": "object", "properties": {"when": {"type": "string", "format": "date-time"}},
      "required": ["when"]}, {"when": "2024-05-06T07:08:09Z"}),
    ({}, {"a": [1, {"b": None}], "c": "x", "d": True}),
]


@pytest.mark.parametrize(("schema", "value"), CASES, ids=[
    "order-with-extras", "bounds-and-enum", "min-lengths-utf8", "two-tools", "format", "any"])
def test_every_prefix_completes_to_a_valid_value(tok, schema, value):
    text = json.dumps(value, ensure_ascii=False, separators=(", ", ": ")).encode()
    grammar = GrammarConstraint.from_json_schema(schema, tok)
    assert grammar.matches(text)
    for i in range(len(text) + 1):  # every byte boundary, inside UTF-8 sequences too
        cursor = JsonCursor(Schemas(schema))
        assert cursor.feed(text[:i]) == OK, text[:i]
        done = [c for c in cursor.completions() if grammar.matches(text[:i] + c)]
        assert done, text[:i]
        assert check_output((text[:i] + done[0]).decode(), schema) is None
    assert shortest_completion(schema, text) == ""


def test_shortest_completion_example():
    schema = {"type": "object", "properties": {"a": {"type": "string"},
                                               "b": {"type": "integer"}}, "required": ["a", "b"]}
    assert shortest_completion(schema, '{"a": "xy') == '", "b": 0}'
    # A declared name being written is finished; an extra one keeps its prefix as its name.
    assert shortest_completion(ORDER, '{"order_id": 1, "it') == 'ems": [], "paid": false}'
    assert shortest_completion(ORDER, '{"order_id": 1, "items": [], "paid": true, "pre') \
        == '": 0}'
    # An extra name that would repeat a key gets one more letter.
    assert shortest_completion(ORDER, '{"order_id": 1, "items": [], "paid": true, "x": 1, "x') \
        == 'a": 0}'


@settings(max_examples=300, deadline=None)
@given(lo=st.one_of(st.none(), st.integers(-300, 300), st.decimals(-50, 50, places=2)),
       width=st.one_of(st.none(), st.decimals("0.01", 500, places=2)),
       integer=st.booleans(), xlo=st.booleans(), xhi=st.booleans(),
       prefix=st.text("-0123456789.", max_size=5))
def test_numbers_within_bounds(tok, lo, width, integer, xlo, xhi, prefix):
    # Bounds as a schema writes them: decimal literals.
    s = {"type": "integer" if integer else "number"}
    if lo is not None:
        s["exclusiveMinimum" if xlo else "minimum"] = float(lo) if not isinstance(lo, int) else lo
    if width is not None:
        s["exclusiveMaximum" if xhi else "maximum"] = float((lo or 0) + width)
    try:
        grammar = GrammarConstraint.from_json_schema(s, tok)
    except GrammarError:  # bounds llguidance cannot express (an empty integer range)
        return
    options = numbers_in_range(s, integer=integer)
    taken = [o for o in options if grammar.matches(o)]
    assert taken or (integer and not options), (s, options)
    assert all(check_output(o, s) is None for o in taken), (s, taken)
    assert Schemas(s, accepts=lambda _, text: grammar.matches(text)).minimal(s) == (
        taken[0].encode() if taken else None)
    if prefix and grammar.is_prefix(prefix):
        tails = finish_number(prefix, s, integer=integer, n=6)
        assert any(grammar.matches(prefix + t) for t in tails), (prefix, tails)


# ---- the key and number rules ----------------------------------------------------------------
def allowed(tok, schema, text: str, nxt: str, budget: int = 1000) -> bool:
    """Whether the constraint allows the bytes ``nxt`` after ``text`` (one byte token each)."""
    c = BudgetedConstraint(GrammarConstraint.from_json_schema(schema, tok), schema, budget)
    for b in text.encode():
        t = tok.byte_id(b)
        assert c.is_allowed(t), text
        c.accept(t)
    for b in nxt.encode():
        t = tok.byte_id(b)
        masked = torch.zeros(tok.n_vocab)
        c.apply(masked)
        if not c.is_allowed(t):
            assert masked[t] == float("-inf")  # apply and is_allowed agree
            return False
        assert masked[t] != float("-inf")
        c.accept(t)
    return True


@pytest.mark.parametrize(("schema", "text", "nxt", "ok"), [
    (ORDER, '{"order_id": 1, "items": [], "paid": true, "x": 1, ', '"x"', False),
    (ORDER, '{"order_id": 1, "items": [], "paid": true, "x": 1, ', '"xy"', True),
    (ORDER, '{"order_id": 1, "items": [], "paid": true, ', '""', False),
    ({}, '[{"a": 1}, {', '"a": 2, "a"', False),
    ({}, '{"a": {"a": 1}, "b": {', '"a"', True),  # the same key in another object
    ({"type": "object", "properties": {"": {"type": "integer"}}}, "{", '""', True),
    (ORDER, '{"order_id": 1, "items": [], "paid": true, ', '"\\u006frder_id"', False),
    (ORDER, '{"order_id": 1, "items": [], "paid": true, "\\u0078y": 1, ', '"xy"', False),
    ({}, "[1.5e30", "8", True),
    ({}, "[1.5e30", "9", False),  # 1.5e309 parses to inf
    ({"type": "number"}, "9" * 400, "0", True),  # an integer: exact in any JSON parser
    ({"type": "number"}, "9" * 400, ".", False),
])
def test_key_and_number_rules(tok, schema, text, nxt, ok):
    assert allowed(tok, schema, text, nxt) is ok


def test_rules_hold_without_budget_pressure_on_random_logits(tok):
    # Any JSON: random logits write many keys; none may repeat, and no number overflows.
    for seed in range(8):
        out, _ = generate(tok, {"type": "object"}, 150, seed, temp=3.0)
        assert check_output(out.decode("utf-8", errors="replace"), {"type": "object"}) is None


# ---- every path: CLI, API (strict and not), forced tools, server -----------------------------
@pytest.mark.parametrize("flag", ["--json-schema", "--json"])
def test_cli_finishes_within_n(tiny_path, tmp_path, monkeypatch, capsys, flag):
    schema = tmp_path / "order.json"
    schema.write_text(json.dumps(ORDER))
    small = smallest_tokens(ORDER, tokens_of(LLM(tiny_path, device="cpu")))
    for seed in range(4):
        args = [flag, str(schema)] if flag == "--json-schema" else [flag]
        code, out, err = run_cli(monkeypatch, capsys, "run", str(tiny_path), "order:",
                                 "-n", str(small + seed), "--seed", str(seed), "--temp", "1.5",
                                 "--device", "cpu", *args)
        assert code == 0, err
        assert check_output(out, ORDER if flag == "--json-schema" else {}) is None, out


@pytest.mark.parametrize("strict", [False, True])
def test_api_response_format_within_max_tokens(tiny, strict):
    small = smallest_tokens(ORDER, tokens_of(tiny))
    fmt = {"type": "json_schema", "json_schema": {"name": "o", "schema": ORDER, "strict": strict}}
    for seed in range(4):
        r = tiny.create_completion("order:", max_tokens=small + 2 * seed, seed=seed,
                                   temperature=1.5, response_format=fmt)
        c = r["choices"][0]
        assert c["finish_reason"] == "stop" and check_output(c["text"], ORDER) is None, c
        r = tiny.create_chat_completion(HI, max_tokens=small + seed, seed=seed,
                                        temperature=1.5, response_format=fmt)
        c = r["choices"][0]
        assert c["finish_reason"] == "stop", c
        assert check_output(c["message"]["content"], ORDER) is None


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_weather"}}])
def test_forced_tool_call_within_max_tokens(tiny, choice):
    small = smallest_tokens(forced_tool_schema(TOOLS, choice), tokens_of(tiny))
    for seed in range(3):
        r = tiny.create_chat_completion(HI, tools=TOOLS, tool_choice=choice,
                                        max_tokens=small + seed, seed=seed, temperature=1.5)
        c = r["choices"][0]
        assert c["finish_reason"] == "tool_calls", c
        call = c["message"]["tool_calls"][0]["function"]
        params = next(t["function"]["parameters"] for t in TOOLS
                      if t["function"]["name"] == call["name"])
        assert check_output(call["arguments"], params) is None, call


def test_forced_numbers_stay_finite(tiny):
    # Logit biases pushing digits and exponents: a number like 1e999 would parse to
    # Infinity and serialize as the non-JSON token Infinity.
    # (The tiny model's own logits differ by tens: the biases are larger, within OpenAI's
    # range of +-100.)
    vocab = tiny.tokenizer
    bias = {t: 40.0 + 60.0 * (b"e" in vocab.token_bytes(t)) for t in range(vocab.n_vocab)
            if vocab.token_bytes(t) and set(vocab.token_bytes(t)) <= set(b"9e")}
    for seed in range(2):
        r = tiny.create_chat_completion(
            HI, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "convert"}},
            max_tokens=300, seed=seed, temperature=1.0, logit_bias=bias)
        args = r["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
        assert "e" in args  # the exponent was written, and kept within a float's range
        assert check_output(args, TOOLS[1]["function"]["parameters"]) is None, args


def test_server_within_max_tokens(tiny_path):
    server = Server(tiny_path)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x")
        small = smallest_tokens(ORDER, tokens_of(LLM(tiny_path, device="cpu")))
        fmt = {"type": "json_schema", "json_schema": {"name": "o", "schema": ORDER}}
        for seed in range(2):
            r = client.chat.completions.create(model="tiny", messages=HI, max_tokens=small + seed,
                                               seed=seed, temperature=1.5, response_format=fmt)
            assert r.choices[0].finish_reason == "stop"
            assert check_output(r.choices[0].message.content, ORDER) is None
            r = client.completions.create(model="tiny", prompt="order:", max_tokens=small,
                                          seed=seed, temperature=1.5,
                                          extra_body={"response_format": fmt})
            assert check_output(r.choices[0].text, ORDER) is None
    finally:
        server.stop()


# ---- the default model ------------------------------------------------------------------------
@pytest.mark.slow
@settings(max_examples=3, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(n=st.integers(0, 2**32 - 1), extra=st.integers(0, 40), seed=st.integers(0, 2**16),
       temp=st.sampled_from([0.3, 0.8, 1.0, 1.5]), strict=st.booleans())
def test_default_model_finishes_within_the_budget(llm, n, extra, seed, temp, strict):
    """Issue 32's property on the default model, a few examples (bench/bench_json_budget.py
    runs many, with budgets up to 300 tokens)."""
    schema = random_schema(random.Random(n))
    budget = smallest_tokens(schema, tokens_of(llm)) + extra
    r = llm.create_completion(
        "Produce a realistic example as JSON.", max_tokens=budget, seed=seed,
        temperature=temp,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "x", "schema": schema, "strict": strict}})
    c = r["choices"][0]
    assert c["finish_reason"] == "stop", (c, schema, budget)
    assert r["usage"]["completion_tokens"] <= budget
    assert check_output(c["text"], schema) is None, (c["text"], schema)
    jsonschema.validate(json.loads(c["text"]), schema)
