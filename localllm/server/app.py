"""An OpenAI-compatible server over one :class:`localllm.LLM` (llama-server's endpoints).

* ``POST /v1/chat/completions`` and ``POST /v1/completions``: the bodies of OpenAI's API
  (extra llama.cpp sampler fields accepted by their llama-server names), validated by the
  API's own schema (:mod:`localllm.api.schema`) and answered by
  :mod:`localllm.api.completions`; ``"stream": true`` answers with server-sent events
  (``data: {chunk}`` lines, then ``data: [DONE]``).
* ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text format),
  ``GET /api/ps`` (Ollama's: the models loaded, their memory and expiry).

The request's ``model`` picks the model among those a :class:`~localllm.server.models.
ModelManager` serves (loaded on first use, evicted least-recently-used, unloaded when idle);
an unknown model is a 404 with code ``model_not_found``.

The runtime holds one sequence, so requests run one at a time, in the order they arrived, on
one worker thread; at most ``max_queue`` wait (then 503 with ``Retry-After``). A client that
disconnects, while waiting or while its tokens stream, cancels its generation and frees the
slot. ``max_tokens`` is capped at ``n_predict`` (llama-server's ``--n-predict``). A generation
stops with an error once it has run ``timeout`` seconds; one that does not stop (a step that
never returns) is given up by a watchdog a grace period later: its client gets the error,
``/health`` answers 503 and new requests are refused with 503 until the worker is free again.
``api_key`` requires ``Authorization: Bearer KEY`` on ``/v1/*`` (401 otherwise). Bodies over
``max_body`` bytes get 413. Every error is an OpenAI error object ``{"error": {"message",
"type", "param", "code"}}``: 400 for invalid requests (the parameter named), never a
traceback. One line per request goes to stderr (client, method, path, status, tokens,
seconds; never the body), as llama-server and ``ollama serve`` log.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import queue
import socket
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..api.completions import create_chat_completion, create_completion
from ..api.core import GenerationTimeout
from ..api.schema import ChatParams, CompletionParams, InvalidRequest, parse
from ..errors import (
    ContextOverflowError,
    InsufficientMemoryError,
    LocalLLMError,
    ModelNotFoundError,
)
from .models import ModelManager

_END = object()
_INLINE_BODY = 64 << 10  # bodies up to this size are checked on the event loop


def error_body(message: str, kind: str = "invalid_request_error", *, param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def dumps(value: Any) -> str:
    """JSON text of a response: non-ASCII kept, but lone surrogates (a tool call's arguments
    may decode to them) escaped and non-finite numbers written as null, so that the text is
    always valid JSON and valid UTF-8."""
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False)
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return json.dumps(value, allow_nan=False)
    except ValueError:  # NaN or infinity somewhere
        return dumps(_finite(value))


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


class _JSON(JSONResponse):
    def render(self, content: Any) -> bytes:
        return dumps(content).encode("utf-8")


def _error(status: int, message: str, kind: str = "invalid_request_error", **kw) -> JSONResponse:
    headers = kw.pop("headers", None)
    return _JSON(error_body(message, kind, **kw), status_code=status, headers=headers)


def _parse_body(body: bytes, model: type) -> Any:
    """The request's parameters, validated (runs on a thread: large bodies take a moment)."""
    try:
        data = json.loads(body)
    except ValueError:  # JSONDecodeError, bad UTF-8
        raise InvalidRequest("the request body is not valid JSON") from None
    except RecursionError:
        raise InvalidRequest("the request body is nested too deeply to parse") from None
    return parse(model, data)


