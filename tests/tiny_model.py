"""Tiny random-weights GGUF models for fast tests (written with gguf.GGUFWriter).

``write_tiny_gguf(path, arch)`` writes a model of a real architecture's tensor layout with a
small vocabulary: SentencePiece-style (``llama`` vocab) for most, byte-level BPE (``gpt2``
vocab) for the Qwen families. Its tensors come from the architecture's declaration
(``localllm.models.<arch>.tensor_specs``).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

SPM_PIECES = ["▁", "▁t", "▁th", "▁the", "he", "e", "t", "h", "▁a", "a", "n", "▁an", "d", "▁and",
              "o", "▁o", "f", "▁of", "s", "r", "i", "▁i", "▁is", "l", "c"]


def spm_vocab() -> tuple[list[str], list[int], list[float]]:
    """The tiny SentencePiece vocabulary: tokens, token types and scores (ids 0-5 special:
    pad, eos, bos, unk and Gemma's turn markers; then the 256 byte tokens, then pieces)."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    types = [3, 3, 3, 2, 3, 3]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    tokens += SPM_PIECES
    types += [1] * len(SPM_PIECES)
    scores = [0.0] * (6 + 256) + [-float(i) for i in range(len(SPM_PIECES))]
    return tokens, types, scores


def _spm_vocab(w: gguf.GGUFWriter, *, bos: int = 2, eos: int = 1) -> int:
    tokens, types, scores = spm_vocab()
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)
    return len(tokens)


# Qwen3's added tokens (CONTROL 3 or USER_DEFINED 4, as in Qwen3's GGUF files): with
# ``specials=QWEN3_SPECIALS`` and Qwen3's chat template, a tiny model of a thinking family.
QWEN3_SPECIALS = (("<|im_start|>", 3), ("<tool_call>", 4), ("</tool_call>", 4),
                  ("<think>", 4), ("</think>", 4), ("<tool_response>", 4),
                  ("</tool_response>", 4))


def _byte_bpe_vocab(w: gguf.GGUFWriter, specials: tuple = ()) -> int:
    from localllm.tokenizer import _byte_decoder

    alphabet = sorted(_byte_decoder(), key=lambda c: _byte_decoder()[c])
    merges = ["Ġ t", "h e", "Ġt he", "Ġ a", "i s", "Ġ is"]
    tokens = alphabet + [m.replace(" ", "") for m in merges] + ["<|endoftext|>", "<|im_end|>"]
    types = [1] * (len(tokens) - 2) + [3, 3]
    tokens += [text for text, _ in specials]  # after the others: their ids do not move
    types += [kind for _, kind in specials]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(len(tokens) - 2 - len(specials))
    w.add_bos_token_id(len(tokens) - 2 - len(specials))
    w.add_add_bos_token(False)
    return len(tokens)


# The order in which tensors get their random values (kept from the first version of this
# file, so that the tiny models of the original architectures keep their weights).
_ORDER = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "ffn_norm",
          "ffn_gate", "ffn_up", "ffn_down", "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps",
          "ffn_down_exps", "attn_q_norm", "attn_k_norm", "post_attention_norm", "post_ffw_norm"]
_TOP = {"token_embd": 0, "output_norm": 1, "rope_freqs": 2, "output": 10**6}


def _rank(name: str) -> tuple:
    from localllm.models.base import layer_of

    layer, stem, suffix = layer_of(name)
    if layer is None:
        return (_TOP.get(stem, 3), 0, 0)
    return (4 + layer, suffix == "bias", _ORDER.index(stem) if stem in _ORDER else 99)


