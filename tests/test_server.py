"""``localllm serve`` driven by the official ``openai`` client over 127.0.0.1.

The server runs as a real subprocess (``localllm serve``) on a free port, on a tiny random
model (content does not matter here); the nested order schema also runs on the real default
model (marked slow). Raw HTTP (malformed bodies, disconnects) goes through http.client.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import jsonschema
import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from tiny_model import write_tiny_gguf

KEY = "test-key"
ORDER_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "items": {"type": "array", "items": {
            "type": "object",
            "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}},
            "required": ["sku", "qty"]}},
        "paid": {"type": "boolean"},
    },
    "required": ["id", "items", "paid"],
}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
HI = [{"role": "user", "content": "hi"}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``localllm serve MODEL ARGS`` in a subprocess on a free port, ready when /health
    answers. Its stderr (the request log) is read as it comes into ``lines``; with
    ``stderr_closed`` the server starts with file descriptor 2 closed."""

    # Ctrl-C at a terminal raises KeyboardInterrupt; a test runner may start us with SIGINT
    # ignored, which the child would inherit.
    MAIN = ("import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
            "from localllm.cli import main; main()")

    def __init__(self, model: Path | str, *args: str, timeout: float = 120.0,
                 stderr_closed: bool = False) -> None:
        self.port = _free_port()
        cmd = [sys.executable, "-c", self.MAIN, "serve", str(model),
               "--port", str(self.port), "--device", "cpu", "-t", "1", *args]
        if stderr_closed:
            cmd = ["sh", "-c", 'exec "$@" 2>&-', "sh", *cmd]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL if stderr_closed
                                     else subprocess.PIPE,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        # (-t 1: on a busy 2-core machine torch's spinning worker threads slow a tiny model
        # down twentyfold.)
        self.lines: list[str] = []
        if not stderr_closed:  # drained as it comes: a full pipe would block the server
            threading.Thread(target=self._drain, daemon=True).start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                time.sleep(0.2)
                raise RuntimeError(f"server exited: {self.stderr}")
            try:
                if self.get("/health")[0] == 200:
                    return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError("server did not start")

    def _drain(self) -> None:
        for line in iter(self.proc.stderr.readline, b""):
            self.lines.append(line.decode(errors="replace").rstrip("\n"))

    @property
    def stderr(self) -> str:
        return "\n".join(self.lines)

    def conn(self, timeout: float = 60.0) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def get(self, path: str) -> tuple[int, str]:
        c = self.conn(5)
        try:
            c.request("GET", path)
            r = c.getresponse()
            return r.status, r.read().decode()
        finally:
            c.close()

    def post(self, path: str, body: bytes, key: str | None = KEY) -> tuple[int, dict, dict]:
        c = self.conn()
        headers = {"Content-Type": "application/json"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        try:
            c.request("POST", path, body=body, headers=headers)
            r = c.getresponse()
            headers = {k.lower(): v for k, v in r.getheaders()}
            return r.status, headers, json.loads(r.read() or b"null")
        finally:
            c.close()

    def client(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=key,
                             max_retries=0, timeout=120)

    def metric(self, name: str) -> float:
        text = self.get("/metrics")[1]
        m = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
        assert m, text
        return float(m.group(1))

    def wait_metric(self, name: str, value: float, timeout: float = 30.0) -> bool:
        """Whether the metric reaches ``value`` (the worker's bookkeeping ends just after
        the reply is sent)."""
        deadline = time.monotonic() + timeout
        while self.metric(name) != value:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def stop(self) -> int:
        """SIGTERM, and the exit status (SIGKILL after 10 s)."""
        self.proc.terminate()
        try:
            return self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


@contextlib.contextmanager
def in_process_server(llm, timeout: float = 60.0):
    """``llm``'s server (``create_app``, as ``localllm serve`` runs it) in a thread of this
    process on a free port of 127.0.0.1, for tests that look inside it or load many models;
    yields the port, stops the server on exit.

    Raises:
        TimeoutError: the server did not start within ``timeout`` seconds."""
    import uvicorn

    from localllm.server.app import bind, create_app

    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(create_app(llm, log=None), log_level="error"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + timeout
        while not server.started:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the in-process server did not start in {timeout} s")
            time.sleep(0.02)
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("serve") / "tiny.gguf", context_length=4096)


@pytest.fixture(scope="module")
def server(tiny_path):
    s = Server(tiny_path, "--api-key", KEY, "-c", "4096", "--max-body", "100000")
    yield s
    s.stop()


def test_models_and_health(server):
    assert json.loads(server.get("/health")[1]) == {"status": "ok"}
    models = server.client().models.list()
    assert models.data[0].id == "tiny.gguf"  # then what else can be served


def test_chat_non_streaming(server):
    r = server.client().chat.completions.create(model="tiny", messages=HI, max_tokens=6,
                                                temperature=0)
    assert isinstance(r, ChatCompletion)
    choice = r.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert 1 <= r.usage.completion_tokens <= 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_streaming_matches_non_streaming(server):
    client = server.client()
    kw = {"model": "tiny", "messages": HI, "max_tokens": 8, "temperature": 0}
    whole = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert all(isinstance(c, ChatCompletionChunk) for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole
    assert chunks[-1].choices[0].finish_reason == "length"
    assert len({c.id for c in chunks}) == 1


def test_completions_and_max_tokens_length(server):
    r = server.client().completions.create(model="tiny", prompt="the", max_tokens=5,
                                           temperature=0, logprobs=2)
    assert isinstance(r, Completion)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 5 and "".join(lp.tokens) == r.choices[0].text
    assert all(len(top) == 2 for top in lp.top_logprobs)


def test_stop_string(server):
    client = server.client()
    text = client.completions.create(model="tiny", prompt="the and", max_tokens=12,
                                     temperature=0).choices[0].text
    assert len(text) >= 4
    stop = text[2:4]
    cut = text[: text.index(stop)]
    r = client.completions.create(model="tiny", prompt="the and", max_tokens=12, temperature=0,
                                  stop=[stop])
    assert r.choices[0].text == cut
    assert r.choices[0].finish_reason == "stop"


def test_seed_reproduces(server):
    client = server.client()

    def sample(seed: int) -> str:
        # A high temperature flattens the tiny model's peaked distribution.
        return client.completions.create(model="tiny", prompt="the", max_tokens=12,
                                         temperature=50, top_p=1, seed=seed,
                                         extra_body={"top_k": 0, "min_p": 0}).choices[0].text

    assert sample(7) == sample(7)
    assert len({sample(s) for s in (1, 2, 3)}) > 1  # the seed does change the draw


@pytest.mark.parametrize("max_tokens", [60, 200])
def test_json_schema_output_validates(server, max_tokens):
    r = server.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "an order as JSON"}],
        max_tokens=max_tokens, seed=1, temperature=1.5,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "order", "schema": ORDER_SCHEMA, "strict": True}})
    value = json.loads(r.choices[0].message.content)
    jsonschema.validate(value, ORDER_SCHEMA)
    assert set(value) == {"id", "items", "paid"}  # strict: no other keys
    assert r.usage.completion_tokens <= max_tokens
    assert r.choices[0].finish_reason == "stop"


