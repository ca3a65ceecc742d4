"""Ollama's model store, read-only: ``ollama:NAME[:TAG]`` (``ollama:qwen3:8b``,
``ollama:hf.co/ORG/REPO:Q4_K_M``) resolves to the GGUF blob Ollama pulled, with its default
parameters, system prompt, template and license.

Layout (Ollama's ``server/modelpath.go``, ``types/model/name.go``): the store is
``$OLLAMA_MODELS``, else ``~/.ollama/models`` (and, for Linux's system service,
``/usr/share/ollama/.ollama/models``). A name ``[HOST/][NAMESPACE/]MODEL[:TAG]`` (defaults
``registry.ollama.ai``, ``library``, ``latest``) has a manifest at
``manifests/HOST/NAMESPACE/MODEL/TAG``: an OCI image manifest whose layers are blobs named by
digest, ``blobs/sha256-HEX``, each of a media type — ``application/vnd.ollama.image.model``
(the GGUF), ``.template`` (a Go template: shown, not rendered; the GGUF's own Jinja template
is used), ``.system``, ``.params`` (JSON options), ``.license``.

Nothing is copied or written there. The GGUF blob is checked against its digest on first use
(and after any change: :mod:`.integrity`, stamps kept in localllm's cache); the small layers
are read at most 1 MiB and checked as they are read.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

from ..errors import CorruptModelError, ModelNotFoundError, ParameterError
from . import LocalModel
from .integrity import open_regular, record_for, verify_file
from .select import check_text

PREFIX = "ollama:"
STORE = "Ollama"
DEFAULT_HOST, DEFAULT_NAMESPACE, DEFAULT_TAG = "registry.ollama.ai", "library", "latest"
MEDIA = "application/vnd.ollama.image."
_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,79}")
_HOST = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,349}(?::[0-9]{1,5})?")
_DIGEST = re.compile(r"sha256[:-]([0-9a-f]{64})")
_MAX_LAYER = 1 << 20  # template, system, params, license, manifest
# Ollama's option names -> llama.cpp's sampling names (SamplingParams fields).
OPTIONS = {"temperature": "temp", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
           "typical_p": "typ_p", "repeat_penalty": "penalty_repeat",
           "repeat_last_n": "penalty_last_n", "frequency_penalty": "penalty_freq",
           "presence_penalty": "penalty_present", "mirostat": "mirostat",
           "mirostat_tau": "mirostat_tau", "mirostat_eta": "mirostat_eta", "seed": "seed"}


def roots() -> list[Path]:
    """Where Ollama keeps models: ``$OLLAMA_MODELS``, else the user's and the Linux service's
    default folders (those that exist)."""
    env = os.environ.get("OLLAMA_MODELS")
    if env:
        return [Path(env).expanduser()]
    candidates = [Path.home() / ".ollama" / "models", Path("/usr/share/ollama/.ollama/models")]
    return [c for c in candidates if c.is_dir()]


def parse(text: str) -> tuple[str, str, str, str]:
    """``ollama:[HOST/][NAMESPACE/]MODEL[:TAG]`` -> (host, namespace, model, tag).

    Raises:
        ParameterError: a malformed name (``..``, an empty part, too many ``/``, control
            characters).
    """
    check_text(text)
    name = text.removeprefix(PREFIX)
    base, tag = name, DEFAULT_TAG
    if ":" in name.rsplit("/", 1)[-1]:
        base, tag = name.rsplit(":", 1)
    parts = base.split("/")
    if len(parts) > 3 or not all(parts):
        raise ParameterError(f"{text!r} is not an Ollama model name ([HOST/][NAMESPACE/]MODEL"
                             "[:TAG])")
    host, namespace = DEFAULT_HOST, DEFAULT_NAMESPACE
    if len(parts) == 3:
        host, namespace, model = parts
    elif len(parts) == 2:
        namespace, model = parts
    else:
        (model,) = parts
    for part in (namespace, model, tag):
        if not _PART.fullmatch(part) or ".." in part:
            raise ParameterError(f"{text!r}: {part!r} is not a valid part of an Ollama name")
    if not _HOST.fullmatch(host) or ".." in host:
        raise ParameterError(f"{text!r}: {host!r} is not a valid Ollama registry host")
    return host, namespace, model, tag


def short_name(host: str, namespace: str, model: str, tag: str) -> str:
    """The name as ``ollama list`` shows it, prefixed: ``ollama:qwen3:8b``."""
    if host == DEFAULT_HOST:
        base = model if namespace == DEFAULT_NAMESPACE else f"{namespace}/{model}"
    else:
        base = f"{host}/{namespace}/{model}"
    return f"{PREFIX}{base}:{tag}"


def _manifest_path(root: Path, parts: tuple[str, str, str, str]) -> Path | None:
    """The manifest of ``parts`` under ``root``, matched case-insensitively as Ollama does."""
    path = root / "manifests"
    for part in parts:
        try:
            names = {p.name.lower(): p.name for p in path.iterdir()}
        except OSError:
            return None
        if part.lower() not in names:
            return None
        path = path / names[part.lower()]
    return path if path.is_file() else None


def _read_limited(path: Path, what: str) -> bytes:
    fd = open_regular(path)
    try:
        data = os.read(fd, _MAX_LAYER + 1)
    finally:
        os.close(fd)
    if len(data) > _MAX_LAYER:
        raise CorruptModelError(f"{path}: {what} larger than {_MAX_LAYER >> 20} MiB")
    return data


def _blob(root: Path, digest: object, where: str) -> tuple[Path, str]:
    m = _DIGEST.fullmatch(str(digest))
    if m is None:
        raise CorruptModelError(f"{where}: malformed layer digest {str(digest)[:80]!r}")
    hexdigest = m.group(1)
    for name in (f"sha256-{hexdigest}", f"sha256:{hexdigest}"):  # older Ollama used ':'
        path = root / "blobs" / name
        if path.exists() or path.is_symlink():
            return path, hexdigest
    raise CorruptModelError(f"{where}: blob sha256-{hexdigest[:12]}... is missing from "
                            f"{root / 'blobs'} (ollama pull it again)")


def _layer_text(root: Path, layer: dict, where: str) -> str:
    path, hexdigest = _blob(root, layer.get("digest"), where)
    data = _read_limited(path, "layer")
    if hashlib.sha256(data).hexdigest() != hexdigest:
        raise CorruptModelError(f"{where}: blob {path.name[:19]}... does not match its digest")
    return data.decode("utf-8", "replace")


def _load(root: Path, manifest: Path, name: str, *, check: bool) -> LocalModel:
    """Read ``manifest`` (and its small layers); ``check``: verify the GGUF blob's sha256."""
    where = f"{name} ({manifest})"
    try:
        doc = json.loads(_read_limited(manifest, "manifest"))
        layers = doc["layers"]
        if not isinstance(layers, list):
            raise TypeError
    except (ValueError, KeyError, TypeError):
        raise CorruptModelError(f"{where}: not an Ollama manifest") from None
    by_type: dict[str, list[dict]] = {}
    for layer in layers:
        if isinstance(layer, dict) and isinstance(layer.get("mediaType"), str):
            by_type.setdefault(layer["mediaType"].removeprefix(MEDIA), []).append(layer)
    models = by_type.get("model", [])
    if len(models) != 1:
        raise CorruptModelError(f"{where}: {len(models)} model layers, expected one")
    path, hexdigest = _blob(root, models[0].get("digest"), where)
    if check:
        verify_file(path, digest=hexdigest, record=record_for(_cache(), path, hexdigest),
                    fix="run `ollama pull` to fetch it again", label=f"verify {name}")

    def text(kind: str) -> str | None:
        found = by_type.get(kind)
        return "\n\n".join(_layer_text(root, layer, where) for layer in found) if found else None

    sampling, stop = {}, ()
    params = text("params")
    if params:
        try:
            options = json.loads(params)
        except ValueError:
            raise CorruptModelError(f"{where}: its params layer is not JSON") from None
        if isinstance(options, dict):
            for key, value in options.items():
                if key in OPTIONS and isinstance(value, (int, float)) and not isinstance(value, bool):
                    sampling[OPTIONS[key]] = value
            if isinstance(options.get("stop"), list):
                stop = tuple(s for s in options["stop"] if isinstance(s, str))
    try:
        size = path.stat().st_size
    except OSError:
        size = 0
    return LocalModel(name, (path,), size, STORE, sampling=sampling, system=text("system"),
                      template=text("template"), license=text("license"), stop=stop)


