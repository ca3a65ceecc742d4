"""Hostile constraints (issue 26, items 4 and 9): every schema and grammar bounded before
generation.

Size keywords (``minItems``, ``minLength``, ``minProperties``), repetition counts in
``pattern`` and in GBNF, and the smallest value a schema allows against the token budget:
refused with one clear :class:`~localllm.errors.GrammarError` naming the keyword, in the
library (``response_format``, ``tool_choice``), the CLI (one ``error:`` line, exit 1) and the
server (400, and it goes on serving). These cases used to loop forever, take gigabytes or
panic inside llguidance: they run in subprocesses with a timeout, their peak memory measured.
Forced tool calls cannot carry NaN, Infinity or lone surrogates.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
from json_schemas import check_output
from test_hostile import assert_cli_error, cli
from test_server import Server
from tiny_model import write_tiny_gguf

from localllm import LLM
from localllm.errors import GrammarError, LocalLLMError
from localllm.grammar.schema import MAX_SCHEMA_SIZE

REPO = Path(__file__).resolve().parents[1]
HI = [{"role": "user", "content": "hi"}]


def array(**kw) -> dict:
    return {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer"},
                                                    **kw}}, "required": ["xs"]}


# (schema, what the one error line names)
HOSTILE = [
    (array(minItems=10**18), "minItems 1e+18 at /properties/xs is above the limit of 10000"),
    (array(minItems=10**7), "minItems 10000000 at /properties/xs"),
    ({"type": "string", "minLength": 10**9}, "minLength 1000000000 at / is above the limit"),
    ({"type": "object", "minProperties": 10**9}, "minProperties 1000000000 at /"),
    ({"type": "string", "pattern": "^a{1000000000}$"},
     "pattern at /: repetition count 1000000000 is above the limit of 10000"),
    ({"type": "string", "pattern": "^(a{100}){1000}$"},
     "pattern at /: the shortest match is longer than 10000 characters"),
    ({"type": "string", "pattern": "^a{5,3}$"}, "the maximum is below the minimum"),
    ({"type": "array", "minItems": 1e18}, "minItems 1e+18 at /"),
]
IDS = ["minItems-1e18", "minItems-1e7", "minLength-1e9", "minProperties-1e9", "pattern-1e9",
       "pattern-nested", "pattern-reversed", "minItems-float"]

PROBE = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
from test_grammar import ByteTokenizer
from localllm.errors import GrammarError, LocalLLMError
from localllm.grammar.budget import BudgetedConstraint
from localllm.grammar.constraint import GrammarConstraint


def hwm():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmHWM:")) // 1024


schema, budget = json.loads(sys.stdin.read()), int(sys.argv[2])
tok = ByteTokenizer()
GrammarConstraint.any_json(tok)  # llguidance's own start-up, outside the measure
before, t0 = hwm(), time.monotonic()
try:
    BudgetedConstraint(GrammarConstraint.from_json_schema(schema, tok, source="s"), schema, budget)
    outcome = "ok"
except GrammarError as e:
    outcome = "GrammarError " + str(e)
print(json.dumps({"outcome": outcome, "mb": hwm() - before, "s": time.monotonic() - t0}))
"""


def probe(schema, budget: int = 4096) -> dict:
    """Build the budgeted constraint in a subprocess: its outcome, peak memory growth (MB)
    and seconds. The timeout is far above the second these take; they used to hang."""
    res = subprocess.run([sys.executable, "-c", PROBE, str(REPO / "tests"), str(budget)],
                         input=json.dumps(schema), capture_output=True, text=True, timeout=60,
                         check=False, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("hostile-grammar") / "tiny.gguf",
                           context_length=2048)


