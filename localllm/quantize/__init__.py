"""Quantization of GGUF models (``localllm quantize``): block quantizers bit-compatible with
ggml's layouts (:mod:`.blocks`), llama.cpp's per-tensor recipes (:mod:`.recipe`) and the file
converter (:mod:`.convert`). Attributes load lazily so that the CLI starts without torch."""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "quantize_rows": "blocks", "dequantize_rows": "blocks", "row_bytes": "blocks",
    "quantize_gguf": "convert", "QuantizeReport": "convert",
    "FILE_TYPES": "recipe", "parse_file_type": "recipe", "plan": "recipe",
}

__all__ = ["FILE_TYPES", "QuantizeReport", "dequantize_rows", "parse_file_type", "plan",
           "quantize_gguf", "quantize_rows", "row_bytes"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
