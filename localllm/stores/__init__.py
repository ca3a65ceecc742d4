"""Models that live outside ``models.toml``: Hugging Face repositories (pulled into the
standard Hugging Face cache) and the GGUF files other tools already downloaded — Ollama's
store, llama.cpp's cache, LM Studio's models folder — used where they are, read-only.

Names (MODEL on the command line, a server request's ``model``):

=================================  ========================================================
``hf.co/ORG/REPO[:TAG]``           a Hugging Face repository (also ``huggingface.co/...``
                                   and, when no such file exists, plain ``ORG/REPO[:TAG]``);
                                   :mod:`.huggingface`
``ollama:NAME[:TAG]``              a model Ollama pulled (``ollama:qwen3:8b``); :mod:`.ollama`
``llamacpp:ORG/REPO[:TAG]``        llama.cpp's ``-hf`` cache; ``llamacpp:FILE.gguf``;
                                   :mod:`.llamacpp`
``lmstudio:PUBLISHER/REPO[:TAG]``  LM Studio's models folder; :mod:`.lmstudio`
=================================  ========================================================

:func:`find` turns such a name into a :class:`LocalModel`; :func:`list_local` lists every
model of every store on this machine. Each store module is imported only when used.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ModelNotFoundError

# prefix -> module of this package
PREFIXES = {"ollama:": "ollama", "llamacpp:": "llamacpp", "lmstudio:": "lmstudio"}
STORES = ("huggingface", "ollama", "llamacpp", "lmstudio")


@dataclass
class LocalModel:
    """A GGUF model found in a store.

    Attributes:
        name: the name that finds it again (``hf.co/org/repo:Q4_K_M``, ``ollama:qwen3:8b``).
        parts: its files, first part first (one, or a split model's parts in order).
        size: bytes of all parts.
        store: which tool's store holds it (``Hugging Face``, ``Ollama``, ...).
        sampling: default sampling parameters, llama.cpp's names (Ollama's ``params``).
        system: default system prompt (Ollama's ``system``).
        template: the store's own prompt template, when it has one of its own (Ollama's Go
            template: shown by ``show``, not rendered; the GGUF's Jinja template is used).
        license: the license text the store keeps beside the model, if any.
        stop: stop strings the store declares (Ollama's ``params``).
    """

    name: str
    parts: tuple[Path, ...]
    size: int
    store: str
    sampling: dict = field(default_factory=dict)
    system: str | None = None
    template: str | None = None
    license: str | None = None
    stop: tuple[str, ...] = ()

    @property
    def path(self) -> Path:
        return self.parts[0]


def _module(name: str):
    return importlib.import_module(f"{__name__}.{name}")


def store_for(text: str):
    """The store module a name belongs to, or None when it is not a store name."""
    for prefix, module in PREFIXES.items():
        if text.startswith(prefix):
            return _module(module)
    hf = _module("huggingface")
    return hf if hf.looks_like(text) else None


def find(text: str, *, pull: bool = True, progress: bool = True) -> LocalModel:
    """The model a store name names, pulled from the Hub first when it is a Hugging Face
    name that is not cached (and ``pull``).

    Raises:
        ModelNotFoundError: not a store name, or the store has no such model.
        ParameterError: a malformed name (``..``, control characters ...).
        PullError / CorruptModelError: see :func:`localllm.stores.huggingface.resolve`.
    """
    store = store_for(text)
    if store is None:
        raise ModelNotFoundError(f"{text!r} is not a store model name")
    return store.resolve(text, pull=pull, progress=progress)


def list_local() -> list[LocalModel]:
    """Every model in every store on this machine (nothing hashed or pulled)."""
    out: list[LocalModel] = []
    for name in STORES:
        out.extend(_module(name).list_models())
    return out


def dir_size(paths) -> int:
    """Bytes of ``paths`` (symlinks followed; a missing file counts 0)."""
    total = 0
    for p in paths:
        try:
            total += Path(p).stat().st_size
        except OSError:
            pass
    return total


__all__ = ["PREFIXES", "STORES", "LocalModel", "dir_size", "find", "list_local", "store_for"]
