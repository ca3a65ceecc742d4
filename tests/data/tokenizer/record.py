"""Record llama.cpp's byte-level BPE tokenization into bpe_golden.json (developer tool).

Run with localllm's venv; llama-cpp-python (an oracle only, never a dependency of localllm)
runs in another interpreter (``--llama-python``, see ``tests/data/oracle.py``)::

    python tests/data/tokenizer/record.py            # re-record ids with the committed vocab
    python tests/data/tokenizer/record.py --retrain  # also retrain bpe_vocab.json

The vocabulary is a byte-level BPE trained with ``tokenizers`` on the GPL-3 text, this project's
own Python sources and unicode samples, then extended with control / user-defined tokens and a few
whole-word tokens that no merge produces (so llama3's ``ignore_merges`` shows).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(HERE.parent))

from oracle import GPL3, LlamaVocab, quiet, run_oracle, train_byte_bpe

N_MERGES = 2500
CONTROL_TOKENS = ["<|begin_of_text|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_TOKENS = ["<tool_call>", "</tool_call>"]
WHOLE_WORDS = [
    " zyxomancy",
    " Quetzalcoatl",
    "floccinaucinihilipilification",
    " 12345",
]  # added without merges

UNICODE_SAMPLES = [
    "naïve café résumé façade coöperate Ångström Øresund straße ǅemal",
    "Привет, как дела? Это тест токенизатора. Ελληνικά γράμματα.",
    "你好，世界！这是一个分词器测试。日本語のテキストとカタカナ。한국어 문장입니다.",
    "مرحبا بالعالم. שלום עולם. हिन्दी पाठ का उदाहरण। ภาษาไทย",
    "emoji 🤖🚀👍🏽 👨‍👩‍👧 ❤️ ✨ flags 🇫🇷🇯🇵 combining e\u0301 a\u0308 n\u0303",
    "math ∑∫√∞ ≤ ≥ ≠ ± × ÷ ° µ ½ ¾ ²³ ①②③ ⅣⅫ ٣٤٥ ０１２",
]

TEXTS = [
    "Hello world",
    " Hello world",
    "  leading two spaces and trailing  ",
    "hello   world\t\ttabs\t \nmixed",
    "\n",
    "\n\n\n",
    "line one\nline two\n\nline four\r\nwindows\r\n\r\n",
    "   \n   \n\t\n end",
    " ",
    "   ",
    "",
    "1 12 123 1234 12345 123456 1234567 3.14159 1,000,000 0x1F 2024-01-31",
    "version 10.2.3 costs $1234.56 (about 99%)",
    "it's I'll we've they're she'd I'm don't IT'S YOU'LL He'D",
    "'s 'll 'S 'LL quote 'single' \"double\"",
    "naïve café résumé Ångström straße",
    "e\u0301 a\u0308 combining marks and \u00e9 precomposed",
    "Привет, мир! Ελληνικά",
    "你好，世界！日本語のテキスト。한국어",
    "مرحبا بالعالم שלום हिन्दी ภาษาไทย",
    "🤖🚀👍🏽 👨‍👩‍👧 ❤️ 🇫🇷",
    "∑∫√∞ ≤ ≥ ½ ²³ ①② ٣٤٥ ０１２",
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}",
    'if __name__ == "__main__":\n        main()\n\n\n',
    '<html><body class="x">&amp; &lt;tag&gt;</body></html>',
    "a.b,c;d:e!f?g...h---i___j",
    "The zyxomancy of Quetzalcoatl is floccinaucinihilipilification: 12345 tokens.",
    " zyxomancy Quetzalcoatl floccinaucinihilipilification12345 zyxomancy's",
    "it'ſelf 'ſt 'Kelvin 'İs 'ıs \n'ſカ!",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|begin_of_text|>Hello<|endoftext|>",
    " <|endoftext|> spaced <|im_end|>\n",
    "<|im_start <|im_end| |im_end|> <|im_end|><|im_end|>",
    'call <tool_call>{"name": "f"}</tool_call> done',
    "<tool_call><|im_start|>",
    "a<|end|>b<|fim_prefix|>c<|file_sep|>d<|return|>e<|eot_id|>f<PAD>g</s>h<|fim_pad|>",
    "x\u00a0nbsp\u2009thin\u3000ideographic\u200bzwsp",
    "\u0000null \u0007bell \x7f del",
    "MiXeD CaSe WORDS and ALLCAPS",
    "GNU General Public License version 3, 29 June 2007",
]


def train_vocab() -> dict:
    """Train the byte-level BPE and add the special and whole-word tokens."""
    from tokenizers import pre_tokenizers

    corpus = [GPL3.read_text()]
    corpus += [p.read_text() for p in sorted((ROOT / "localllm").glob("*.py"))]
    corpus += UNICODE_SAMPLES * 20
    return train_byte_bpe(corpus, N_MERGES, pre_tokenizers.ByteLevel(add_prefix_space=False),
                          whole_words=WHOLE_WORDS, control=CONTROL_TOKENS, user=USER_TOKENS)


def variants(vocab: dict) -> dict[str, dict]:
    """GGUF tokenizer metadata per recorded variant; add_bos is left to llama.cpp's default
    where the key is absent. ``extra`` tokens (text, type) carry turn-end / fill-in-the-middle
    texts under types other than CONTROL, which llama.cpp promotes to CONTROL (and EOG)."""
    ids = {t: i for i, t in enumerate(vocab["tokens"])}
    eot = ids["<|endoftext|>"]
    n = len(vocab["tokens"])
    return {
        "llama3": {
            "pre": "llama-bpe",
            "bos": ids["<|begin_of_text|>"],
            "eos": eot,
            "eot": n,
            "extra": [["<|eot_id|>", 3], ["<|end|>", 4], ["<PAD>", 1]],
        },
        "qwen2": {
            "pre": "qwen2",
            "bos": eot,
            "eos": eot,
            "add_bos": False,
            "extra": [
                ["<|fim_prefix|>", 4],
                ["<|fim_pad|>", 4],
                ["<|file_sep|>", 4],
                ["<|end|>", 1],
                ["</s>", 4],
            ],
        },
        "gpt2": {
            "pre": "gpt-2",
            "bos": eot,
            "eos": eot,
            "extra": [["<|return|>", 3], ["<|call|>", 3], ["<|end|>", 4], ["<|eot_id|>", 1]],
        },
        "default": {"pre": "default", "bos": eot, "eos": eot},
    }


def oracle(folder: Path) -> dict:
    """(llama venv) variant -> llama.cpp's ids, pieces, add_bos, EOG and control tokens."""
    import llama_cpp as lc

    quiet(lc)
    out = {}
    for name, n_vocab in json.loads((folder / "variants.json").read_text()).items():
        lv = LlamaVocab(folder / f"{name}.gguf")
        cases = []
        for text in TEXTS:
            special = lv.tokenize(text, False, True)
            cases.append({
                "plain": lv.tokenize(text, False, False),
                "bos": lv.tokenize(text, True, False),
                "special": special,
                "detok": lv.pieces(special, False),
                "detok_special": lv.pieces(special, True),
            })
        out[name] = {**lv.info(n_vocab), "cases": cases}
        lv.close()
    return out


