"""Every ``tokenizer.ggml.pre`` name llama.cpp knows tokenizes as llama.cpp does.

tests/data/pretokenizers/vocab.json is a small byte-level BPE trained with ``tokenizers`` on
mixed text (merges cross letters, digits, punctuation and spaces, so where a pre-tokenizer
splits shows in the ids); golden.json holds llama.cpp's ids (llama-cpp-python,
``vocab_only``, see record.py there) for each name under the same vocabulary.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from cli_helpers import assert_one_line_error, run_cli
from test_tokenizer_bpe_golden import write_vocab_gguf

from localllm.errors import GGUFError, UnsupportedError
from localllm.gguf.file import open_gguf
from localllm.tokenizer import PRE_TOKENIZERS, PreTokenizer, Tokenizer

DATA = Path(__file__).parent / "data" / "pretokenizers"
GOLDEN = json.loads((DATA / "golden.json").read_text())
VOCAB = json.loads((DATA / "vocab.json").read_text())
IDS = {t: i for i, t in enumerate(VOCAB["tokens"])}


def meta(pre: str) -> dict:
    return {"pre": pre, "bos": IDS["<|begin_of_text|>"], "eos": IDS["<|endoftext|>"]}


def tokenizer_for(tmp_path: Path, pre: str, vocab: dict = VOCAB) -> Tokenizer:
    path = write_vocab_gguf(tmp_path / "vocab.gguf", vocab, meta(pre))
    return Tokenizer(open_gguf(path).metadata)


def reference(name: str) -> dict:
    ref = GOLDEN["names"][name]
    return GOLDEN["names"][ref["same_as"]] if "same_as" in ref else ref


def test_table_covers_every_recorded_name():
    assert set(GOLDEN["names"]) == set(PRE_TOKENIZERS)
    assert {"smollm", "starcoder", "refact", "command-r", "olmo", "dbrx", "stablelm2",
            "deepseek-llm", "deepseek-coder", "deepseek-v3", "gpt-4o", "tekken", "chatglm-bpe",
            "glm4", "jais", "exaone", "minerva-7b", "kimi-k2", "seed-coder", "superbpe",
            "trillion", "bailingmoe", "llama4", "pixtral", "hunyuan", "grok-2"} <= set(GOLDEN["names"])


@pytest.mark.parametrize("name", sorted(GOLDEN["names"]))
def test_ids_match_llamacpp(name, tmp_path):
    ref = reference(name)
    tok = tokenizer_for(tmp_path, name)
    assert tok.add_bos == ref["add_bos"]
    for text, plain, special in zip(GOLDEN["texts"], ref["plain"], ref["special"]):
        assert tok.encode(text, add_bos=False) == plain, text
        assert tok.encode(text) == special, text
        assert tok.decode(plain) == text


def test_unknown_name_falls_back_to_default_with_a_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="localllm.tokenizer"):
        tok = tokenizer_for(tmp_path, "no-such-pre")
    assert tok.pre == "default"
    assert len(caplog.records) == 1 and "no-such-pre" in caplog.records[0].getMessage()
    ref = reference("default")
    assert [tok.encode(t, add_bos=False) for t in GOLDEN["texts"]] == ref["plain"]


def test_flags_follow_llamacpp():
    assert PRE_TOKENIZERS["llama-bpe"].ignore_merges and PRE_TOKENIZERS["llama-bpe"].add_bos
    assert PRE_TOKENIZERS["tekken"].ignore_merges and not PRE_TOKENIZERS["tekken"].clean_spaces
    assert not PRE_TOKENIZERS["smollm"].clean_spaces and not PRE_TOKENIZERS["smollm"].add_bos
    assert PRE_TOKENIZERS["starcoder"].clean_spaces


def test_merges_naming_missing_tokens_is_a_gguf_error(tmp_path):
    bad = dict(VOCAB, merges=VOCAB["merges"] + ["zzqq xxyy"])
    with pytest.raises(GGUFError, match=r"merges\[\d+\] = 'zzqq xxyy' names 'zzqq'"):
        tokenizer_for(tmp_path, "smollm", bad)
    bad = dict(VOCAB, merges=["nospace"] + VOCAB["merges"])
    with pytest.raises(GGUFError, match="not two space-separated pieces"):
        tokenizer_for(tmp_path, "smollm", bad)


def test_bad_merges_on_the_cli_is_one_line(tmp_path, monkeypatch, capsys):
    bad = dict(VOCAB, merges=VOCAB["merges"] + ["zzqq xxyy"])
    path = write_vocab_gguf(tmp_path / "bad.gguf", bad, meta("smollm"))
    code, _, err = run_cli(monkeypatch, capsys, "tokenize", str(path), "hello")
    assert_one_line_error(code, err, "tokenizer.ggml.merges", "zzqq")


def test_regex_that_does_not_compile_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(PRE_TOKENIZERS, "broken", PreTokenizer((r"(?<=\p{L}+)x[",)))
    with pytest.raises(UnsupportedError, match="'broken': the regex .* does not compile"):
        tokenizer_for(tmp_path, "broken")
    path = write_vocab_gguf(tmp_path / "broken.gguf", VOCAB, meta("broken"))
    code, _, err = run_cli(monkeypatch, capsys, "tokenize", str(path), "hello")
    assert_one_line_error(code, err, "does not compile")


def test_raw_utf8_pre_tokenizers_are_refused_by_name(tmp_path):
    with pytest.raises(UnsupportedError, match="'gemma4'"):
        tokenizer_for(tmp_path, "gemma4")