def test_json_object(server):
    r = server.client().chat.completions.create(
        model="tiny", messages=HI, max_tokens=10, response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_named_tool_call(server):
    r = server.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "weather in Paris?"}],
        tools=[WEATHER_TOOL], max_tokens=150,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments),
                        WEATHER_TOOL["function"]["parameters"])


def test_tool_result_round_trip(server):
    client = server.client()
    first = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER_TOOL],
        tool_choice="required", max_tokens=150)
    call = first.choices[0].message.tool_calls[0]
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]
    r = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER_TOOL],
                                       max_tokens=4, temperature=0)
    assert r.usage.prompt_tokens > first.usage.prompt_tokens


def test_concurrent_clients_all_answered(server):
    before = server.metric('localllm_requests_total{endpoint="/v1/chat/completions",status="200"}')
    client = server.client()
    results: dict[int, ChatCompletion] = {}
    errors: list[BaseException] = []

    def ask(i: int) -> None:
        try:
            results[i] = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": f"client {i}"}],
                max_tokens=4, temperature=0)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and sorted(results) == list(range(8))
    assert all(r.usage.completion_tokens == 4 for r in results.values())
    after = server.metric('localllm_requests_total{endpoint="/v1/chat/completions",status="200"}')
    assert after - before == 8
    assert server.wait_metric("localllm_requests_deferred", 0)