def main() -> None:
    if "--oracle" in sys.argv:
        print(json.dumps(oracle(Path(sys.argv[sys.argv.index("--oracle") + 1]))))
        return
    from test_tokenizer_bpe_golden import write_vocab_gguf  # localllm's venv only

    vocab_path = HERE / "bpe_vocab.json"
    if "--retrain" in sys.argv or not vocab_path.exists():
        vocab_path.write_text(json.dumps(train_vocab(), ensure_ascii=False, separators=(",", ":")))
    vocab = json.loads(vocab_path.read_text())
    metas = variants(vocab)
    with tempfile.TemporaryDirectory() as tmp:
        for name, meta in metas.items():
            write_vocab_gguf(Path(tmp) / f"{name}.gguf", vocab, meta)
        sizes = {name: len(vocab["tokens"]) + len(meta.get("extra", []))
                 for name, meta in metas.items()}
        (Path(tmp) / "variants.json").write_text(json.dumps(sizes))
        results = run_oracle(__file__, tmp)
    out: dict = {"texts": TEXTS, "variants": {}}
    for name, meta in metas.items():
        res = results[name]
        out["variants"][name] = {"meta": meta, **meta, **{k: v for k, v in res.items()
                                                          if k != "cases"},
                                 "cases": res["cases"]}
    (HERE / "bpe_golden.json").write_text(json.dumps(out, ensure_ascii=False, indent=None))


if __name__ == "__main__":
    main()
