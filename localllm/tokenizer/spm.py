"""SentencePiece BPE (``tokenizer.ggml.model = llama``) on the ``sentencepiece`` library."""

from __future__ import annotations

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def build_sentencepiece(tokens, scores, types, ids):
    """A SentencePiece BPE processor holding exactly the GGUF vocabulary."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    proto.trainer_spec.model_type = pb.TrainerSpec.BPE
    proto.trainer_spec.vocab_size = len(tokens)
    proto.trainer_spec.byte_fallback = BYTE in types
    # Without tokenizer.ggml.unknown_token_id, the UNKNOWN-typed piece is the unknown one
    # (sentencepiece refuses a second); else piece 0, as sentencepiece's default.
    unk = ids["unknown"] if ids["unknown"] is not None else next(
        (i for i, kind in enumerate(types) if kind == UNKNOWN), 0)
    proto.trainer_spec.unk_id = unk
    # BOS/EOS/padding are added and recognised by us, not by sentencepiece: left out of the
    # spec, so that one also being the unknown token (Llama 2's pad = unk) is no conflict.
    proto.trainer_spec.bos_id = proto.trainer_spec.eos_id = proto.trainer_spec.pad_id = -1
    # The space prefix and special-token splitting are done by us, as llama.cpp does them.
    proto.normalizer_spec.name = "identity"
    proto.normalizer_spec.add_dummy_prefix = False
    proto.normalizer_spec.remove_extra_whitespaces = False
    proto.normalizer_spec.escape_whitespaces = True
    seen: set[str] = set()
    for i, text in enumerate(tokens):
        piece = proto.pieces.add()
        kind = types[i]
        if text in seen or not text:  # sentencepiece rejects duplicates and empty pieces
            text, kind = f"<localllm-unused-{i}>", UNUSED
        elif kind == UNKNOWN and i != unk:  # sentencepiece allows one unknown piece
            kind = CONTROL
        seen.add(text)
        piece.piece = text
        piece.score = float(scores[i]) if scores is not None else 0.0
        piece.type = kind if kind in (NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE) else NORMAL
    if proto.trainer_spec.unk_id >= 0:
        proto.pieces[proto.trainer_spec.unk_id].type = UNKNOWN
    processor = spm.SentencePieceProcessor()
    processor.LoadFromSerializedProto(proto.SerializeToString())
    return processor