# ---- metrics --------------------------------------------------------------------------------
class Metrics:
    """Counters for ``/metrics`` (names follow llama-server's ``llamacpp:*``, prefixed
    ``localllm_``)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = {}
        self.prompt_tokens = 0
        self.prompt_seconds = 0.0
        self.predicted_tokens = 0
        self.predicted_seconds = 0.0

    def count(self, endpoint: str, status: int) -> None:
        with self.lock:
            key = (endpoint, status)
            self.requests[key] = self.requests.get(key, 0) + 1

    def add_timings(self, t: dict) -> None:
        """Add one generation's llama-server ``timings`` object."""
        with self.lock:
            self.prompt_tokens += t["prompt_n"]
            self.prompt_seconds += t["prompt_ms"] / 1e3
            self.predicted_tokens += t["predicted_n"]
            self.predicted_seconds += t["predicted_ms"] / 1e3

    def text(self, processing: int, waiting: int) -> str:
        with self.lock:
            lines = ["# HELP localllm_requests_total Requests answered, by endpoint and status.",
                     "# TYPE localllm_requests_total counter"]
            for (endpoint, status), n in sorted(self.requests.items()):
                labels = f'endpoint="{endpoint}",status="{status}"'
                lines.append(f"localllm_requests_total{{{labels}}} {n}")
            rows = [
                ("prompt_tokens_total", "counter", "Prompt tokens evaluated.", self.prompt_tokens),
                ("prompt_seconds_total", "counter", "Seconds spent evaluating prompts.",
                 self.prompt_seconds),
                ("tokens_predicted_total", "counter", "Tokens generated.", self.predicted_tokens),
                ("tokens_predicted_seconds_total", "counter", "Seconds spent generating.",
                 self.predicted_seconds),
                ("prompt_tokens_seconds", "gauge", "Average prompt throughput in tokens/s.",
                 self.prompt_tokens / self.prompt_seconds if self.prompt_seconds else 0.0),
                ("predicted_tokens_seconds", "gauge", "Average generation throughput in tokens/s.",
                 self.predicted_tokens / self.predicted_seconds if self.predicted_seconds else 0.0),
                ("requests_processing", "gauge", "Requests generating now.", processing),
                ("requests_deferred", "gauge", "Requests waiting in the queue.", waiting),
            ]
        for name, kind, help_text, value in rows:
            lines += [f"# HELP localllm_{name} {help_text}", f"# TYPE localllm_{name} {kind}",
                      f"localllm_{name} {value:g}" if isinstance(value, float)
                      else f"localllm_{name} {value}"]
        return "\n".join(lines) + "\n"


# ---- the queue --------------------------------------------------------------------------------
class Busy(Exception):
    """The queue is full."""


