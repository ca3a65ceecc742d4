"""llama.cpp's download cache, read-only: ``llamacpp:ORG/REPO[:TAG]`` (a model llama.cpp
fetched with ``-hf ORG/REPO:TAG``) and ``llamacpp:FILE.gguf`` (any GGUF file there).

The cache is ``$LLAMA_CACHE``, else ``$XDG_CACHE_HOME/llama.cpp`` or ``~/.cache/llama.cpp``
(``~/Library/Caches/llama.cpp`` on macOS, ``%LOCALAPPDATA%\\llama.cpp`` on Windows), as
llama.cpp's ``fs_get_cache_directory``. Its ``-hf`` downloads up to 2025 are flat files:
``ORG_REPO_FILE.gguf`` (each ``/`` of ``ORG/REPO`` and of the file's path made ``_``) with a
``.etag`` beside it, and the Hub's answer for each tag in ``manifest=ORG=REPO=TAG.json``
(``ggufFile.rfilename`` names the file). Newer llama.cpp keeps ``-hf`` downloads in the
Hugging Face cache, which :mod:`.huggingface` reads. A file whose ``.etag`` is a sha256 (the
Hub's etag of an LFS file) is checked against it on first use.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from ..errors import CorruptModelError, ModelNotFoundError, ParameterError
from . import LocalModel, dir_size
from .integrity import read_record, record_for, verify_file
from .select import check_text, is_model_file, split_info

PREFIX = "llamacpp:"
STORE = "llama.cpp"
_REPO = re.compile(r"[A-Za-z0-9_.\-]+/[A-Za-z0-9_.\-]+")  # llama.cpp's validate_repo_name
_FILE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*\.gguf", re.IGNORECASE)
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")
_ETAG = re.compile(r'^(?:W/)?"?([0-9a-f]{64})"?$')


def root() -> Path:
    """llama.cpp's cache directory (whether or not it exists)."""
    if os.environ.get("LLAMA_CACHE"):
        return Path(os.environ["LLAMA_CACHE"]).expanduser()
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "llama.cpp"
    if sys.platform == "win32" and os.environ.get("LOCALAPPDATA"):
        return Path(os.environ["LOCALAPPDATA"]) / "llama.cpp"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "llama.cpp"


def _parts(first: Path) -> tuple[Path, ...]:
    prefix, _, count = split_info(first.name)
    if count == 1:
        return (first,)
    return tuple(first.with_name(f"{prefix}-{i:05d}-of-{count:05d}.gguf")
                 for i in range(1, count + 1))


def _check(path: Path, name: str) -> None:
    """Verify ``path`` against the sha256 its ``.etag`` holds, if it holds one."""
    try:
        etag = (path.with_name(path.name + ".etag")).read_text(encoding="ascii")[:200].strip()
    except (OSError, UnicodeDecodeError):
        return
    m = _ETAG.match(etag)
    if m is None:
        return
    from ..paths import cache_dir

    verify_file(path, digest=m.group(1), record=record_for(cache_dir(), path, m.group(1)),
                fix="download it again with llama.cpp", label=f"verify {name}")


def _from_manifest(repo: str, tag: str) -> Path | None:
    manifest = root() / f"manifest={repo.replace('/', '=')}={tag}.json"
    data = read_record(manifest, limit=1 << 20)
    if data is None:
        return None
    rfilename = (data.get("ggufFile") or {}).get("rfilename") if isinstance(
        data.get("ggufFile"), dict) else None
    if not isinstance(rfilename, str) or not rfilename:
        raise CorruptModelError(f"{manifest}: no ggufFile.rfilename")
    local = f"{repo}_{rfilename}".replace("/", "_")
    if not _FILE.fullmatch(local):
        raise CorruptModelError(f"{manifest}: malformed file name {rfilename!r}")
    return root() / local


def resolve(text: str, *, pull: bool = True, progress: bool = True) -> LocalModel:
    """The file of llama.cpp's cache that ``text`` names.

    Raises:
        ParameterError: a malformed name.
        ModelNotFoundError: no such manifest or file.
        CorruptModelError: a malformed manifest, a file that fails its etag's sha256.
    """
    check_text(text)
    rest = text.removeprefix(PREFIX)
    if rest.lower().endswith(".gguf"):
        if not _FILE.fullmatch(rest) or ".." in rest:
            raise ParameterError(f"{text!r}: not a plain .gguf file name")
        path = root() / rest
    else:
        repo, _, tag = rest.partition(":")
        tag = tag or "latest"
        if not _REPO.fullmatch(repo) or ".." in repo or not _TAG.fullmatch(tag) or ".." in tag:
            raise ParameterError(f"{text!r} is not llamacpp:ORG/REPO[:TAG] or llamacpp:FILE.gguf")
        path = _from_manifest(repo, tag)
        if path is None:
            raise ModelNotFoundError(f"{text}: llama.cpp's cache ({root()}) has no manifest for "
                                     f"{repo}:{tag}")
    if not path.is_file():
        raise ModelNotFoundError(f"{text}: {path} is not in llama.cpp's cache")
    parts = _parts(path)
    for p in parts:
        if p.is_file():
            _check(p, text)
    return LocalModel(text, parts, dir_size(parts), STORE)


def list_models() -> list[LocalModel]:
    """Manifests as ``llamacpp:ORG/REPO:TAG``; other GGUF files as ``llamacpp:FILE.gguf``."""
    base = root()
    try:
        entries = sorted(base.iterdir())
    except OSError:
        return []
    out, named = [], set()
    for e in entries:
        m = re.fullmatch(r"manifest=([^=]+)=([^=]+)=([^=]+)\.json", e.name)
        if m is None:
            continue
        name = f"{PREFIX}{m.group(1)}/{m.group(2)}:{m.group(3)}"
        try:
            path = _from_manifest(f"{m.group(1)}/{m.group(2)}", m.group(3))
        except CorruptModelError:
            continue
        if path is not None and path.is_file():
            named.add(path.name)
            out.append(LocalModel(name, _parts(path), dir_size(_parts(path)), STORE))
    for e in entries:
        if (is_model_file(e.name) and e.name not in named and e.is_file()
                and _FILE.fullmatch(e.name) and split_info(e.name)[1] == 1):
            out.append(LocalModel(PREFIX + e.name, _parts(e), dir_size(_parts(e)), STORE))
    return out


__all__ = ["PREFIX", "list_models", "resolve", "root"]
