"""Random-weights GGUF files of real model geometries, for benchmarks (``bench --synthetic``).

A synthetic file has the hyperparameters, tensor names and shapes of a real model
(Llama-3-8B, Qwen2-7B, Gemma-3-270M), a vocabulary of the real size, and llama.cpp's
per-tensor type mix for a quantization recipe (:func:`localllm.quantize.recipe.plan`), so
that both our runtime and llama.cpp load it and read exactly as many bytes per token as
they would for the real model. Speed can then be measured without downloading weights.

Quantized tensors are random bytes whose fp16 block scales are set so that the dequantized
weights have a realistic spread (standard deviation ``WEIGHT_STD``, mean near zero): the
bytes are generated directly, which takes seconds for an 8B model, instead of quantizing
random floats. The block layouts are ggml's (``ggml-common.h``: ``block_q4_K`` ...).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

from ..atomic import atomic_output
from ..errors import LocalLLMError, ParameterError
from ..tokenizer import BYTE, CONTROL, NORMAL, UNKNOWN, UNUSED  # GGUF token types

Q = GGMLQuantizationType

WEIGHT_STD = 0.02  # standard deviation of dequantized matrix weights (typical of trained LLMs)



@dataclass(frozen=True)
class Geometry:
    """Hyperparameters and vocabulary of a model family, as its GGUF metadata states them."""

    name: str
    arch: str  # general.architecture: "llama", "qwen2" or "gemma3"
    n_vocab: int
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    context_length: int
    rope_base: float
    norm_eps: float
    vocab: str  # tokenizer.ggml.model: "llama" (SentencePiece) or "gpt2" (byte-level BPE)
    pre: str  # tokenizer.ggml.pre
    specials: tuple[str, ...] = ()  # CONTROL tokens (see _spm_vocab / _bpe_vocab for placement)
    qkv_bias: bool = False
    tied_output: bool = False
    sliding_window: int | None = None
    n_pad_tokens: int = 0  # [PAD] tokens after the specials (rows of the embedding past the vocab)
    extra: dict = field(default_factory=dict)  # other ``{arch}.*`` keys


_LLAMA3_SPECIALS = tuple(
    {0: "<|begin_of_text|>", 1: "<|end_of_text|>", 6: "<|start_header_id|>",
     7: "<|end_header_id|>", 9: "<|eot_id|>"}.get(i, f"<|reserved_special_token_{i}|>")
    for i in range(256)
)

GEOMETRIES: dict[str, Geometry] = {
    # Meta-Llama-3-8B (config.json of the HF release)
    "llama3-8b": Geometry(
        "llama3-8b", "llama", 128256, 32, 4096, 32, 8, 128, 14336, 8192, 500000.0, 1e-5,
        "gpt2", "llama-bpe", specials=_LLAMA3_SPECIALS),
    # Llama-3.2-1B: tied output (its llama3 RoPE scaling is left out: speed is the same)
    "llama3.2-1b": Geometry(
        "llama3.2-1b", "llama", 128256, 16, 2048, 32, 8, 64, 8192, 131072, 500000.0, 1e-5,
        "gpt2", "llama-bpe", specials=_LLAMA3_SPECIALS, tied_output=True),
    # Qwen2-7B: QKV biases, untied output, 152064-row embedding (vocab padded with [PAD] tokens)
    "qwen2-7b": Geometry(
        "qwen2-7b", "qwen2", 152064, 28, 3584, 28, 4, 128, 18944, 32768, 1000000.0, 1e-6,
        "gpt2", "qwen2", specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        qkv_bias=True, n_pad_tokens=418),
    # Gemma-3-270M: tied output, 5 of 6 layers sliding-window (512)
    "gemma3-270m": Geometry(
        "gemma3-270m", "gemma3", 262144, 18, 640, 4, 1, 256, 2048, 32768, 1000000.0, 1e-6,
        "llama", "default", specials=("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>",
                                      "<end_of_turn>"),
        tied_output=True, sliding_window=512),
}


def tensor_shapes(g: Geometry) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape in torch order) of every tensor, in llama.cpp's converter order."""
    d, hd, nq, nkv = g.d_model, g.head_dim, g.n_heads * g.head_dim, g.n_kv_heads * g.head_dim
    out: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (g.n_vocab, d))]
    for i in range(g.n_layers):
        p = f"blk.{i}."
        out += [(p + "attn_norm.weight", (d,)), (p + "attn_q.weight", (nq, d)),
                (p + "attn_k.weight", (nkv, d)), (p + "attn_v.weight", (nkv, d))]
        if g.qkv_bias:
            out += [(p + "attn_q.bias", (nq,)), (p + "attn_k.bias", (nkv,)),
                    (p + "attn_v.bias", (nkv,))]
        if g.arch == "gemma3":
            out += [(p + "attn_q_norm.weight", (hd,)), (p + "attn_k_norm.weight", (hd,))]
        out.append((p + "attn_output.weight", (d, nq)))
        if g.arch == "gemma3":
            out.append((p + "post_attention_norm.weight", (d,)))
        out += [(p + "ffn_norm.weight", (d,)), (p + "ffn_gate.weight", (g.ffn_dim, d)),
                (p + "ffn_up.weight", (g.ffn_dim, d)), (p + "ffn_down.weight", (d, g.ffn_dim))]
        if g.arch == "gemma3":
            out.append((p + "post_ffw_norm.weight", (d,)))
    out.append(("output_norm.weight", (d,)))
    if not g.tied_output:
        out.append(("output.weight", (g.n_vocab, d)))
    return out


