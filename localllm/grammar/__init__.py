"""Constrained decoding: GBNF parsed and checked (:mod:`.gbnf`), compiled with JSON schemas on
llguidance into a per-token mask (:mod:`.constraint`). Attributes load lazily."""

from __future__ import annotations

from importlib import import_module
from typing import Any

__all__ = ["GrammarConstraint", "constraint_for", "generate_json"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(import_module(".constraint", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
