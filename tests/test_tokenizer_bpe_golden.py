"""Byte-level BPE (``gpt2`` vocab) tokenization identical to llama.cpp's.

The vocabulary in tests/data/tokenizer/bpe_vocab.json is a small BPE trained on text, code and
unicode samples, plus control / user-defined tokens; bpe_golden.json holds the ids llama.cpp
(through llama-cpp-python, see record.py there) gives for tricky texts under several
``tokenizer.ggml.pre`` types. Each test writes the vocabulary into a weights-less GGUF, reads it
back through our GGUF reader and compares.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from localllm.tokenizer import StreamDecoder, Tokenizer

DATA = Path(__file__).parent / "data" / "tokenizer"


def write_vocab_gguf(path: str | Path, vocab: dict, meta: dict) -> Path:
    """Write a GGUF holding only the tokenizer: ``vocab`` (tokens/types/merges lists) and
    ``meta`` (pre, bos, eos, optional eot/add_bos/add_eos, and ``extra``: [text, token type]
    pairs appended to the vocabulary) as ``tokenizer.ggml.*`` keys."""
    import gguf

    extra = meta.get("extra", [])
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(meta["pre"])
    w.add_token_list(vocab["tokens"] + [text for text, _ in extra])
    w.add_token_types(vocab["types"] + [kind for _, kind in extra])
    w.add_token_merges(vocab["merges"])
    w.add_bos_token_id(meta["bos"])
    w.add_eos_token_id(meta["eos"])
    if "eot" in meta:
        w.add_eot_token_id(meta["eot"])
    if "add_bos" in meta:
        w.add_add_bos_token(meta["add_bos"])
    if "add_eos" in meta:
        w.add_add_eos_token(meta["add_eos"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads((DATA / "bpe_golden.json").read_text())


@pytest.fixture(scope="module")
def tokenizers(golden, tmp_path_factory) -> dict[str, Tokenizer]:
    from localllm.gguf.file import open_gguf

    vocab = json.loads((DATA / "bpe_vocab.json").read_text())
    out = {}
    for name, variant in golden["variants"].items():
        path = write_vocab_gguf(
            tmp_path_factory.mktemp("bpe") / f"{name}.gguf", vocab, variant["meta"]
        )
        out[name] = Tokenizer(open_gguf(path).metadata)
    return out


VARIANTS = ("llama3", "qwen2", "gpt2", "default")


@pytest.mark.parametrize("name", VARIANTS)
def test_metadata_matches_llamacpp(name, golden, tokenizers):
    tok, ref = tokenizers[name], golden["variants"][name]
    assert tok.add_bos == ref["add_bos"]
    assert tok.bos_id == ref["bos"] and tok.eos_id == ref["eos"]
    assert tok.eog_ids == set(ref["eog"])
    control = {i for i in range(tok.n_vocab) if tok.is_control(i)}
    assert control == set(ref["control"])


@pytest.mark.parametrize("name", VARIANTS)
def test_ids_match_llamacpp(name, golden, tokenizers):
    tok, cases = tokenizers[name], golden["variants"][name]["cases"]
    assert len(cases) == len(golden["texts"])
    for text, case in zip(golden["texts"], cases):
        for key, kwargs in (
            ("plain", {"add_bos": False}),
            ("bos", {}),
            ("special", {"add_bos": False, "special": True}),
        ):
            assert tok.encode(text, **kwargs) == case[key], (key, text)


@pytest.mark.parametrize("name", VARIANTS)
def test_decode_matches_llamacpp_and_roundtrips(name, golden, tokenizers):
    tok, cases = tokenizers[name], golden["variants"][name]["cases"]
    for text, case in zip(golden["texts"], cases):
        assert tok.decode(case["plain"]) == text
        assert tok.decode(case["special"]) == case["detok"], text
        assert tok.decode(case["special"], special=True) == case["detok_special"], text
        assert tok.decode(tok.encode(text, add_bos=False, special=True), special=True) == text


def test_stream_decoder_on_byte_level_pieces(golden, tokenizers):
    tok = tokenizers["qwen2"]
    for text in golden["texts"]:
        dec = StreamDecoder(tok)
        pieces = [dec.push(i) for i in tok.encode(text, add_bos=False)] + [dec.flush()]
        assert "".join(pieces) == text
        assert all("\ufffd" not in p for p in pieces), text
