"""Byte-level BPE (``tokenizer.ggml.model = gpt2``) on the ``tokenizers`` library.

The GGUF vocabulary and merges become a ``tokenizers`` BPE model; the pre-tokenizer is the
regex sequence that ``tokenizer.ggml.pre`` names (:mod:`.pretokenizers`), then GPT-2's byte
to unicode mapping. Merges are ranked by their order, as in llama.cpp's ``bpe_ranks``.
"""

from __future__ import annotations

from ..errors import GGUFError, UnsupportedError
from .pretokenizers import PreTokenizer


def build_byte_bpe(tokens: list[str], merges: list[str], pre_name: str, pre: PreTokenizer):
    """A ``tokenizers.Tokenizer`` holding the GGUF vocabulary, merges and pre-tokenizer.

    Raises:
        GGUFError: a merge is not two space-separated pieces, or names a piece (or makes a
            token) that is not in the vocabulary.
        UnsupportedError: a regex of the pre-tokenizer does not compile.
    """
    from tokenizers import Regex, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import BPE

    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        seen: set[str] = set()
        dup = next(t for t in tokens if t in seen or seen.add(t))
        raise GGUFError(f"tokenizer.ggml.tokens has the token {dup!r} twice")
    pairs = []
    for i, m in enumerate(merges):
        left, sep, right = m.partition(" ")
        if not sep or not left or not right:
            raise GGUFError(f"tokenizer.ggml.merges[{i}] = {m!r} is not two space-separated pieces")
        for piece in (left, right, left + right):
            if piece not in vocab:
                raise GGUFError(f"tokenizer.ggml.merges[{i}] = {m!r} names {piece!r}, which is "
                                f"not in tokenizer.ggml.tokens")
        pairs.append((left, right))
    bpe = HFTokenizer(BPE(vocab, pairs, ignore_merges=pre.ignore_merges))
    splits = []
    for regex in pre.regexes:
        try:
            splits.append(pre_tokenizers.Split(Regex(regex), behavior="isolated"))
        except Exception as e:  # noqa: BLE001 (tokenizers raises a bare Exception for a bad pattern
            raise UnsupportedError(f"tokenizer.ggml.pre {pre_name!r}: the regex {regex!r} does "
                                   f"not compile: {e}") from None
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    return bpe