def test_disconnect_mid_stream_frees_the_slot(server):
    before = server.metric("localllm_tokens_predicted_total")
    body = json.dumps({"model": "tiny", "prompt": "the", "max_tokens": 3000, "stream": True,
                       "ignore_eos": True}).encode()
    c = server.conn()
    c.request("POST", "/v1/completions", body=body,
              headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    r = c.getresponse()
    assert r.status == 200 and r.getheader("content-type").startswith("text/event-stream")
    assert r.readline().startswith(b"data: {")
    c.sock.shutdown(socket.SHUT_RDWR)
    c.close()
    # The slot is free: the next request is answered while the abandoned one would still run.
    done = server.client().completions.create(model="tiny", prompt="the", max_tokens=2)
    assert done.choices[0].finish_reason == "length"
    assert server.wait_metric("localllm_requests_processing", 0)
    generated = server.metric("localllm_tokens_predicted_total") - before
    assert generated < 3000 / 2, generated


def test_wrong_api_key_is_401(server):
    with pytest.raises(openai.AuthenticationError) as e:
        server.client(key="wrong").chat.completions.create(model="tiny", messages=HI, max_tokens=1)
    assert e.value.status_code == 401
    assert e.value.body["type"] == "authentication_error"
    status, _, body = server.post("/v1/models", b"", key=None)
    assert status == 401 and "error" in body
    assert server.get("/health")[0] == 200  # health needs no key, as llama-server's


@pytest.mark.parametrize(("body", "fragment"), [
    (b"{not json", "not valid JSON"),
    (b'{"model": "tiny"}', "messages"),
    (b'{"messages": [{"role": "robot", "content": "x"}]}', "role"),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "many"}', "max_tokens"),
    (b'{"messages": [{"role": "user", "content": "x"}], "frobnicate": 1, "max_tokens": 1}',
     "frobnicate"),
    (b'{"messages": [{"role": "user", "content": "x"}], "top_p": 2, "max_tokens": 1}', "top_p"),
    (b'{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "yaml"}}',
     "response_format"),
    ((b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", '
     b'"function": {"name": "f"}}], "tool_choice": {"type": "function", "function": '
     b'{"name": "g"}}}'), "'g'"),
])
def test_malformed_body_is_400_error_object(server, body, fragment):
    status, _, reply = server.post("/v1/chat/completions", body)
    assert status == 400, reply
    err = reply["error"]
    assert err["type"] == "invalid_request_error" and fragment in err["message"]
    assert "Traceback" not in err["message"]


def test_prompt_too_long_is_400(server):
    status, _, reply = server.post("/v1/completions", json.dumps(
        {"prompt": "the " * 5000, "max_tokens": 1}).encode())
    assert status == 400 and reply["error"]["code"] == "context_length_exceeded"


def test_body_size_limit_is_413(server):
    status, _, reply = server.post("/v1/completions", b'{"prompt": "' + b"a" * 120_000 + b'"}')
    assert status == 413 and "error" in reply


