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
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]

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
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    sys.path.insert(0, str(ROOT))
    from localllm.tokenizer import _byte_decoder

    corpus = [(ROOT / "tests" / "data" / "reference" / "gpl-3.txt").read_text()]
    corpus += [p.read_text() for p in sorted((ROOT / "localllm").rglob("*.py"))[:20]]
    corpus += SAMPLES * 30
    tok = Tokenizer(models.BPE())
    # Merges across letters, digits, punctuation and spaces (only line breaks cut the
    # training text), so that where a pre-tokenizer splits changes the ids.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"[^\n]{1,24}"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(vocab_size=256 + N_MERGES, min_frequency=2,
                                  show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [1] * len(tokens)
    byte_char = {b: c for c, b in _byte_decoder().items()}
    for word in WHOLE_WORDS:
        piece = "".join(byte_char[b] for b in word.encode())
        if piece not in tokens:
            tokens.append(piece)
            types.append(1)
    tokens += CONTROL_TOKENS
    types += [3] * len(CONTROL_TOKENS)
    return {"tokens": tokens, "types": types, "merges": merges}


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

    global _QUIET
    _QUIET = lc.llama_log_callback(lambda *a: None)  # kept alive: llama.cpp calls it later
    lc.llama_log_set(_QUIET, None)
    out = {}
    for name in names:
        params = lc.llama_model_default_params()
        params.vocab_only = True
        model = lc.llama_model_load_from_file(str(folder / f"{name}.gguf").encode(), params)
        if not model:
            out[name] = {"error": "llama.cpp could not load it"}
            continue
        vocab = lc.llama_model_get_vocab(model)

        def tokenize(text: str, add_special: bool) -> list[int]:
            data = text.encode()
            cap = 4 * len(data) + 16
            buf = (lc.llama_token * cap)()
            n = lc.llama_tokenize(vocab, data, len(data), buf, cap, add_special, False)
            assert n >= 0, n
            return list(buf[:n])

        out[name] = {
            "add_bos": bool(lc.llama_vocab_get_add_bos(vocab)),
            "plain": [tokenize(t, False) for t in TEXTS],
            "special": [tokenize(t, True) for t in TEXTS],
        }
        lc.llama_model_free(model)
    return out


def main() -> None:
    if "--oracle" in sys.argv:
        folder = Path(sys.argv[sys.argv.index("--oracle") + 1])
        names = json.loads((folder / "names.json").read_text())
        print(json.dumps(oracle(folder, names)))
        return
    llama_python = "/work/llamavenv/bin/python"
    if "--llama-python" in sys.argv:
        llama_python = sys.argv[sys.argv.index("--llama-python") + 1]
    vocab_path = HERE / "vocab.json"
    if "--retrain" in sys.argv or not vocab_path.exists():
        vocab_path.write_text(json.dumps(train_vocab(), ensure_ascii=False, separators=(",", ":")))
    vocab = json.loads(vocab_path.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        names = write_ggufs(vocab, Path(tmp))
        (Path(tmp) / "names.json").write_text(json.dumps(names))
        done = subprocess.run([llama_python, __file__, "--oracle", tmp], capture_output=True,
                              text=True, check=True)
        results = json.loads(done.stdout)
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