class Scheduler:
    """Runs jobs one at a time, in submission order, on one worker thread; at most
    ``max_queue`` wait behind the running one.

    The worker is a daemon thread: a job that never returns cannot keep the process from
    exiting (a ``ThreadPoolExecutor``'s threads are joined at exit).
    """

    def __init__(self, max_queue: int) -> None:
        self.max_queue = max_queue
        self.pending = 0  # submitted and not finished (the running one included)
        self.running = 0
        self.started: float | None = None  # time.monotonic() when the running job began
        self.lock = threading.Lock()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name="localllm-generate",
                                        daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], Any]) -> Future:
        """Queue ``job`` (a callable run on the worker thread); cancel the future to drop it
        while it waits.

        Raises:
            Busy: ``max_queue`` requests already wait.
        """
        with self.lock:
            if self.pending > self.max_queue:  # the first pending one runs, the rest wait
                raise Busy
            self.pending += 1
        future: Future = Future()
        self._queue.put((future, job))
        return future

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            future, job = item
            if future.set_running_or_notify_cancel():
                with self.lock:
                    self.running, self.started = 1, time.monotonic()
                try:
                    future.set_result(job())
                except Exception as e:  # noqa: BLE001 - handed to whoever waits on the future
                    future.set_exception(e)
            with self.lock:
                self.pending -= 1
                self.running, self.started = 0, None

    def busy_for(self) -> float:
        """Seconds the running job has been running (0 when idle)."""
        with self.lock:
            return 0.0 if self.started is None else time.monotonic() - self.started

    @property
    def waiting(self) -> int:
        return self.pending - self.running

    def shutdown(self) -> None:
        """Drop the waiting jobs and let the worker end after the running one."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
                with self.lock:
                    self.pending -= 1
        self._queue.put(None)


# ---- guard middleware: API key, body size, the request log -------------------------------------
def _stderr_line(text: str) -> None:
    stream = sys.stderr
    if stream is None:
        return
    with contextlib.suppress(OSError, ValueError):  # closed or broken stderr: no log, no crash
        stream.write(text + "\n")
        stream.flush()


class Guard:
    """Pure ASGI middleware: bearer-token check on ``/v1/*``, a request body size limit (the
    body is read here, at most ``max_body + 1`` bytes, then replayed to the app) and one log
    line per request (``log``: a function of the line, or None).

    ``stop()`` (``on_stop``) ends the generations in progress: the server calls it when it
    begins to shut down, so that streams end by themselves within the graceful period.
    """

    def __init__(self, app, *, api_key: str | None, max_body: int,
                 log: Callable[[str], None] | None = _stderr_line,
                 on_stop: Callable[[], None] | None = None) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body = max_body
        self.log = log
        self._on_stop = on_stop

    def stop(self) -> None:
        """End the generations in progress and refuse new ones (shutting down)."""
        if self._on_stop is not None:
            self._on_stop()

    async def _reply(self, send, status: int, body: dict, headers=()) -> None:
        data = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(data)).encode()), *headers]})
        await send({"type": "http.response.body", "body": data})

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        record = {"status": None, "tokens": None, "t0": time.perf_counter()}
        scope["localllm.log"] = record

        async def sending(message) -> None:
            if message["type"] == "http.response.start":
                record["status"] = message["status"]
            await send(message)

        try:
            await self._guarded(scope, receive, sending)
        finally:
            if self.log is not None:
                self.log(_log_line(scope, record))

    async def _guarded(self, scope, receive, send) -> None:
        headers = dict(scope.get("headers") or [])
        if self.api_key is not None and scope["path"].startswith(("/v1/", "/api/")):
            given = headers.get(b"authorization", b"").decode("latin-1")
            if given != f"Bearer {self.api_key}":
                return await self._reply(send, 401, error_body(
                    "invalid API key: send the header 'Authorization: Bearer <key>'",
                    "authentication_error", code="invalid_api_key"),
                    [(b"www-authenticate", b"Bearer")])
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        too_large = error_body(f"request body larger than {self.max_body} bytes",
                               code="request_too_large")
        try:
            if int(headers.get(b"content-length", b"0")) > self.max_body:
                return await self._reply(send, 413, too_large)
        except ValueError:
            return await self._reply(send, 400, error_body("malformed Content-Length"))
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body:
                return await self._reply(send, 413, too_large)
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


def _log_line(scope: dict, record: dict) -> str:
    """``TIME CLIENT METHOD PATH STATUS [PROMPT+GENERATED tokens] SECONDS`` (no query string,
    no body)."""
    client = scope.get("client")
    who = client[0] if client else "-"
    status = record["status"] if record["status"] is not None else 499  # the client left
    tokens = record["tokens"]
    used = f" {tokens[0]}+{tokens[1]} tokens" if tokens else ""
    seconds = time.perf_counter() - record["t0"]
    path = "".join(c if c.isprintable() and c != " " else "?" for c in scope["path"][:200])
    return (f"{time.strftime('%Y-%m-%d %H:%M:%S')} {who} {scope['method']} {path} {status}"
            f"{used} {seconds:.3f}s")


# ---- the app ------------------------------------------------------------------------------------
class _Ticket:
    """One request's job: its cancel flag and when it started on the worker."""

    def __init__(self) -> None:
        self.cancel = threading.Event()
        self.started: float | None = None


def create_app(llm, *, api_key: str | None = None, max_queue: int = 64,
               max_body: int = 8 << 20, n_predict: int = -1, timeout: float = 600.0,
               log: Callable[[str], None] | None = _stderr_line,
               models: ModelManager | None = None) -> Guard:
    """The ASGI app serving ``llm`` (and, with ``models``, the models it serves).

    Args:
        llm: a loaded :class:`localllm.LLM`, the default model (or None with ``models``).
        models: which models requests may name (default: ``llm`` alone).
        api_key: when set, ``/v1/*`` needs ``Authorization: Bearer <api_key>``.
        max_queue: requests that may wait while one generates (more get 503).
        max_body: largest request body in bytes (more get 413).
        n_predict: cap on a request's ``max_tokens`` (-1: none but the context).
        timeout: seconds one generation may run (then it stops with an error, 504).
        log: receives one line per request (None: no log).
    """
    metrics = Metrics()
    if models is None:
        models = ModelManager(llm, max_models=1, keep_alive=None)
    scheduler = Scheduler(max_queue)
    started = int(time.time())
    active: set[threading.Event] = set()  # cancel flags of the requests not finished
    closing = threading.Event()  # shutting down: every request in progress ends now
    # A generation past `timeout` stops at its next token; one whose step never returns is
    # given up `grace` seconds later (the worker is then reported stuck).
    grace = min(30.0, max(1.0, timeout / 10))

    def stop() -> None:
        closing.set()
        for cancel in list(active):
            cancel.set()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        models.start()
        yield
        stop()
        scheduler.shutdown()
        models.stop()

    app = FastAPI(title="localllm", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)
    app.state.models = models
    app.state.metrics = metrics
    app.state.scheduler = scheduler
    if llm is not None:
        llm.reserve()  # allocate the KV cache now, not inside the first request

    def stuck() -> float | None:
        busy = scheduler.busy_for()
        return busy if busy > timeout + grace else None

    def stuck_error() -> JSONResponse:
        return _error(503, f"the generation worker has been on one request for "
                      f"{scheduler.busy_for():.0f} s (limit {timeout:g} s) and does not stop",
                      "unavailable_error", code="worker_stuck", headers={"Retry-After": "5"})

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return _error(exc.status_code, str(exc.detail),
                      "not_found_error" if exc.status_code == 404 else "invalid_request_error")

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception):
        metrics.count(request.url.path, 500)
        return _error(500, f"internal error ({type(exc).__name__})", "server_error")

    @app.get("/health")
    async def health():
        if stuck() is not None:
            return stuck_error()
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        text = metrics.text(scheduler.running, scheduler.waiting) + models.metrics_text()
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def list_models():
        names = await asyncio.to_thread(models.available)
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": started, "owned_by": "localllm"}
            for name in names]}

    @app.get("/api/ps")
    async def ps():
        return {"models": models.status()}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await _answer(request, "/v1/chat/completions", ChatParams, create_chat_completion)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _answer(request, "/v1/completions", CompletionParams, create_completion)

    async def _answer(request: Request, endpoint: str, model: type, call):
        record = request.scope.get("localllm.log") or {}
        body = await request.body()
        try:
            # A large body takes a moment to check: off the event loop, which keeps
            # answering (/health among others); a small one is not worth a thread hop.
            params = (_parse_body(body, model) if len(body) < _INLINE_BODY
                      else await asyncio.to_thread(_parse_body, body, model))
        except InvalidRequest as e:
            metrics.count(endpoint, 400)
            return _error(400, str(e), param=e.param)
        if stuck() is not None:
            metrics.count(endpoint, 503)
            return stuck_error()
        loop = asyncio.get_running_loop()
        items: asyncio.Queue = asyncio.Queue()
        ticket = _Ticket()
        active.add(ticket.cancel)

        def put(item) -> None:
            with contextlib.suppress(RuntimeError):  # the event loop is gone (shutting down)
                loop.call_soon_threadsafe(items.put_nowait, item)

        def account(result: dict) -> None:
            if "timings" in result and record.get("tokens") is None:
                metrics.add_timings(result["timings"])
                usage = result["usage"]
                record["tokens"] = (usage["prompt_tokens"], usage["completion_tokens"])

        def job() -> None:
            ticket.started = time.monotonic()
            result = None
            try:
                if ticket.cancel.is_set():
                    return
                with models.use(params.model) as used:  # loaded on first use
                    result = call(used, params, n_predict=n_predict, time_limit=timeout,
                                  cancel=ticket.cancel)
                    try:
                        if params.stream:
                            for chunk in result:
                                account(chunk)
                                put(chunk)
                                if ticket.cancel.is_set():
                                    break
                        else:
                            account(result)
                            put(result)
                    finally:
                        if params.stream:
                            result.close()  # releases the LLM's lock if the client went away
            except ModelNotFoundError as e:
                put((404, error_body(str(e), param="model", code="model_not_found")))
            except InsufficientMemoryError as e:
                put((503, error_body(str(e), "unavailable_error", code="insufficient_memory")))
            except GenerationTimeout as e:
                put((504, error_body(str(e), "server_error", code="generation_timeout")))
            except LocalLLMError as e:
                code = "context_length_exceeded" if isinstance(e, ContextOverflowError) else None
                param = e.param if isinstance(e, InvalidRequest) else None
                put((400, error_body(str(e), code=code, param=param)))
            except Exception as e:  # noqa: BLE001 (a bug: answer without a traceback, keep serving
                put((500, error_body(f"internal error ({type(e).__name__})", "server_error")))
            finally:
                active.discard(ticket.cancel)
                put(_END)

        try:
            future = scheduler.submit(job)
        except Busy:
            active.discard(ticket.cancel)
            metrics.count(endpoint, 503)
            return _error(503, "the server is busy: too many requests are waiting",
                          "unavailable_error", code="server_busy", headers={"Retry-After": "1"})
        first = await _next_item(request, items, future, ticket)
        if first is None:  # the client left while waiting
            metrics.count(endpoint, 499)
            return Response(status_code=499)
        if isinstance(first, tuple):
            metrics.count(endpoint, first[0])
            return _JSON(first[1], status_code=first[0])
        metrics.count(endpoint, 200)
        if not params.stream:
            return _JSON(first)

        async def events():
            try:
                item = first
                while item is not None and item is not _END:
                    yield f"data: {dumps(item[1] if isinstance(item, tuple) else item)}\n\n"
                    if isinstance(item, tuple):  # an error after the stream began: the end
                        break
                    item = await _next_item(request, items, future, ticket)
                if item is not None:
                    yield "data: [DONE]\n\n"
            finally:  # also on disconnect: Starlette cancels this generator
                ticket.cancel.set()
                future.cancel()

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def _next_item(request: Request, items: asyncio.Queue, future: Future,
                         ticket: _Ticket):
        """The job's next item; None when the client disconnected first; an error item
        when the job overran its time limit and the grace period (the watchdog)."""
        getter = asyncio.ensure_future(items.get())
        try:
            while True:
                done, _ = await asyncio.wait({getter}, timeout=0.2)
                if done:
                    return getter.result()
                if await request.is_disconnected():
                    ticket.cancel.set()
                    future.cancel()
                    return None
                if closing.is_set():  # a stuck job would hold the shutdown: leave it
                    future.cancel()
                    return (503, error_body("the server is shutting down", "unavailable_error",
                                            code="shutting_down"))
                started = ticket.started
                if started is not None and time.monotonic() - started > timeout + grace:
                    ticket.cancel.set()
                    return (504, error_body(
                        f"the generation did not stop within its time limit of {timeout:g} s",
                        "server_error", code="generation_timeout"))
        finally:
            if not getter.done():
                getter.cancel()

    return Guard(app, api_key=api_key, max_body=max_body, log=log, on_stop=stop)


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: any free port).

    Raises:
        LocalLLMError: the address cannot be bound (in use, not local, not allowed).
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise LocalLLMError(f"--host {host}: {e.strerror or e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise LocalLLMError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def serve(llm, *, host: str = "127.0.0.1", port: int = 8080, api_key: str | None = None,
          max_queue: int = 64, max_body: int = 8 << 20, n_predict: int = -1,
          timeout: float = 600.0, log_level: str = "warning", on_ready=None,
          models: ModelManager | None = None) -> None:
    """Serve ``llm`` (and, with ``models``, the models it serves) with uvicorn until interrupted (Ctrl-C, SIGTERM; the signal is raised
    again once the server has shut down, so the process exits as the signal says).

    Args:
        n_predict, timeout, models: see :func:`create_app`.
        on_ready: called with the bound port once the server accepts connections.
    Raises:
        LocalLLMError: the address cannot be bound.
    """
    import uvicorn

    sock = bind(host, port)
    app = create_app(llm, api_key=api_key, max_queue=max_queue, max_body=max_body,
                     n_predict=n_predict, timeout=timeout, models=models)
    config = uvicorn.Config(app, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    shutdown = server.shutdown

    async def stop_then_shutdown(sockets=None):
        # End the streams first: uvicorn waits for open responses, then cancels them (a
        # CancelledError traceback) and asyncio.run cancels what is left.
        app.stop()
        await shutdown(sockets=sockets)

    server.shutdown = stop_then_shutdown
    if on_ready is not None:
        original = server.startup

        async def startup(sockets=None):
            await original(sockets=sockets)
            if server.started:
                on_ready(sock.getsockname()[1])

        server.startup = startup
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
