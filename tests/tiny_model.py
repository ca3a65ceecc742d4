"""Tiny random-weights GGUF models for fast tests (written with gguf.GGUFWriter).

``write_tiny_gguf(path, arch)`` writes a model of a real architecture's tensor layout with a
small vocabulary: SentencePiece-style (``llama`` vocab) for gemma3/llama/mistral, byte-level
BPE (``gpt2`` vocab) for qwen2/qwen3.
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


def _byte_bpe_vocab(w: gguf.GGUFWriter) -> int:
    from localllm.tokenizer import _byte_decoder

    alphabet = sorted(_byte_decoder(), key=lambda c: _byte_decoder()[c])
    merges = ["Ġ t", "h e", "Ġt he", "Ġ a", "i s", "Ġ is"]
    tokens = alphabet + [m.replace(" ", "") for m in merges] + ["<|endoftext|>", "<|im_end|>"]
    types = [1] * (len(tokens) - 2) + [3, 3]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(len(tokens) - 2)
    w.add_bos_token_id(len(tokens) - 2)
    w.add_add_bos_token(False)
    return len(tokens)


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
) -> Path:
    """Write a random-weights model; matrices stored as ``qtype`` (F32, F16, legacy quants;
    other types get random bytes)."""
    path = Path(path)
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    n_vocab = _byte_bpe_vocab(w) if arch in ("qwen2", "qwen3") else _spm_vocab(w)
    w.add_context_length(context_length)
    w.add_embedding_length(d_model)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(ffn_dim)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    if arch == "gemma3":
        w.add_sliding_window(sliding_window)

    def mat(name: str, rows: int, cols: int, scale: float = 0.2) -> None:
        a = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
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
            raw = rng.integers(0, 256, (rows, cols // block * size), dtype=np.uint8)
            w.add_tensor(name, raw, raw_dtype=qtype)

    def vec(name: str, n: int, center: float = 1.0) -> None:
        w.add_tensor(name, (center + 0.1 * rng.standard_normal(n)).astype(np.float32))

    mat("token_embd.weight", n_vocab, d_model, 1.0)
    vec("output_norm.weight", d_model)
    for i in range(n_layers):
        p = f"blk.{i}."
        vec(p + "attn_norm.weight", d_model)
        mat(p + "attn_q.weight", n_heads * head_dim, d_model)
        mat(p + "attn_k.weight", n_kv_heads * head_dim, d_model)
        mat(p + "attn_v.weight", n_kv_heads * head_dim, d_model)
        mat(p + "attn_output.weight", d_model, n_heads * head_dim)
        vec(p + "ffn_norm.weight", d_model)
        mat(p + "ffn_gate.weight", ffn_dim, d_model)
        mat(p + "ffn_up.weight", ffn_dim, d_model)
        mat(p + "ffn_down.weight", d_model, ffn_dim)
        if arch in ("gemma3", "qwen3"):
            vec(p + "attn_q_norm.weight", head_dim)
            vec(p + "attn_k_norm.weight", head_dim)
        if arch == "gemma3":
            vec(p + "post_attention_norm.weight", d_model)
            vec(p + "post_ffw_norm.weight", d_model)
        if arch == "qwen2":
            vec(p + "attn_q.bias", n_heads * head_dim, 0.0)
            vec(p + "attn_k.bias", n_kv_heads * head_dim, 0.0)
            vec(p + "attn_v.bias", n_kv_heads * head_dim, 0.0)
    if arch in ("llama", "mistral"):
        mat("output.weight", n_vocab, d_model)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
