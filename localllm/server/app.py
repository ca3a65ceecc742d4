"""An OpenAI-compatible server over one :class:`localllm.LLM` (llama-server's endpoints).

* ``POST /v1/chat/completions`` and ``POST /v1/completions``: the bodies of OpenAI's API
  (extra llama.cpp sampler fields accepted by their llama-server names), answered by
  :meth:`LLM.create_chat_completion` / :meth:`LLM.create_completion`; ``"stream": true``
  answers with server-sent events (``data: {chunk}`` lines, then ``data: [DONE]``).
* ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text format),
  ``GET /api/ps`` (Ollama's: the models loaded, their memory and expiry).

The request's ``model`` picks the model among those a :class:`~localllm.server.models.
ModelManager` serves (loaded on first use, evicted least-recently-used, unloaded when idle);
an unknown model is a 404 with code ``model_not_found``.

The runtime holds one sequence, so requests run one at a time, in the order they arrived, on
one worker thread; at most ``max_queue`` wait (then 503 with ``Retry-After``). A client that
disconnects, while waiting or while its tokens stream, cancels its generation and frees the
slot. ``api_key`` requires ``Authorization: Bearer KEY`` on ``/v1/*`` (401 otherwise).
Bodies over ``max_body`` bytes get 413. Every error is an OpenAI error object
``{"error": {"message", "type", "param", "code"}}``: 400 for invalid requests (pydantic
validation, unknown parameters, prompts that do not fit), never a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import (
    ContextOverflowError,
    InsufficientMemoryError,
    LocalLLMError,
    ModelNotFoundError,
)
from .models import ModelManager

_END = object()
# OpenAI request fields that have no effect here (accepted so that clients need no change).
_IGNORED = {"user", "parallel_tool_calls", "store", "metadata", "service_tier", "model"}


def error_body(message: str, kind: str = "invalid_request_error", *, param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _error(status: int, message: str, kind: str = "invalid_request_error", **kw) -> JSONResponse:
    headers = kw.pop("headers", None)
    return JSONResponse(error_body(message, kind, **kw), status_code=status, headers=headers)


# ---- request bodies -------------------------------------------------------------------------
class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool", "function", "ipython"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    grammar: str | None = None
    n: int = 1

    def arguments(self) -> dict:
        """Keyword arguments of the API call: the fields given, unknown ones included (the
        API names an unknown one in its error), the ignorable ones dropped."""
        args = self.model_dump(exclude_unset=True)
        if self.model_extra:
            args.update(self.model_extra)
        for name in _IGNORED:
            args.pop(name, None)
        args.pop("stream", None)
        return args


class ChatRequest(_Common):
    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None

    def arguments(self) -> dict:
        args = super().arguments()
        args["messages"] = [m.model_dump(exclude_none=True) for m in self.messages]
        return args


class CompletionRequest(_Common):
    prompt: str | list[int]
    logprobs: int | None = None
    echo: bool = False
    max_tokens: int | None = 16


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

    def add_timings(self, t) -> None:
        if t is None:
            return
        with self.lock:
            self.prompt_tokens += t.prompt_tokens
            self.prompt_seconds += t.prompt_seconds
            self.predicted_tokens += t.generated_tokens
            self.predicted_seconds += t.generate_seconds

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
    ``max_queue`` wait behind the running one."""

    def __init__(self, max_queue: int) -> None:
        self.max_queue = max_queue
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="localllm-generate")
        self.pending = 0  # submitted and not finished (the running one included)
        self.running = 0
        self.lock = threading.Lock()

    def submit(self, job) -> Future:
        """Queue ``job`` (a callable run on the worker thread).

        Raises:
            Busy: ``max_queue`` requests already wait.
        """
        with self.lock:
            if self.pending > self.max_queue:  # the first pending one runs, the rest wait
                raise Busy
            self.pending += 1

        def run():
            with self.lock:
                self.running = 1
            try:
                return job()
            finally:
                with self.lock:
                    self.pending -= 1
                    self.running = 0

        future = self.executor.submit(run)

        def forget(f: Future) -> None:  # a cancelled job never ran: take it out of the count
            if f.cancelled():
                with self.lock:
                    self.pending -= 1

        future.add_done_callback(forget)
        return future

    @property
    def waiting(self) -> int:
        return self.pending - self.running

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


# ---- guard middleware: API key and body size ---------------------------------------------------
class Guard:
    """Pure ASGI middleware: bearer-token check on ``/v1/*`` and a request body size limit
    (the body is read here, at most ``max_body + 1`` bytes, then replayed to the app)."""

    def __init__(self, app, *, api_key: str | None, max_body: int) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body = max_body

    async def _reply(self, send, status: int, body: dict, headers=()) -> None:
        data = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(data)).encode()), *headers]})
        await send({"type": "http.response.body", "body": data})

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
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


