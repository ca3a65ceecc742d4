"""Tokenizers built from GGUF metadata, matching llama.cpp's ``llama-vocab.cpp``.

Four vocabulary types are supported, under the names llama.cpp gives them in
``tokenizer.ggml.model``:

* ``llama``: SentencePiece BPE (Llama 1/2, Mistral, Gemma). Encoding goes through the
  ``sentencepiece`` library, fed a model proto rebuilt from the GGUF vocabulary
  (pieces, scores, token types) (``spm.py``).
* ``gpt2``: byte-level BPE (Llama 3, Qwen 2/3, SmolLM ...). Encoding goes through the
  ``tokenizers`` library with the pre-tokenizer that ``tokenizer.ggml.pre`` names
  (``bpe.py``, ``pretokenizers.py``).
* ``bert``: WordPiece (``wpm.py``); ``t5``: Unigram (``ugm.py``). ``rwkv`` is refused.

Special tokens follow llama.cpp: CONTROL tokens are only recognised in the text when
``special=True``; USER_DEFINED tokens are always recognised. Known turn-end and
fill-in-the-middle texts count as CONTROL whatever type the GGUF gives them, as in
llama.cpp. Decoding is our own: each token maps to the bytes it contributes
(:meth:`Tokenizer.token_bytes`).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from functools import lru_cache

from ..errors import GGUFError, LocalLLMError, UnsupportedError
from .pretokenizers import pre_tokenizer

# GGUF token types (gguf.TokenType; identical to sentencepiece's piece types).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Token texts llama.cpp (llama_vocab::impl::load) always treats as CONTROL, whatever type the
# GGUF gives them, and adds to the end-of-generation set. Checked against llama.cpp with
# tests/data/tokenizer/record.py.
_EOG_TEXTS = (
    "<end_of_turn>", "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<|endoftext|>",
    "<|end_of_text|>", "<EOT>", "_<EOT>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_utterance>", "<｜end▁of▁sentence｜>", "</s>", "<eos>",
    # fill-in-the-middle padding, repository and file separators
    "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "<|fim_repo|>", "<|repo_name|>",
    "<fim-repo>", "<REPO>", "<reponame>", "<|file_sep|>",
)
# Fill-in-the-middle prefix/suffix/middle texts: promoted to CONTROL, but do not end generation.
_FIM_TEXTS = (
    "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<PRE>", "▁<PRE>", "<｜fim▁begin｜>",
    "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<SUF>", "▁<SUF>", "<｜fim▁hole｜>",
    "<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<MID>", "▁<MID>", "<｜fim▁end｜>",
)
# In the harmony (gpt-oss) style vocabularies "<|end|>" ends a message, not the generation;
# llama.cpp recognises them by these pairs and then leaves "<|end|>" alone.
_END_IS_NOT_EOG_WITH = (("<|return|>", "<|call|>"), ("<|calls|>", "<|flush|>"))
_SPECIAL_ID_KEYS = ("bos", "eos", "eot", "eom", "unknown", "padding", "sep")
# tokenizer.ggml.model values: SentencePiece BPE, byte-level BPE, WordPiece, Unigram.
_MODEL_TYPES = ("llama", "gpt2", "bert", "t5")

@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable-unicode alphabet for bytes, inverted: char -> byte value."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class Tokenizer:
    """Text <-> token ids for one GGUF vocabulary.

    Attributes:
        n_vocab: vocabulary size (tokens).
        bos_id / eos_id: from ``tokenizer.ggml.bos_token_id`` / ``eos_token_id`` (or None).
        eog_ids: every end-of-generation token id (EOS, EOT, EOM, known turn-end texts and
            fill-in-the-middle separators, as llama.cpp collects them).
        add_bos: ``tokenizer.ggml.add_bos_token`` (llama.cpp's default: True for ``llama`` and
            ``bert``, and for ``gpt2`` when the pre-tokenizer's type says so).
        add_eos / add_sep: appended when special tokens are added (defaults: ``t5`` adds EOS,
            ``bert`` SEP).
        pre: the ``tokenizer.ggml.pre`` entry in use (``default`` for a missing or unknown
            name and for non-BPE vocabularies); clean_spaces: its clean-up flag.
    Raises:
        GGUFError: missing or inconsistent tokenizer keys, merges naming unknown pieces.
        UnsupportedError: a vocabulary type (rwkv ...) or pre-tokenizer not implemented.
    """

    def __init__(self, metadata: dict) -> None:
        self.model_type: str = metadata.get("tokenizer.ggml.model", "")
        tokens = metadata.get("tokenizer.ggml.tokens")
        if self.model_type == "rwkv":
            raise UnsupportedError("tokenizer type 'rwkv' (RWKV's greedy trie tokenizer) is not "
                                   "supported")
        if self.model_type not in _MODEL_TYPES:
            raise UnsupportedError(f"tokenizer type {self.model_type!r} is not supported "
                                   f"(supported: {', '.join(_MODEL_TYPES)})")
        if not tokens:
            raise GGUFError("tokenizer.ggml.tokens is missing or empty")
        # The metadata's list itself when it is one (never modified here): a copy of the
        # default model's 262,144 references is 2 MiB more resident memory.
        self.tokens: list[str] = tokens if isinstance(tokens, list) else list(tokens)
        self.n_vocab = len(self.tokens)
        types = metadata.get("tokenizer.ggml.token_type")
        self.types: list[int] = list(types) if types is not None else [NORMAL] * self.n_vocab
        self.scores = metadata.get("tokenizer.ggml.scores")
        if len(self.types) != self.n_vocab or (
            self.scores is not None and len(self.scores) != self.n_vocab
        ):
            raise GGUFError("tokenizer.ggml.token_type/scores lengths differ from tokens")

        def special_id(name: str) -> int | None:
            key = "seperator" if name == "sep" else name  # llama.cpp's spelling of the key
            value = metadata.get(f"tokenizer.ggml.{key}_token_id")
            if value is None:
                return None
            if not 0 <= int(value) < self.n_vocab:
                raise GGUFError(
                    f"tokenizer.ggml.{name}_token_id = {value} is outside the vocabulary "
                    f"(size {self.n_vocab})"
                )
            return int(value)

        ids = {name: special_id(name) for name in _SPECIAL_ID_KEYS}
        self.bos_id, self.eos_id, self.sep_id = ids["bos"], ids["eos"], ids["sep"]
        self.unk_id = ids["unknown"]
        # llama.cpp's per-type defaults (llama_vocab::impl::load), then the GGUF's keys
        default_eos = default_sep = False
        if self.model_type == "gpt2":
            self.pre, pre = pre_tokenizer(metadata.get("tokenizer.ggml.pre"))
            default_bos, self.clean_spaces = pre.add_bos, pre.clean_spaces
        else:
            self.pre, pre = "default", None
            default_bos, self.clean_spaces = self.model_type != "t5", self.model_type == "bert"
            default_eos = self.model_type == "t5"
            default_sep = self.model_type == "bert"
        self.add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", default_bos))
        self.add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", default_eos))
        self.add_sep = bool(metadata.get("tokenizer.ggml.add_sep_token", default_sep))
        self.add_space_prefix = bool(
            metadata.get("tokenizer.ggml.add_space_prefix", self.model_type == "llama")
        )
        eog = {i for i in (ids["eos"], ids["eot"], ids["eom"]) if i is not None}
        eog.update(self._promote_special_texts())
        self.eog_ids: frozenset[int] = frozenset(eog)
        text_to_id = {t: i for i, t in enumerate(self.tokens) if self.types[i] != NORMAL}

        # Texts recognised as single tokens before the BPE runs (llama.cpp's
        # tokenizer_st_partition): CONTROL only with special=True, USER_DEFINED always.
        user = [t for i, t in enumerate(self.tokens) if self.types[i] == USER_DEFINED and t]
        self._user_re = _alternation(user)
        self._text_to_id = text_to_id
        self._bytes_cache: dict[int, bytes] = {}  # the pieces seen so far (not 2 MiB of Nones)
        try:
            if self.model_type == "llama":
                from .spm import build_sentencepiece

                self._sp = build_sentencepiece(self.tokens, self.scores, self.types, ids)
            elif self.model_type == "bert":
                from .wpm import WordPiece

                lower = bool(metadata.get("tokenizer.ggml.normalizer.lowercase", True))
                strip = bool(metadata.get("tokenizer.ggml.normalizer.strip_accents", lower))
                self._wpm = WordPiece(self.tokens, self.unk_id, lowercase=lower, strip_accents=strip)
            elif self.model_type == "t5":
                from .ugm import Unigram

                self._ugm = Unigram(self.tokens, self.scores, self.types, self.unk_id,
                                    metadata.get("tokenizer.ggml.precompiled_charsmap"),
                                    add_space_prefix=self.add_space_prefix,
                                    remove_extra_whitespaces=bool(metadata.get(
                                        "tokenizer.ggml.remove_extra_whitespaces", False)))
            else:
                from .bpe import build_byte_bpe

                merges = metadata.get("tokenizer.ggml.merges")
                if not merges:
                    raise GGUFError("tokenizer.ggml.merges is missing for a gpt2 vocabulary")
                self._bpe = build_byte_bpe(self.tokens, list(merges), self.pre, pre)
        except (KeyboardInterrupt, SystemExit, LocalLLMError):
            raise
        except BaseException as e:  # noqa: BLE001 - sentencepiece's RuntimeError, a Rust
            # panic in tokenizers (a BaseException): what validate_vocab did not foresee
            library = "sentencepiece" if self.model_type == "llama" else "tokenizers"
            message = " ".join(str(e).split())[:200]
            raise GGUFError(f"the vocabulary is refused by {library}: {message}") from None

    def _special_pattern(self) -> re.Pattern | None:
        """CONTROL, UNKNOWN and USER_DEFINED texts as one alternation, compiled on first use
        (thousands of control tokens in Gemma's vocabulary: 0.16 s that raw prompts skip)."""
        if not hasattr(self, "_special_re"):
            texts = [t for i, t in enumerate(self.tokens)
                     if self.types[i] in (CONTROL, UNKNOWN, USER_DEFINED) and t]
            self._special_re = _alternation(texts)
        return self._special_re

    def _promote_special_texts(self) -> set[int]:
        """Mark the turn-end and fill-in-the-middle texts CONTROL, as llama.cpp does on load;
        returns the ids of those that end generation."""
        index = {t: i for i, t in enumerate(self.tokens)}
        eog_texts = set(_EOG_TEXTS)
        if any(a in index and b in index for a, b in _END_IS_NOT_EOG_WITH):
            eog_texts.discard("<|end|>")
        promoted = [index[t] for t in (*eog_texts, *_FIM_TEXTS) if t in index]
        if promoted:
            self.types = list(self.types)
            for i in promoted:
                self.types[i] = CONTROL
        return {index[t] for t in eog_texts if t in index}

    # ---- encoding -------------------------------------------------------------------------
    def encode(self, text: str, *, add_bos: bool | None = None, special: bool = False) -> list[int]:
        """Token ids of ``text``.

        Args:
            add_bos: prepend BOS (default: the vocabulary's ``add_bos_token``).
            special: recognise CONTROL token texts (``<start_of_turn>`` ...) as single tokens;
                leave False for raw user input.
        """
        add_special = add_bos is not False  # llama.cpp's add_special: BOS, EOS, SEP
        add_bos = self.add_bos if add_bos is None else add_bos
        ids: list[int] = [self.bos_id] if add_bos and self.bos_id is not None else []
        pattern = self._special_pattern() if special else self._user_re
        prev_special = True
        pos = 0
        for m in pattern.finditer(text) if pattern is not None else ():
            if m.start() > pos:
                ids += self._encode_raw(text[pos : m.start()], prev_special)
            ids.append(self._text_to_id[m.group(0)])
            prev_special, pos = True, m.end()
        if pos < len(text):
            ids += self._encode_raw(text[pos:], prev_special)
        if add_special and self.add_eos and self.eos_id is not None:
            ids.append(self.eos_id)
        if add_special and self.add_sep and self.sep_id is not None:
            ids.append(self.sep_id)
        return ids

    def _encode_raw(self, text: str, after_special: bool) -> list[int]:
        if self.model_type == "llama":
            if self.add_space_prefix and after_special:
                text = " " + text
            return self._sp.encode(text)
        if self.model_type == "bert":
            return self._wpm.encode(text)
        if self.model_type == "t5":
            return self._ugm.encode(text)
        return self._bpe.encode(text, add_special_tokens=False).ids

    # ---- decoding -------------------------------------------------------------------------
    def token_text(self, token: int) -> str:
        """The raw vocabulary piece of ``token`` (``▁`` and ``<0x0A>`` as stored)."""
        return self.tokens[token]

    def is_control(self, token: int) -> bool:
        return self.types[token] in (CONTROL, UNKNOWN, UNUSED)

    def token_bytes(self, token: int) -> bytes:
        """The bytes ``token`` contributes to the output text (b'' for control tokens)."""
        cached = self._bytes_cache.get(token)
        if cached is None:
            cached = self._bytes_cache[token] = self._piece_bytes(token)
        return cached

    def _piece_bytes(self, token: int) -> bytes:
        text, kind = self.tokens[token], self.types[token]
        if kind in (CONTROL, UNKNOWN, UNUSED):
            return b""
        if kind == BYTE:
            return bytes([int(text[3:-1], 16)])
        if kind == USER_DEFINED:
            return text.encode("utf-8")
        if self.model_type != "gpt2":  # SentencePiece-style pieces: ▁ is a space
            return text.replace("▁", " ").encode("utf-8")
        table = _byte_decoder()
        try:
            return bytes(table[c] for c in text)
        except KeyError:  # a piece outside the byte alphabet: take it literally
            return text.encode("utf-8")

    def special_bytes(self, token: int) -> bytes:
        """Like :meth:`token_bytes`, but control tokens render as their text."""
        return self.tokens[token].encode("utf-8") if self.is_control(token) else self.token_bytes(token)

    def decode(self, ids: Sequence[int], *, special: bool = False) -> str:
        """Text of ``ids``; invalid UTF-8 is replaced. ``special`` renders control tokens."""
        piece = self.special_bytes if special else self.token_bytes
        data = b"".join(piece(i) for i in ids)
        if (self.model_type == "bert" or self.model_type != "gpt2" and self.add_space_prefix) \
                and data.startswith(b" "):
            data = data[1:]  # the space the encoder prefixed (llama.cpp strips it too)
        return data.decode("utf-8", errors="replace")


class StreamDecoder:
    """Turns a stream of token ids into text pieces that are always whole UTF-8.

    ``special``: control tokens show as their text; ``preserved``: only these do (a chat
    format's markers, llama.cpp's preserved tokens).

    Bytes of a character split across tokens (byte-fallback tokens, byte-level BPE) are
    held back until the character is complete; :meth:`flush` returns what remains.
    """

    def __init__(self, tokenizer: Tokenizer, *, special: bool = False,
                 preserved: Collection[int] = ()) -> None:
        self._piece = tokenizer.special_bytes if special else tokenizer.token_bytes
        if preserved and not special:  # these control tokens show as their text
            plain, shown = tokenizer.token_bytes, tokenizer.special_bytes
            keep = frozenset(preserved)
            self._piece = lambda t: shown(t) if t in keep else plain(t)
        self._pending = b""

    def push(self, token: int) -> str:
        data = self._pending + self._piece(token)
        cut = _complete_utf8_prefix(data)
        self._pending = data[cut:]
        return data[:cut].decode("utf-8", errors="replace")

    def flush(self) -> str:
        data, self._pending = self._pending, b""
        return data.decode("utf-8", errors="replace")


def _complete_utf8_prefix(data: bytes) -> int:
    """Length of the longest prefix of ``data`` that does not end inside a UTF-8 character."""
    n = len(data)
    for back in range(1, min(4, n) + 1):
        b = data[n - back]
        if b & 0xC0 == 0x80:  # continuation byte: keep looking for the lead byte
            continue
        need = 2 if b & 0xE0 == 0xC0 else 3 if b & 0xF0 == 0xE0 else 4 if b & 0xF8 == 0xF0 else 1
        return n if back >= need else n - back
    return n  # only continuation bytes (invalid): let the replacement character show it


def _alternation(texts: list[str]) -> re.Pattern | None:
    if not texts:
        return None
    texts = sorted(set(texts), key=len, reverse=True)  # longest match first, as llama.cpp
    return re.compile("|".join(map(re.escape, texts)))