def _cache() -> Path:
    from ..paths import cache_dir

    return cache_dir()


def resolve(text: str, *, pull: bool = True, progress: bool = True) -> LocalModel:
    """The model Ollama keeps under ``text`` (``ollama:NAME[:TAG]``), its blob checked.

    Raises:
        ParameterError: a malformed name.
        ModelNotFoundError: no such manifest in any store folder.
        CorruptModelError: a malformed manifest, a missing or tampered blob.
    """
    parts = parse(text)
    for root in roots():
        manifest = _manifest_path(root, parts)
        if manifest is not None:
            return _load(root, manifest, short_name(*parts), check=True)
    where = ", ".join(str(r) for r in roots()) or "~/.ollama/models (absent)"
    raise ModelNotFoundError(f"{short_name(*parts)} is not in Ollama's store ({where})")


def list_models() -> list[LocalModel]:
    """Every model of Ollama's store(s) (manifests read, blobs not hashed)."""
    out = []
    for root in roots():
        base = root / "manifests"
        try:
            hosts = sorted(base.iterdir())
        except OSError:
            continue
        for manifest in _walk(hosts, 3):
            parts = manifest.relative_to(base).parts
            try:
                out.append(_load(root, manifest, short_name(*parts), check=False))
            except (CorruptModelError, ParameterError, OSError):
                continue
    return out


def _walk(dirs: list[Path], depth: int):
    for d in dirs:
        try:
            children = sorted(d.iterdir()) if d.is_dir() and not d.is_symlink() else []
        except OSError:
            continue
        if depth == 0:
            if d.is_file():
                yield d
            continue
        yield from _walk(children, depth - 1)


__all__ = ["OPTIONS", "PREFIX", "list_models", "parse", "resolve", "roots", "short_name"]