# ---- the app ------------------------------------------------------------------------------------
def create_app(llm, *, api_key: str | None = None, max_queue: int = 64,
               max_body: int = 8 << 20, models: ModelManager | None = None) -> Guard:
    """The ASGI app serving ``llm`` (and, with ``models``, the models it serves).

    Args:
        llm: a loaded :class:`localllm.LLM`, the default model (or None with ``models``).
        models: which models requests may name (default: ``llm`` alone).
        api_key: when set, ``/v1/*`` needs ``Authorization: Bearer <api_key>``.
        max_queue: requests that may wait while one generates (more get 503).
        max_body: largest request body in bytes (more get 413).
    """
    metrics = Metrics()
    if models is None:
        models = ModelManager(llm, max_models=1, keep_alive=None)
    scheduler = Scheduler(max_queue)
    started = int(time.time())
    active: set[threading.Event] = set()  # cancel flags of the requests not finished

    @contextlib.asynccontextmanager
    async def lifespan(app):
        models.start()
        yield
        for cancel in list(active):  # shutting down: stop the generation in progress
            cancel.set()
        scheduler.shutdown()
        models.stop()

    app = FastAPI(title="localllm", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)
    app.state.models = models
    app.state.metrics = metrics
    app.state.scheduler = scheduler
    if llm is not None:
        llm._shared_session()  # allocate the KV cache now, not inside the first request

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            where, message = "", "the request body is not valid JSON"
        metrics.count(request.url.path, 400)
        return _error(400, f"{where}: {message}" if where else message, param=where or None)

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
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        text = metrics.text(scheduler.running, scheduler.waiting) + models.metrics_text()
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def list_models():
        names = await asyncio.get_running_loop().run_in_executor(None, models.available)
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": started, "owned_by": "localllm"}
            for name in names]}

    @app.get("/api/ps")
    async def ps():
        return {"models": models.status()}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        return await _answer(request, "/v1/chat/completions", "create_chat_completion",
                             body.arguments(), body.stream, body.model)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _answer(request, "/v1/completions", "create_completion",
                             body.arguments(), body.stream, body.model)

    async def _answer(request: Request, endpoint: str, method: str, args: dict, stream: bool,
                      model: str | None):
        loop = asyncio.get_running_loop()
        items: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()
        active.add(cancel)

        def put(item) -> None:
            loop.call_soon_threadsafe(items.put_nowait, item)

        def job() -> None:
            if cancel.is_set():
                return put(_END)
            result = used = None
            try:
                with models.use(model) as used:  # loads it on first use
                    result = getattr(used, method)(**args, stream=stream, _cancel=cancel)
                    try:
                        if stream:
                            for chunk in result:
                                put(chunk)
                                if cancel.is_set():
                                    break
                        else:
                            put(result)
                    finally:
                        if stream and hasattr(result, "close"):
                            result.close()  # releases the LLM's lock if the client went away
            except ModelNotFoundError as e:
                put((404, error_body(str(e), param="model", code="model_not_found")))
            except InsufficientMemoryError as e:
                put((503, error_body(str(e), "unavailable_error", code="insufficient_memory")))
            except LocalLLMError as e:
                code = "context_length_exceeded" if isinstance(e, ContextOverflowError) else None
                put((400, error_body(str(e), code=code)))
            except Exception as e:  # noqa: BLE001 (a bug: answer without a traceback, keep serving
                put((500, error_body(f"internal error ({type(e).__name__})", "server_error")))
            finally:
                metrics.add_timings(used.last_timings if result is not None else None)
                active.discard(cancel)
                put(_END)

        try:
            future = scheduler.submit(job)
        except Busy:
            active.discard(cancel)
            metrics.count(endpoint, 503)
            return _error(503, "the server is busy: too many requests are waiting",
                          "unavailable_error", code="server_busy", headers={"Retry-After": "1"})
        first = await _first_item(request, items, future, cancel)
        if first is None:  # the client left while waiting
            metrics.count(endpoint, 499)
            return Response(status_code=499)
        if isinstance(first, tuple):
            metrics.count(endpoint, first[0])
            return JSONResponse(first[1], status_code=first[0])
        metrics.count(endpoint, 200)
        if not stream:
            return JSONResponse(first)

        async def events():
            try:
                item = first
                while item is not _END:
                    if isinstance(item, tuple):  # an error after the stream began
                        yield f"data: {json.dumps(item[1])}\n\n"
                    else:
                        yield f"data: {json.dumps(item, ensure_ascii=False)}\n\n"
                    item = await items.get()
                yield "data: [DONE]\n\n"
            finally:  # also on disconnect: Starlette cancels this generator
                cancel.set()
                future.cancel()

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def _first_item(request: Request, items: asyncio.Queue, future: Future,
                          cancel: threading.Event):
        """The job's first item, or None when the client disconnected first."""
        getter = asyncio.ensure_future(items.get())
        try:
            while True:
                done, _ = await asyncio.wait({getter}, timeout=0.2)
                if done:
                    item = getter.result()
                    return None if item is _END else item
                if await request.is_disconnected():
                    cancel.set()
                    future.cancel()
                    return None
        finally:
            if not getter.done():
                getter.cancel()

    return Guard(app, api_key=api_key, max_body=max_body)


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
          max_queue: int = 64, max_body: int = 8 << 20, log_level: str = "warning",
          on_ready=None, models: ModelManager | None = None) -> None:
    """Serve ``llm`` with uvicorn until interrupted (Ctrl-C, SIGTERM).

    Args:
        on_ready: called with the bound port once the server accepts connections.
    Raises:
        LocalLLMError: the address cannot be bound.
    """
    import uvicorn

    sock = bind(host, port)
    app = create_app(llm, api_key=api_key, max_queue=max_queue, max_body=max_body,
                     models=models)
    config = uvicorn.Config(app, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
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
