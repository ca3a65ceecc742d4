"""Agent clients against ``localllm serve`` over 127.0.0.1: Anthropic's Messages API driven by
the official ``anthropic`` client, OpenAI's Responses API and chat completions by the official
``openai`` client (tool round trips, streams), reasoning separated end to end, and the rest of
llama-server's surface (embeddings, tokenize, props, CORS, Host allow-list, model check).

The server runs a tiny random model of a thinking family: Qwen3's tokens and Qwen3.5's real
chat template (tests/data/templates), whose generation prompt opens a ``<think>`` block. With
``--reasoning-budget`` the server closes that block after a few tokens, so every reply has a
short reasoning and then an answer, whatever the random weights write: the split is checked
against the budget, the template's markers and (for structured output and tool calls) against
the JSON schemas with ``jsonschema``.
"""

from __future__ import annotations

import base64
import http.client
import json
from pathlib import Path

import anthropic
import jsonschema
import numpy as np
import openai
import pytest
from test_server import KEY, Server
from tiny_model import QWEN3_SPECIALS, write_tiny_gguf

TEMPLATES = Path(__file__).resolve().parent / "data" / "templates"
BUDGET = 6
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
OPENAI_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER}}
MARKERS = ("<think>", "</think>", "<tool_call>", "</tool_call>")


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    path = write_tiny_gguf(tmp_path_factory.mktemp("agents") / "thinker.gguf", "qwen3",
                           context_length=4096, specials=QWEN3_SPECIALS,
                           chat_template=(TEMPLATES / "Qwen3.5-4B.jinja").read_text("utf-8"))
    s = Server(path, "--api-key", KEY, "-c", "4096", "--reasoning-budget", str(BUDGET),
               "--cors-origins", "http://front.example")
    yield s
    s.stop()


def oai(server: Server) -> openai.OpenAI:
    return server.client()


def claude(server: Server, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}", api_key=key,
                               max_retries=0, timeout=120)


def raw(server: Server, method: str, path: str, body: dict | None = None,
        headers: dict | None = None) -> tuple[int, dict, dict]:
    c = server.conn()
    try:
        c.request(method, path, body=None if body is None else json.dumps(body),
                  headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}",
                           **(headers or {})})
        r = c.getresponse()
        data = r.read()
        is_json = r.getheader("content-type", "").startswith("application/json")
        return r.status, {k.lower(): v for k, v in r.getheaders()}, \
            json.loads(data) if is_json else {"text": data.decode()}
    finally:
        c.close()


# ---- reasoning through chat completions ---------------------------------------------------
def test_chat_separates_reasoning_stream_and_non_stream(thinker):
    kw = {"model": "thinker", "messages": [{"role": "user", "content": "hi"}],
          "max_tokens": 24, "temperature": 0}
    whole = oai(thinker).chat.completions.create(**kw)
    msg = whole.choices[0].message
    reasoning = msg.model_extra["reasoning_content"]
    assert reasoning and not any(m in reasoning for m in MARKERS)
    assert not any(m in (msg.content or "") for m in MARKERS)
    used = whole.usage.completion_tokens_details.reasoning_tokens
    assert 0 < used <= BUDGET + 1  # the budget's tokens and the end marker forced after them
    chunks = list(oai(thinker).chat.completions.create(**kw, stream=True))
    streamed_reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or ""
                                 for c in chunks if c.choices)
    streamed_content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert (streamed_reasoning, streamed_content) == (reasoning, msg.content or "")
    # the reasoning deltas come before the answer's
    kinds = [("r" if c.choices[0].delta.model_extra.get("reasoning_content") else "c")
             for c in chunks if c.choices and (c.choices[0].delta.content
                                               or c.choices[0].delta.model_extra.get(
                                                   "reasoning_content"))]
    assert kinds == sorted(kinds, key=lambda k: k != "r")


def test_reasoning_format_none_leaves_thinking_in_content(thinker):
    r = oai(thinker).chat.completions.create(
        model="thinker", messages=[{"role": "user", "content": "hi"}], max_tokens=16,
        temperature=0, extra_body={"reasoning_format": "none"})
    msg = r.choices[0].message
    assert not msg.model_extra.get("reasoning_content")
    assert "</think>" in msg.content  # the budget closed the block; its text stays


