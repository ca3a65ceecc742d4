"""Architectures, one file each, found by ``general.architecture``.

Each module defines ``ModelArgs.from_gguf(metadata, n_vocab)`` and ``Model(args, weights)``
with ``make_caches(ctx_size, slack=...)`` and ``forward(tokens, pos, caches, all_logits=...)``.
"""

from __future__ import annotations

from types import ModuleType

from ..errors import UnsupportedError
from . import gemma3, llama

ARCHITECTURES: dict[str, ModuleType] = {
    "gemma3": gemma3,
    "llama": llama,
    "mistral": llama,
    "qwen2": llama,
    "qwen3": llama,
}


def architecture(name: str) -> ModuleType:
    """The module implementing ``general.architecture`` = ``name``.

    Raises:
        UnsupportedError: no module implements it.
    """
    try:
        return ARCHITECTURES[name]
    except KeyError:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise UnsupportedError(
            f"architecture {name!r} is not supported (supported: {supported})"
        ) from None
