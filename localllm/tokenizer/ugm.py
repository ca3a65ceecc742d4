"""Unigram (``tokenizer.ggml.model = t5``), as llama.cpp's ``llm_tokenizer_ugm``.

Source: llama.cpp ``src/llama-vocab.cpp`` (UGM session), itself SentencePiece's optimized
Viterbi for unigram language models.

Normalization: SentencePiece's precompiled character map (``tokenizer.ggml.precompiled_charsmap``,
applied through the ``tokenizers`` library's ``Precompiled`` normalizer), then spaces become
``▁``, with one prepended to the text (``add_space_prefix``) or to every run of non-spaces with
runs of spaces dropped (``remove_extra_whitespaces``). User-defined token texts are left
as they are. Viterbi: NORMAL, USER_DEFINED (score 0) and UNUSED tokens are candidates; a code
point no token covers costs the lowest NORMAL score minus 10 and is ``<unk>``; runs of
``<unk>`` collapse into one.
"""

from __future__ import annotations

import re

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
_SPACE = "\u2581"


class Unigram:
    """Viterbi tokenization over a GGUF unigram vocabulary (pieces, log-prob scores)."""

    def __init__(self, tokens: list[str], scores, types: list[int], unk_id: int | None,
                 charsmap=None, *, add_space_prefix: bool = True,
                 remove_extra_whitespaces: bool = False) -> None:
        scores = list(scores) if scores is not None else [0.0] * len(tokens)
        self.unk_id = unk_id
        self.pieces: dict[str, tuple[int, float]] = {}
        normal = [scores[i] for i, k in enumerate(types) if k == NORMAL]
        self.unknown_score = (min(normal) if normal else 0.0) - 10.0
        user = []
        for i, (text, kind) in enumerate(zip(tokens, types)):
            if kind in (NORMAL, USER_DEFINED, UNUSED) and text and text not in self.pieces:
                self.pieces[text] = (i, 0.0 if kind == USER_DEFINED else float(scores[i]))
            if kind == USER_DEFINED and text:
                user.append(text)
        self.max_len = max((len(t) for t in self.pieces), default=1)
        self._user_re = (re.compile("|".join(map(re.escape, sorted(user, key=len, reverse=True))))
                         if user else None)
        self._normalizer = None
        if charsmap is not None and len(charsmap) > 0:
            from tokenizers import normalizers

            self._normalizer = normalizers.Precompiled(bytes(int(b) & 0xFF for b in charsmap))
        self.add_space_prefix = add_space_prefix
        self.merge_spaces = remove_extra_whitespaces

    def normalize(self, text: str) -> str:
        """llama.cpp's ``normalize``: character map, then spaces as ``▁``."""
        parts, pos = [], 0
        for m in self._user_re.finditer(text) if self._user_re is not None else ():
            parts.append(self._map(text[pos:m.start()]))
            parts.append(m.group(0))
            pos = m.end()
        parts.append(self._map(text[pos:]))
        text = "".join(parts)
        out, in_word, prepended = [], False, False
        for ch in text:
            if ch != " ":
                if not in_word:
                    in_word = True
                    if (self.add_space_prefix and not prepended) or self.merge_spaces:
                        out.append(_SPACE)
                        prepended = True
                out.append(ch)
            else:
                in_word = False
                if not self.merge_spaces:
                    out.append(_SPACE)
        return "".join(out)

    def _map(self, text: str) -> str:
        if not text or self._normalizer is None:
            return text
        return self._normalizer.normalize_str(text)

    def encode(self, text: str) -> list[int]:
        s = self.normalize(text)
        n = len(s)
        if n == 0:
            return []
        best = [(-float("inf"), 0, self.unk_id)] * (n + 1)  # (score, start, token)
        best[0] = (0.0, 0, self.unk_id)
        pieces, max_len = self.pieces, self.max_len
        for i in range(n):
            base = best[i][0]
            single = False
            for j in range(i + 1, min(n, i + max_len) + 1):
                hit = pieces.get(s[i:j])
                if hit is None:
                    continue
                if j == i + 1:
                    single = True
                score = base + hit[1]
                if score > best[j][0]:
                    best[j] = (score, i, hit[0])
            if not single:
                score = base + self.unknown_score
                if score > best[i + 1][0]:
                    best[i + 1] = (score, i, self.unk_id)
        out, pos, prev_unk = [], n, False
        while True:
            _, start, tok = best[pos]
            is_unk = tok == self.unk_id
            if not (prev_unk and is_unk):
                out.append(tok)
            if start == 0:
                break
            prev_unk, pos = is_unk, start
        out.reverse()
        return out
