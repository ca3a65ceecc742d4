"""The user's own ``models.toml`` (in the config dir: ``$XDG_CONFIG_HOME/localllm``), written by
``localllm create`` and ``cp`` and edited by ``rm``: Ollama's Modelfile idea — a name for a
model with its own system prompt, sampling defaults and template — as registry entries,
without a new file format.

An entry ``create`` writes::

    [models.my-assistant]
    from = "hf.co/ORG/REPO:Q4_K_M"     # any MODEL: a name, a store name, a .gguf path
    system = "You answer in French."
    chat_template = "{% for m in messages %}..."   # --template FILE, inlined
    [models.my-assistant.sampling]
    temp = 0.3

The file is edited in place: only the tables of the entry written are replaced (the user's
comments and other entries stay), the result is parsed again and checked as the registry
checks it before it replaces the file (atomically); an edit that would not give exactly the
intended registry is refused.
"""

from __future__ import annotations

import math
import re
import tomllib
from pathlib import Path

from .atomic import atomic_output
from .errors import LocalLLMError, ModelNotFoundError, ParameterError
from .paths import user_models_file as user_file

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
MAX_SYSTEM = 64 * 1024
_HEADER = re.compile(r"^\s*\[\[?\s*([^\]]*?)\s*\]\]?\s*(?:#.*)?$")
_FIELDS = ("base", "path", "package", "assembler", "version", "file", "sha256", "size",
           "chat_template", "system", "notes")


def check_name(name: str) -> str:
    """A name ``create``/``cp`` may write: 1-64 letters, digits, ``.``, ``_``, ``-``, starting
    with a letter or digit, no ``..`` (it never reads as a path or a store name).

    Raises:
        ParameterError: naming the rule.
    """
    if not isinstance(name, str) or not NAME.fullmatch(name) or ".." in name:
        shown = name.encode("unicode_escape").decode("ascii") if isinstance(name, str) else name
        raise ParameterError(f"model name {shown!r}: use 1-64 letters, digits, '.', '_' or '-', "
                             "starting with a letter or digit (no '/', ':' or '..')")
    return name


def entry_table(entry) -> dict:
    """The models.toml table of a :class:`localllm.registry.ModelEntry` (set fields only)."""
    table = {}
    for key in _FIELDS:
        value = getattr(entry, key)
        if value not in (None, ""):
            table["from" if key == "base" else key] = value
    if entry.sampling:
        table["sampling"] = dict(entry.sampling)
    return table


def create(name: str, base: str, *, system: str | None = None, template: Path | None = None,
           sampling: dict | None = None, notes: str | None = None) -> Path:
    """Write ``[models.NAME]`` built ``from`` model ``base`` into the user's models.toml.

    Args:
        base: any MODEL (checked to resolve now: a Hugging Face model is pulled).
        system: default system prompt (at most 64 KiB).
        template: a Jinja chat template file (at most 128 KiB, compiled now), inlined.
        sampling: llama.cpp sampling names -> values (checked as ``SamplingParams``).
    Returns:
        The file written.
    Raises:
        ParameterError: a bad name, system prompt or sampling value.
        ModelNotFoundError: ``base`` resolves to nothing.
        TemplateError: the template does not compile.
        LocalLLMError: NAME is a packaged model's, or the file cannot be edited or written.
    """
    from .registry import load_registry

    check_name(name)
    registry = load_registry()
    registry.resolve(base)  # it must exist (and be pulled) now, as Ollama's FROM
    table: dict = {"from": base}
    if system is not None:
        if len(system) > MAX_SYSTEM or "\x00" in system:
            raise ParameterError(f"--system: at most {MAX_SYSTEM // 1024} KiB of text")
        table["system"] = system
    if template is not None:
        table["chat_template"] = _read_template(template)
    if sampling:
        from .sampling.chain import SamplingParams

        SamplingParams.from_dict(dict(sampling))  # one error line naming a bad value
        table["sampling"] = dict(sampling)
    if notes:
        table["notes"] = notes
    return write_entry(name, table)


def copy(source: str, name: str) -> Path:
    """``cp SOURCE NAME``: NAME gets SOURCE's models.toml entry, or, for a file or a store
    model, an entry built ``from`` it.

    Raises:
        ModelNotFoundError: SOURCE resolves to nothing.
        LocalLLMError: see :func:`write_entry`.
    """
    from .registry import load_registry

    check_name(name)
    registry = load_registry()
    entry = registry.models.get(source)
    if entry is not None:
        return write_entry(name, entry_table(entry))
    path, _ = registry.resolve(source, pull=False)
    is_file = Path(source).expanduser().is_file()
    return write_entry(name, {"path": str(path.resolve())} if is_file else {"from": source})


def remove(name: str) -> Path:
    """Delete ``[models.NAME]`` from the user's models.toml.

    Raises:
        ModelNotFoundError: the user's file has no such entry.
    """
    if name not in _models(_read(user_file())):
        raise ModelNotFoundError(f"model {name!r} is not in your models.toml ({user_file()})")
    return write_entry(name, None)