def test_queue_full_is_503_with_retry_after(tiny_path):
    s = Server(tiny_path, "--max-queue", "0", "-c", "4096")
    try:
        body = json.dumps({"prompt": "the", "max_tokens": 3000, "stream": True,
                           "ignore_eos": True}).encode()
        c = s.conn()
        c.request("POST", "/v1/completions", body=body,
                  headers={"Content-Type": "application/json"})
        r = c.getresponse()
        assert r.readline().startswith(b"data: {")  # generating: the one slot is taken
        status, headers, reply = s.post("/v1/completions", b'{"prompt": "the", "max_tokens": 1}')
        assert status == 503 and headers.get("retry-after") == "1"
        assert reply["error"]["code"] == "server_busy"
        c.close()
    finally:
        s.stop()


@pytest.mark.slow
def test_order_schema_real_model():
    """The issue's report: a nested order schema at max_tokens=200 must parse, any seed."""
    from conftest import DEFAULT_MODEL

    s = Server(DEFAULT_MODEL, "-c", "1024")
    try:
        client = s.client(key="unused")
        for seed in (1, 2):
            r = client.chat.completions.create(
                model="gemma3-270m", seed=seed, max_tokens=200,
                messages=[{"role": "user", "content": "Write an order with three items as JSON."}],
                response_format={"type": "json_schema", "json_schema": {
                    "name": "order", "schema": ORDER_SCHEMA, "strict": True}})
            jsonschema.validate(json.loads(r.choices[0].message.content), ORDER_SCHEMA)
            assert r.usage.completion_tokens <= 200
        r = client.chat.completions.create(
            model="gemma3-270m", max_tokens=60, tools=[WEATHER_TOOL],
            messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        args = json.loads(r.choices[0].message.tool_calls[0].function.arguments)
        jsonschema.validate(args, WEATHER_TOOL["function"]["parameters"])
    finally:
        s.stop()


def test_port_in_use_is_one_line_error(tiny_path, monkeypatch, capsys):
    from cli_helpers import assert_one_line_error, run_cli

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        code, _, err = run_cli(monkeypatch, capsys, "serve", str(tiny_path), "--port", str(port),
                               "--device", "cpu")
    assert_one_line_error(code, err, f"cannot listen on 127.0.0.1:{port}")


@pytest.mark.parametrize(("flag", "value"), [("--port", "70000"), ("--max-queue", "-1"),
                                             ("--api-key", ""), ("--threads", "0")])
def test_bad_serve_flags(tiny_path, monkeypatch, capsys, flag, value):
    from cli_helpers import assert_one_line_error, run_cli

    code, _, err = run_cli(monkeypatch, capsys, "serve", str(tiny_path), flag, value)
    assert_one_line_error(code, err, flag)


def test_streamed_tool_call(server):
    chunks = list(server.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER_TOOL],
        max_tokens=150, stream=True, tool_choice="required"))
    deltas = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
    # OpenAI's incremental shape: the first delta of a call has its id and name, the
    # arguments come in pieces after it (more than one: they stream as generated)
    assert deltas[0].id and deltas[0].function.name == "get_weather"
    assert {d.index for d in deltas} == {0}
    assert all(d.id is None and d.function.name is None for d in deltas[1:])
    assert len(deltas) > 2
    arguments = "".join(d.function.arguments or "" for d in deltas)
    jsonschema.validate(json.loads(arguments), WEATHER_TOOL["function"]["parameters"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_scheduler_runs_in_arrival_order_and_bounds_the_queue():
    from localllm.server.app import Busy, Scheduler

    scheduler = Scheduler(max_queue=8)
    gate = threading.Event()
    ran: list[int] = []

    def job(i: int):
        def run() -> int:
            gate.wait(30)
            ran.append(i)
            return i
        return run

    futures = [scheduler.submit(job(i)) for i in range(9)]  # one running, eight waiting
    with pytest.raises(Busy):
        scheduler.submit(job(99))
    futures[3].cancel()  # a client that left while waiting
    gate.set()
    assert [f.result(30) for i, f in enumerate(futures) if i != 3] == [0, 1, 2, 4, 5, 6, 7, 8]
    assert ran == [0, 1, 2, 4, 5, 6, 7, 8]
    assert scheduler.pending == 0 and scheduler.waiting == 0
    scheduler.shutdown()
