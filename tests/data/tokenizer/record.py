"""Record llama.cpp's byte-level BPE tokenization into bpe_golden.json (developer tool).

Needs llama-cpp-python (an oracle only, never a dependency of localllm) and ``tokenizers``::

    python tests/data/tokenizer/record.py            # re-record ids with the committed vocab
    python tests/data/tokenizer/record.py --retrain  # also retrain bpe_vocab.json

The vocabulary is a byte-level BPE trained with ``tokenizers`` on the GPL-3 text, this project's
own Python sources and unicode samples, then extended with control / user-defined tokens and a few
whole-word tokens that no merge produces (so llama3's ``ignore_merges`` shows).
"""

from __future__ import annotations

import ctypes
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from test_tokenizer_bpe_golden import write_vocab_gguf

from localllm.tokenizer import _byte_decoder

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
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    corpus = [(ROOT.parent / "shared" / "reference" / "gpl-3.txt").read_text()]
    corpus += [p.read_text() for p in sorted((ROOT / "localllm").glob("*.py"))]
    corpus += UNICODE_SAMPLES * 20
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=256 + N_MERGES,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
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
    tokens += CONTROL_TOKENS + USER_TOKENS
    types += [3] * len(CONTROL_TOKENS) + [4] * len(USER_TOKENS)
    return {"tokens": tokens, "types": types, "merges": merges}


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


class LlamaVocab:
    """llama.cpp's vocabulary of a GGUF, loaded with ``vocab_only``."""

    def __init__(self, path: Path) -> None:
        import llama_cpp as lc

        self.lc = lc
        params = lc.llama_model_default_params()
        params.vocab_only = True
        self.model = lc.llama_model_load_from_file(str(path).encode(), params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.vocab = lc.llama_model_get_vocab(self.model)

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        data = text.encode()
        cap = len(data) + 8
        buf = (self.lc.llama_token * cap)()
        n = self.lc.llama_tokenize(
            self.vocab, data, len(data), buf, cap, add_special, parse_special
        )
        assert n >= 0, n
        return list(buf[:n])

    def pieces(self, ids: list[int], special: bool) -> str:
        """The concatenated ``llama_token_to_piece`` bytes (what llama-cli prints; unlike
        ``llama_detokenize`` it never cleans up spaces)."""
        out = b""
        buf = ctypes.create_string_buffer(256)
        for i in ids:
            n = self.lc.llama_token_to_piece(self.vocab, i, buf, 256, 0, special)
            assert n >= 0, n
            out += buf.raw[:n]
        return out.decode("utf-8", errors="replace")

    def info(self, n_vocab: int) -> dict:
        lc, v = self.lc, self.vocab
        return {
            "add_bos": bool(lc.llama_vocab_get_add_bos(v)),
            "eog": [i for i in range(n_vocab) if lc.llama_vocab_is_eog(v, i)],
            "control": [i for i in range(n_vocab) if lc.llama_vocab_is_control(v, i)],
        }

    def close(self) -> None:
        self.lc.llama_model_free(self.model)


def main() -> None:
    vocab_path = HERE / "bpe_vocab.json"
    if "--retrain" in sys.argv or not vocab_path.exists():
        vocab_path.write_text(json.dumps(train_vocab(), ensure_ascii=False, separators=(",", ":")))
    vocab = json.loads(vocab_path.read_text())
    out: dict = {"texts": TEXTS, "variants": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, meta in variants(vocab).items():
            lv = LlamaVocab(write_vocab_gguf(Path(tmp) / f"{name}.gguf", vocab, meta))
            cases = []
            for text in TEXTS:
                special = lv.tokenize(text, False, True)
                cases.append(
                    {
                        "plain": lv.tokenize(text, False, False),
                        "bos": lv.tokenize(text, True, False),
                        "special": special,
                        "detok": lv.pieces(special, False),
                        "detok_special": lv.pieces(special, True),
                    }
                )
            out["variants"][name] = {
                "meta": meta,
                **meta,
                **lv.info(len(vocab["tokens"]) + len(meta.get("extra", []))),
                "cases": cases,
            }
            lv.close()
    (HERE / "bpe_golden.json").write_text(json.dumps(out, ensure_ascii=False, indent=None))


if __name__ == "__main__":
    main()
