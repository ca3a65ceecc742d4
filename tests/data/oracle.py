"""What the fixture recorders (``tests/data/*/record.py``) share: llama.cpp as an oracle
through llama-cpp-python, and the toy byte-level BPE vocabularies they train.

Developer tool only: llama-cpp-python runs in its own interpreter (``--llama-python``, default
``/work/llamavenv/bin/python``) and is never a dependency of localllm or of its tests; the
tests read only the recorded JSON/NPZ files.
"""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_LLAMA_PYTHON = "/work/llamavenv/bin/python"
GPL3 = ROOT / "tests" / "data" / "reference" / "gpl-3.txt"


def llama_python() -> str:
    """The interpreter with llama-cpp-python: ``--llama-python PATH`` or the default."""
    if "--llama-python" in sys.argv:
        return sys.argv[sys.argv.index("--llama-python") + 1]
    return DEFAULT_LLAMA_PYTHON


def run_oracle(script: str | Path, folder: str | Path):
    """Run ``script --oracle folder`` under :func:`llama_python` and return the JSON value
    it prints on stdout. Raises ``subprocess.CalledProcessError`` when it fails."""
    done = subprocess.run([llama_python(), str(script), "--oracle", str(folder)],
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def log_softmax(x):
    """Row-wise log-softmax in float64 of a numpy array (..., n_vocab)."""
    import numpy as np

    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


_QUIET = None


def quiet(lc) -> None:
    """Silence llama.cpp's log (the callback is kept alive: llama.cpp calls it later)."""
    global _QUIET
    _QUIET = lc.llama_log_callback(lambda *a: None)
    lc.llama_log_set(_QUIET, None)


class LlamaVocab:
    """llama.cpp's vocabulary of a GGUF, loaded with ``vocab_only`` (llama-cpp-python's
    low-level API: ``llama_tokenize``, ``llama_token_to_piece``).

    Raises:
        RuntimeError: llama.cpp refused the file.
    """

    def __init__(self, path: str | Path) -> None:
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
        cap = 4 * len(data) + 16
        buf = (self.lc.llama_token * cap)()
        n = self.lc.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special,
                                   parse_special)
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
        """llama.cpp's add_bos and its end-of-generation and control token ids."""
        lc, v = self.lc, self.vocab
        return {
            "add_bos": bool(lc.llama_vocab_get_add_bos(v)),
            "eog": [i for i in range(n_vocab) if lc.llama_vocab_is_eog(v, i)],
            "control": [i for i in range(n_vocab) if lc.llama_vocab_is_control(v, i)],
        }

    def close(self) -> None:
        self.lc.llama_model_free(self.model)


def train_byte_bpe(corpus: list[str], n_merges: int, pre_tokenizer, *,
                   whole_words: list[str], control: list[str],
                   user: list[str] = ()) -> dict:
    """A byte-level BPE trained with ``tokenizers`` on ``corpus`` (``n_merges`` merges over
    the 256 byte characters), extended with ``whole_words`` that no merge makes (so
    ``ignore_merges`` shows), then ``control`` (type 3) and ``user`` (type 4) tokens.
    Returns the GGUF form ``{"tokens", "types", "merges"}``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    sys.path.insert(0, str(ROOT))
    from localllm.tokenizer import _byte_decoder

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=256 + n_merges, min_frequency=2,
                                  show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [1] * len(tokens)
    byte_char = {b: c for c, b in _byte_decoder().items()}
    for word in whole_words:
        piece = "".join(byte_char[b] for b in word.encode())
        if piece not in tokens:
            tokens.append(piece)
            types.append(1)
    tokens += list(control) + list(user)
    types += [3] * len(control) + [4] * len(user)
    return {"tokens": tokens, "types": types, "merges": merges}
