"""Several models behind one server, as Ollama's scheduler keeps them: a request's ``model``
picks one; it is loaded on first use, evicted least-recently-used when ``max_models`` are
loaded or when the next one does not fit in free memory, and unloaded after ``keep_alive``
seconds without a request (Ollama's ``keep_alive``; None: never, 0: after each request).
The model the server was started with is loaded at once and is not unloaded for idleness
(it can still be evicted to make room).

A request names a model by a models.toml name or a store name (``hf.co/ORG/REPO:TAG``,
``ollama:NAME`` ...: :mod:`localllm.stores`), never by a file path: a network client opens
only what the registry and the stores hold, and nothing is pulled for it. The started
model also answers to its aliases (its name, file name and file stem, ``--alias``).

The app calls :meth:`ModelManager.use` around each generation (on its worker thread),
:meth:`available` for ``/v1/models``, :meth:`status` for ``/api/ps`` and :meth:`metrics_text`
for ``/metrics``; a sweeper thread started by :meth:`start` applies the keep-alive.
"""

from __future__ import annotations

import gc
import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime

from ..errors import InsufficientMemoryError, ModelNotFoundError


@dataclass
class Loaded:
    """A loaded model: its ``llm``, the requests using it now, when it was last used and
    when it expires (``time.monotonic`` seconds; None: never)."""

    name: str
    llm: object
    memory: int
    loaded_at: float
    last_used: float
    expires_at: float | None
    pinned: bool = False  # the started model: not unloaded for idleness
    in_use: int = 0
    aliases: tuple[str, ...] = field(default_factory=tuple)


