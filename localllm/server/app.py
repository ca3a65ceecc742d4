"""An OpenAI-compatible server over one :class:`localllm.LLM` (llama-server's endpoints).

* ``POST /v1/chat/completions`` and ``POST /v1/completions``: the bodies of OpenAI's API
  (extra llama.cpp sampler fields accepted by their llama-server names), validated by the
  API's own schema (:mod:`localllm.api.schema`) and answered by
  :mod:`localllm.api.completions`; ``"stream": true`` answers with server-sent events
  (``data: {chunk}`` lines, then ``data: [DONE]``).
* ``POST /v1/messages`` (Anthropic's Messages API, :mod:`localllm.server.anthropic`) and
  ``POST /v1/responses`` (OpenAI's Responses API, :mod:`localllm.server.responses`), on the same
  chat turns (:mod:`localllm.api.chat`);
* ``POST /v1/embeddings``, ``POST /tokenize``, ``POST /detokenize``, ``GET /props``
  (:mod:`localllm.server.extras`);
* ``GET /v1/models`` (with the context length of the loaded ones), ``GET /health``,
  ``GET /metrics`` (Prometheus text, ``prometheus-client``: :mod:`localllm.server.metrics`),
  ``GET /api/ps`` (Ollama's: the models loaded, their memory and expiry).

The request's ``model`` picks the model among those a :class:`~localllm.server.models.
ModelManager` serves (loaded on first use, evicted least-recently-used, unloaded when idle);
an unknown model is a 404 with code ``model_not_found``, as OpenAI answers.

The runtime holds one sequence, so requests run one at a time, in the order they arrived, on
one worker thread; at most ``max_queue`` wait (then 503 with ``Retry-After``). A client that
disconnects, while waiting or while its tokens stream, cancels its generation and frees the
slot. ``max_tokens`` is capped at ``n_predict`` (llama-server's ``--n-predict``). A generation
stops with an error once it has run ``timeout`` seconds; one that does not stop (a step that
never returns) is given up by a watchdog a grace period later: its client gets the error,
``/health`` answers 503 and new requests are refused with 503 until the worker is free again.
The front door (:mod:`localllm.server.guard`): ``api_key`` requires ``Authorization: Bearer
KEY`` (or Anthropic's ``x-api-key: KEY``) on ``/v1/*`` and the llama-server endpoints (401
otherwise; compared in constant time). Bodies over ``max_body`` bytes get 413. Every error
is an OpenAI error object ``{"error": {"message", "type", "param", "code"}}`` (Anthropic's
``{"type": "error", "error": {"type", "message"}}`` on ``/v1/messages``): 400 for invalid
requests (the parameter named), never a traceback. Streams are server-sent events
(``sse-starlette``, with keep-alive comments). ``cors_origins`` lets browser front ends of
those origins call the server (Starlette's CORS middleware); bound to a loopback address,
requests whose ``Host`` is not a loopback name are refused (400), which stops DNS-rebinding
pages from reaching it. One line per request goes to stderr (client, method, path, status,
tokens, seconds; never the body), as llama-server and ``ollama serve`` log.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..api.chat import create_chat_completion
from ..api.completions import create_completion
from ..api.core import GenerationTimeout
from ..api.schema import ChatParams, CompletionParams, InvalidRequest, parse
from ..errors import (
    ContextOverflowError,
    InsufficientMemoryError,
    LocalLLMError,
    ModelNotFoundError,
)
from .guard import LOOPBACK_NAMES, Guard, is_loopback, stderr_line, style_of
from .metrics import CONTENT_TYPE, Metrics
from .models import ModelManager
from .protocol import OPENAI, Failure, JSONReply, Style, dumps, read_json

_END = object()
_INLINE_BODY = 64 << 10  # bodies up to this size are checked on the event loop


def _parse_body(body: bytes, model: type) -> Any:
    """The request's parameters, validated (runs on a thread: large bodies take a moment)."""
    return parse(model, read_json(body))


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
# ---- the app ------------------------------------------------------------------------------------
class _Ticket:
    """One request's job: its cancel flag and when it started on the worker."""

    def __init__(self) -> None:
        self.cancel = threading.Event()
        self.started: float | None = None


