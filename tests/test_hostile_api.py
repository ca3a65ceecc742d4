"""Hostile input, round three (issue #26): the Python API, the server and the chat surface.

Every case here used to end in a 500, a traceback, a hang, a wedged server or unbounded
memory. Now the API raises a :class:`~localllm.errors.LocalLLMError` naming the parameter and
the server answers 400 with OpenAI's error object (or 504/503 for a generation that runs too
long) and goes on serving: each server case is followed by a normal request that must
succeed. The servers are real ``localllm serve`` subprocesses on 127.0.0.1 driven by
http.client and the ``openai`` client (one runs in-process, to look at its template cache).
"""

from __future__ import annotations

import http.client
import json
import math
import re
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import pytest
from test_server import HI, WEATHER_TOOL, Server, in_process_server
from tiny_model import write_tiny_gguf

from localllm import LLM
from localllm.chat.tools import parse_tool_calls
from localllm.errors import LocalLLMError, ParameterError

INF = float("inf")
TOOLS = [WEATHER_TOOL]
# A chat template that renders for its whole time limit (5 s): a step of the worker that
# does not return while it runs (the sandbox's range() stops at 100,000 items; two loops
# do not).
SLOW_TEMPLATE = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                 "{% endfor %}")


def nested(n: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(n):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def deep_value(n: int):
    value: list = []
    for _ in range(n - 1):
        value = [value]
    return value


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("hostile-api") / "tiny.gguf",
                           context_length=4096)


@pytest.fixture(scope="module")
def llm(tiny_path):
    return LLM(tiny_path, device="cpu", ctx_size=512)


@pytest.fixture(scope="module")
def server(tiny_path):
    s = Server(tiny_path, "-c", "4096", "--max-body", "4000000")
    yield s
    s.stop()


