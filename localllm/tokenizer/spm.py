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
    proto.trainer_spec.unk_id = ids["unknown"] if ids["unknown"] is not None else 0
    proto.trainer_spec.bos_id = ids["bos"] if ids["bos"] is not None else -1
    proto.trainer_spec.eos_id = ids["eos"] if ids["eos"] is not None else -1
    proto.trainer_spec.pad_id = ids["padding"] if ids["padding"] is not None else -1
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
        seen.add(text)
        piece.piece = text
        piece.score = float(scores[i]) if scores is not None else 0.0
        piece.type = kind if kind in (NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE) else NORMAL
    if proto.trainer_spec.unk_id >= 0:
        proto.pieces[proto.trainer_spec.unk_id].type = UNKNOWN
    processor = spm.SentencePieceProcessor()
    processor.LoadFromSerializedProto(proto.SerializeToString())
    return processor
