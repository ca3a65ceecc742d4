"""The few unicode facts llama.cpp's tokenizers use beyond ``unicodedata`` categories.

Source: llama.cpp ``src/unicode.cpp`` / ``unicode-data.cpp``.
"""

from __future__ import annotations

# llama.cpp's whitespace set (the Unicode White_Space property).
_WHITESPACE = frozenset([*range(0x09, 0x0E), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B),
                         0x2028, 0x2029, 0x202F, 0x205F, 0x3000])


def is_whitespace(cp: int) -> bool:
    return cp in _WHITESPACE


def simple_lower(ch: str) -> str:
    """The one-code-point lowercase of ``ch`` (Unicode's simple mapping, as
    ``unicode_tolower``): Python's full mapping is used unless it expands."""
    low = ch.lower()
    return low if len(low) == 1 else (low[0] if ch == "\u0130" else ch)
