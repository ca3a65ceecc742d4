"""Record llama.cpp's WordPiece (``bert``) and Unigram (``t5``) tokenization (developer tool).

Run with localllm's venv; llama-cpp-python (an oracle only) runs in another interpreter::

    python tests/data/vocab_types/record.py [--retrain] [--llama-python /work/llamavenv/bin/python]

1. trains a small WordPiece with ``tokenizers`` (BERT normalizer, uncased) and a small
   Unigram with ``sentencepiece`` (nmt_nfkc normalization, so the GGUF carries a precompiled
   character map) on mixed text; writes ``bert.json`` / ``t5.json`` in GGUF form (WordPiece
   continuations bare, word starts with ``▁``, as llama.cpp's converter writes them);
2. (llama venv, ``--oracle DIR``) loads each vocabulary-only GGUF and tokenizes the
   pre-tokenizer fixture's texts with and without the special tokens llama.cpp adds;
3. writes ``golden.json``.
"""

from __future__ import annotations

import gzip
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from oracle import GPL3, ROOT, LlamaVocab, quiet, run_oracle

sys.path.insert(0, str(ROOT / "tests" / "data" / "pretokenizers"))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from record import SAMPLES, TEXTS


def corpus() -> list[str]:
    lines = GPL3.read_text().splitlines()
    return [ln for ln in lines if ln.strip()] + SAMPLES * 30


def train_bert() -> dict:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok.train_from_iterator(corpus(), trainers.WordPieceTrainer(
        vocab_size=700, special_tokens=specials, show_progress=False))
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    tokens, types = [], []
    for text, _ in vocab:
        if text in specials:
            tokens.append(text)
            types.append(2 if text == "[UNK]" else 3)
        else:
            tokens.append(text[2:] if text.startswith("##") else "\u2581" + text)
            types.append(1)
    return {"tokens": tokens, "types": types}


def train_t5() -> dict:
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb

    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "corpus.txt"
        text.write_text("\n".join(corpus()))
        spm.SentencePieceTrainer.train(
            input=str(text), model_prefix=str(Path(tmp) / "m"), vocab_size=800,
            model_type="unigram", normalization_rule_name="nmt_nfkc", pad_id=0, eos_id=1,
            unk_id=2, bos_id=-1, user_defined_symbols=["<extra_id_0>"],
            character_coverage=0.9995, minloglevel=2)
        proto = pb.ModelProto()
        proto.ParseFromString((Path(tmp) / "m.model").read_bytes())
    return {
        "tokens": [p.piece for p in proto.pieces],
        "scores": [p.score for p in proto.pieces],
        "types": [int(p.type) for p in proto.pieces],
        "charsmap": proto.normalizer_spec.precompiled_charsmap,  # stored beside, gzipped
        "add_space_prefix": proto.normalizer_spec.add_dummy_prefix,
        "remove_extra_whitespaces": proto.normalizer_spec.remove_extra_whitespaces,
    }


def oracle(folder: Path) -> dict:
    import llama_cpp as lc

    quiet(lc)
    out = {}
    for kind in ("bert", "t5"):
        lv = LlamaVocab(folder / f"{kind}.gguf")
        out[kind] = {"plain": [lv.tokenize(t, False, False) for t in TEXTS],
                     "special": [lv.tokenize(t, True, False) for t in TEXTS]}
        lv.close()
    return out


def main() -> None:
    if "--oracle" in sys.argv:
        print(json.dumps(oracle(Path(sys.argv[sys.argv.index("--oracle") + 1]))))
        return
    for kind, train in (("bert", train_bert), ("t5", train_t5)):
        path = HERE / f"{kind}.json"
        if "--retrain" in sys.argv or not path.exists():
            v = train()
            if "charsmap" in v:
                (HERE / "t5_charsmap.bin.gz").write_bytes(gzip.compress(v.pop("charsmap"), 9, mtime=0))
            path.write_text(json.dumps(v, ensure_ascii=False, separators=(",", ":")))
    from test_vocab_types import write_gguf  # localllm's venv only (imports localllm)

    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("bert", "t5"):
            write_gguf(Path(tmp) / f"{kind}.gguf", kind, json.loads((HERE / f"{kind}.json").read_text()))
        results = run_oracle(__file__, tmp)
    golden = {"texts": TEXTS, **results}
    (HERE / "golden.json").write_text(json.dumps(golden, ensure_ascii=False, separators=(",", ":")))
    print("->", HERE / "golden.json")


if __name__ == "__main__":
    main()