def owns(name: str) -> bool:
    """True when the user's models.toml defines ``name``."""
    try:
        return name in _models(_read(user_file()))
    except LocalLLMError:
        return False


def write_entry(name: str, table: dict | None) -> Path:
    """Replace (``table``) or delete (None) the entry ``name`` of the user's models.toml.

    Raises:
        LocalLLMError: NAME belongs to the packaged registry; the file is not valid TOML, its
            entry cannot be rewritten without touching anything else, the result fails the
            registry's checks, or it cannot be written.
    """
    from .data import MODELS_TOML
    from .registry import ModelEntry, load_registry

    path = user_file()
    if table is not None and name in load_registry([MODELS_TOML]).models:
        raise LocalLLMError(f"{name!r} is a packaged model's name: choose another")
    if table is not None:  # the registry's checks of the entry, before any file is touched
        try:
            ModelEntry(name=name, **{("base" if k == "from" else k): v for k, v in table.items()})
        except TypeError as e:
            raise LocalLLMError(f"[models.{name}]: {e}") from None
    text = path.read_text(encoding="utf-8") if path.is_file() else ""
    before = _read(path)
    kept = _without(text, name)
    if table is not None:
        kept = kept.rstrip("\n") + ("\n\n" if kept.strip() else "") + _tables(name, table)
    try:
        after = tomllib.loads(kept)
    except tomllib.TOMLDecodeError as e:
        raise LocalLLMError(f"{path}: editing {name!r} gave invalid TOML ({e}): edit the file "
                            "by hand") from None
    expected = dict(before)
    models = dict(_models(expected))
    models.pop(name, None)
    if table is not None:
        models[name] = table
    if models or "models" in expected:
        expected["models"] = models
    if after != expected:
        raise LocalLLMError(f"{path}: cannot rewrite {name!r} without touching other entries "
                            "(an inline table?): edit the file by hand")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_output(path) as tmp:
            tmp.write_text(kept, encoding="utf-8")
            load_registry([tmp])  # the registry's own checks, before the file is replaced
    except OSError as e:
        raise LocalLLMError(f"cannot write {path}: {e.strerror or e}") from None
    return path


def _read(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise LocalLLMError(f"{path}: cannot read: {e}: fix or remove it") from None


def _models(doc: dict) -> dict:
    models = doc.get("models", {})
    return models if isinstance(models, dict) else {}


def _without(text: str, name: str) -> str:
    """``text`` without the tables ``[models.NAME]`` and ``[models.NAME.*]`` (header to the
    next header that is not one of them)."""
    out, skipping = [], False
    for line in text.splitlines(keepends=True):
        m = _HEADER.match(line)
        if m:
            skipping = _key_path(m.group(1))[:2] == ["models", name]
        if not skipping:
            out.append(line)
    return "".join(out)


def _key_path(key: str) -> list[str]:
    try:
        doc = tomllib.loads(f"[{key}]\n")
    except tomllib.TOMLDecodeError:
        return []
    path = []
    while isinstance(doc, dict) and len(doc) == 1:
        k = next(iter(doc))
        path.append(k)
        doc = doc[k]
    return path


def _tables(name: str, table: dict) -> str:
    lines = [f"[models.{_key(name)}]"]
    lines += [f"{_key(k)} = {_value(v)}" for k, v in table.items() if k != "sampling"]
    if table.get("sampling"):
        lines += ["", f"[models.{_key(name)}.sampling]"]
        lines += [f"{_key(k)} = {_value(v)}" for k, v in table["sampling"].items()]
    return "\n".join(lines) + "\n"


def _key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else _string(key)


def _string(s: str) -> str:
    """A TOML basic string: quotes, backslashes and control characters escaped."""
    out = []
    for ch in s:
        if ch in ('"', "\\"):
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ParameterError(f"{v!r} is not a finite number")
        return repr(v)
    if isinstance(v, str):
        return _string(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_key(str(k))} = {_value(x)}" for k, x in v.items()) + "}"
    raise ParameterError(f"cannot write {type(v).__name__} {v!r} to models.toml")


def _read_template(path: Path) -> str:
    from .chat.template import MAX_TEMPLATE_CHARS, ChatTemplate

    try:
        with open(path, "rb") as f:
            data = f.read(4 * MAX_TEMPLATE_CHARS + 1)
        text = data.decode("utf-8")
    except OSError as e:
        raise LocalLLMError(f"--template {path}: cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise LocalLLMError(f"--template {path}: not UTF-8 (byte {e.start})") from None
    ChatTemplate(str(path), text)  # compiles it: a TemplateError names the line
    return text


__all__ = ["check_name", "copy", "create", "entry_table", "owns", "remove", "user_file",
           "write_entry"]