def post(server: Server, path: str, body: dict | bytes, timeout: float = 120):
    """(status, parsed reply, raw bytes) of a POST."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(10_000)  # the hostile bodies nest deeper than json.dumps goes
    try:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
    finally:
        sys.setrecursionlimit(limit)
    c = server.conn(timeout)
    try:
        c.request("POST", path, body=data, headers={"Content-Type": "application/json"})
        r = c.getresponse()
        raw = r.read()
        if r.getheader("content-type", "").startswith("text/event-stream"):
            return r.status, None, raw
        return r.status, json.loads(raw or b"null"), raw
    finally:
        c.close()


def assert_still_serving(server: Server) -> None:
    """A normal request right after: the server is healthy and answers."""
    assert server.get("/health")[0] == 200
    r = server.client().chat.completions.create(model="tiny", messages=HI, max_tokens=3,
                                                temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1


def strict_json(raw: bytes):
    """``raw`` as JSON that is also valid UTF-8 and has no NaN/Infinity."""
    def reject(name):
        raise ValueError(f"{name} is not JSON")

    return json.loads(raw.decode("utf-8"), parse_constant=reject)


# ---- item 6, 9, 10: one table of wrong types and ranges, for the API and the server ----------
def chat(**kw) -> tuple[str, dict]:
    return "chat", {"messages": HI, **kw}


def assistant_call(function) -> tuple[str, dict]:
    return "chat", {"messages": [HI[0], {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": function}]}]}


def parts(*items) -> tuple[str, dict]:
    return "chat", {"messages": [{"role": "user", "content": list(items)}]}


BAD = {
    # item 6: extra fields that collided with the API's own arguments
    "extra _cancel": (chat(_cancel=True), "unknown parameter '_cancel'"),
    "extra self": (chat(self=1), "unknown parameter 'self'"),
    "extra self (completions)": (("completions", {"prompt": "x", "self": 1}), "'self'"),
    # text parts of the wrong type
    "text part int": (parts({"type": "text", "text": 5}), "messages[0].content[0].text"),
    "text part dict": (parts({"type": "text", "text": {"a": 1}}), "messages[0].content[0].text"),
    "text part null": (parts({"type": "text", "text": None}), "messages[0].content[0].text"),
    "image part": (parts({"type": "image_url", "image_url": {"url": "x"}}),
                   "messages[0].content[0].type"),
    "content int": (("chat", {"messages": [{"role": "user", "content": 3}]}),
                    "messages[0].content"),
    # assistant tool calls of the wrong shape
    "tool_calls function list": (assistant_call(["get_weather"]),
                                 "messages[1].tool_calls[0].function"),
    "tool_calls function string": (assistant_call("get_weather"),
                                   "messages[1].tool_calls[0].function"),
    "tool_calls arguments int": (assistant_call({"name": "get_weather", "arguments": 5}),
                                 "messages[1].tool_calls[0].function.arguments"),
    # tool names that are not strings
    "tool name list": (chat(tools=[{"type": "function", "function": {"name": ["a"]}}]),
                       "tools[0].function.name"),
    "tool_choice name list": (chat(tools=TOOLS, tool_choice={
        "type": "function", "function": {"name": ["get_weather"]}}), "tool_choice.function.name"),
    "tool_choice unknown": (chat(tools=TOOLS, tool_choice="maybe"), "tool_choice"),
    "stream_options string": (chat(stream_options="yes"), "stream_options"),
    # numbers out of machine range
    "temperature inf": (chat(temperature=INF), "temperature: must be a finite number"),
    "top_k 1e30": (chat(top_k=1e30), "top_k"),
    "top_k 2^63": (chat(top_k=2**63), "top_k"),
    "repeat_last_n 2^40": (chat(repeat_last_n=2**40), "repeat_last_n"),
    "seed 2^64": (chat(seed=2**64), "seed"),
    "dry_base 1e300": (chat(dry_multiplier=0.8, dry_base=1e300), "dry_base"),
    # item 9: a bias that is +inf in float32
    "logit_bias 1e308": (chat(logit_bias={"5": 1e308}), "logit-bias"),
    "logit_bias inf": (chat(logit_bias={"5": INF}), "logit_bias.5"),
    "logit_bias key": (chat(logit_bias={"five": 1}), "logit_bias.five"),
    # item 4: DRY breakers (5,000 took the worker 10 minutes)
    "dry breakers 5000": (chat(dry_multiplier=0.8, dry_sequence_breakers=[
        f"w{i}" for i in range(5000)]), "dry_sequence_breakers"),
    "samplers 1000": (chat(samplers=["top_k"] * 1000), "samplers"),
    "stop 100 strings": (chat(stop=["x"] * 100), "stop"),
    "stop string 10k": (chat(stop="x" * 10_000), "stop"),
    # nesting (RecursionError before)
    "strict schema 300 deep": (chat(response_format={"type": "json_schema", "json_schema": {
        "name": "n", "schema": nested(300), "strict": True}}), "nested"),
    "strict schema 600 deep": (chat(response_format={"type": "json_schema", "json_schema": {
        "name": "n", "schema": nested(600), "strict": True}}), "nested"),
    "tool parameters 600 deep": (chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": nested(600)}}]), "nested"),
    "call arguments 900 deep": (assistant_call({"name": "f", "arguments": {
        "a": deep_value(900)}}), "nested"),
    "metadata 900 deep": (chat(metadata={"a": deep_value(900)}), "nested"),
    # lone surrogates ("\ud800" in JSON)
    "surrogate content": (("chat", {"messages": [{"role": "user", "content": "a\ud800"}]}),
                          "lone surrogate"),
    "surrogate stop": (chat(stop=["\udc80"]), "stop[0]: text is not valid Unicode"),
    "surrogate schema": (chat(response_format={"type": "json_schema", "json_schema": {
        "name": "s", "schema": {"enum": ["\ud800"]}}}), "lone surrogate"),
    "surrogate key": (chat(metadata={"\ud800": "x"}), "lone surrogate"),
    # item 10: max_tokens (OpenAI answers 400 for 0 and negatives)
    "max_tokens -1": (chat(max_tokens=-1), "max_tokens"),
    "max_tokens 0": (chat(max_tokens=0), "max_tokens"),
    "max_tokens -5": (("completions", {"prompt": "x", "max_tokens": -5}), "max_tokens"),
    "max_tokens 1e30": (chat(max_tokens=1e30), "max_tokens"),
    "max_completion_tokens 0": (chat(max_completion_tokens=0), "max_completion_tokens"),
    "n 2": (chat(n=2), "n: must be 1"),
    # other shapes
    "prompt strings": (("completions", {"prompt": ["a", "b"]}), "prompt"),
    "prompt ids outside": (("completions", {"prompt": [10**9]}), "outside the vocabulary"),
    "logprobs 21": (("completions", {"prompt": "x", "logprobs": 21}), "logprobs"),
    "top_logprobs 100": (chat(logprobs=True, top_logprobs=100), "top_logprobs"),
    "response_format yaml": (chat(response_format={"type": "yaml"}), "response_format"),
    "response_format schema list": (chat(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}),
        "response_format.json_schema.schema"),
    "grammar int": (chat(grammar=5), "grammar"),
    "messages empty": (("chat", {"messages": []}), "messages"),
    "role robot": (("chat", {"messages": [{"role": "robot", "content": "x"}]}),
                   "messages[0].role"),
    # item 1: a file path where a template's text is expected
    "chat_template /etc/passwd": (chat(chat_template="/etc/passwd"), "Jinja text"),
    "chat_template environ": (chat(chat_template="/proc/self/environ"), "Jinja text"),
}


def api_call(llm, endpoint: str, body: dict):
    if endpoint == "chat":
        return llm.create_chat_completion(**{"max_tokens": 2, **body})
    return llm.create_completion(**{"max_tokens": 2, **body})


@pytest.mark.parametrize("case", list(BAD))
def test_api_refuses_with_a_parameter_error(llm, case):
    (endpoint, body), fragment = BAD[case]
    with pytest.raises(LocalLLMError) as e:
        api_call(llm, endpoint, body)
    assert fragment in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("case", list(BAD))
def test_server_answers_400_and_goes_on(server, case):
    (endpoint, body), fragment = BAD[case]
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    status, reply, raw = post(server, path, {"max_tokens": 2, **body})
    assert status == 400, reply
    err = reply["error"]
    assert err["type"] == "invalid_request_error" and fragment in err["message"], err
    assert "Traceback" not in raw.decode() and "root:" not in raw.decode()
    assert_still_serving(server)


def test_json_1e400_literal_is_a_400(server):
    for field in ("temperature", "top_p", "top_k", "repeat_penalty", "dry_base", "seed"):
        body = b'{"messages": [{"role": "user", "content": "hi"}], "%s": 1e400}' % field.encode()
        status, reply, _ = post(server, "/v1/chat/completions", body)
        assert status == 400 and field in reply["error"]["message"], reply
    assert_still_serving(server)


def test_request_json_nested_1000_deep(server):
    body = b'{"messages": [{"role": "user", "content": "hi"}], "metadata": {"a": ' + \
        b"[" * 1000 + b"]" * 1000 + b"}}"
    status, reply, _ = post(server, "/v1/chat/completions", body)
    assert status == 400 and "nested" in reply["error"]["message"], reply
    body = b"[" * 100_000 + b"]" * 100_000  # deeper than the JSON parser goes
    status, reply, _ = post(server, "/v1/chat/completions", body)
    assert status == 400 and "nested too deeply" in reply["error"]["message"], reply
    assert_still_serving(server)


def test_api_self_referencing_values(llm):
    schema: dict = {"type": "object"}
    schema["properties"] = {"self": schema}
    with pytest.raises(ParameterError, match="contains itself"):
        llm.create_chat_completion(HI, max_tokens=2, response_format={
            "type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    message: dict = {"role": "user", "content": "hi"}
    message["extra"] = [message]
    with pytest.raises(ParameterError, match="contains itself"):
        llm.create_chat_completion([message], max_tokens=2)
    with pytest.raises(ParameterError, match="not a JSON value"):
        llm.create_chat_completion(HI, max_tokens=2, metadata={"a": object()})


@pytest.mark.parametrize(("kwargs", "fragment"), [
    ({"ctx_size": "x"}, "ctx_size"),
    ({"ctx_size": -5}, "--ctx-size"),
    ({"batch_size": 0}, "--batch-size"),
    ({"device": 3}, "device"),
    ({"device": "tpu"}, "device"),
    ({"verbose": "loud"}, "verbose"),
    ({"n_threads": 0}, "unknown keyword argument 'n_threads'"),
    ({"dtype": "float16"}, "dtype"),
])
def test_llm_constructor_arguments(tiny_path, kwargs, fragment):
    with pytest.raises(ParameterError, match=re.escape(fragment)):
        LLM(tiny_path, **kwargs)
    with pytest.raises(ParameterError, match="model must be a name or a path"):
        LLM(42)


def test_numeric_sampler_extremes_never_crash(llm):
    """Every numeric sampler parameter at machine extremes: a valid answer or a
    ParameterError, never another exception (OverflowError before)."""
    fields = ["temperature", "top_p", "top_k", "min_p", "typical_p", "dynatemp_range",
              "dynatemp_exponent", "repeat_last_n", "repeat_penalty", "frequency_penalty",
              "presence_penalty", "dry_multiplier", "dry_base", "dry_allowed_length",
              "dry_penalty_last_n", "xtc_probability", "xtc_threshold", "top_n_sigma",
              "mirostat_mode", "mirostat_tau", "mirostat_eta", "min_keep", "seed", "n_probs"]
    answered = refused = 0
    for name in fields:
        for value in (1e30, -1e30, 1e-300, 2**31 - 1, -(2**31), 2**62):
            extra = {"dry_multiplier": 0.8} if name.startswith("dry_") else {}
            try:
                r = llm.create_completion("the", max_tokens=3, ignore_eos=True,
                                          **{**extra, name: value})
            except ParameterError:
                refused += 1
                continue
            assert r["usage"]["completion_tokens"] == 3
            answered += 1
    assert answered and refused


# ---- item 1: files named by the client ---------------------------------------------------------
def test_template_paths_are_never_read_and_give_no_oracle(server, tmp_path):
    secret = tmp_path / "secret.jinja"
    secret.write_text("{% for m in messages %}SECRETWORD{% endfor %}")
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for x in %} SECRETWORD")
    big = tmp_path / "big.jinja"
    with open(big, "wb") as f:  # a sparse 2.5 GB file: the server took 5.6 GiB reading it
        f.truncate(2_500_000_000)
    rss = _rss_mb(server)
    messages = []
    for path in (secret, broken, big, tmp_path / "missing.jinja", "/etc/passwd",
                 "/proc/self/environ", "/dev/zero", str(tmp_path)):
        status, reply, raw = post(server, "/v1/chat/completions",
                                  {"messages": HI, "max_tokens": 2, "chat_template": str(path)})
        assert status == 400, reply
        assert "SECRETWORD" not in raw.decode() and "root:" not in raw.decode()
        messages.append(re.sub(r"chat template '[^']*'", "", reply["error"]["message"]))
    assert len(set(messages)) == 1, messages  # existing or not, file or not: the same answer
    assert _rss_mb(server) - rss < 100
    assert_still_serving(server)


def _rss_mb(server: Server) -> float:
    for line in Path(f"/proc/{server.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_client_templates_are_kept_in_a_bounded_cache(llm):
    """Every distinct template of a request was compiled and kept for ever (26,000 requests:
    394 -> 4,409 MiB); now the compiled ones live in a bounded LRU cache. A real server on
    127.0.0.1, in-process so that the cache can be looked at."""
    from localllm.chat.template import MAX_CACHED_TEMPLATES, compiled

    with in_process_server(llm) as port:
        compiled.cache_clear()
        n = 3 * MAX_CACHED_TEMPLATES
        for i in range(n):
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            c.request("POST", "/v1/chat/completions", headers={"Content-Type": "application/json"},
                      body=json.dumps({"messages": HI, "max_tokens": 1, "chat_template":
                                       "{% for m in messages %}" + f"{i}:" + "{{ m.content }}"
                                       "{% endfor %}"}))
            r = c.getresponse()
            assert r.status == 200, r.read()
            c.close()
        info = compiled.cache_info()
        assert info.currsize <= MAX_CACHED_TEMPLATES and info.misses >= n


# ---- items 6 and 9: what the model writes, forced by a grammar -----------------------------------
def gbnf_literal(text: str) -> str:
    return 'root ::= "' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def forced_reply(server: Server, text: str, **kw) -> tuple[dict, bytes]:
    status, reply, raw = post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS,
        "grammar": gbnf_literal(text), "max_tokens": 3 * len(text) + 20, **kw})
    assert status == 200, reply
    return reply, raw


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_tool_arguments_that_are_not_json_are_no_call(server, value):
    text = '{"name": "get_weather", "arguments": {"city": ' + value + ', "unit": "celsius"}}'
    _, raw = forced_reply(server, text)
    message = strict_json(raw)["choices"][0]["message"]
    assert not message.get("tool_calls") and message["content"] == text
    assert_still_serving(server)


def test_tool_arguments_with_lone_surrogate_escapes(server):
    text = '{"name": "get_weather", "arguments": {"city": "\\ud800x", "unit": "celsius"}}'
    for stream in (False, True):
        if stream:
            status, _, raw = post(server, "/v1/chat/completions", {
                "messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS,
                "grammar": gbnf_literal(text), "max_tokens": 300, "stream": True})
            assert status == 200
            events = [strict_json(line[6:]) for line in raw.split(b"\n\n")
                      if line.startswith(b"data: {")]
            deltas = [c for e in events for c in e["choices"][0]["delta"].get("tool_calls") or []]
            # the streamed pieces of one call: its id and name first, then the arguments
            assert {d["index"] for d in deltas} == {0} and deltas[0]["id"]
            calls = [{**deltas[0], "function": {**deltas[0]["function"], "arguments": "".join(
                d["function"].get("arguments", "") for d in deltas)}}]
        else:
            _, raw = forced_reply(server, text)
            calls = strict_json(raw)["choices"][0]["message"]["tool_calls"]
        (call,) = calls
        assert call["function"]["arguments"] == '{"city": "\\ud800x", "unit": "celsius"}'
    assert_still_serving(server)


def test_tool_call_nested_1000_deep_in_the_reply(server):
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": ' + "[" * 1000 + \
        "]" * 1000 + "}}</tool_call>"
    _, raw = forced_reply(server, text, max_tokens=2 * len(text))
    message = strict_json(raw)["choices"][0]["message"]
    assert not message.get("tool_calls") and message["content"] == text
    assert_still_serving(server)


FORMATS = {
    "hermes": ("<tool_call>", "</tool_call>"),
    "fenced": ("```tool_call\n", "\n```"),
    "mistral": ("[TOOL_CALLS] [", "]"),
    "python_tag": ("<|python_tag|>", ""),
    "bare": ("", ""),
}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_parse_tool_calls_hostile_text(fmt):
    head, tail = FORMATS[fmt]

    def wrap(body: str) -> str:
        return head + body + tail

    ok = wrap('{"name": "get_weather", "arguments": {"city": "Paris"}}')
    assert parse_tool_calls(ok, TOOLS)[1], ok  # the format itself is recognised
    deep = wrap('{"name": "get_weather", "arguments": {"city": ' + "[" * 1000 + "]" * 1000 + "}}")
    for text in (deep, wrap('{"name": "get_weather", "arguments": {"city": NaN}}'),
                 wrap('{"name": ["get_weather"], "arguments": {}}'),
                 wrap('{"name": {"x": 1}, "arguments": {}}')):
        assert parse_tool_calls(text, TOOLS) == (text, [])
    spaces = " " * 200_000  # the <tool_call> regex took > 70 s on 100,000
    for text in (head + spaces, head + spaces + "x", head + "\n " * 100_000, spaces + tail):
        t0 = time.perf_counter()
        parse_tool_calls(text, TOOLS)
        assert time.perf_counter() - t0 < 2.0, fmt


def test_surrogate_arguments_are_escaped_not_dropped():
    _, calls = parse_tool_calls(
        '{"name": "get_weather", "arguments": {"city": "\\udc80"}}', TOOLS)
    assert calls[0]["function"]["arguments"] == '{"city": "\\udc80"}'
    calls[0]["function"]["arguments"].encode("utf-8")


# ---- item 10: max_tokens and the server's cap ------------------------------------------------------
@pytest.fixture(scope="module")
def capped(tiny_path):
    s = Server(tiny_path, "-c", "4096", "--n-predict", "16")
    yield s
    s.stop()


@pytest.mark.parametrize("max_tokens", [2**63, 10**30, 4000, None])
def test_n_predict_caps_max_tokens(capped, max_tokens):
    body = {"prompt": "the", "ignore_eos": True}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    status, reply, _ = post(capped, "/v1/completions", body)
    assert status == 200, reply
    assert reply["usage"]["completion_tokens"] == 16
    assert reply["choices"][0]["finish_reason"] == "length"
    status, reply, _ = post(capped, "/v1/chat/completions", {
        "messages": HI, "ignore_eos": True, "max_completion_tokens": 5})
    assert status == 200 and reply["usage"]["completion_tokens"] == 5  # below the cap: as asked


def test_api_max_tokens_huge_runs_to_the_context(llm):
    r = llm.create_completion("the", max_tokens=2**63, ignore_eos=True)
    assert r["choices"][0]["finish_reason"] == "length"
    # the context is full: every cell holds a token, and the last one sampled needs none
    assert r["usage"]["total_tokens"] == llm.ctx_size + 1


@pytest.mark.parametrize(("flag", "value"), [("--n-predict", "0"), ("--n-predict", "-3"),
                                             ("--timeout", "0"), ("--timeout", "nan")])
def test_bad_cap_flags(tiny_path, monkeypatch, capsys, flag, value):
    from cli_helpers import assert_one_line_error, run_cli

    code, _, err = run_cli(monkeypatch, capsys, "serve", str(tiny_path), flag, value)
    assert_one_line_error(code, err, flag)


# ---- item 4: time limits, a wedged worker, DRY breakers ---------------------------------------------
@pytest.fixture(scope="module")
def slow(tiny_path):
    s = Server(tiny_path, "-c", "4096", "--timeout", "1")
    yield s
    s.stop()


def test_generation_past_the_time_limit_stops_with_an_error(slow):
    body = {"prompt": "the", "max_tokens": 4000, "ignore_eos": True}
    status, reply, _ = post(slow, "/v1/completions", body)
    assert status == 504 and reply["error"]["code"] == "generation_timeout", reply
    assert "time limit" in reply["error"]["message"]
    status, _, raw = post(slow, "/v1/completions", {**body, "stream": True})
    events = [e for e in raw.decode().split("\n\n") if e]
    assert status == 200 and events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["error"]["code"] == "generation_timeout"
    r = slow.client().completions.create(model="tiny", prompt="the", max_tokens=3)
    assert r.usage.completion_tokens == 3


def test_wedged_worker_is_given_up_and_health_says_so(slow):
    """A step that does not return (a template rendering for 5 s, past the 1 s limit): the
    client gets a 504 once the grace period is over, /health answers 503 and new requests
    are refused at once while the worker is stuck; then it recovers."""
    t0 = time.monotonic()
    status, reply, _ = post(slow, "/v1/chat/completions",
                            {"messages": HI, "max_tokens": 2, "chat_template": SLOW_TEMPLATE})
    assert status == 504 and reply["error"]["code"] == "generation_timeout", reply
    assert time.monotonic() - t0 < 4.5  # given up before the render's own 5 s limit
    status, body = slow.get("/health")
    assert status == 503 and json.loads(body)["error"]["code"] == "worker_stuck"
    status, reply, _ = post(slow, "/v1/completions", {"prompt": "the", "max_tokens": 2})
    assert status == 503 and reply["error"]["code"] == "worker_stuck"
    deadline = time.monotonic() + 60
    while slow.get("/health")[0] != 200:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    r = slow.client().completions.create(model="tiny", prompt="the", max_tokens=3)
    assert r.usage.completion_tokens == 3


def test_dry_breakers_at_the_limit_are_quick(server):
    from localllm.sampling.chain import MAX_DRY_BREAKERS

    t0 = time.monotonic()
    status, reply, _ = post(server, "/v1/chat/completions", {
        "messages": HI, "max_tokens": 4, "dry_multiplier": 0.8,
        "dry_sequence_breakers": ["x" * 40 + str(i) for i in range(MAX_DRY_BREAKERS)]})
    assert status == 200, reply
    assert time.monotonic() - t0 < 30
    assert_still_serving(server)


# ---- items 4 and 8: signals, closed stderr -------------------------------------------------------------
def _wait_processing(server: Server, n: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while server.metric("localllm_requests_processing") != n:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_sigterm_exits_while_the_worker_is_wedged(tiny_path):
    s = Server(tiny_path, "-c", "4096", "--timeout", "1")
    try:
        threading.Thread(target=lambda: post(s, "/v1/chat/completions", {
            "messages": HI, "max_tokens": 2, "chat_template": SLOW_TEMPLATE}, timeout=30),
            daemon=True).start()
        _wait_processing(s, 1)  # the 5 s render has begun
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        code = s.proc.wait(30)
        assert time.monotonic() - t0 < 4.0  # not held until the render ends
        assert code == 143
        time.sleep(0.2)
        assert "Traceback" not in s.stderr, s.stderr
    finally:
        s.stop()


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_while_streaming_exits_cleanly(tiny_path, sig, code):
    s = Server(tiny_path, "-c", "4096")
    try:
        c = s.conn()
        c.request("POST", "/v1/completions", body=json.dumps({
            "prompt": "the", "max_tokens": 4000, "ignore_eos": True, "stream": True}).encode(),
            headers={"Content-Type": "application/json"})
        r = c.getresponse()
        assert r.readline().startswith(b"data: {")  # streaming
        s.proc.send_signal(sig)
        assert s.proc.wait(30) == code
        try:  # the stream ends (cleanly, or cut), the client is not left hanging
            rest = r.read()
        except http.client.IncompleteRead as e:  # cut mid-chunk by the exit
            rest = e.partial
        assert b"Traceback" not in rest
        c.close()
        time.sleep(0.2)
        assert "Traceback" not in s.stderr and "CancelledError" not in s.stderr, s.stderr
        assert "Exception in ASGI" not in s.stderr
    finally:
        s.stop()


def test_serve_with_stderr_closed(tiny_path):
    s = Server(tiny_path, "-c", "4096", stderr_closed=True)
    try:
        r = s.client().completions.create(model="tiny", prompt="the", max_tokens=3)
        assert r.usage.completion_tokens == 3
    finally:
        assert s.stop() == 143


def test_client_disconnect_while_waiting_frees_the_queue(server):
    """A client that leaves while a long generation holds the worker takes its request out
    of the queue."""
    c = server.conn()
    c.request("POST", "/v1/completions", body=json.dumps({
        "prompt": "the", "max_tokens": 3000, "ignore_eos": True, "stream": True}).encode(),
        headers={"Content-Type": "application/json"})
    first = c.getresponse()
    assert first.readline().startswith(b"data: {")
    waiting = server.conn()
    waiting.request("POST", "/v1/completions", body=b'{"prompt": "the", "max_tokens": 5}',
                    headers={"Content-Type": "application/json"})
    deadline = time.monotonic() + 30
    while server.metric("localllm_requests_deferred") != 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    waiting.sock.shutdown(socket.SHUT_RDWR)
    waiting.close()
    c.sock.shutdown(socket.SHUT_RDWR)
    c.close()
    assert server.wait_metric("localllm_requests_deferred", 0)
    assert server.wait_metric("localllm_requests_processing", 0)
    assert_still_serving(server)


# ---- the request log ------------------------------------------------------------------------------
def test_one_log_line_per_request_without_the_body(server):
    before = len(server.lines)
    secret = "do-not-log-this-" + "x" * 8
    r = server.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": secret}], max_tokens=4,
        temperature=0, extra_body={"ignore_eos": True})
    status, _, _ = post(server, "/v1/completions", {"prompt": secret, "max_tokens": "many"})
    assert status == 400
    # an earlier test's request may log its line after its client has read the response, so
    # this request's line is the one with its own token counts
    mine = f"POST /v1/chat/completions 200 {r.usage.prompt_tokens}+4 tokens"
    deadline = time.monotonic() + 10
    while True:
        new = server.lines[before:]
        ok = [line for line in new if mine in line]
        bad = [line for line in new if "POST /v1/completions 400" in line]
        if (ok and bad) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not any(secret in line for line in server.lines)
    assert len(ok) == 1 and len(bad) == 1, new
    assert re.search(rf" 127\.0\.0\.1 POST /v1/chat/completions 200 "
                     rf"{r.usage.prompt_tokens}\+4 tokens \d+\.\d+s$", ok[0]), ok[0]


def test_per_request_timings_feed_the_metrics(server):
    before = server.metric("localllm_tokens_predicted_total")
    r = server.client().completions.create(model="tiny", prompt="the and", max_tokens=7,
                                           extra_body={"ignore_eos": True})
    timings = r.model_extra["timings"]
    assert timings["predicted_n"] == 7 == r.usage.completion_tokens
    assert timings["prompt_n"] + timings["cache_n"] == r.usage.prompt_tokens
    assert math.isfinite(timings["predicted_per_second"])
    assert server.wait_metric("localllm_tokens_predicted_total", before + 7)


def test_stuck_is_not_reported_for_a_long_healthy_queue(server):
    """/health stays 200 while ordinary requests keep the worker busy."""
    results = []
    threads = [threading.Thread(target=lambda: results.append(post(
        server, "/v1/completions", {"prompt": "the", "max_tokens": 50}))) for _ in range(4)]
    for t in threads:
        t.start()
    statuses = []
    while any(t.is_alive() for t in threads):
        statuses.append(server.get("/health")[0])
        time.sleep(0.05)
    for t in threads:
        t.join()
    assert set(statuses) <= {200} and [r[0] for r in results] == [200] * 4


def test_health_is_answered_during_a_request_with_a_large_body(server):
    """Validating a large body runs off the event loop."""
    big = {"messages": [{"role": "user", "content": "hi", "extra": list(range(300_000))}],
           "max_tokens": 1}
    done = []
    t = threading.Thread(target=lambda: done.append(post(server, "/v1/chat/completions", big)))
    t.start()
    while t.is_alive():
        t0 = time.monotonic()
        assert server.get("/health")[0] == 200
        assert time.monotonic() - t0 < 5
        time.sleep(0.02)
    t.join()
    assert done[0][0] in (200, 400)


def test_http_client_sees_json_errors_for_everything(server):
    """Not found and wrong methods are OpenAI error objects too."""
    c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        c.request("GET", "/v1/chat/completions")
        r = c.getresponse()
        assert r.status == 405 and "error" in json.loads(r.read())
    finally:
        c.close()


# ---- the chat REPL interrupted while a reply streams -----------------------------------------------
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_chat_signal_while_a_reply_streams(tiny_path, sig):
    """Ctrl-C stops the reply and the REPL goes on (the next line is answered); SIGTERM exits
    143. Neither prints a traceback. The reply is held mid-way (test_signals' wrapper: the
    6th Session.eval stalls) so that the signal lands while it streams."""
    import os
    import subprocess

    from test_signals import REPO as ROOT
    from test_signals import WRAPPER

    env = {**os.environ, "STALL_AT": "localllm.runtime.session:Session.eval", "STALL_AFTER": "6",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-c", WRAPPER, "chat", str(tiny_path), "-n", "40",
                             "-c", "512", "--temp", "1", "--seed", "1", "-t", "1"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)
    err = b""
    try:
        proc.stdin.write(b"hello\n")
        proc.stdin.flush()
        for line in iter(proc.stderr.readline, b""):
            err += line
            if line.strip() == b"STALLED":
                break
        proc.send_signal(sig)
        if sig == signal.SIGINT:
            time.sleep(0.5)
            proc.stdin.write(b"and again\n")
        proc.stdin.close()
        out = proc.stdout.read()  # small: no need to read both pipes at once
        err += proc.stderr.read()
        proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert b"Traceback" not in err, err.decode(errors="replace")
    if sig == signal.SIGINT:
        assert proc.returncode == 0, err
        assert b"[interrupted]" in out and out.count(b" tokens, ") == 2  # two replies' stats
    else:
        assert proc.returncode == 143