class Api:
    """What the endpoints share: the served model, the request log, the queue and the way a
    request becomes a job whose items are sent back (:meth:`answer`). Endpoint modules
    (:mod:`~localllm.server.anthropic`, :mod:`~localllm.server.responses`,
    :mod:`~localllm.server.extras`) register their routes with it.

    Attributes:
        models: the served models (:meth:`use` picks a request's).
        n_predict / timeout: the server's caps (``--n-predict``, ``--timeout``).
        metrics: the ``/metrics`` counters.
    """

    def __init__(self, models: ModelManager, *, max_queue: int, n_predict: int,
                 timeout: float) -> None:
        self.models = models
        self.n_predict = n_predict
        self.timeout = timeout
        self.scheduler = Scheduler(max_queue)
        self.metrics = Metrics(lambda: self.scheduler.running, lambda: self.scheduler.waiting)
        self.active: set[threading.Event] = set()  # cancel flags of the requests not finished
        self.closing = threading.Event()  # shutting down: every request in progress ends now
        # A generation past `timeout` stops at its next token; one whose step never returns
        # is given up `grace` seconds later (the worker is then reported stuck).
        self.grace = min(30.0, max(1.0, timeout / 10))

    def stop(self) -> None:
        self.closing.set()
        for cancel in list(self.active):
            cancel.set()

    def stuck(self) -> bool:
        return self.scheduler.busy_for() > self.timeout + self.grace

    def stuck_failure(self) -> Failure:
        return Failure(503, f"the generation worker has been on one request for "
                       f"{self.scheduler.busy_for():.0f} s (limit {self.timeout:g} s) and does "
                       "not stop", "unavailable_error", code="worker_stuck",
                       headers={"Retry-After": "5"})

    def use(self, name: str | None):
        """The model a request names, loaded if needed and held while the block runs (see
        :meth:`ModelManager.use`; call it on a worker thread: it may load a model)."""
        return self.models.use(name)

    @staticmethod
    def failure(e: LocalLLMError) -> Failure:
        """The answer to an error a request's job raised."""
        if isinstance(e, ModelNotFoundError):
            return Failure(404, str(e), param="model", code="model_not_found")
        if isinstance(e, InsufficientMemoryError):
            return Failure(503, str(e), "unavailable_error", code="insufficient_memory")
        if isinstance(e, GenerationTimeout):
            return Failure(504, str(e), "server_error", code="generation_timeout")
        code = "context_length_exceeded" if isinstance(e, ContextOverflowError) else None
        param = e.param if isinstance(e, InvalidRequest) else None
        return Failure(400, str(e), code=code, param=param)

    async def parse(self, request: Request, parse: Callable[[bytes], Any]) -> Any:
        """The request's parameters: ``parse(body)``, off the event loop for a large body
        (which keeps answering /health among others; a small one is not worth the hop)."""
        body = await request.body()
        return parse(body) if len(body) < _INLINE_BODY else await asyncio.to_thread(parse, body)

    async def quick(self, request: Request, endpoint: str, parse: Callable[[bytes], Any] | None,
                    work: Callable[[Any, Any], Any], style: Style = OPENAI) -> Any:
        """Answer a request that generates nothing (``/tokenize``, ``count_tokens`` ...):
        ``work(llm, params)`` on a thread, out of the generation queue, with the model the
        request names (``parse`` None: no body, the default model)."""
        try:
            params = None if parse is None else await self.parse(request, parse)

            def run() -> Any:
                with self.use(getattr(params, "model", None)) as llm:
                    return work(llm, params)

            result = await asyncio.to_thread(run)
        except LocalLLMError as e:
            failure = self.failure(e)
            self.metrics.count(endpoint, failure.status)
            return style.reply(failure)
        self.metrics.count(endpoint, 200)
        return result

    async def answer(self, request: Request, endpoint: str, parse: Callable[[bytes], Any],
                     call: Callable[..., Any], style: Style = OPENAI) -> Response:
        """Answer a generating request: parse and check its body, run ``call(llm, params,
        n_predict=, time_limit=, cancel=)`` as a job on the worker (a dict, or an iterator
        of stream items when ``params.stream``), send the result back in ``style``."""
        metrics = self.metrics
        record = request.scope.get("localllm.log") or {}
        try:
            params = await self.parse(request, parse)
        except InvalidRequest as e:
            metrics.count(endpoint, 400)
            return style.reply(Failure(400, str(e), param=e.param))
        if self.stuck():
            metrics.count(endpoint, 503)
            return style.reply(self.stuck_failure())
        loop = asyncio.get_running_loop()
        items: asyncio.Queue = asyncio.Queue()
        ticket = _Ticket()
        self.active.add(ticket.cancel)
        stream = bool(getattr(params, "stream", False))

        def put(item) -> None:
            with contextlib.suppress(RuntimeError):  # the event loop is gone (shutting down)
                loop.call_soon_threadsafe(items.put_nowait, item)

        def account(item) -> None:
            tally = style.tally(item)
            if tally is not None and record.get("tokens") is None:
                timings, prompt, generated = tally
                metrics.add_timings(timings)
                record["tokens"] = (prompt, generated)

        def job() -> None:
            ticket.started = time.monotonic()
            try:
                if ticket.cancel.is_set():
                    return
                with self.use(getattr(params, "model", None)) as llm:  # loaded on first use
                    result = call(llm, params, n_predict=self.n_predict,
                                  time_limit=self.timeout, cancel=ticket.cancel)
                    try:
                        if stream:
                            for item in result:
                                account(item)
                                put(item)
                                if ticket.cancel.is_set():
                                    break
                        else:
                            account(result)
                            put(result)
                    finally:
                        if stream:
                            result.close()  # releases the LLM's lock if the client went away
            except LocalLLMError as e:
                put(self.failure(e))
            except Exception as e:  # noqa: BLE001 (a bug: answer without a traceback, keep serving
                put(Failure(500, f"internal error ({type(e).__name__})", "server_error"))
            finally:
                self.active.discard(ticket.cancel)
                put(_END)

        try:
            future = self.scheduler.submit(job)
        except Busy:
            self.active.discard(ticket.cancel)
            metrics.count(endpoint, 503)
            return style.reply(Failure(503, "the server is busy: too many requests are waiting",
                                       "unavailable_error", code="server_busy",
                                       headers={"Retry-After": "1"}))
        first = await self._next_item(request, items, future, ticket)
        if first is None:  # the client left while waiting
            metrics.count(endpoint, 499)
            return Response(status_code=499)
        if isinstance(first, Failure):
            metrics.count(endpoint, first.status)
            return style.reply(first)
        metrics.count(endpoint, 200)
        if not stream:
            return JSONReply(first)

        async def events():
            try:
                item = first
                while item is not None and item is not _END:
                    if isinstance(item, Failure):  # an error after the stream began: the end
                        yield {"event": "error", "data": dumps(style.error(item))} \
                            if style.done is None else {"data": dumps(style.error(item))}
                        break
                    yield style.event(item)
                    item = await self._next_item(request, items, future, ticket)
                if item is not None and style.done is not None:
                    yield {"data": style.done}
            finally:  # also on disconnect: the response cancels this generator
                ticket.cancel.set()
                future.cancel()

        from sse_starlette.sse import EventSourceResponse  # it patches uvicorn when imported

        return EventSourceResponse(events(), sep="\n", ping=15,
                                   headers={"Cache-Control": "no-cache"})

    async def _next_item(self, request: Request, items: asyncio.Queue, future: Future,
                         ticket: _Ticket):
        """The job's next item; None when the client disconnected first; a Failure when the
        job overran its time limit and the grace period (the watchdog)."""
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
                if self.closing.is_set():  # a stuck job would hold the shutdown: leave it
                    future.cancel()
                    return Failure(503, "the server is shutting down", "unavailable_error",
                                   code="shutting_down")
                started = ticket.started
                if started is not None and time.monotonic() - started > self.timeout + self.grace:
                    ticket.cancel.set()
                    return Failure(504, f"the generation did not stop within its time limit "
                                   f"of {self.timeout:g} s", "server_error",
                                   code="generation_timeout")
        finally:
            if not getter.done():
                getter.cancel()