class ModelManager:
    """Which models a server holds, loaded on demand.

    Args:
        default: the model the server was started with (loaded), or None.
        default_source: what the loader takes to load it again after an eviction (the
            MODEL it was started with: a name or a path; default: its name).
        aliases: more names the default answers to.
        resolve: a request's model name -> the canonical name of what it names (the name
            the loader takes). Raises ModelNotFoundError (a 404) or ParameterError.
        loader: a canonical name -> a loaded :class:`localllm.LLM`. Raises LocalLLMError;
            InsufficientMemoryError makes the manager evict and try again.
        max_models: most models loaded at once (>= 1).
        keep_alive: seconds a model stays loaded after its last request (None: forever).
        available: the names ``/v1/models`` lists besides the loaded ones (called per
            request of that list).
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, default=None, *, default_source: str | None = None,
                 aliases: tuple[str, ...] = (),
                 resolve: Callable[[str], str] | None = None,
                 loader: Callable[[str], object] | None = None, max_models: int = 3,
                 keep_alive: float | None = 300.0,
                 available: Callable[[], list[str]] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_models < 1:
            raise ValueError("max_models must be >= 1")
        self.resolve_name = resolve
        self.loader = loader
        self.max_models = max_models
        self.keep_alive = keep_alive
        self.list_available = available
        self.clock = clock
        self.loaded: dict[str, Loaded] = {}
        self.loading: str | None = None
        self.loads = 0
        self.load_seconds = 0.0
        self.unloads: dict[str, int] = {"lru": 0, "memory": 0, "keep_alive": 0}
        self._lock = threading.Lock()  # the tables above
        self._load_lock = threading.Lock()  # one load at a time
        self._stop = threading.Event()
        self._sweeper: threading.Thread | None = None
        self.default_name: str | None = None
        self.default_aliases: tuple[str, ...] = ()
        self.sources: dict[str, str] = {}  # canonical name -> what the loader takes
        if default is not None:
            name = default.model_name
            self.default_aliases = tuple(dict.fromkeys(a for a in (name, *aliases) if a))
            self.sources[name] = default_source or name
            now = clock()
            default.reserve()  # the KV cache now, not inside the first request
            self.loaded[name] = Loaded(name, default, _memory(default), now, now, None,
                                       pinned=True, aliases=self.default_aliases)
            self.default_name = name

    # ---- names ---------------------------------------------------------------------------
    def key(self, name: str | None) -> str:
        """The canonical name a request's ``model`` stands for (None: the started model).

        Raises:
            ModelNotFoundError: no such model (the app answers 404 ``model_not_found``).
            ParameterError: a malformed name.
        """
        if not name:
            if self.default_name is None:
                raise ModelNotFoundError("this server has no default model: name one in 'model'")
            return self.default_name
        if name in self.default_aliases:
            return self.default_name
        with self._lock:
            for m in self.loaded.values():
                if name == m.name or name in m.aliases:
                    return m.name
        if self.resolve_name is None:
            raise ModelNotFoundError(f"model {name!r} is not served here")
        return self.resolve_name(name)

    # ---- use -------------------------------------------------------------------------------
    @contextmanager
    def use(self, name: str | None) -> Iterator[object]:
        """The loaded model ``name`` names, loaded first if needed; held (never evicted or
        unloaded) until the block ends.

        Raises:
            ModelNotFoundError / ParameterError: see :meth:`key`.
            InsufficientMemoryError: it does not fit even with every idle model unloaded.
            LocalLLMError: the model cannot be loaded.
        """
        key = self.key(name)
        with self._lock:
            m = self.loaded.get(key)
            if m is not None:
                m.in_use += 1
        if m is None:
            m = self._load(key)
        try:
            yield m.llm
        finally:
            with self._lock:
                m.in_use -= 1
                m.last_used = self.clock()
                if self.keep_alive is not None and not m.pinned:
                    m.expires_at = m.last_used + self.keep_alive
            if self.keep_alive == 0:
                self.sweep()

    def _load(self, key: str) -> Loaded:
        if self.loader is None:
            raise ModelNotFoundError(f"model {key!r} is not served here")
        with self._load_lock:
            with self._lock:
                m = self.loaded.get(key)
                if m is not None:  # loaded by another request meanwhile
                    m.in_use += 1
                    return m
                self.loading = key
            try:
                while len(self.loaded) >= self.max_models and self._evict("lru"):
                    pass
                start = time.monotonic()
                while True:
                    try:
                        llm = self.loader(self.sources.get(key, key))
                        break
                    except InsufficientMemoryError:
                        if not self._evict("memory"):
                            raise
                llm.reserve()  # the KV cache now, not inside the first request
                seconds = time.monotonic() - start
            finally:
                with self._lock:
                    self.loading = None
            now = self.clock()
            pinned = key == self.default_name
            m = Loaded(key, llm, _memory(llm), now, now, None, pinned=pinned, in_use=1,
                       aliases=self.default_aliases if pinned else (key,))
            with self._lock:
                self.loaded[key] = m
                self.loads += 1
                self.load_seconds += seconds
            return m

    def _evict(self, reason: str) -> bool:
        """Unload the least recently used idle model; False when every model is in use."""
        with self._lock:
            idle = [m for m in self.loaded.values() if m.in_use == 0]
            if not idle:
                return False
            victim = min(idle, key=lambda m: m.last_used)
            del self.loaded[victim.name]  # the started model too: it reloads on demand
            self.unloads[reason] += 1
        _release(victim)
        return True

    def sweep(self) -> int:
        """Unload the idle models whose keep-alive expired; returns how many."""
        now = self.clock()
        with self._lock:
            expired = [m for m in self.loaded.values() if m.in_use == 0 and not m.pinned
                       and m.expires_at is not None and now >= m.expires_at]
            for m in expired:
                del self.loaded[m.name]
                self.unloads["keep_alive"] += 1
        for m in expired:
            _release(m)
        return len(expired)

    # ---- the sweeper thread ------------------------------------------------------------------
    def start(self, interval: float = 0.5) -> None:
        """Apply the keep-alive every ``interval`` seconds on a daemon thread."""
        if self._sweeper is not None or self.keep_alive is None:
            return
        self._stop.clear()

        def run() -> None:
            while not self._stop.wait(interval):
                self.sweep()

        self._sweeper = threading.Thread(target=run, name="localllm-keep-alive", daemon=True)
        self._sweeper.start()

    def stop(self) -> None:
        self._stop.set()
        if self._sweeper is not None:
            self._sweeper.join(5)
            self._sweeper = None

    # ---- what is served ---------------------------------------------------------------------
    def available(self) -> list[str]:
        """The loaded models, the started one, then what ``available`` lists."""
        with self._lock:
            names = [m.name for m in self.loaded.values()]
        if self.default_name is not None:
            names.append(self.default_name)
        if self.list_available is not None:
            names += self.list_available()
        return list(dict.fromkeys(names))

    def loaded_models(self) -> dict[str, object]:
        """The loaded models by name (each a :class:`localllm.LLM`)."""
        with self._lock:
            return {m.name: m.llm for m in self.loaded.values()}

    def status(self) -> list[dict]:
        """Ollama's ``ps``: the loaded models (and one loading), memory and expiry."""
        now, wall = self.clock(), time.time()

        def when(t: float | None) -> str | None:
            if t is None:
                return None
            return datetime.fromtimestamp(wall + t - now, UTC).isoformat(timespec="seconds")

        with self._lock:
            rows = [{"name": m.name, "model": m.name, "size": m.memory,
                     "device": str(getattr(m.llm, "device", "cpu")),
                     "context_length": getattr(m.llm, "ctx_size", None),
                     "loaded_at": when(m.loaded_at), "expires_at": when(m.expires_at),
                     "in_use": m.in_use, "state": "loaded"}
                    for m in sorted(self.loaded.values(), key=lambda m: -m.last_used)]
            if self.loading is not None:
                rows.append({"name": self.loading, "model": self.loading, "size": None,
                             "device": None, "context_length": None, "loaded_at": None,
                             "expires_at": None, "in_use": 0, "state": "loading"})
        return rows

    def metrics_text(self) -> str:
        """Prometheus lines: models loaded and loading, loads, load seconds, unloads by
        reason, memory per loaded model."""
        with self._lock:
            memory = [(m.name, m.memory) for m in self.loaded.values()]
            lines = [
                "# HELP localllm_models_loaded Models loaded now.",
                "# TYPE localllm_models_loaded gauge",
                f"localllm_models_loaded {len(self.loaded)}",
                "# HELP localllm_models_loading Models being loaded now.",
                "# TYPE localllm_models_loading gauge",
                f"localllm_models_loading {int(self.loading is not None)}",
                "# HELP localllm_model_loads_total Models loaded on demand.",
                "# TYPE localllm_model_loads_total counter",
                f"localllm_model_loads_total {self.loads}",
                "# HELP localllm_model_load_seconds_total Seconds spent loading models.",
                "# TYPE localllm_model_load_seconds_total counter",
                f"localllm_model_load_seconds_total {self.load_seconds:g}",
                "# HELP localllm_model_unloads_total Models unloaded, by reason.",
                "# TYPE localllm_model_unloads_total counter",
            ]
            lines += [f'localllm_model_unloads_total{{reason="{r}"}} {n}'
                      for r, n in self.unloads.items()]
        lines += ["# HELP localllm_model_memory_bytes Estimated memory of each loaded model.",
                  "# TYPE localllm_model_memory_bytes gauge"]
        lines += [f'localllm_model_memory_bytes{{model="{_label(n)}"}} {b}' for n, b in memory]
        return "\n".join(lines) + "\n"


