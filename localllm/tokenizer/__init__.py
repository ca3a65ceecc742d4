"""Tokenizers built from GGUF metadata, matching llama.cpp's ``llama-vocab.cpp``.

``vocab.py``: :class:`Tokenizer` (special tokens, encode/decode) and :class:`StreamDecoder`;
``pretokenizers.py``: llama.cpp's ``tokenizer.ggml.pre`` table; ``bpe.py``: byte-level BPE;
``spm.py``: SentencePiece.
"""

from .pretokenizers import PRE_TOKENIZERS, PreTokenizer, pre_tokenizer
from .vocab import (
    BYTE,
    CONTROL,
    NORMAL,
    UNKNOWN,
    UNUSED,
    USER_DEFINED,
    StreamDecoder,
    Tokenizer,
    _byte_decoder,  # noqa: F401  (record scripts use it)
)

__all__ = ["BYTE", "CONTROL", "NORMAL", "PRE_TOKENIZERS", "UNKNOWN", "UNUSED", "USER_DEFINED",
           "PreTokenizer", "StreamDecoder", "Tokenizer", "pre_tokenizer"]