@pytest.fixture(scope="module")
def tiny(tiny_path):
    return LLM(tiny_path, device="cpu", ctx_size=2048)


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")
@pytest.mark.parametrize(("schema", "message"), HOSTILE, ids=IDS)
def test_schema_sizes_are_refused_fast_in_bounded_memory(schema, message):
    got = probe(schema)
    assert got["outcome"] == f"GrammarError s: {message}" or (
        got["outcome"].startswith("GrammarError s: ") and message in got["outcome"]), got
    assert got["mb"] < 64 and got["s"] < 10, got


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")
@pytest.mark.parametrize(("schema", "budget", "message"), [
    (array(minItems=MAX_SCHEMA_SIZE), 20,
     "(minItems 10000 at /properties/xs) cannot fit in 20 tokens"),
    ({"type": "string", "minLength": 5000}, 10, "(minLength 5000 at /) cannot fit in 10"),
    ({"type": "string", "pattern": "^(ab{50}){100}$"}, 50, "(pattern at /) cannot fit in 50"),
    # Nested sizes multiply: 100 arrays of 100 arrays of 100 items.
    ({"type": "array", "minItems": 100, "items": array(minItems=100)}, 4096,
     "cannot fit in 4096 tokens"),
])
def test_smallest_value_beyond_the_budget_is_refused(schema, budget, message):
    got = probe(schema, budget)
    assert got["outcome"].startswith("GrammarError s: the smallest value the schema allows")
    assert message in got["outcome"] and got["mb"] < 64 and got["s"] < 10, got


