"""llama.cpp's byte-level BPE pre-tokenizers, one entry per ``tokenizer.ggml.pre`` name.

Source: llama.cpp ``src/llama-vocab.cpp`` (``llama_vocab::impl::load``: name -> type and flags;
``llm_tokenizer_bpe``: type -> regexes) and ``src/unicode.cpp`` (the hand-written splitters
behind the Kimi-K2 and AFMoE patterns). The regexes are llama.cpp's adapted forms: ASCII-case
contractions instead of ``(?i:...)``, letter case through lookaheads, ``[0-9]`` where
llama.cpp's ``std::regex`` only knows ASCII digits, so that the Oniguruma engine of
``tokenizers`` splits text as llama.cpp does.

A sequence of regexes is applied in stages: each one splits every piece the previous one
produced, and the text between matches stays a piece of its own (``unicode_regex_split``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger("localllm.tokenizer")

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"

GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
         r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
JAIS2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
         r"|\s*[\r\n]+|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)"
         r"|\s{16}(?!\S)|\s{8}(?!\S)|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}")
_GPT2_CORE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_CORE, r"\p{N}+", r"[0-9][0-9][0-9]")
FALCON = (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2_CORE, r"[0-9][0-9][0-9]")
STARCODER = (r"\p{N}", _GPT2_CORE)
DEEPSEEK_LLM = (
    r"[\r\n]",
    # letters by range, escaped (NFC would fold some of these code points)
    (r"\s?"
    "[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295"
    "-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-"
    "\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5"
    "\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00"
    "-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-"
    "\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-"
    "\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-"
    "\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149"
    "\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
    "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13"
    "-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
    "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df"
    "\U0001e900-\U0001e943]+"),
    r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
    r"\s+$",
    r"[一-龥ࠀ-一가-퟿]+",
    r"\p{N}+",
)
DEEPSEEK_CODER = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}")
DEEPSEEK3 = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    (r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
)
SPARK2_5 = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    (r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+"),
    r"\p{N}",
)
# Letter case through lookaheads: a non-ASCII letter counts as both cases (llama.cpp's
# collapsed-category matching), an ASCII one as its own.
_UPPER = r"((?=[\p{L}])([^a-z]))"
_LOWER = r"((?=[\p{L}])([^A-Z]))"
# llama.cpp matches \p{Lu}, \p{Ll} ... as "any letter" (its std::regex sees one collapsed
# letter class, ASCII A-Za-z included), so a case-split word is just letters and marks.
_LETTERS_MARKS = r"[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+" + _CONTRACTIONS + "?"
YOUTU = (
    r"[가-힣ㄱ-ㆎ]+|[！…“”‘’—：；，、-〿︰-﹏]+|[ㄅ-ㄯ]+|[一-龥぀-ゟ゠-ヿ]+",
    _LETTERS_MARKS + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
TEKKEN = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
          r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GPT4O = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
         rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
         r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_UPPER_M = r"((?=[\p{L}\p{M}])([^a-z]))"
_LOWER_M = r"((?=[\p{L}\p{M}])([^A-Z]))"
GRANITE_EMB_MULTI = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER_M}*{_LOWER_M}+{_CONTRACTIONS}?"
                     rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER_M}+{_LOWER_M}*{_CONTRACTIONS}?"
                     r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Digit runs cut from the right into groups of three (llama.cpp's custom AFMoE splitter, also
# used for tiny_aya's \d{1,3}(?=(?:\d{3})*\b)).
_DIGITS_FROM_RIGHT = r"(?<!\p{N})\p{N}{1,2}(?=(?:\p{N}{3})*(?!\p{N}))|\p{N}{3}"
TINY_AYA = (_DIGITS_FROM_RIGHT, _LETTERS_MARKS + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*"
            r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PORO = r" ?[^(\s|.,!?…。，、।۔،)]+"
VIKING = (r" ?[^(\s|.,!?…。，、।۔،)]+", r"\p{N}")
CHAMELEON = (
    r"<sentinel:[0-9]+>",
    r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
    r"([\t\n]|    |  )",
    r"\p{N}",
    r"[\p{P}!-/:-@\[-`{-~]",
    _GPT2_CORE,
)
# Kimi-K2: llama.cpp's hand-written splitter for tokenization_kimi.py's pattern (Han runs
# first, letter words exclude Han).
KIMI_K2 = (r"\p{Han}+|[^\r\n\p{L}\p{N}]?(?:(?!\p{Han})\p{L})+" + _CONTRACTIONS
           + r"?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SUPERBPE = (r"\p{N}+", r"(?=([0-9]{3})+(?![0-9]))")
BAILINGMOE = (r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+")
SEED_CODER = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
UFAKZEKA = (r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)"
            r"|\s+")
AFMOE = (
    _DIGITS_FROM_RIGHT,
    r"[一-鿿㐀-䶿豈-﫿぀-ゟ゠-ヿ･-ﾟ⼀-⿟เ-๿຀-໿ក-៿က-႟ꩠ-ꩿꧠ-꧿가-힯ᄀ-ᇿ]+",
    (r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
)
LAGUNA = (r"[^\n]+|[\n]+", QWEN2)
EXAONE_MOE = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+")
MINICPM5 = (r"\p{N}{1,3}", _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+"
            r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class PreTokenizer:
    """One ``tokenizer.ggml.pre`` type of llama.cpp.

    Attributes:
        regexes: the split regexes, applied in stages.
        ignore_merges: a whole pre-token found in the vocabulary is one token, merges skipped.
        add_bos: BOS is added unless ``tokenizer.ggml.add_bos_token`` says otherwise.
        clean_spaces: llama.cpp's ``clean_up_tokenization_spaces`` when detokenizing.
        add_sep: SEP is appended (RoBERTa-style encoders).
        no_default_bos: llama.cpp forgets the default BOS id (ChatGLM).
    """

    regexes: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False
    clean_spaces: bool = True
    add_sep: bool = False
    no_default_bos: bool = False


def _p(regexes, **flags) -> PreTokenizer:
    return PreTokenizer((regexes,) if isinstance(regexes, str) else tuple(regexes), **flags)


_LLAMA3_TYPE = _p(LLAMA3, ignore_merges=True, add_bos=True)
_GPT2_TYPE = _p(GPT2)
_QWEN2_TYPE = _p(QWEN2, clean_spaces=False)
_STARCODER_TYPE = _p(STARCODER)
_GPT4O_TYPE = _p(GPT4O, clean_spaces=False)
_DEEPSEEK3_TYPE = _p(DEEPSEEK3, clean_spaces=False)
_ROBERTA_TYPE = _p(GPT2, add_sep=True)
_BAILING_TYPE = _p(BAILINGMOE, clean_spaces=False)
_TINY_AYA_TYPE = _p(TINY_AYA, clean_spaces=False)
_CHATGLM_TYPE = _p(LLAMA3, no_default_bos=True)
_PORO_TYPE = _p(PORO)

# name -> type, in llama_vocab::impl::load's order.
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": _p(DEFAULT),
    "minicpm5": _p(MINICPM5, ignore_merges=True),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                     "midm-2.0", "lfm2", "jina-v5-nano"), _LLAMA3_TYPE),
    "deepseek-llm": _p(DEEPSEEK_LLM, clean_spaces=False),
    "deepseek-coder": _p(DEEPSEEK_CODER, clean_spaces=False),
    "deepseek-v3": _DEEPSEEK3_TYPE,
    "spark2_5": _p(SPARK2_5, clean_spaces=False),
    "youtu": _p(YOUTU, clean_spaces=False, ignore_merges=True),
    "falcon": _p(FALCON),
    "mpt": _GPT2_TYPE,
    "starcoder": _STARCODER_TYPE,
    **dict.fromkeys(("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es",
                     "jina-v2-de", "a.x-4.0", "mellum", "modern-bert"), _GPT2_TYPE),
    "jais-2": _p(JAIS2),
    **dict.fromkeys(("jina-v1-en", "jina-v2-code", "roberta-bpe"), _ROBERTA_TYPE),
    "refact": _STARCODER_TYPE,
    "command-r": _p(STARCODER, clean_spaces=False),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2"), _QWEN2_TYPE),
    "qwen35": _p(QWEN35, clean_spaces=False),
    "stablelm2": _p(QWEN2),
    "olmo": _GPT2_TYPE,
    "dbrx": _p(LLAMA3),
    "smaug-bpe": _p(LLAMA3),
    "poro-chat": _p(PORO, clean_spaces=False),
    # the oracle build (llama-cpp-python 0.3.36) also skips merges for whole words of glm4
    "glm4": _p(LLAMA3, ignore_merges=True, no_default_bos=True),
    "chatglm-bpe": _CHATGLM_TYPE,
    "viking": _p(VIKING, clean_spaces=False),
    "jais": _GPT2_TYPE,
    "tekken": _p(TEKKEN, clean_spaces=False, ignore_merges=True, add_bos=True),
    "smollm": _p(STARCODER, clean_spaces=False),
    "codeshell": _STARCODER_TYPE,
    "bloom": _PORO_TYPE,
    "gpt3-finnish": _PORO_TYPE,
    "exaone": _STARCODER_TYPE,
    "exaone4": _GPT2_TYPE,
    "exaone-moe": _p(EXAONE_MOE),
    "chameleon": _p(CHAMELEON, add_bos=True, clean_spaces=False),
    "minerva-7b": _STARCODER_TYPE,
    "megrez": _p(QWEN2),
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie"), _GPT4O_TYPE),
    "granite-embed-multi-97m": _p(GRANITE_EMB_MULTI, clean_spaces=False, ignore_merges=True),
    **dict.fromkeys(("tiny_aya", "cohere2moe"), _TINY_AYA_TYPE),
    "superbpe": _p(SUPERBPE, clean_spaces=False),
    "trillion": _p(GPT2, clean_spaces=False),
    "granite-docling": _p(GPT2, clean_spaces=False),
    **dict.fromkeys(("bailingmoe", "bailingmoe2", "llada-moe"), _BAILING_TYPE),
    "seed-coder": _p(SEED_CODER, clean_spaces=False),
    "hunyuan": _p(QWEN2, clean_spaces=False),
    **dict.fromkeys(("hunyuan-dense", "hy_v4", "joyai-llm"), _DEEPSEEK3_TYPE),
    "kimi-k2": _p(KIMI_K2, clean_spaces=False),
    "ufakzeka": _p(UFAKZEKA, clean_spaces=False),
    "grok-2": _p(QWEN2, clean_spaces=False),
    "afmoe": _p(AFMOE, clean_spaces=False),
    "laguna": _p(LAGUNA, clean_spaces=False),
    "minimax-m2": _GPT4O_TYPE,
    "solar-open": _p(QWEN2, clean_spaces=False),
    "mellum2": _STARCODER_TYPE,
}

# Pre-tokenizers llama.cpp runs on raw UTF-8 with SentencePiece-style spaces, not bytes:
# a different tokenizer, refused by name rather than mis-tokenized.
NOT_BYTE_LEVEL = frozenset({"gemma4", "granite-embed-multi-311m", "sarvam-moe", "whitespace"})


def pre_tokenizer(name: str | None) -> tuple[str, PreTokenizer]:
    """(the name used, its type) for ``tokenizer.ggml.pre``; a missing or unknown name falls
    back to ``default`` (llama.cpp's regexes for a missing pre-tokenizer) with a warning.

    Raises:
        UnsupportedError: a name llama.cpp tokenizes without byte-level BPE.
    """
    from ..errors import UnsupportedError

    if name in NOT_BYTE_LEVEL:
        raise UnsupportedError(f"tokenizer.ggml.pre {name!r} (raw UTF-8 BPE) is not supported")
    if name is None:
        log.warning("tokenizer.ggml.pre is missing: using the 'default' pre-tokenizer "
                    "(generation quality may be degraded)")
        return "default", PRE_TOKENIZERS["default"]
    if name not in PRE_TOKENIZERS:
        log.warning("tokenizer.ggml.pre %r is unknown: using the 'default' pre-tokenizer", name)
        return "default", PRE_TOKENIZERS["default"]
    return name, PRE_TOKENIZERS[name]
