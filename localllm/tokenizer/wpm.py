"""WordPiece (``tokenizer.ggml.model = bert``), as llama.cpp's ``llm_tokenizer_wpm``.

Source: llama.cpp ``src/llama-vocab.cpp`` (WPM session). The GGUF vocabulary stores word
starts with a leading ``▁`` and continuations bare (the converter's form of BERT's ``##``).

Normalization (BERT's): accents stripped (NFD, marks dropped) and text lowercased, as the
``tokenizer.ggml.normalizer.lowercase`` / ``strip_accents`` keys say (strip_accents follows
lowercase when absent, both default on); whitespace splits words, control characters go,
punctuation, ASCII symbols and CJK ideographs are words of their own. Each word is then cut
greedily into the longest vocabulary pieces; a word with no complete cut is ``[UNK]``.
"""

from __future__ import annotations

import unicodedata

from .unicode import is_whitespace, simple_lower

_PHANTOM = "\u2581"


def _is_chinese(cp: int) -> bool:
    return (0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x20000 <= cp <= 0x2A6DF
            or 0x2A700 <= cp <= 0x2B73F or 0x2B740 <= cp <= 0x2B81F or 0x2B920 <= cp <= 0x2CEAF
            or 0xF900 <= cp <= 0xFAFF or 0x2F800 <= cp <= 0x2FA1F)


class WordPiece:
    """Greedy longest-match WordPiece over a GGUF vocabulary."""

    def __init__(self, tokens: list[str], unk_id: int | None, *, lowercase: bool = True,
                 strip_accents: bool = True) -> None:
        self.token_to_id = {t: i for i, t in enumerate(tokens)}
        self.unk_id = unk_id
        self.max_len = max((len(t) for t in tokens), default=1)
        self.lowercase, self.strip_accents = lowercase, strip_accents

    def words(self, text: str) -> list[str]:
        """llama.cpp's ``preprocess``: the normalized words of ``text``."""
        if self.strip_accents:
            text = unicodedata.normalize("NFD", text)
        words, cur = [], []
        for ch in text:
            cp = ord(ch)
            if is_whitespace(cp):
                if cur:
                    words.append("".join(cur))
                    cur = []
                continue
            cat = unicodedata.category(ch)
            if cp == 0 or cp == 0xFFFD or cat in ("Cc", "Cf", "Co", "Cs"):
                continue
            if self.strip_accents and (cat[0] == "M" or 0x1160 <= cp <= 0x11FF):
                continue  # llama.cpp's tables flag Hangul vowel / final jamo as marks
            s = simple_lower(ch) if self.lowercase else ch
            if cat[0] == "P" or (cp < 0x7F and cat[0] == "S") or _is_chinese(cp):
                if cur:
                    words.append("".join(cur))
                    cur = []
                words.append(s)
            else:
                cur.append(s)
        if cur:
            words.append("".join(cur))
        return words

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        vocab = self.token_to_id
        for word in self.words(text):
            word = _PHANTOM + word
            n, start, ids = len(word), 0, []
            while start < n:
                for end in range(min(n, start + self.max_len), start, -1):
                    tid = vocab.get(word[start:end])
                    if tid is not None:
                        ids.append(tid)
                        start = end
                        break
                else:
                    ids = []
                    break
            if ids:
                out += ids
            elif self.unk_id is not None:
                out.append(self.unk_id)
        return out
