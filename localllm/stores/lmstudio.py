"""LM Studio's models folder, read-only: ``lmstudio:PUBLISHER/REPO[:TAG]`` (``lms get``
downloads, kept as ``MODELS/PUBLISHER/REPO/FILE.gguf``, the Hub's names).

The folder is the ``downloadsFolder`` of LM Studio's ``settings.json`` when set, else
``models/`` in LM Studio's home: the path in ``~/.lmstudio-home-pointer``, else
``~/.lmstudio``; installs before 0.3 used ``~/.cache/lm-studio/models``. The tag picks a file
of the folder as for Hugging Face (:mod:`.select`); split models load as one. LM Studio's
``import --symbolic-link`` leaves links to files elsewhere, so links are followed here.
LM Studio records no hash of its files: they are checked as GGUF files only.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from ..errors import ModelNotFoundError, ParameterError
from . import LocalModel, dir_size
from .select import check_text, models_in, name_for, select

PREFIX = "lmstudio:"
STORE = "LM Studio"
_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")
_MAX_FILES = 10_000


def home() -> Path:
    """LM Studio's home folder (``~/.lmstudio-home-pointer`` or ``~/.lmstudio``)."""
    try:
        pointer = (Path.home() / ".lmstudio-home-pointer").read_text(encoding="utf-8")[:4096]
        if pointer.strip():
            return Path(pointer.strip()).expanduser()
    except (OSError, UnicodeDecodeError):
        pass
    return Path.home() / ".lmstudio"


def roots() -> list[Path]:
    """The models folders that exist: the configured one, the default, the legacy one."""
    candidates = []
    try:
        settings = json.loads((home() / "settings.json").read_text(encoding="utf-8")[:1 << 20])
        folder = settings.get("downloadsFolder") if isinstance(settings, dict) else None
        if isinstance(folder, str) and folder:
            candidates.append(Path(folder).expanduser())
    except (OSError, ValueError, UnicodeDecodeError):
        pass
    candidates += [home() / "models", Path.home() / ".cache" / "lm-studio" / "models"]
    out = []
    for c in candidates:
        if c.is_dir() and c not in out:
            out.append(c)
    return out


def _files(folder: Path) -> list[str]:
    out = []
    for p in sorted(folder.rglob("*.gguf"))[:_MAX_FILES]:
        if p.is_file():
            out.append(p.relative_to(folder).as_posix())
    return out


def resolve(text: str, *, pull: bool = True, progress: bool = True) -> LocalModel:
    """The model of LM Studio's folder that ``text`` names.

    Raises:
        ParameterError: a malformed name.
        ModelNotFoundError: no such folder, no GGUF model, no file for the tag, or several.
    """
    check_text(text)
    repo, _, tag = text.removeprefix(PREFIX).partition(":")
    parts = repo.split("/")
    if len(parts) != 2 or not all(_PART.fullmatch(p) and ".." not in p for p in parts):
        raise ParameterError(f"{text!r} is not lmstudio:PUBLISHER/REPO[:TAG]")
    if tag and (not _TAG.fullmatch(tag) or ".." in tag):
        raise ParameterError(f"{text!r}: {tag!r} is not a quant tag or a .gguf file name")
    for base in roots():
        folder = base / parts[0] / parts[1]
        if folder.is_dir():
            files = _files(folder)
            model = select(files, tag or None, f"{PREFIX}{repo}")
            paths = tuple(folder / p for p in model.parts)
            return LocalModel(name_for(f"{PREFIX}{repo}", model, files), paths,
                              dir_size(paths), STORE)
    where = ", ".join(str(r) for r in roots()) or "~/.lmstudio/models (absent)"
    raise ModelNotFoundError(f"{text}: no such model in LM Studio's folder ({where})")


def list_models() -> list[LocalModel]:
    """Every GGUF model of LM Studio's folders, named ``lmstudio:PUBLISHER/REPO:TAG``."""
    out = []
    for base in roots():
        for folder in sorted(p for p in base.glob("*/*") if p.is_dir()):
            repo = f"{folder.parent.name}/{folder.name}"
            if not all(_PART.fullmatch(p) for p in repo.split("/")):
                continue
            files = _files(folder)
            for model in models_in(files):
                paths = tuple(folder / p for p in model.parts)
                out.append(LocalModel(name_for(f"{PREFIX}{repo}", model, files), paths,
                                      dir_size(paths), STORE))
    return out


__all__ = ["PREFIX", "home", "list_models", "resolve", "roots"]
