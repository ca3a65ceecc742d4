"""The server's ASGI front door (:class:`Guard`): the API key, the ``Host`` allow-list, CORS,
the body size limit and the one-line request log, before any endpoint runs."""

from __future__ import annotations

import contextlib
import ipaddress
import secrets
import sys
import time
from collections.abc import Callable

from .protocol import OPENAI, Failure, Style, dumps


def stderr_line(text: str) -> None:
    stream = sys.stderr
    if stream is None:
        return
    with contextlib.suppress(OSError, ValueError):  # closed or broken stderr: no log, no crash
        stream.write(text + "\n")
        stream.flush()


# Paths that need the API key when one is set (llama-server protects its own endpoints too);
# /health and /metrics stay open to monitors.
PROTECTED = ("/v1/", "/api/", "/tokenize", "/detokenize", "/props", "/embedding")
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1", "[::1]")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or address) is this machine only."""
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def style_of(path: str) -> Style:
    """The API family of a path (its errors' shape)."""
    if path.startswith("/v1/messages"):
        from .anthropic import ANTHROPIC

        return ANTHROPIC
    return OPENAI


class Guard:
    """Pure ASGI middleware: the API key (``Authorization: Bearer`` or ``x-api-key``) on the
    :data:`PROTECTED` paths, a request body size limit (the body is read here, at most
    ``max_body + 1`` bytes, then replayed to the app) and one log line per request (``log``:
    a function of the line, or None). With ``cors_origins``, Starlette's CORS middleware
    answers preflights and marks replies for those origins (the key's 401 included). With
    ``allowed_hosts``, a request whose ``Host`` header (port apart) is not one of them gets
    400: a page of another site whose name resolves to 127.0.0.1 (DNS rebinding) cannot use
    a server listening on loopback.

    ``stop()`` (``on_stop``) ends the generations in progress: the server calls it when it
    begins to shut down, so that streams end by themselves within the graceful period.
    """

    def __init__(self, app, *, api_key: str | None, max_body: int,
                 log: Callable[[str], None] | None = stderr_line,
                 on_stop: Callable[[], None] | None = None,
                 cors_origins: tuple[str, ...] = (),
                 allowed_hosts: tuple[str, ...] | None = None) -> None:
        self.app = app
        self.allowed_hosts = None if allowed_hosts is None else {
            h.lower().strip("[]") for h in allowed_hosts}
        self.api_key = api_key.encode("utf-8") if api_key is not None else None
        self.max_body = max_body
        self.log = log
        self._on_stop = on_stop
        self._entry = self._guarded
        if cors_origins:
            from starlette.middleware.cors import CORSMiddleware

            self._entry = CORSMiddleware(self._guarded, allow_origins=list(cors_origins),
                                         allow_methods=["*"], allow_headers=["*"],
                                         expose_headers=["Retry-After"])

    def stop(self) -> None:
        """End the generations in progress and refuse new ones (shutting down)."""
        if self._on_stop is not None:
            self._on_stop()

    async def _reply(self, send, status: int, body: dict, headers=()) -> None:
        data = dumps(body).encode("utf-8")
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
            await self._entry(scope, receive, sending)
        finally:
            if self.log is not None:
                self.log(_log_line(scope, record))

    def _key_ok(self, headers: dict) -> bool:
        given = headers.get(b"authorization", b"")
        if given[:7].lower() == b"bearer ":
            given = given[7:].strip()
        else:
            given = headers.get(b"x-api-key", b"").strip()
        return secrets.compare_digest(given, self.api_key)

    def _host_ok(self, headers: dict) -> bool:
        if self.allowed_hosts is None:
            return True
        host = headers.get(b"host", b"").decode("latin-1").lower()
        if host.startswith("["):  # [v6]:port
            host = host[1:host.find("]")] if "]" in host else host
        elif host.count(":") == 1:
            host = host.split(":")[0]
        return host in self.allowed_hosts

    async def _guarded(self, scope, receive, send) -> None:
        headers = dict(scope.get("headers") or [])
        style = style_of(scope["path"])
        if not self._host_ok(headers):
            return await self._reply(send, 400, style.error(Failure(
                400, "this Host header is not allowed: the server listens on a loopback "
                "address and answers requests for loopback names only (serve with --host to "
                "listen elsewhere)", code="invalid_host")))
        if self.api_key is not None and scope["path"].startswith(PROTECTED) \
                and scope["method"] != "OPTIONS" and not self._key_ok(headers):
            return await self._reply(send, 401, style.error(Failure(
                401, "invalid API key: send the header 'Authorization: Bearer <key>' "
                "(or 'x-api-key: <key>')", "authentication_error", code="invalid_api_key")),
                [(b"www-authenticate", b"Bearer")])
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        too_large = style.error(Failure(413, f"request body larger than {self.max_body} bytes",
                                        "request_too_large", code="request_too_large"))
        try:
            if int(headers.get(b"content-length", b"0")) > self.max_body:
                return await self._reply(send, 413, too_large)
        except ValueError:
            return await self._reply(send, 400, style.error(Failure(400,
                                                                    "malformed Content-Length")))
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


__all__ = ["LOOPBACK_NAMES", "PROTECTED", "Guard", "is_loopback", "stderr_line", "style_of"]
