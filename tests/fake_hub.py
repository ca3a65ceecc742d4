"""A Hugging Face Hub on 127.0.0.1 for tests (``HF_ENDPOINT``): the endpoints the
``huggingface_hub`` client uses to pull a file, answered the way huggingface.co answers.

* ``GET /api/models/ORG/REPO/revision/REV`` (``?blobs=true``): the model info, with
  ``sha`` (the commit) and ``siblings`` (``rfilename``, ``size``, ``blobId``, and for LFS files
  ``lfs: {sha256, size, pointerSize}``);
* ``HEAD`` / ``GET /ORG/REPO/resolve/REV/PATH``: the file, with ``X-Repo-Commit``, ``ETag``
  / ``X-Linked-Etag`` (the sha256 of an LFS file, the git blob sha1 of another),
  ``X-Linked-Size``, ``Accept-Ranges: bytes``; ``Range: bytes=N-`` answers 206;
* errors as the Hub sends them: 404 with ``X-Error-Code: RepoNotFound`` / ``EntryNotFound``
  / ``RevisionNotFound``, 401 for a private repository without its token.

Faults for the tests: ``cut[path] = n`` closes the connection after ``n`` bytes of the next
GET of ``path`` (once); ``tamper`` serves other bytes than the metadata describes;
``slow[path] = seconds`` sleeps between chunks. ``log`` records (method, path, Range).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Repo:
    files: dict[str, bytes]
    commit: str
    token: str | None = None  # private: needs "Authorization: Bearer TOKEN"
    lfs_from: int = 0  # files of at least this many bytes are LFS files

    def is_lfs(self, path: str) -> bool:
        return len(self.files[path]) >= self.lfs_from

    def etag(self, path: str) -> str:
        data = self.files[path]
        if self.is_lfs(path):
            return hashlib.sha256(data).hexdigest()
        return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class FakeHub:
    repos: dict[str, Repo] = field(default_factory=dict)
    cut: dict[str, int] = field(default_factory=dict)
    tamper: set[str] = field(default_factory=set)
    slow: dict[str, float] = field(default_factory=dict)
    log: list[tuple[str, str, str | None]] = field(default_factory=list)
    url: str = ""

    def add(self, repo: str, files: dict[str, bytes], *, token: str | None = None,
            lfs_from: int = 0) -> Repo:
        commit = hashlib.sha1(repr(sorted((k, hashlib.sha256(v).hexdigest())
                                          for k, v in files.items())).encode()).hexdigest()
        self.repos[repo] = Repo(dict(files), commit, token, lfs_from)
        return self.repos[repo]

    def gets(self, path: str) -> list[str | None]:
        """The Range headers of the GETs of file ``path`` (None: the whole file)."""
        return [r for m, p, r in self.log if m == "GET" and p.endswith("/" + path)]


def _handler(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet
            pass

        def _send(self, status: int, body: bytes = b"", headers: dict | None = None) -> None:
            self.send_response(status)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _error(self, status: int, code: str, commit: str | None = None) -> None:
            headers = {"X-Error-Code": code, "Content-Type": "application/json"}
            if commit:
                headers["X-Repo-Commit"] = commit
            self._send(status, json.dumps({"error": code}).encode(), headers)

        def _repo(self, name: str) -> Repo | None:
            repo = hub.repos.get(name)
            if repo is None:
                self._error(401 if "Authorization" not in self.headers else 404, "RepoNotFound")
                return None
            if repo.token is not None and self.headers.get("Authorization") != f"Bearer {repo.token}":
                self.send_response(401)
                self.send_header("X-Error-Code", "RepoNotFound")
                self.send_header("X-Error-Message", "Invalid username or password.")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return None
            return repo

        def do_HEAD(self):
            self.do_GET()

        def do_GET(self):
            hub.log.append((self.command, self.path, self.headers.get("Range")))
            path = self.path.split("?", 1)[0]
            m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/revision/([^/]+)", path)
            if m:
                repo = self._repo(m.group(1))
                if repo is None:
                    return
                if m.group(2) not in ("main", repo.commit):
                    return self._error(404, "RevisionNotFound")
                siblings = []
                for name, data in sorted(repo.files.items()):
                    s = {"rfilename": name, "size": len(data), "blobId": repo.etag(name)
                         if not repo.is_lfs(name) else hashlib.sha1(name.encode()).hexdigest()}
                    if repo.is_lfs(name):
                        s["lfs"] = {"sha256": repo.etag(name), "size": len(data),
                                    "pointerSize": 134}
                    siblings.append(s)
                body = {"_id": m.group(1), "id": m.group(1), "modelId": m.group(1),
                        "sha": repo.commit, "private": repo.token is not None,
                        "siblings": siblings}
                return self._send(200, json.dumps(body).encode(),
                                  {"Content-Type": "application/json"})
            m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
            if not m:
                return self._error(404, "NotFound")
            repo = self._repo(m.group(1))
            if repo is None:
                return
            if m.group(2) not in ("main", repo.commit):
                return self._error(404, "RevisionNotFound")
            name = m.group(3)
            if name not in repo.files:
                return self._error(404, "EntryNotFound", repo.commit)
            self._file(repo, name)

        def _file(self, repo: Repo, name: str) -> None:
            data = repo.files[name]
            if name in hub.tamper:
                data = bytes([data[0] ^ 0xFF]) + data[1:]
            etag = f'"{repo.etag(name)}"'
            headers = {"X-Repo-Commit": repo.commit, "ETag": etag, "Accept-Ranges": "bytes",
                       "Content-Type": "application/octet-stream"}
            if repo.is_lfs(name):
                headers.update({"X-Linked-Etag": etag, "X-Linked-Size": str(len(data))})
            start, status = 0, 200
            rng = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range") or "")
            if rng and self.command == "GET":
                start, status = int(rng.group(1)), 206
                headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            body = data[start:]
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command == "HEAD":
                return
            cut = hub.cut.pop(name, None) if self.command == "GET" else None
            delay = hub.slow.get(name, 0.0)
            sent = 0
            for i in range(0, len(body), 4096):
                chunk = body[i:i + 4096]
                if cut is not None and sent + len(chunk) > cut:
                    self.wfile.write(chunk[: cut - sent])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                try:
                    self.wfile.write(chunk)
                except (BrokenPipeError, ConnectionResetError):
                    return
                sent += len(chunk)
                if delay:
                    time.sleep(delay)

    return Handler


class HubServer:
    """Runs a :class:`FakeHub` on 127.0.0.1 in a thread (a context manager)."""

    def __init__(self, hub: FakeHub) -> None:
        self.hub = hub
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
        self.server.daemon_threads = True
        hub.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self.hub

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