def tensor_types(g: Geometry, quant: str) -> dict[str, GGMLQuantizationType]:
    """llama.cpp's type of every tensor for file type ``quant`` (e.g. ``"Q4_K_M"``)."""
    from ..quantize.recipe import parse_file_type, plan

    ftype = parse_file_type(quant)
    tensors = [(n, s, Q.F16 if len(s) > 1 else Q.F32) for n, s in tensor_shapes(g)]
    return plan(tensors, _hparams(g), ftype)


# ---- vocabulary -----------------------------------------------------------------------------
def _gpt2_byte_chars() -> list[str]:
    """GPT-2's printable stand-in character of each byte value 0..255 (byte-level BPE)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def _bpe_vocab(g: Geometry) -> dict:
    """Byte-level BPE vocabulary of ``g.n_vocab`` tokens: the 256 byte characters, filler
    pieces of 2 and 3 characters (each with the merge that builds it), then the special
    tokens, then ``[PAD]`` tokens up to the embedding size (as llama.cpp's converter pads)."""
    alphabet = _gpt2_byte_chars()
    n_pad = g.n_pad_tokens
    n_normal = g.n_vocab - len(g.specials) - n_pad
    tokens, merges = list(alphabet), []

    def fillers() -> Iterator[tuple[str, str]]:
        pairs = ((a, b) for a in alphabet for b in alphabet)
        yield from pairs
        for a, b in itertools.product(alphabet, alphabet):
            for c in alphabet:
                yield a + b, c

    for left, right in itertools.islice(fillers(), max(0, n_normal - len(tokens))):
        tokens.append(left + right)
        merges.append(f"{left} {right}")
    types = [NORMAL] * len(tokens) + [CONTROL] * len(g.specials) + [UNUSED] * n_pad
    tokens += list(g.specials) + [f"[PAD{i}]" for i in range(n_pad)]
    first_special = n_normal
    md = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": g.pre,
          "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
          "tokenizer.ggml.merges": merges}
    if g.arch == "llama":
        md.update({"tokenizer.ggml.bos_token_id": first_special,
                   "tokenizer.ggml.eos_token_id": first_special + 1,
                   "tokenizer.ggml.add_bos_token": True})
    else:
        md.update({"tokenizer.ggml.bos_token_id": first_special,
                   "tokenizer.ggml.eos_token_id": first_special,
                   "tokenizer.ggml.padding_token_id": first_special,
                   "tokenizer.ggml.add_bos_token": False})
    return md


def _spm_vocab(g: Geometry) -> dict:
    """SentencePiece vocabulary of ``g.n_vocab`` tokens: the special tokens (pad, eos, bos,
    unk, ... as Gemma numbers them), the 256 byte-fallback tokens, then filler pieces made
    of lowercase letters, with and without the ``▁`` word prefix, by decreasing score."""
    tokens = list(g.specials) + [f"<0x{b:02X}>" for b in range(256)]
    types = [CONTROL] * len(g.specials) + [BYTE] * 256
    types[g.specials.index("<unk>")] = UNKNOWN

    def fillers() -> Iterator[str]:
        for n in itertools.count(1):
            for letters in itertools.product("abcdefghijklmnopqrstuvwxyz", repeat=n):
                s = "".join(letters)
                yield "▁" + s
                yield s

    n_fill = g.n_vocab - len(tokens)
    tokens += list(itertools.islice(fillers(), n_fill))
    types += [NORMAL] * n_fill
    scores = [0.0] * (len(g.specials) + 256) + [-float(i) for i in range(n_fill)]
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": g.pre,
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.bos_token_id": g.specials.index("<bos>"),
            "tokenizer.ggml.eos_token_id": g.specials.index("<eos>"),
            "tokenizer.ggml.unknown_token_id": g.specials.index("<unk>"),
            "tokenizer.ggml.padding_token_id": g.specials.index("<pad>"),
            "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_space_prefix": False}


