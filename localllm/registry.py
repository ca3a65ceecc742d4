"""The model registry (``models.toml``): names -> GGUF files and per-model defaults.

Files read, later ones overriding earlier entries of the same name:

1. ``models.toml`` shipped with localllm (package data, :mod:`localllm.data`; its source is
   ``models.toml`` at the project's top level);
2. ``$XDG_CONFIG_HOME/localllm/models.toml`` (the user's own entries);
3. the file named by ``$LOCALLLM_MODELS``, when set.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from .atomic import atomic_output
from .data import MODELS_TOML as PROJECT_MODELS
from .errors import LocalLLMError, ModelNotFoundError


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

    @property
    def source(self) -> str:
        return f"package {self.package}" if self.package else f"file {self.path}"

    def status(self) -> str:
        """'present', or what is missing."""
        if self.path:
            return "present" if Path(self.path).expanduser().is_file() else "missing file"
        module = (self.assembler or "").split(":")[0]
        if module and importlib.util.find_spec(module) is not None:
            return "present"
        return f"not installed (pip install {self.package})"

    def resolve(self) -> Path:
        """The GGUF path, assembling the package's file on first use.

        Raises:
            ModelNotFoundError: the package is not installed or the file is missing.
        """
        if self.path:
            p = Path(self.path).expanduser()
            if not p.is_file():
                raise ModelNotFoundError(f"model {self.name!r}: file {p} does not exist")
            return p
        if not self.assembler or ":" not in self.assembler:
            raise LocalLLMError(f"models.toml: model {self.name!r} needs 'path' or 'assembler'")
        module_name, func_name = self.assembler.split(":", 1)
        if importlib.util.find_spec(module_name) is None:
            raise ModelNotFoundError(
                f"model {self.name!r} is not installed: pip install {self.package}")
        stamp = AssemblyStamp(self)
        path = stamp.lookup()
        if path is not None:  # assembled and checked before, unchanged since
            return path
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            raise ModelNotFoundError(
                f"model {self.name!r} is not installed: pip install {self.package}"
            ) from None
        path = Path(getattr(module, func_name)())
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


@dataclass
class Registry:
    default: str
    models: dict[str, ModelEntry]

    def resolve(self, model: str | os.PathLike | None) -> tuple[Path, ModelEntry | None]:
        """MODEL (a registry name, a path, or None for the default) -> (path, entry).

        Raises:
            ModelNotFoundError: neither a known name nor an existing file.
        """
        if model is None:
            model = self.default
        text = str(model)
        if text in self.models:
            entry = self.models[text]
            return entry.resolve(), entry
        path = Path(text).expanduser()
        if path.is_file():
            return path, None
        known = ", ".join(sorted(self.models)) or "none"
        raise ModelNotFoundError(
            f"model {text!r} is neither a name in models.toml (known: {known}) nor an existing file"
        )


def config_files() -> list[Path]:
    from platformdirs import user_config_dir

    files = [PROJECT_MODELS, Path(user_config_dir("localllm")) / "models.toml"]
    if os.environ.get("LOCALLLM_MODELS"):
        files.append(Path(os.environ["LOCALLLM_MODELS"]))
    return [f for f in files if f.is_file()]


def load_registry(files: list[Path] | None = None) -> Registry:
    """Read and merge the registry files.

    Raises:
        LocalLLMError: a file is not valid TOML or an entry has unknown keys.
    """
    default, models = "gemma3-270m", {}
    for f in config_files() if files is None else files:
        try:
            data = tomllib.loads(f.read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise LocalLLMError(f"{f}: cannot read model registry: {e}") from None
        default = data.get("default", default)
        for name, table in data.get("models", {}).items():
            try:
                models[name] = ModelEntry(name=name, **table)
            except TypeError as e:
                raise LocalLLMError(f"{f}: [models.{name}]: {e}") from None
    return Registry(default, models)