def test_fair_sizes_still_generate(tiny):
    schema = {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[a-z]{3}$"},
        "xs": {"type": "array", "items": {"type": "integer"}, "minItems": 5}},
        "required": ["code", "xs"]}
    r = tiny.create_completion("x", max_tokens=80, seed=1, response_format={
        "type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    assert check_output(r["choices"][0]["text"], schema) is None, r


@pytest.mark.parametrize("schema", [HOSTILE[0][0], HOSTILE[2][0], HOSTILE[4][0]],
                         ids=["minItems", "minLength", "pattern"])
def test_cli_refuses_in_one_line(tiny_path, tmp_path, schema):
    path = tmp_path / "s.json"
    path.write_text(json.dumps(schema))
    t0 = time.monotonic()
    res = cli("run", str(tiny_path), "x", "-n", "8", "--device", "cpu", "--json-schema",
              str(path), timeout=120)
    assert_cli_error(res, "s.json", "above the limit")
    assert time.monotonic() - t0 < 60


def test_cli_refuses_a_value_beyond_n(tiny_path):
    res = cli("run", str(tiny_path), "x", "-n", "20", "--device", "cpu", "--json-schema",
              json.dumps(array(minItems=5000)), timeout=120)
    assert_cli_error(res, "minItems 5000", "cannot fit in 20 tokens")


@pytest.mark.parametrize(("text", "message"), [
    ('root ::= "a"{1000000000}', "--grammar:1:14: repetition count above the limit of 10000"),
    ('root ::= ("a"{10000}){1000}', "--grammar:1:1: rule 'root' is too large once repetitions are expanded"),
    # Within the counts, but beyond what llguidance's lexer builds: found on the first token.
    ('root ::= ("a"{1000}){1000}', "--grammar: the grammar is too large to match"),
], ids=["count", "expansion", "lexer"])
def test_cli_gbnf_repetitions_are_bounded(tiny_path, text, message):
    res = cli("run", str(tiny_path), "x", "-n", "4", "--device", "cpu", "--grammar", text,
              timeout=120)
    assert_cli_error(res, message)


def test_api_refuses_response_format_and_tool_choice(tiny):
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": HOSTILE[0][0]}}
    with pytest.raises(GrammarError, match="^response_format: minItems 1e"):
        tiny.create_completion("x", max_tokens=4, response_format=fmt)
    tools = [{"type": "function", "function": {"name": "f", "parameters": HOSTILE[0][0]}}]
    # a tool's schema is checked when the request is parsed, naming the parameter
    with pytest.raises(LocalLLMError, match=r"^tools\[0\]\.function\.parameters: .*minItems 1e"):
        tiny.create_chat_completion(HI, tools=tools, tool_choice="required", max_tokens=4)
    with pytest.raises(GrammarError, match="cannot fit in 20 tokens"):
        tiny.create_completion("x", max_tokens=20, response_format={
            "type": "json_schema", "json_schema": {"name": "s", "schema": array(minItems=5000)}})


def test_lone_surrogates_in_a_schema_are_refused(tiny):
    schema = {"type": "object", "properties": {"u": {"enum": ["a\ud800"]}}, "required": ["u"]}
    # refused by the request schema (the parameter named) before a grammar is compiled
    with pytest.raises(LocalLLMError, match=r"properties.u.enum\[0\].*lone surrogate"):
        tiny.create_completion("x", max_tokens=8, response_format={
            "type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    # A tool's schema is rendered into the prompt first, which refuses it there.
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    with pytest.raises(LocalLLMError, match="lone surrogate|not valid UTF-8"):
        tiny.create_chat_completion(HI, tools=tools, tool_choice="required", max_tokens=8)


@pytest.fixture(scope="module")
def server(tiny_path):
    s = Server(tiny_path, "-c", "2048")
    yield s
    s.stop()


def post(server, path: str, body: str) -> tuple[int, dict]:
    c = server.conn(120)
    c.request("POST", path, body=body.encode(), headers={"Content-Type": "application/json"})
    r = c.getresponse()
    return r.status, json.loads(r.read() or b"null")


@pytest.mark.parametrize(("path", "body", "message"), [
    ("/v1/completions", {"prompt": "x", "max_tokens": 4, "response_format": {
        "type": "json_schema", "json_schema": {"name": "s", "schema": HOSTILE[0][0]}}},
     "minItems 1e+18"),
    ("/v1/chat/completions", {"messages": HI, "max_tokens": 4, "response_format": {
        "type": "json_schema", "json_schema": {"name": "s", "schema": HOSTILE[2][0]}}},
     "minLength 1000000000"),
    ("/v1/chat/completions", {"messages": HI, "max_tokens": 4, "tool_choice": "required",
                              "tools": [{"type": "function", "function": {
                                  "name": "f", "parameters": HOSTILE[0][0]}}]},
     "minItems 1e+18"),
    ("/v1/chat/completions", {"messages": HI, "max_tokens": 4, "response_format": {
        "type": "json_schema", "json_schema": {"name": "s", "schema": HOSTILE[4][0]}}},
     "repetition count"),
    ("/v1/chat/completions", {"messages": HI, "max_tokens": 4, "response_format": {
        "type": "json_schema", "json_schema": {"name": "s", "schema": {"enum": ["\ud800"]}}}},
     "lone surrogate"),
], ids=["completions-minItems", "chat-minLength", "tool-minItems", "pattern", "surrogate"])
def test_server_answers_400_and_keeps_serving(server, path, body, message):
    t0 = time.monotonic()
    # json.dumps escapes the lone surrogate as \ud800, as a client's JSON would.
    status, reply = post(server, path, json.dumps(body))
    assert status == 400 and message in reply["error"]["message"], reply
    assert time.monotonic() - t0 < 30
    assert server.get("/health")[0] == 200
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x")
    r = client.completions.create(model="tiny", prompt="x", max_tokens=2)
    assert r.choices[0].finish_reason == "length"


def test_server_forced_tool_call_has_finite_numbers(server, tiny):
    # Large logit biases on "9" and "e" (the tiny model's own logits differ by tens): without
    # the overflow rule the arguments came back as {"amount": Infinity}, not JSON.
    vocab = tiny.tokenizer
    bias = {str(t): 40 + 60 * (vocab.token_bytes(t) == b"e") for t in range(vocab.n_vocab)
            if vocab.token_bytes(t) in (b"9", b"e")}
    tools = [{"type": "function", "function": {"name": "convert", "parameters": {
        "type": "object", "properties": {"amount": {"type": "number"}},
        "required": ["amount"]}}}]
    status, reply = post(server, "/v1/chat/completions", json.dumps({
        "messages": HI, "max_tokens": 300, "seed": 0, "tools": tools, "tool_choice": "required",
        "logit_bias": bias}))
    assert status == 200, reply
    args = reply["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
    assert "e" in args and check_output(args, tools[0]["function"]["parameters"]) is None, args
