"""Ollama's model verbs: ``show``, ``create``, ``cp`` (``pull``/``rm``/``models`` are in
:mod:`localllm.cli.pull`, ``ps`` asks a running ``serve``)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

import typer

from .terminal import printable

# Control characters but newline and tab, C1 controls, separators and bidi overrides: a
# template or a license printed whole (--template, --license) must not drive the terminal.
_UNPRINTABLE = re.compile(
    r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def _text(s: object) -> str:
    return _UNPRINTABLE.sub("", str(s))


def _line(s: object, most: int = 100) -> str:
    t = " ".join(printable(s).split())
    return t if len(t) <= most else t[: most - 1] + "…"


def show_command(
    model: Annotated[str, typer.Argument(help="models.toml name, .gguf path or store name")],
    template: Annotated[bool, typer.Option("--template", help="print the template only")] = False,
    parameters: Annotated[bool, typer.Option(
        "--parameters", help="print the default parameters only")] = False,
    system: Annotated[bool, typer.Option("--system", help="print the system prompt only")] = False,
    license_: Annotated[bool, typer.Option("--license", help="print the license only")] = False,
) -> None:
    """Architecture, parameters, context, quantization, template, default parameters, system
    prompt and license of a model (its weights are not loaded; nothing is pulled)."""
    from .. import stores
    from ..gguf.file import open_gguf
    from ..hub import human_size
    from ..registry import load_registry
    from .info import file_type_name

    path, entry = load_registry().resolve(model, pull=False)
    local = None
    if model not in load_registry().models and stores.store_for(model) is not None:
        local = stores.find(model, pull=False)
    gguf = open_gguf(path)
    md = gguf.metadata
    arch = md.get("general.architecture", "?")
    sampling = dict(entry.sampling) if entry is not None else {}
    stop = local.stop if local is not None else ()
    system_text = entry.system if entry is not None else None
    chosen = entry.chat_template if entry is not None else None
    jinja = chosen or md.get("tokenizer.chat_template")
    template_text = local.template if local is not None and local.template else jinja
    license_text = (local.license if local is not None else None) or md.get("general.license")
    if template or parameters or system or license_:
        if template and template_text:
            print(_text(template_text))
        if parameters:
            for k, v in sampling.items():
                print(f"{k:<16} {v}")
            for s in stop:
                print(f"{'stop':<16} {s!r}")
        if system and system_text:
            print(_text(system_text))
        if license_ and license_text:
            print(_text(license_text))
        return
    n_params = sum(t.n_elements for t in gguf.tensors.values())
    size = sum(p.stat().st_size for p in gguf.files)
    rows = [("name", entry.name if entry is not None else path.name),
            ("architecture", arch),
            ("parameters", _count(n_params)),
            ("context length", md.get(f"{arch}.context_length", "?")),
            ("embedding length", md.get(f"{arch}.embedding_length", "?")),
            ("quantization", file_type_name(md.get("general.file_type"))),
            ("size", human_size(size)),
            ("file", f"{path}" + (f" (+{len(gguf.files) - 1} parts)" if len(gguf.files) > 1
                                  else ""))]
    if local is not None:
        rows.append(("store", local.store))
    print("  Model")
    for k, v in rows:
        print(f"    {k:<20}{_line(v, 200)}")
    if sampling or stop:
        print("\n  Parameters")
        for k, v in sampling.items():
            print(f"    {k:<20}{v}")
        for s in stop:
            print(f"    {'stop':<20}{_line(repr(s))}")
    if system_text:
        print("\n  System")
        print(f"    {_line(system_text)}")
    if template_text:
        where = ("Ollama's (Go, shown only; the GGUF's Jinja template is used)"
                 if local is not None and local.template else
                 "models.toml" if chosen else "tokenizer.chat_template")
        print(f"\n  Template ({where})")
        print(f"    {_line(template_text)}")
    if license_text:
        print("\n  License")
        print(f"    {_line(license_text)}")


def _count(n: int) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def create_command(
    name: Annotated[str, typer.Argument(help="the new model's name")],
    base: Annotated[str, typer.Option(
        "--from", help="the model it is built on: a models.toml name, .gguf path or store name",
        show_default=False)],
    system: Annotated[str | None, typer.Option("--system", help="default system prompt")] = None,
    template: Annotated[Path | None, typer.Option(
        "--template", help="Jinja chat template FILE (inlined)")] = None,
    temp: Annotated[float | None, typer.Option("--temp", help="default temperature")] = None,
    top_k: Annotated[int | None, typer.Option("--top-k", help="default top-k")] = None,
    top_p: Annotated[float | None, typer.Option("--top-p", help="default top-p")] = None,
    min_p: Annotated[float | None, typer.Option("--min-p", help="default min-p")] = None,
    repeat_penalty: Annotated[float | None, typer.Option(
        "--repeat-penalty", help="default repeat penalty")] = None,
    notes: Annotated[str | None, typer.Option("--notes", help="a description")] = None,
) -> None:
    """Name a model with its own system prompt, template and sampling defaults (Ollama's
    Modelfile, as an entry of your models.toml)."""
    from ..usermodels import create

    sampling = {k: v for k, v in (("temp", temp), ("top_k", top_k), ("top_p", top_p),
                                  ("min_p", min_p), ("penalty_repeat", repeat_penalty))
                if v is not None}
    path = create(name, base, system=system, template=template, sampling=sampling, notes=notes)
    print(f"created {name} (from {base}) in {path}")


def cp_command(
    source: Annotated[str, typer.Argument(help="a models.toml name, .gguf path or store name")],
    destination: Annotated[str, typer.Argument(help="the new name")],
) -> None:
    """Copy a model under a new name (an entry of your models.toml; no file is copied)."""
    from ..usermodels import copy

    path = copy(source, destination)
    print(f"copied {source} to {destination} in {path}")


def ps_command(
    host: Annotated[str, typer.Option("--host", help="the server's address")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="the server's port")] = 8080,
    api_key: Annotated[str | None, typer.Option(
        "--api-key", help="the server's key", envvar="LOCALLLM_API_KEY")] = None,
) -> None:
    """What a running `localllm serve` has loaded: model, memory, device, context, until when
    (Ollama's ps, from the server's /api/ps)."""
    import json
    import urllib.error
    import urllib.request

    from ..errors import LocalLLMError
    from ..hub import human_size

    url = f"http://{host}:{port}/api/ps"
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"}
                                     if api_key else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            rows = json.loads(r.read(1 << 20))["models"]
    except urllib.error.HTTPError as e:
        raise LocalLLMError(f"{url}: HTTP {e.code}" + (" (give --api-key)" if e.code == 401
                                                         else "")) from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", None) or e
        raise LocalLLMError(f"no localllm server at {host}:{port} ({reason})") from None
    except (ValueError, KeyError, TypeError):
        raise LocalLLMError(f"{url}: not a localllm server's answer") from None
    print(f"{'NAME':<40} {'SIZE':>9}  {'PROCESSOR':<9} {'CONTEXT':>7}  UNTIL")
    for m in rows:
        if not isinstance(m, dict):
            continue
        size = human_size(m["size"]) if isinstance(m.get("size"), int) else "-"
        until = ("loading" if m.get("state") == "loading" else
                 "in use" if m.get("in_use") else m.get("expires_at") or "forever")
        print(f"{_line(m.get('name'), 40):<40} {size:>9}  {_line(m.get('device') or '-', 9):<9} "
              f"{m.get('context_length') or '-'!s:>7}  {_line(until, 40)}")


__all__ = ["cp_command", "create_command", "ps_command", "show_command"]