def create_app(llm, *, api_key: str | None = None, max_queue: int = 64,
               max_body: int = 8 << 20, n_predict: int = -1, timeout: float = 600.0,
               log: Callable[[str], None] | None = stderr_line,
               cors_origins: tuple[str, ...] = (), allowed_hosts: tuple[str, ...] | None = None,
               aliases: tuple[str, ...] = (), pooling: str | None = None,
               models: ModelManager | None = None) -> Guard:
    """The ASGI app serving ``llm`` (and, with ``models``, the models it serves).

    Args:
        llm: a loaded :class:`localllm.LLM`, the default model (or None with ``models``).
        models: which models requests may name (default: ``llm`` alone, also named by
            ``aliases``).
        api_key: when set, the :data:`PROTECTED` paths need it (``Authorization: Bearer
            <api_key>`` or ``x-api-key: <api_key>``).
        max_queue: requests that may wait while one generates (more get 503).
        max_body: largest request body in bytes (more get 413).
        n_predict: cap on a request's ``max_tokens`` (-1: none but the context).
        timeout: seconds one generation may run (then it stops with an error, 504).
        log: receives one line per request (None: no log).
        cors_origins: browser origins allowed to call the server (``*``: any).
        allowed_hosts: ``Host`` header values accepted (None: any; ``serve`` gives the
            loopback names when it listens on a loopback address).
        aliases: more names a request's ``model`` may give for ``llm`` (without ``models``).
        pooling: the embeddings' pooling (None: the GGUF's ``pooling_type``, else mean).
    """
    if models is None:
        models = ModelManager(llm, aliases=(*aliases, llm.path.name, llm.path.stem),
                              max_models=1, keep_alive=None)
    api = Api(models, max_queue=max_queue, n_predict=n_predict, timeout=timeout)
    metrics = api.metrics
    started = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app):
        models.start()
        yield
        api.stop()
        api.scheduler.shutdown()
        models.stop()

    app = FastAPI(title="localllm", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)
    app.state.api = api
    app.state.models = models
    if llm is not None:
        llm.reserve()  # allocate the KV cache now, not inside the first request

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return style_of(request.url.path).reply(Failure(
            exc.status_code, str(exc.detail),
            "not_found_error" if exc.status_code == 404 else "invalid_request_error"))

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception):
        metrics.count(request.url.path, 500)
        return style_of(request.url.path).reply(Failure(
            500, f"internal error ({type(exc).__name__})", "server_error"))

    @app.get("/health")
    async def health():
        if api.stuck():
            return OPENAI.reply(api.stuck_failure())
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.text() + models.metrics_text().encode("utf-8"),
                        media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def list_models():
        names = await asyncio.to_thread(models.available)
        loaded = models.loaded_models()
        return {"object": "list", "data": [model_card(name, started, loaded.get(name))
                                           for name in names]}

    @app.get("/api/ps")
    async def ps():
        return {"models": models.status()}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await api.answer(request, "/v1/chat/completions",
                                lambda body: _parse_body(body, ChatParams), create_chat_completion)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await api.answer(request, "/v1/completions",
                                lambda body: _parse_body(body, CompletionParams),
                                create_completion)

    from . import anthropic, extras, responses

    anthropic.register(app, api)
    responses.register(app, api)
    extras.register(app, api, pooling=pooling)
    return Guard(app, api_key=api_key, max_body=max_body, log=log, on_stop=api.stop,
                 cors_origins=cors_origins, allowed_hosts=allowed_hosts)


