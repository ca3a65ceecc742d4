"""``localllm pull`` / ``rm`` / ``models``: Ollama's verbs for registry models (pulled from
the package index), Hugging Face repositories and the models other tools keep on disk."""

from __future__ import annotations

from typing import Annotated

import typer

from ..errors import LocalLLMError, ModelNotFoundError


def _registry_entry(name: str):
    from ..registry import load_registry

    return load_registry().models.get(name)


def pull_command(
    name: Annotated[str, typer.Argument(
        help="models.toml name, or hf.co/ORG/REPO[:TAG] (TAG: quant such as Q4_K_M, "
        "the default, or a .gguf file name)")],
    force: Annotated[bool, typer.Option("--force", help="fetch again even if cached")] = False,
) -> None:
    """Download a model, verified by sha256: a registry model's GGUF into localllm's cache,
    or a Hugging Face repository's GGUF (every part of a split one) into the Hugging Face
    cache."""
    from .. import hub, stores
    from ..stores import huggingface

    entry = _registry_entry(name)
    if entry is not None and entry.base is not None:
        return pull_command(entry.base, force=force)  # the model it is built on
    if entry is not None:
        source = entry.wheel_source
        if source is None:
            raise LocalLLMError(f"model {name!r} is not pulled from a package index "
                                f"(its source: {entry.source}); nothing to do")
        if not force and hub.state(source) == "pulled":
            print(f"{name}: already pulled ({hub.cached_path(source)})")
            return
        path = hub.pull(source, force=True)
        print(f"{name}: {hub.human_size(source.size)} in {path}")
        return
    store = stores.store_for(name)
    if store is huggingface:
        local = huggingface.pull_model(huggingface.parse(name), force=force)
        where = local.path if len(local.parts) == 1 else f"{len(local.parts)} parts, {local.path}"
        print(f"{local.name}: {hub.human_size(local.size)} in {where}")
        return
    if store is not None:
        raise LocalLLMError(f"{name}: {store.STORE}'s store is read-only here; pull it with "
                            f"{store.STORE}, then use it as {name}")
    from ..registry import load_registry

    known = ", ".join(sorted(load_registry().models)) or "none"
    raise ModelNotFoundError(f"model {name!r} is not in models.toml (known: {known}) nor a "
                             "Hugging Face name (hf.co/ORG/REPO[:TAG])")


def rm_command(
    name: Annotated[str, typer.Argument(
        help="a pulled models.toml name, a model made by create/cp, or hf.co/ORG/REPO[:TAG]")],
) -> None:
    """Remove a model: a pulled file from localllm's cache, an entry `create` or `cp` wrote,
    or a Hugging Face model's files from the Hugging Face cache."""
    from .. import hub, stores, usermodels
    from ..stores import huggingface

    if usermodels.owns(name):
        path = usermodels.remove(name)
        print(f"deleted {name} (from {path})")
        return
    entry = _registry_entry(name)
    if entry is not None:
        source = entry.wheel_source
        if source is None:
            raise LocalLLMError(f"model {name!r} is not pulled from a package index "
                                f"(its source: {entry.source}); nothing to do")
        if not hub.remove(source):
            raise LocalLLMError(f"model {name!r} is not pulled ({hub.cached_path(source)})")
        print(f"deleted {name} ({hub.cached_path(source)})")
        return
    store = stores.store_for(name)
    if store is huggingface:
        removed = huggingface.remove(name)
        print(f"deleted {name} ({len(removed)} file{'s' if len(removed) > 1 else ''} from "
              f"{huggingface.hub_cache()})")
        return
    if store is not None:
        raise LocalLLMError(f"{name}: {store.STORE}'s store is read-only here; remove it with "
                            f"{store.STORE}")
    raise ModelNotFoundError(f"model {name!r} is not in models.toml nor a Hugging Face name")


def print_models() -> None:
    """The registry as a table (name, source, status, size, where, notes), then the models
    of the stores on this machine (name to use, store, size, where)."""
    from pathlib import Path

    from rich.console import Console
    from rich.table import Table

    from .. import hub, stores
    from ..registry import load_registry
    from .terminal import shown

    reg = load_registry()
    table = Table("name", "source", "status", "size", "where", "notes", title="models.toml")
    for name, e in reg.models.items():
        tags = [t for t, d in (("default", reg.default), ("chat", reg.chat_default)) if name == d]
        status, size, where = e.status(), "", ""
        source = e.wheel_source
        if source is not None:
            where = str(hub.cached_path(source))
            size = hub.human_size(source.size)
        elif e.path:
            p = Path(e.path).expanduser()
            where = str(p)
            size = hub.human_size(p.stat().st_size) if p.is_file() else ""
        table.add_row(shown(name + (f" ({', '.join(tags)})" if tags else "")), shown(e.source),
                      status, size, shown(where), shown(e.notes))
    console = Console(width=200)
    console.print(table)
    local = stores.list_local()
    if local:
        found = Table("name", "store", "size", "where", title="on this machine (read where "
                      "they are; run/chat/serve take the name)")
        for m in local:
            parts = f" (+{len(m.parts) - 1} parts)" if len(m.parts) > 1 else ""
            found.add_row(shown(m.name), m.store, hub.human_size(m.size), shown(m.path) + parts)
        console.print(found)