def test_structured_output_after_thinking_validates(thinker):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type":
                                                                               "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    r = oai(thinker).chat.completions.create(
        model="thinker", messages=[{"role": "user", "content": "json"}], max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"]  # the constraint waited for the block to close
    jsonschema.validate(json.loads(msg.content), schema)


def test_streamed_tool_calls_after_thinking(thinker):
    chunks = list(oai(thinker).chat.completions.create(
        model="thinker", messages=[{"role": "user", "content": "weather?"}],
        tools=[OPENAI_TOOL], tool_choice="required", max_tokens=200, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert deltas and chunks[-1].choices[0].finish_reason == "tool_calls"
    calls: dict[int, dict] = {}
    for d in deltas:
        if d.id is not None:  # a call opens: its id and name once
            assert d.index not in calls and d.function.name == "get_weather"
            calls[d.index] = {"id": d.id, "arguments": ""}
        calls[d.index]["arguments"] += d.function.arguments or ""
    assert sorted(calls) == list(range(len(calls)))
    assert len({c["id"] for c in calls.values()}) == len(calls)
    for c in calls.values():
        jsonschema.validate(json.loads(c["arguments"]), WEATHER)
    assert any(c.choices[0].delta.model_extra.get("reasoning_content") for c in chunks
               if c.choices)
    for c in chunks:  # the call's markup never leaks into content
        assert not any(m in (c.choices[0].delta.content or "") for m in MARKERS[2:]) \
            if c.choices else True


def test_parallel_tool_calls_false_gives_one_call(thinker):
    r = oai(thinker).chat.completions.create(
        model="thinker", messages=[{"role": "user", "content": "weather?"}],
        tools=[OPENAI_TOOL], tool_choice="required", parallel_tool_calls=False, max_tokens=200)
    calls = r.choices[0].message.tool_calls
    assert len(calls) == 1 and r.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER)


# ---- Anthropic Messages ---------------------------------------------------------------------
def test_anthropic_messages_create_and_stream(thinker):
    client = claude(thinker)
    # (Anthropic's 2.x client takes no sampling parameters: greedy decoding by extra_body)
    kw = {"model": "thinker", "max_tokens": 24, "extra_body": {"temperature": 0},
          "system": "You are terse.", "messages": [{"role": "user", "content": "hi"}]}
    m = client.messages.create(**kw)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    kinds = [b.type for b in m.content]
    assert kinds[0] == "thinking" and m.content[0].thinking
    assert m.stop_reason in ("end_turn", "max_tokens")
    assert m.usage.input_tokens > 0 and 0 < m.usage.output_tokens <= 24
    with client.messages.stream(**kw) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "content_block_start" in events and "content_block_stop" in events
    # greedy: the stream assembles the same message
    assert [b.model_dump(exclude={"signature"}) for b in final.content] == \
        [b.model_dump(exclude={"signature"}) for b in m.content]
    assert final.stop_reason == m.stop_reason


def test_anthropic_tool_round_trip(thinker):
    client = claude(thinker)
    tool = {"name": "get_weather", "description": "Current weather", "input_schema": WEATHER}
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    m = client.messages.create(model="thinker", max_tokens=200, messages=ask, tools=[tool],
                               tool_choice={"type": "any"})
    uses = [b for b in m.content if b.type == "tool_use"]
    assert uses and m.stop_reason == "tool_use"
    for b in uses:
        assert b.id.startswith("toolu_") and b.name == "get_weather"
        jsonschema.validate(b.input, WEATHER)
    history = [*ask, {"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                                       for b in m.content]},
               {"role": "user", "content": [
                   {"type": "tool_result", "tool_use_id": b.id, "content": "21 C"}
                   for b in uses]}]
    with client.messages.stream(model="thinker", max_tokens=12, messages=history,
                                tools=[tool]) as stream:
        answer = stream.get_final_message()
    assert answer.role == "assistant" and answer.content
    # a tool_result that answers no tool_use of the turn before it
    bad = [*history[:2], {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_nope", "content": "21 C"}]}]
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="thinker", max_tokens=8, messages=bad, tools=[tool])
    assert "tool_use_id" in str(e.value) and e.value.body["type"] == "error"


@pytest.mark.parametrize(("block", "named"), [
    ({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}},
     "image"),
    ({"type": "video", "url": "x"}, "'video'"),
    ({"type": "tool_use", "id": "t", "name": "x", "input": {}}, "tool_use"),  # from the user
])
def test_anthropic_unknown_blocks_are_named(thinker, block, named):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude(thinker).messages.create(model="thinker", max_tokens=8, messages=[
            {"role": "user", "content": [{"type": "text", "text": "hi"}, block]}])
    assert named in e.value.body["error"]["message"]
    assert "messages[0].content[1]" in e.value.body["error"]["message"]


@pytest.mark.parametrize(("extra", "named"), [
    ({"tools": [{"name": "f", "input_schema": "not a schema"}]}, "input_schema"),
    ({"tools": [{"name": "f", "input_schema": {"type": "nope"}}]}, "tools"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search"),
    ({"thinking": {"type": "enabled", "budget_tokens": -5}}, "budget_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}, 5]}, "messages[1]: "),  # path, not .1
])
def test_anthropic_bad_requests(thinker, extra, named):
    body = {"model": "thinker", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
            **extra}
    status, _, reply = raw(thinker, "POST", "/v1/messages", body, {"x-api-key": KEY})
    assert status == 400 and reply["type"] == "error", reply
    assert reply["error"]["type"] == "invalid_request_error" and named in \
        reply["error"]["message"]
    assert raw(thinker, "GET", "/health")[0] == 200  # still serving


def test_anthropic_key_and_model(thinker):
    with pytest.raises(anthropic.AuthenticationError):
        claude(thinker, key="wrong").messages.create(
            model="thinker", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.NotFoundError) as e:
        claude(thinker).messages.create(
            model="claude-opus-4", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["error"]["type"] == "not_found_error"
    n = claude(thinker).messages.count_tokens(
        model="thinker", messages=[{"role": "user", "content": "hi there"}])
    assert n.input_tokens > 2


# ---- OpenAI Responses -----------------------------------------------------------------------
def test_responses_create_and_stream(thinker):
    client = oai(thinker)
    kw = {"model": "thinker", "input": "hi", "instructions": "Be terse.",
          "max_output_tokens": 24, "temperature": 0}
    r = client.responses.create(**kw)
    assert r.status in ("completed", "incomplete") and r.id.startswith("resp_")
    kinds = [o.type for o in r.output]
    assert kinds[0] == "reasoning" and r.usage.output_tokens_details.reasoning_tokens > 0
    with client.responses.stream(**kw) as stream:
        types = [e.type for e in stream]
        final = stream.get_final_response()
    assert types[0] == "response.created" and types[-1] == "response.completed"
    assert final.output_text == r.output_text
    assert [o.type for o in final.output] == kinds


def test_responses_tool_round_trip(thinker):
    client = oai(thinker)
    tool = {"type": "function", "name": "get_weather", "description": "Current weather",
            "parameters": WEATHER}
    r = client.responses.create(model="thinker", input="Weather in Paris?", tools=[tool],
                                tool_choice="required", max_output_tokens=200)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls
    for c in calls:
        assert c.name == "get_weather"
        jsonschema.validate(json.loads(c.arguments), WEATHER)
    follow = [{"role": "user", "content": "Weather in Paris?"},
              *[o.model_dump(exclude_none=True) for o in r.output],
              *[{"type": "function_call_output", "call_id": c.call_id, "output": "21 C"}
                for c in calls]]
    with client.responses.stream(model="thinker", input=follow, tools=[tool],
                                 max_output_tokens=12) as stream:
        done = stream.get_final_response()
    assert done.status in ("completed", "incomplete")
    # streamed: the arguments arrive as deltas that add up to the call
    with client.responses.stream(model="thinker", input="Weather?", tools=[tool],
                                 tool_choice="required", max_output_tokens=200) as stream:
        pieces = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        final = stream.get_final_response()
    streamed = [o for o in final.output if o.type == "function_call"]
    assert "".join(pieces) == "".join(o.arguments for o in streamed)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="thinker", tools=[tool], input=[
            {"role": "user", "content": "x"},
            {"type": "function_call_output", "call_id": "call_nope", "output": "1"}])
    assert "call_id" in str(e.value)


@pytest.mark.parametrize(("body", "named"), [
    ({"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "data:image/png;base64,AA=="}]}]}, "input_image"),
    ({"input": [{"type": "web_search_call", "id": "x"}]}, "web_search_call"),
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {"type": 3}}]},
     "tools"),
    ({"input": "hi", "max_output_tokens": -1}, "max_output_tokens"),
    ({"input": [{"role": "user", "content": "x"}, 3]}, "input[1]: "),  # no union member named
])
def test_responses_bad_requests(thinker, body, named):
    status, _, reply = raw(thinker, "POST", "/v1/responses", {"model": "thinker", **body})
    assert status == 400 and named in reply["error"]["message"], reply


# ---- chat completions: bad input ----------------------------------------------------------------
@pytest.mark.parametrize(("extra", "named"), [
    ({"reasoning_budget_tokens": -2}, "reasoning_budget_tokens"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
      "tool_choice": "required"}, "tools"),
    ({"chat_template_kwargs": {"enable_thinking": "yes"}}, "enable_thinking"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
])
def test_chat_bad_reasoning_and_tools(thinker, extra, named):
    status, _, reply = raw(thinker, "POST", "/v1/chat/completions", {
        "model": "thinker", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        **extra})
    assert status == 400 and named in reply["error"]["message"], reply


# ---- llama-server's surface ---------------------------------------------------------------------
def test_embeddings(thinker):
    client = oai(thinker)
    texts = ["the cat sat", "on the mat"]
    both = client.embeddings.create(model="thinker", input=texts)
    vecs = [np.array(d.embedding) for d in both.data]
    assert [d.index for d in both.data] == [0, 1] and both.usage.prompt_tokens > 0
    assert vecs[0].shape == vecs[1].shape and vecs[0].ndim == 1
    for v in vecs:
        assert abs(np.linalg.norm(v) - 1) < 1e-5
    assert not np.allclose(vecs[0], vecs[1])
    one = client.embeddings.create(model="thinker", input=texts[1])
    np.testing.assert_allclose(one.data[0].embedding, vecs[1], atol=1e-6)
    status, _, packed = raw(thinker, "POST", "/v1/embeddings",
                            {"input": texts[0], "encoding_format": "base64"})
    decoded = np.frombuffer(base64.b64decode(packed["data"][0]["embedding"]), "<f4")
    np.testing.assert_allclose(decoded, vecs[0], atol=1e-6)
    status, _, reply = raw(thinker, "POST", "/v1/embeddings", {"input": ["a", 5]})
    assert status == 400 and "input" in reply["error"]["message"]


def test_tokenize_detokenize_props_models(thinker):
    text = "Hello <think>world</think>"
    status, _, tok = raw(thinker, "POST", "/tokenize", {"content": text, "with_pieces": True})
    assert status == 200
    ids = [t["id"] for t in tok["tokens"]]
    assert "<think>" in [t["piece"] for t in tok["tokens"]]  # a special token, one piece
    assert raw(thinker, "POST", "/detokenize", {"tokens": ids})[2]["content"] == text
    assert raw(thinker, "POST", "/detokenize", {"tokens": [10 ** 8]})[0] == 400
    status, _, props = raw(thinker, "GET", "/props")
    assert status == 200 and props["n_ctx"] == 4096 and props["reasoning_budget"] == BUDGET
    assert props["chat_format"]["reasoning"]["start"] == "<think>"
    assert props["modalities"] == {"vision": False, "audio": False}
    for path in ("/v1/messages", "/v1/responses", "/v1/embeddings", "/tokenize"):
        assert path in props["endpoints"]
    card = oai(thinker).models.list().data[0]
    assert card.model_extra["context_length"] == 4096
    with pytest.raises(openai.NotFoundError) as e:
        oai(thinker).chat.completions.create(model="gpt-4o", messages=[
            {"role": "user", "content": "hi"}], max_tokens=2)
    assert e.value.code == "model_not_found"
    assert raw(thinker, "POST", "/tokenize", {"content": "x"}, {"Authorization": "Bearer no"}
               )[0] == 401


def test_cors_and_host_allow_list(thinker):
    status, headers, _ = raw(thinker, "OPTIONS", "/v1/chat/completions", None, {
        "Origin": "http://front.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert status == 200 and headers["access-control-allow-origin"] == "http://front.example"
    status, headers, _ = raw(thinker, "OPTIONS", "/v1/chat/completions", None, {
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in headers
    status, headers, _ = raw(thinker, "GET", "/props", None, {"Origin": "http://front.example"})
    assert headers["access-control-allow-origin"] == "http://front.example"
    # DNS rebinding: a page of another name that resolves to 127.0.0.1
    c = http.client.HTTPConnection("127.0.0.1", thinker.port, timeout=10)
    try:
        c.putrequest("GET", "/props", skip_host=True)
        c.putheader("Host", f"rebind.example:{thinker.port}")
        c.putheader("Authorization", f"Bearer {KEY}")
        c.endheaders()
        r = c.getresponse()
        assert r.status == 400 and b"Host" in r.read()
    finally:
        c.close()
    for host in (f"localhost:{thinker.port}", f"127.0.0.1:{thinker.port}"):
        assert raw(thinker, "GET", "/health", None, {"Host": host})[0] == 200


def test_metrics_count_the_new_endpoints(thinker):
    raw(thinker, "POST", "/tokenize", {"content": "x"})
    status, text = thinker.get("/metrics")
    assert status == 200
    assert 'localllm_requests_total{endpoint="/tokenize",status="200"}' in text
    assert "localllm_tokens_predicted_total" in text


# ---- a real instruct model ---------------------------------------------------------------------
def test_round_trips_on_smollm2():
    """Claude Code- and Codex-shaped tool round trips on smollm2-135m-instruct (its own
    template, which knows no tools: the calls go through the fenced fallback)."""
    from localllm import hub
    from localllm.registry import PROJECT_MODELS, load_registry

    source = load_registry([PROJECT_MODELS]).models["smollm2-135m-instruct"].wheel_source
    if hub.state(source) != "pulled":
        pytest.skip("smollm2-135m-instruct is not pulled")
    s = Server(hub.cached_path(source), "--api-key", KEY, "-c", "2048")
    try:
        name = "smollm2-135m-instruct"
        tool = {"name": "get_weather", "description": "Current weather", "input_schema": WEATHER}
        ask = [{"role": "user", "content": "What is the weather in Paris?"}]
        m = claude(s).messages.create(model=name, max_tokens=80, messages=ask, tools=[tool],
                                      tool_choice={"type": "any"})
        use = next(b for b in m.content if b.type == "tool_use")
        jsonschema.validate(use.input, WEATHER)
        with claude(s).messages.stream(model=name, max_tokens=16, tools=[tool], messages=[
                *ask, {"role": "assistant", "content": [use.model_dump(exclude_none=True)]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                              "content": "21 C, sunny"}]}]) as stream:
            text = stream.get_final_text()
        assert text.strip()
        fn = {"type": "function", "name": "get_weather", "parameters": WEATHER}
        r = oai(s).responses.create(model=name, input="Weather in Paris?", tools=[fn],
                                    tool_choice="required", max_output_tokens=80)
        call = next(o for o in r.output if o.type == "function_call")
        jsonschema.validate(json.loads(call.arguments), WEATHER)
        done = oai(s).responses.create(model=name, tools=[fn], max_output_tokens=16, input=[
            {"role": "user", "content": "Weather in Paris?"}, call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": "21 C"}])
        assert done.output_text.strip()
    finally:
        s.stop()