def _hparams(g: Geometry) -> dict:
    a = g.arch + "."
    md = {"general.architecture": g.arch, a + "context_length": g.context_length,
          a + "embedding_length": g.d_model, a + "block_count": g.n_layers,
          a + "feed_forward_length": g.ffn_dim, a + "attention.head_count": g.n_heads,
          a + "attention.head_count_kv": g.n_kv_heads, a + "attention.key_length": g.head_dim,
          a + "attention.value_length": g.head_dim, a + "rope.freq_base": g.rope_base,
          a + "attention.layer_norm_rms_epsilon": g.norm_eps}
    if g.arch != "gemma3":
        md[a + "rope.dimension_count"] = g.head_dim
        md[a + "vocab_size"] = g.n_vocab
    if g.sliding_window is not None:
        md[a + "attention.sliding_window"] = g.sliding_window
    md.update(g.extra)
    return md


# ---- tensor data ----------------------------------------------------------------------------
# ggml block layouts: byte offset of the fp16 scale ``d`` and of the fp16 min/dmin (or None),
# and the min as a multiple of d that centres the block's values near zero: for the "_1"
# types the block adds ``m`` (set to -ratio*d), for the K-quants it subtracts dmin * min_j
# with 4/6-bit mins as large as the scales (so dmin = ratio*d balances sc*q on average).
_SCALE_LAYOUT: dict[GGMLQuantizationType, tuple[int, int | None, float]] = {
    Q.Q4_0: (0, None, 0.0), Q.Q5_0: (0, None, 0.0), Q.Q8_0: (0, None, 0.0),
    Q.Q4_1: (0, 2, -7.5), Q.Q5_1: (0, 2, -15.5),
    Q.Q2_K: (80, 82, 1.5), Q.Q3_K: (108, None, 0.0), Q.Q4_K: (0, 2, 7.5),
    Q.Q5_K: (0, 2, 15.5), Q.Q6_K: (208, None, 0.0),
}
_UNIT_STD: dict[GGMLQuantizationType, float] = {}


def _random_blocks(qtype: GGMLQuantizationType, n_blocks: int, d: float,
                   rng: np.random.Generator) -> np.ndarray:
    """``n_blocks`` random blocks of ``qtype`` with scales ``d`` x U(0.75, 1.25): uint8
    (n_blocks, block_bytes)."""
    d_off, m_off, ratio = _SCALE_LAYOUT[qtype]
    size = GGML_QUANT_SIZES[qtype][1]
    raw = np.frombuffer(rng.bytes(n_blocks * size), dtype=np.uint8).reshape(n_blocks, size).copy()
    scales = (d * rng.uniform(0.75, 1.25, n_blocks)).astype(np.float16)
    raw[:, d_off:d_off + 2] = scales.view(np.uint8).reshape(n_blocks, 2)
    if m_off is not None:
        mins = (scales.astype(np.float32) * ratio).astype(np.float16)
        raw[:, m_off:m_off + 2] = mins.view(np.uint8).reshape(n_blocks, 2)
    return raw


def _unit_std(qtype: GGMLQuantizationType) -> float:
    """Standard deviation of the dequantized values of random blocks with scale 1 (measured
    once per type with our dequantizer, so that the layout table above is checked too)."""
    if qtype not in _UNIT_STD:
        import torch

        from ..gguf.quants import dequantize

        block = GGML_QUANT_SIZES[qtype][0]
        raw = _random_blocks(qtype, 512, 1.0, np.random.default_rng(1))
        x = dequantize(raw, qtype, (512, block), dtype=torch.float32)
        _UNIT_STD[qtype] = float(x.std())
    return _UNIT_STD[qtype]