def model_card(name: str, created: int, llm=None) -> dict:
    """A model as ``/v1/models`` lists it: OpenAI's fields; for a loaded ``llm``, its context
    length as LM Studio (``context_length``) and llama-server (``meta``) give it."""
    card: dict[str, Any] = {"id": name, "object": "model", "created": created,
                            "owned_by": "localllm"}
    if llm is not None:
        card["context_length"] = llm.ctx_size
        card["meta"] = {"n_ctx": llm.ctx_size, "n_ctx_train": llm.args.context_length,
                        "n_vocab": llm.tokenizer.n_vocab}
    return card


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
          cors_origins: tuple[str, ...] = (), aliases: tuple[str, ...] = (),
          pooling: str | None = None, models: ModelManager | None = None) -> None:
    """Serve ``llm`` with uvicorn until interrupted (Ctrl-C, SIGTERM; the signal is raised
    again once the server has shut down, so the process exits as the signal says). On a
    loopback ``host`` only loopback ``Host`` headers are answered (see :class:`Guard`).

    Args:
        n_predict, timeout, cors_origins, aliases, pooling, models: see :func:`create_app`.
        on_ready: called with the bound port once the server accepts connections.
    Raises:
        LocalLLMError: the address cannot be bound.
    """
    import uvicorn

    sock = bind(host, port)
    allowed = (*LOOPBACK_NAMES, host) if is_loopback(host) else None
    app = create_app(llm, api_key=api_key, max_queue=max_queue, max_body=max_body,
                     n_predict=n_predict, timeout=timeout, cors_origins=cors_origins,
                     allowed_hosts=allowed, aliases=aliases, pooling=pooling, models=models)
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
