"""SentencePiece BPE (``tokenizer.ggml.model = llama``) on the ``sentencepiece`` library.

The library is handed a serialized ``ModelProto`` (``sentencepiece_model.proto``) written
here directly in protobuf's wire format: building it as a Python protobuf message first
cost about 27 MiB of resident memory for the default model's 262,144 pieces, kept by the
allocator after the message was freed.
"""

from __future__ import annotations

import struct

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
_TYPES = (NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE)
_BPE = 2  # TrainerSpec.ModelType.BPE
_FLOAT = struct.Struct("<f")


def _varint(n: int) -> bytes:
    """Protobuf's base-128 varint; a negative int32 takes ten bytes (two's complement)."""
    if n < 0:
        n += 1 << 64
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(number: int, wire: int) -> bytes:
    return _varint(number << 3 | wire)


def _message(number: int, body: bytes) -> bytes:
    """A length-delimited field (string, bytes, sub-message)."""
    return _field(number, 2) + _varint(len(body)) + body


def _ints(fields: list[tuple[int, int]]) -> bytes:
    """Varint fields (int32, enum, bool) in the given order."""
    return b"".join(_field(k, 0) + _varint(v) for k, v in fields)


def model_proto(tokens, scores, types, ids) -> bytes:
    """The serialized ``sentencepiece.ModelProto`` of a GGUF ``llama`` vocabulary.

    Args:
        tokens: the pieces (``tokenizer.ggml.tokens``, str); scores: floats or None (zeros);
        types: GGUF token types; ids: the special ids (``ids["unknown"]``: int or None).
    Returns:
        the proto as bytes, equal field by field to the ``sentencepiece_model_pb2`` message
        with the same values (``tests/test_tokenizer.py``). Duplicate and empty pieces,
        which sentencepiece refuses, become UNUSED ``<localllm-unused-{i}>``; of several
        UNKNOWN pieces only the unknown id stays UNKNOWN (the others: CONTROL).
    """
    # Without tokenizer.ggml.unknown_token_id, the UNKNOWN-typed piece is the unknown one
    # (sentencepiece refuses a second); else piece 0, as sentencepiece's default.
    unk = ids["unknown"] if ids["unknown"] is not None else next(
        (i for i, kind in enumerate(types) if kind == UNKNOWN), 0)
    out = bytearray()
    seen: set[str] = set()
    pack = _FLOAT.pack
    small = [_varint(n) for n in range(1 << 14)]  # lengths and types: one lookup each
    for i, text in enumerate(tokens):
        kind = types[i]
        if text in seen or not text:  # sentencepiece rejects duplicates and empty pieces
            text, kind = f"<localllm-unused-{i}>", UNUSED
        elif kind == UNKNOWN and i != unk:  # sentencepiece allows one unknown piece
            kind = CONTROL
        seen.add(text)
        if i == unk:
            kind = UNKNOWN
        elif kind not in _TYPES:
            kind = NORMAL
        piece = text.encode("utf-8")
        score = float(scores[i]) if scores is not None else 0.0
        n = len(piece)
        body = b"".join((b"\x0a", small[n] if n < 1 << 14 else _varint(n), piece, b"\x15",
                         pack(score), b"\x18", small[kind]))
        out += b"\x0a"  # ModelProto.pieces (1)
        out += small[len(body)] if len(body) < 1 << 14 else _varint(len(body))
        out += body
    del seen
    # BOS/EOS/padding are added and recognised by us, not by sentencepiece: left out of the
    # spec (-1), so that one also being the unknown token (Llama 2's pad = unk) is no conflict.
    trainer = _ints([(3, _BPE), (4, len(tokens)), (35, int(BYTE in types)), (40, unk),
                     (41, -1), (42, -1), (43, -1)])
    # The space prefix and special-token splitting are done by us, as llama.cpp does them.
    normalizer = _message(1, b"identity") + _ints([(3, 0), (4, 0), (5, 1)])
    out += _message(2, trainer) + _message(3, normalizer)
    return bytes(out)


def build_sentencepiece(tokens, scores, types, ids):
    """A SentencePiece BPE processor holding exactly the GGUF vocabulary (:func:`model_proto`).

    Raises:
        RuntimeError: sentencepiece refuses the vocabulary.
    """
    import sentencepiece as spm

    processor = spm.SentencePieceProcessor()
    processor.LoadFromSerializedProto(model_proto(tokens, scores, types, ids))
    return processor
