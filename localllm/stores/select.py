"""Which GGUF file of a repository a quant tag names (llama.cpp's ``-hf REPO:TAG`` rule), and
the checks every store applies to the names users type.

llama.cpp (``common/download.cpp``, ``find_best_model``): the tag is matched case-insensitively
against the file paths as ``TAG`` followed by ``.`` or ``-``; without a tag ``Q4_K_M`` is
tried, then ``Q8_0``. Files that are not models (``mmproj``, ``imatrix``, speculative-decoding
heads) are skipped, and a split model (``NAME-00001-of-00003.gguf`` ...) counts as one model
named by its first part. Where llama.cpp takes the first match in listing order, this refuses
a tag that matches several models and names them; a tag may also be a whole file name
(``REPO:model-Q4_K_M.gguf``), as llama.cpp's ``--hf-file``. The match also needs a boundary
before the tag, so that ``F16`` does not pick ``BF16``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import ModelNotFoundError, ParameterError

DEFAULT_TAGS = ("Q4_K_M", "Q8_0")
_NOT_MODELS = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")
_SPLIT = re.compile(r"^(?P<prefix>.+)-(?P<no>[0-9]{5})-of-(?P<count>[0-9]{5})$", re.IGNORECASE)
_TAG_AT_END = re.compile(r"[-.]([A-Za-z0-9_]+)$")
# Control characters (C0, DEL, C1) and the bidirectional overrides: never part of a name.
_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")
MAX_NAME = 512


@dataclass(frozen=True)
class GGUFModel:
    """One model among a repository's files: its parts (one, or a split's in order), the tag
    its name carries (``Q4_K_M``, upper case; "" if none)."""

    parts: tuple[str, ...]
    tag: str

    @property
    def first(self) -> str:
        return self.parts[0]


def check_text(text: str, what: str = "model name") -> str:
    """``text`` if it is a possible name: not empty, at most 512 characters, no control or
    bidi characters.

    Raises:
        ParameterError: naming what is wrong (the text itself shown escaped).
    """
    if not isinstance(text, str) or not text:
        raise ParameterError(f"the {what} is empty")
    if len(text) > MAX_NAME:
        raise ParameterError(f"the {what} is longer than {MAX_NAME} characters")
    if _UNPRINTABLE.search(text):
        raise ParameterError(f"the {what} {text!r} holds control characters")
    return text


def check_relative(path: str, what: str) -> str:
    """A relative file path inside a repository or store: no empty, ``.`` or ``..`` segment,
    no leading ``/``, no backslash.

    Raises:
        ParameterError: a path that could leave its folder.
    """
    check_text(path, what)
    parts = path.split("/")
    if "\\" in path or any(p in ("", ".", "..") for p in parts):
        raise ParameterError(f"the {what} {path!r} is not a plain relative path "
                             "(no '..', leading '/' or empty segment)")
    return path


def split_info(path: str) -> tuple[str, int, int]:
    """(prefix, number, count) of a GGUF path: ``a/m-Q4_K_M-00002-of-00003.gguf`` ->
    (``a/m-Q4_K_M``, 2, 3); an unsplit file is part 1 of 1."""
    stem = path[: -len(".gguf")] if path.lower().endswith(".gguf") else path
    m = _SPLIT.match(stem)
    if m is None:
        return stem, 1, 1
    return m.group("prefix"), int(m.group("no")), int(m.group("count"))


def tag_of(path: str) -> str:
    """The quant tag a file name ends with (``Model-Q4_K_M.gguf`` -> ``Q4_K_M``), or ""."""
    prefix = split_info(path)[0].rsplit("/", 1)[-1]
    m = _TAG_AT_END.search(prefix)
    return m.group(1).upper() if m else ""


def is_model_file(path: str) -> bool:
    name = path.rsplit("/", 1)[-1].lower()
    return name.endswith(".gguf") and not any(k in name for k in _NOT_MODELS)


def models_in(files: list[str]) -> list[GGUFModel]:
    """The GGUF models among ``files`` (repository-relative paths), splits grouped; a split
    whose parts are not all listed is left out."""
    present = set(files)
    out = []
    for f in sorted(files):
        if not is_model_file(f):
            continue
        prefix, no, count = split_info(f)
        if no != 1:
            continue
        if count == 1:
            out.append(GGUFModel((f,), tag_of(f)))
            continue
        parts = tuple(f"{prefix}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1))
        if all(p in present for p in parts):
            out.append(GGUFModel(parts, tag_of(f)))
    return out


def select(files: list[str], tag: str | None, where: str) -> GGUFModel:
    """The model ``tag`` names among ``files`` (see the module docstring).

    Args:
        where: names the repository in errors (``hf.co/org/repo``).
    Raises:
        ModelNotFoundError: no GGUF model, no match for the tag, or several matches (each
            message lists what there is).
    """
    models = models_in(files)
    if not models:
        raise ModelNotFoundError(f"{where} has no GGUF model file")
    if tag and tag.lower().endswith(".gguf"):
        hits = [m for m in models if tag.lower() in (m.first.lower(),
                                                     m.first.rsplit("/", 1)[-1].lower())]
        if not hits:
            raise ModelNotFoundError(f"{where} has no model file {tag!r} "
                                     f"(there are: {_listing(models)})")
        return _one(hits, tag, where)
    for t in (tag,) if tag else DEFAULT_TAGS:
        pattern = re.compile(r"(?<![A-Za-z0-9])" + re.escape(t) + r"[.-]", re.IGNORECASE)
        hits = [m for m in models if pattern.search(m.first)]
        if hits:
            return _one(hits, t, where)
    if tag:
        raise ModelNotFoundError(f"{where} has no file for tag {tag!r} "
                                 f"(tags: {_tags(models)})")
    if len(models) == 1:
        return models[0]
    raise ModelNotFoundError(f"{where} has several GGUF models and none is Q4_K_M or Q8_0: "
                             f"add :TAG (tags: {_tags(models)})")


def name_for(where: str, model: GGUFModel, files: list[str]) -> str:
    """``WHERE:TAG`` when that tag picks ``model`` among ``files``, else ``WHERE:FILE``."""
    if model.tag:
        try:
            if select(files, model.tag, where) == model:
                return f"{where}:{model.tag}"
        except ModelNotFoundError:
            pass
    return f"{where}:{model.first}"


def _one(hits: list[GGUFModel], tag: str, where: str) -> GGUFModel:
    if len(hits) > 1:
        raise ModelNotFoundError(f"tag {tag!r} matches {len(hits)} models in {where}: "
                                 f"{_listing(hits)}; name one with :FILE.gguf")
    return hits[0]


def _listing(models: list[GGUFModel], most: int = 8) -> str:
    names = [m.first for m in models[:most]]
    return ", ".join(names) + (f" and {len(models) - most} more" if len(models) > most else "")


def _tags(models: list[GGUFModel]) -> str:
    tags = sorted({m.tag for m in models if m.tag})
    return ", ".join(tags) if tags else _listing(models)


__all__ = ["DEFAULT_TAGS", "GGUFModel", "check_relative", "check_text", "is_model_file",
           "models_in", "name_for", "select", "split_info", "tag_of"]