def write_tiny_gguf(
    path: str | Path,
    arch: str = "gemma3",
    *,
    n_layers: int = 2,
    d_model: int = 64,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    head_dim: int = 16,
    ffn_dim: int = 128,
    sliding_window: int = 8,
    context_length: int = 256,
    seed: int = 0,
    qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F16,
    extra: dict | tuple | None = None,
    optional: tuple[str, ...] | None = None,
    specials: tuple = (),
    chat_template: str | None = None,
    split_max_tensors: int = 0,
) -> Path:
    """Write a random-weights model; matrices stored as ``qtype`` (F32, F16, legacy quants;
    other types get random bytes). The tensors are those of the architecture's declaration
    (``tensor_specs``) for these hyperparameters: the required ones plus ``optional`` (default:
    ``output.weight`` for llama/mistral). ``extra``: more ``{arch}.*`` keys (expert counts ...).
    ``split_max_tensors``: write a split model as llama.cpp's gguf-split does (gguf-py's
    writer: ``STEM-00001-of-0000N.gguf`` ..., metadata in the first part); returns the first.
    """
    from localllm.models import model_args, tensor_specs

    path = Path(path)
    extra = dict(extra or {})  # a tuple of pairs too (hashable, for the conftest cache)
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    w.add_name(f"tiny-{arch}")
    n_vocab = (_byte_bpe_vocab(w, specials) if arch in ("qwen2", "qwen3", "qwen3moe")
               else _spm_vocab(w))
    if chat_template is not None:
        w.add_chat_template(chat_template)
    a = arch + "."
    md = {"general.architecture": arch, a + "context_length": context_length,
          a + "embedding_length": d_model, a + "block_count": n_layers,
          a + "feed_forward_length": ffn_dim, a + "attention.head_count": n_heads,
          a + "attention.head_count_kv": n_kv_heads, a + "attention.key_length": head_dim,
          a + "attention.value_length": head_dim, a + "attention.layer_norm_rms_epsilon": 1e-6,
          a + "rope.freq_base": 10000.0}
    if arch in ("gemma2", "gemma3", "gpt-oss"):
        md[a + "attention.sliding_window"] = sliding_window
    if arch == "apertus":  # xIELU's parameters (keys outside the arch's namespace)
        md.update({"xielu.alpha_n": 0.8, "xielu.alpha_p": 0.8, "xielu.beta": 0.5,
                   "xielu.eps": -1e-6})
    md.update({(k if "." in k and k.split(".")[0] in (arch, "general", "xielu") else a + k): v
               for k, v in (extra or {}).items()})
    from localllm.models.synthetic import _add_kv

    for key, value in md.items():
        if key != "general.architecture":
            _add_kv(w, key, value)
    if optional is None:
        optional = ("output.weight",) if arch in ("llama", "mistral") else ()
    from localllm.errors import LocalLLMError

    try:
        args = model_args(md, n_vocab)
    except LocalLLMError:  # a deliberately invalid key in ``extra``: tensors of the rest
        args = model_args({k: v for k, v in md.items()
                           if k.removeprefix(a) not in (extra or {})}, n_vocab)
    specs = [s for s in tensor_specs(args) if not s.optional or s.name in optional]

    def mat(name: str, shape: tuple[int, ...], scale: float = 0.2) -> None:
        a = (rng.standard_normal(shape) * scale).astype(np.float32)
        if qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, a)
        elif qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, a.astype(np.float16))
        elif qtype in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0,
                       gguf.GGMLQuantizationType.Q5_0, gguf.GGMLQuantizationType.Q4_1,
                       gguf.GGMLQuantizationType.Q5_1):
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
        else:  # a type gguf-py cannot quantize: random bytes of the right size
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            raw = rng.integers(0, 256, (*shape[:-1], shape[-1] // block * size), dtype=np.uint8)
            w.add_tensor(name, raw, raw_dtype=qtype)

    def vec(name: str, n: int, center: float = 1.0) -> None:
        w.add_tensor(name, (center + 0.1 * rng.standard_normal(n)).astype(np.float32))

    for s in sorted(specs, key=lambda s: _rank(s.name)):
        if len(s.shape) > 1 and "gate_inp" not in s.name:
            mat(s.name, s.shape, 1.0 if s.name == "token_embd.weight" else 0.2)
        elif len(s.shape) > 1:  # the MoE router stays float32, as llama.cpp's converter keeps it
            w.add_tensor(s.name, (rng.standard_normal(s.shape) * 0.2).astype(np.float32))
        else:
            vec(s.name, s.shape[0], 0.0 if s.name.endswith(".bias") else 1.0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return w.format_shard_names(path)[0]