def for_server(llm, source: str | None, *, device: str = "auto", ctx_size: int = 4096,
               batch_size: int = 512, max_models: int = 3, keep_alive: float | None = 300.0,
               chat_template=None, options: dict | None = None,
               aliases: tuple[str, ...] = (),
               setup: Callable[[object], None] | None = None,
               kv_cache: dict | None = None) -> ModelManager:
    """The manager ``localllm serve`` runs: ``llm`` (started from MODEL ``source``, with
    the compiled ``--chat-template`` ``chat_template`` and the LLM keywords ``options``
    (speculative decoding), both kept if it is reloaded) answers to its name, its file's name and stem, and
    ``aliases``; other models load as :class:`localllm.LLM` with the same device and sizes,
    by registry or store name; ``setup`` is called on each model loaded (the server's
    reasoning settings). ``kv_cache``: the LLM keywords ``type_k`` / ``type_v`` (``-ctk`` /
    ``-ctv``), for every model the manager loads (Ollama's ``OLLAMA_KV_CACHE_TYPE`` does the
    same).
    """
    from pathlib import Path

    from ..api import LLM
    from ..registry import load_registry

    def resolve(name: str) -> str:
        _, entry = load_registry().resolve(name, pull=False, paths=False)
        return entry.name  # never None: paths are not resolved for requests

    started_as = source or llm.model_name

    def load(name: str):
        started = name == started_as  # the started model, reloaded after an eviction
        loaded = LLM(name, device=device, ctx_size=ctx_size, batch_size=batch_size,
                     progress=None, **(options or {} if started else {}), **(kv_cache or {}))
        if chat_template is not None and started:
            loaded.chat_template = chat_template
        if setup is not None:
            setup(loaded)
        return loaded

    path = Path(llm.path)
    names = (*aliases, path.name, path.name.removesuffix(".gguf"))
    return ModelManager(llm, default_source=source, aliases=names, resolve=resolve, loader=load,
                        max_models=max_models, keep_alive=keep_alive, available=servable)


def servable() -> list[str]:
    """Registry names whose file is there (nothing hashed) and the stores' models."""
    from .. import hub, stores
    from ..registry import load_registry

    names = []
    for name, e in load_registry().models.items():
        source = e.wheel_source if e.base is None else None
        if e.base is not None:
            ok = True
        elif source is not None:
            ok = hub.cached_path(source).is_file()
        else:
            ok = e.status() == "present"  # a path, or an installed package: nothing imported
        if ok:
            names.append(name)
    return names + [m.name for m in stores.list_local()]


def _label(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _memory(llm) -> int:
    """Estimated bytes a loaded model holds (weights + KV cache + runtime)."""
    try:
        from ..runtime.resources import estimate_memory

        loaded = llm.loaded
        return int(estimate_memory(loaded.gguf, loaded.args, llm.ctx_size, llm.device).total)
    except (AttributeError, TypeError, ValueError):  # a stand-in model in tests
        return int(getattr(llm, "memory", 0))


def _release(m: Loaded) -> None:
    """Drop a model's memory now (its last reference goes; the CUDA cache is emptied)."""
    device = str(getattr(m.llm, "device", "cpu"))
    m.llm = None
    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


def parse_duration(text: str) -> float | None:
    """Ollama's ``keep_alive``: ``5m``, ``30s``, ``1h``, ``300`` (seconds), ``0``; a negative
    value keeps models loaded forever (None).

    Raises:
        ValueError: anything else.
    """
    t = text.strip().lower()
    scale = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
    for suffix in ("ms", "s", "m", "h"):
        if t.endswith(suffix):
            number, factor = t[: -len(suffix)], scale[suffix]
            break
    else:
        number, factor = t, 1.0
    value = float(number) * factor  # ValueError for junk
    if not math.isfinite(value):
        raise ValueError(text)
    return None if value < 0 else value


__all__ = ["Loaded", "ModelManager", "for_server", "parse_duration", "servable"]
