"""WordPiece (``bert``) and Unigram (``t5``) vocabularies tokenize as llama.cpp does.

tests/data/vocab_types holds a small WordPiece trained with ``tokenizers`` (uncased BERT
normalizer) and a small Unigram trained with ``sentencepiece`` (nmt_nfkc, so its GGUF carries
a precompiled character map), in the form llama.cpp's converter writes, and llama.cpp's ids for
the pre-tokenizer fixture's texts (record.py there).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from cli_helpers import assert_one_line_error, run_cli

from localllm.errors import UnsupportedError
from localllm.gguf.file import open_gguf
from localllm.tokenizer import Tokenizer

DATA = Path(__file__).parent / "data" / "vocab_types"


def write_gguf(path: Path, kind: str, v: dict) -> Path:
    """A vocabulary-only GGUF of ``kind`` (bert or t5) from ``v`` (DATA/<kind>.json)."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(kind)
    w.add_tokenizer_pre("default")
    w.add_token_list(v["tokens"])
    w.add_token_types(v["types"])
    ids = {t: i for i, t in enumerate(v["tokens"])}
    if kind == "bert":
        w.add_bos_token_id(ids["[CLS]"])
        w.add_sep_token_id(ids["[SEP]"])
        w.add_unk_token_id(ids["[UNK]"])
        w.add_pad_token_id(ids["[PAD]"])
        w.add_mask_token_id(ids["[MASK]"])
    else:
        w.add_token_scores(v["scores"])
        w.add_eos_token_id(1)
        w.add_unk_token_id(2)
        w.add_pad_token_id(0)
        w.add_add_bos_token(False)
        w.add_add_eos_token(True)
        w.add_add_space_prefix(v["add_space_prefix"])
        w.add_remove_extra_whitespaces(v["remove_extra_whitespaces"])
        w.add_precompiled_charsmap(gzip.decompress((DATA / "t5_charsmap.bin.gz").read_bytes()))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads((DATA / "golden.json").read_text())


@pytest.mark.parametrize("kind", ["bert", "t5"])
def test_ids_match_llamacpp(kind, golden, tmp_path):
    v = json.loads((DATA / f"{kind}.json").read_text())
    tok = Tokenizer(open_gguf(write_gguf(tmp_path / f"{kind}.gguf", kind, v)).metadata)
    ref = golden[kind]
    for text, plain, special in zip(golden["texts"], ref["plain"], ref["special"]):
        assert tok.encode(text, add_bos=False) == plain, text
        assert tok.encode(text) == special, text


def test_rwkv_is_refused_clearly(tmp_path, monkeypatch, capsys):
    import gguf

    path = tmp_path / "rwkv.gguf"
    w = gguf.GGUFWriter(str(path), "rwkv6")
    w.add_tokenizer_model("rwkv")
    w.add_token_list(["a", "b"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedError, match="'rwkv'"):
        Tokenizer(open_gguf(path).metadata)
    code, _, err = run_cli(monkeypatch, capsys, "tokenize", str(path), "hello")
    assert_one_line_error(code, err, "rwkv")