def random_tensor(name: str, shape: tuple[int, ...], qtype: GGMLQuantizationType,
                  rng: np.random.Generator) -> np.ndarray:
    """Random data of one tensor as the bytes GGUF stores: uint8 (n_bytes,).

    Norm weights are 1 + N(0, 0.02) (Gemma's GGUF norms already include its +1); biases and
    float matrices are N(0, WEIGHT_STD); quantized matrices dequantize to std ~WEIGHT_STD.
    """
    n = int(np.prod(shape))
    if qtype in (Q.F32, Q.F16, Q.BF16):
        x = rng.standard_normal(n, dtype=np.float32)
        x *= WEIGHT_STD
        if "norm" in name:
            x += 1.0
        if qtype == Q.F32:
            return x.view(np.uint8)
        if qtype == Q.F16:
            return x.astype(np.float16).view(np.uint8)
        return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    if qtype not in _SCALE_LAYOUT:
        raise LocalLLMError(f"synthetic weights of type {qtype.name} are not supported")
    n_blocks = n // GGML_QUANT_SIZES[qtype][0]
    return _random_blocks(qtype, n_blocks, WEIGHT_STD / _unit_std(qtype), rng).reshape(-1)


# ---- files ----------------------------------------------------------------------------------
def cache_path(name: str, quant: str) -> Path:
    """``<user cache>/localllm/synthetic/NAME-QUANT.gguf``."""
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("localllm")) / "synthetic" / f"{name}-{quant.upper()}.gguf"


def write_synthetic(path: str | Path, geometry: Geometry, quant: str, *, seed: int = 0) -> Path:
    """Write a random-weights GGUF of ``geometry`` with the tensor types of recipe ``quant``.

    The file is written to a temporary name beside ``path`` and renamed when complete, so an
    interrupted write leaves nothing behind. Returns ``path``.

    Raises:
        ParameterError: unknown quant type.
        LocalLLMError: the file cannot be written.
    """
    from ..quantize.recipe import FILE_TYPES

    path = Path(path)
    quant = quant.upper()
    types = tensor_types(geometry, quant)
    vocab = _spm_vocab(geometry) if geometry.vocab == "llama" else _bpe_vocab(geometry)
    if len(vocab["tokenizer.ggml.tokens"]) != geometry.n_vocab:
        raise LocalLLMError(f"synthetic vocabulary of {geometry.name}: "
                            f"{len(vocab['tokenizer.ggml.tokens'])} != {geometry.n_vocab}")
    rng = np.random.default_rng(seed)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LocalLLMError(f"{path.parent}: cannot create: {e.strerror or e}") from None
    with atomic_output(path) as tmp:
        w = GGUFWriter(tmp, geometry.arch)
        w.add_name(f"synthetic {geometry.name} {quant}")
        for key, value in {**_hparams(geometry), **vocab}.items():
            if key != "general.architecture":
                _add_kv(w, key, value)
        w.add_file_type(int(FILE_TYPES[quant][0]))
        w.add_quantization_version(2)
        shapes = tensor_shapes(geometry)
        for name, shape in shapes:
            qt = types[name]
            block, size = GGML_QUANT_SIZES[qt]
            row = shape[-1] // block * size
            w.add_tensor_info(name, (*shape[:-1], row), np.dtype(np.uint8),
                              row * int(np.prod(shape[:-1])), raw_dtype=qt)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for name, shape in shapes:
            w.write_tensor_data(random_tensor(name, shape, types[name], rng))
        w.close()
    return path


def _add_kv(w: GGUFWriter, key: str, value) -> None:
    from gguf import GGUFValueType as V

    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    elif isinstance(value, list):
        sub = (V.STRING if isinstance(value[0], str) else
               V.FLOAT32 if isinstance(value[0], float) else V.INT32)
        w.add_key_value(key, value, V.ARRAY, sub)
    else:
        raise TypeError(f"{key}: cannot store {type(value).__name__}")


def synthetic_model(name: str, quant: str = "Q4_K_M", *, cache_dir: str | Path | None = None
                    ) -> Path:
    """Path of the synthetic model ``name`` (a key of :data:`GEOMETRIES`) at ``quant``,
    written on first use into the cache directory and reused afterwards.

    Raises:
        ParameterError: unknown geometry name or quant type (naming ``--synthetic``/``--quant``).
    """
    from ..quantize.recipe import parse_file_type

    if name not in GEOMETRIES:
        raise ParameterError(f"--synthetic {name}: unknown geometry "
                             f"(one of {', '.join(GEOMETRIES)})")
    try:
        quant = parse_file_type(quant)
    except ParameterError as e:
        raise ParameterError(str(e).replace("--type", "--quant", 1)) from None
    path = (Path(cache_dir) / f"{name}-{quant}.gguf" if cache_dir is not None
            else cache_path(name, quant))
    if not path.exists():
        write_synthetic(path, GEOMETRIES[name], quant)
    return path
