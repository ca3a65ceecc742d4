"""Record llama.cpp's tokenization under every ``tokenizer.ggml.pre`` name (developer tool).

Run with localllm's venv; it calls llama-cpp-python (an oracle only, never a dependency) in
another interpreter::

    python tests/data/pretokenizers/record.py [--retrain] [--llama-python /work/llamavenv/bin/python]

1. (localllm venv) trains a small byte-level BPE with ``tokenizers`` on mixed text (the
   GPL-3 text, this project's sources, code, numbers, CJK, emoji, whitespace runs,
   contractions) into ``vocab.json``, extended with whole-word tokens that no merge makes
   (so ``ignore_merges`` shows) and control tokens; writes one vocabulary-only GGUF per name;
2. (llama venv, ``--oracle DIR``) loads each with ``vocab_only=True`` and tokenizes TEXTS with
   and without the special tokens llama.cpp adds;
3. writes ``golden.json``: per name, the ids (or the name of an earlier one with identical
   results) and llama.cpp's add_bos.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from oracle import GPL3, ROOT, LlamaVocab, quiet, run_oracle, train_byte_bpe

N_MERGES = 1200
CONTROL_TOKENS = ["<|begin_of_text|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WHOLE_WORDS = [" zyxomancy", " Quetzalcoatl", "floccinaucinihilipilification", " 12345",
               "Hello", "日本語"]

SAMPLES = [
    "naïve café résumé façade coöperate Ångström Øresund straße ǅemal",
    "Привет, как дела? Это тест токенизатора. Ελληνικά γράμματα.",
    "你好，世界！这是一个分词器测试。日本語のテキストとカタカナ。한국어 문장입니다.",
    "مرحبا بالعالم. שלום עולם. हिन्दी पाठ का उदाहरण। ภาษาไทย",
    "emoji 🤖🚀👍🏽 👨‍👩‍👧 ❤️ ✨ flags 🇫🇷🇯🇵 combining e\u0301 a\u0308 n\u0303",
    "math ∑∫√∞ ≤ ≥ ≠ ± × ÷ ° µ ½ ¾ ²³ ①②③ ⅣⅫ ٣٤٥ ０１２",
    "1 12 123 1234 12345 123456 1234567 3.14159 1,000,000 0x1F 2024-01-31 v10.2.3",
    "def f(x):\n    return x ** 2  # square\n\tif a != b: pass\n",
    "it's I'll we've they're she'd I'm don't IT'S YOU'LL He'D",
]

TEXTS = [
    "Hello world",
    " Hello world",
    "  leading two spaces and trailing  ",
    "hello   world\t\ttabs\t \nmixed",
    "\n\n\n",
    "line one\nline two\n\nline four\r\nwindows\r\n\r\n",
    "   \n   \n\t\n end",
    "   ",
    "1 12 123 1234 12345 123456 1234567 3.14159 1,000,000 0x1F 2024-01-31",
    "12345678901 and 999,999.5 and ٣٤٥٦ and ０１２３",
    "version 10.2.3 costs $1234.56 (about 99%)",
    "it's I'll we've they're she'd I'm don't IT'S YOU'LL He'D",
    "'s 'll 'S 'LL quote 'single' \"double\"",
    "naïve café résumé Ångström straße",
    "e\u0301 a\u0308 combining marks and \u00e9 precomposed",
    "Привет, мир! Ελληνικά ΠΡΙΒΕΤ МиР",
    "你好，世界！日本語のテキスト。한국어 カタカナ ひらがな",
    "中文English混合123測試",
    "مرحبا بالعالم שלום हिन्दी ภาษาไทย",
    "🤖🚀👍🏽 👨‍👩‍👧 ❤️ 🇫🇷",
    "∑∫√∞ ≤ ≥ ½ ²³ ①② ٣٤٥ ０１２",
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}",
    'if __name__ == "__main__":\n        main()\n\n\n',
    '<html><body class="x">&amp; &lt;tag&gt;</body></html>',
    "a.b,c;d:e!f?g...h---i___j",
    "path/to/file.txt and C:\\Windows\\ and https://example.com/a?b=c",
    "The zyxomancy of Quetzalcoatl is floccinaucinihilipilification: 12345 tokens.",
    " zyxomancy Quetzalcoatl floccinaucinihilipilification12345 zyxomancy's",
    "CamelCaseWords HTTPServer getHTTPResponse iPhone ÉCOLE École",
    "it'ſelf 'ſt 'Kelvin 'İs 'ıs \n'ſカ!",
    "x\u00a0nbsp\u2009thin\u3000ideographic\u200bzwsp",
    "<sentinel:12> IMGIMGABZ tabs\t\tand    four",
    "MiXeD CaSe WORDS and ALLCAPS",
    "GNU General Public License version 3, 29 June 2007",
    "<|im_start|>user\nHi there<|im_end|>\n",
]


def train_vocab() -> dict:
    """The byte-level BPE, plus whole-word and control tokens."""
    from tokenizers import Regex, pre_tokenizers

    corpus = [GPL3.read_text()]
    corpus += [p.read_text() for p in sorted((ROOT / "localllm").rglob("*.py"))[:20]]
    corpus += SAMPLES * 30
    # Merges across letters, digits, punctuation and spaces (only line breaks cut the
    # training text), so that where a pre-tokenizer splits changes the ids.
    pre = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"[^\n]{1,24}"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    return train_byte_bpe(corpus, N_MERGES, pre, whole_words=WHOLE_WORDS,
                          control=CONTROL_TOKENS)


def write_ggufs(vocab: dict, folder: Path) -> list[str]:
    sys.path.insert(0, str(ROOT / "tests"))
    sys.path.insert(0, str(ROOT))
    from test_tokenizer_bpe_golden import write_vocab_gguf

    from localllm.tokenizer import PRE_TOKENIZERS

    ids = {t: i for i, t in enumerate(vocab["tokens"])}
    names = sorted(PRE_TOKENIZERS)
    for name in names:
        meta = {"pre": name, "bos": ids["<|begin_of_text|>"], "eos": ids["<|endoftext|>"]}
        write_vocab_gguf(folder / f"{name}.gguf", vocab, meta)
    return names


def oracle(folder: Path, names: list[str]) -> dict:
    """(llama venv) name -> {"add_bos", "plain", "special"} from llama.cpp."""
    import llama_cpp as lc

    quiet(lc)
    out = {}
    for name in names:
        try:
            lv = LlamaVocab(folder / f"{name}.gguf")
        except RuntimeError:
            out[name] = {"error": "llama.cpp could not load it"}
            continue
        out[name] = {
            "add_bos": lv.info(0)["add_bos"],
            "plain": [lv.tokenize(t, False, False) for t in TEXTS],
            "special": [lv.tokenize(t, True, False) for t in TEXTS],
        }
        lv.close()
    return out


def main() -> None:
    if "--oracle" in sys.argv:
        folder = Path(sys.argv[sys.argv.index("--oracle") + 1])
        names = json.loads((folder / "names.json").read_text())
        print(json.dumps(oracle(folder, names)))
        return
    vocab_path = HERE / "vocab.json"
    if "--retrain" in sys.argv or not vocab_path.exists():
        vocab_path.write_text(json.dumps(train_vocab(), ensure_ascii=False, separators=(",", ":")))
    vocab = json.loads(vocab_path.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        names = write_ggufs(vocab, Path(tmp))
        (Path(tmp) / "names.json").write_text(json.dumps(names))
        results = run_oracle(__file__, tmp)
    golden: dict = {"texts": TEXTS, "names": {}}
    first_with: dict[str, str] = {}
    for name in names:
        res = results[name]
        key = json.dumps(res, sort_keys=True)
        if key in first_with:
            golden["names"][name] = {"same_as": first_with[key]}
        else:
            first_with[key] = name
            golden["names"][name] = res
    (HERE / "golden.json").write_text(json.dumps(golden, ensure_ascii=False, separators=(",", ":")))
    distinct = len(first_with)
    print(f"{len(names)} names, {distinct} distinct tokenizations -> {HERE / 'golden.json'}")


if __name__ == "__main__":
    main()
