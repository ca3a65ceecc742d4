"""Random-weights GGUF files of real model geometries, for benchmarks (``bench --synthetic``).

A synthetic file has the hyperparameters, tensor names and shapes of a real model
(Llama-3-8B, Qwen2-7B, Gemma-3-270M: :mod:`localllm.models.geometries`), a vocabulary of the real size, and llama.cpp's
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
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter

from ..atomic import atomic_output
from ..errors import LocalLLMError, ParameterError
from ..gguf.quants import BLOCK_FORMATS
from ..tokenizer import BYTE, CONTROL, NORMAL, UNKNOWN, UNUSED  # GGUF token types
from .geometries import GEOMETRIES, Geometry

Q = GGMLQuantizationType

WEIGHT_STD = 0.02  # standard deviation of dequantized matrix weights (typical of trained LLMs)


def geometry_args(g: Geometry):
    """The architecture's validated ``ModelArgs`` of the geometry's metadata (what a model
    loaded from its file has: memory layouts and estimates read them)."""
    from . import model_args

    return model_args(_hparams(g), g.n_vocab)


def tensor_shapes(g: Geometry) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape in torch order) of every tensor, from the architecture's declaration
    (``tensor_specs`` of the geometry's metadata): the required tensors, ``output.weight``
    unless the output is tied, and the optional ones named in ``g.optional``; a tensor
    whose alternative (``TensorSpec.unless``, e.g. Gemma 4's fused ``ffn_gate_up_exps``)
    is written is left out."""
    from . import tensor_specs

    specs = [s for s in tensor_specs(geometry_args(g))
             if not s.optional or (s.name == "output.weight" and not g.tied_output)
             or s.name in g.optional or _unlayered(s.name) in g.optional
             or (g.qkv_bias and ".bias" in s.name and "attn_output" not in s.name)]
    written = {s.name for s in specs}
    return [(s.name, s.shape) for s in specs if s.unless is None or s.unless not in written]


def _unlayered(name: str) -> str:
    """``blk.3.ssm_conv1d.bias`` -> ``ssm_conv1d.bias`` (a per-layer optional tensor in
    ``Geometry.optional`` names every layer's)."""
    return name.split(".", 2)[2] if name.startswith("blk.") else name


def _stored_f32(name: str, shape: tuple[int, ...]) -> bool:
    """Vectors, biases (gpt-oss's per-expert biases are matrices) and the state-space
    parameters (``models.base.DENSE_TENSORS``: llama.cpp's SSM kernels read them as F32) are
    written F32, as the converters write them; other matrices F16 before the recipe."""
    from .base import DENSE_TENSORS, layer_of

    return len(shape) == 1 or name.endswith(".bias") or layer_of(name)[1] in DENSE_TENSORS


def tensor_types(g: Geometry, quant: str) -> dict[str, GGMLQuantizationType]:
    """llama.cpp's type of every tensor for file type ``quant`` (e.g. ``"Q4_K_M"``)."""
    from ..quantize.recipe import parse_file_type, plan

    ftype = parse_file_type(quant)
    tensors = [(n, s, Q.F32 if _stored_f32(n, s) else Q.F16) for n, s in tensor_shapes(g)]
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
    if "<|return|>" in g.specials:  # harmony: as the released gpt-oss files
        md.update({"tokenizer.ggml.bos_token_id": first_special + g.specials.index("<|startoftext|>"),
                   "tokenizer.ggml.eos_token_id": first_special + g.specials.index("<|return|>"),
                   "tokenizer.ggml.padding_token_id": first_special + g.specials.index("<|endoftext|>"),
                   "tokenizer.ggml.add_bos_token": False})
    elif g.arch in ("llama", "mistral", "granite", "olmo2", "phi3"):
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
            "tokenizer.ggml.bos_token_id": _special(g, "<bos>", "<s>"),
            "tokenizer.ggml.eos_token_id": _special(g, "<eos>", "</s>"),
            "tokenizer.ggml.unknown_token_id": g.specials.index("<unk>"),
            "tokenizer.ggml.padding_token_id": _special(g, "<pad>", "<unk>"),
            "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_space_prefix": False}


def _special(g: Geometry, *names: str) -> int:
    """Id of the first of ``names`` among the geometry's special tokens."""
    return next(g.specials.index(n) for n in names if n in g.specials)


def _hparams(g: Geometry) -> dict:
    a = g.arch + "."
    md = {"general.architecture": g.arch, a + "context_length": g.context_length,
          a + "embedding_length": g.d_model, a + "block_count": g.n_layers,
          a + "feed_forward_length": g.ffn_dim, a + "attention.head_count": g.n_heads,
          a + "attention.head_count_kv": g.n_kv_heads, a + "attention.key_length": g.head_dim,
          a + "attention.value_length": g.head_dim, a + "rope.freq_base": g.rope_base,
          a + "attention.layer_norm_rms_epsilon": g.norm_eps}
    if not g.arch.startswith("gemma"):
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
    Q.Q5_K: (0, 2, 15.5), Q.Q6_K: (208, None, 0.0), Q.IQ4_NL: (0, None, 0.0),
    Q.IQ4_XS: (0, None, 0.0),
}
_UNIT_STD: dict[GGMLQuantizationType, float] = {}


def _ssm_values(name: str, x: np.ndarray, rng: np.random.Generator) -> np.ndarray | None:
    """Values of a state-space tensor in the ranges of Mamba2's initialization (Dao & Gu
    2024), from standard normals ``x``; None for other tensors. ``ssm_a``: A = -exp(U(0,
    ln 16)) (the converter stores -exp(A_log)); ``ssm_d``: D = 1 + N(0, 0.1);
    ``ssm_dt.bias``: softplus^-1 of dt log-uniform in [0.001, 0.1]; convolution kernels
    (``ssm_conv1d``, LFM2's ``shortconv.conv``): N(0, 0.5)."""
    if name.endswith(".ssm_a"):
        return -np.exp(rng.uniform(0.0, np.log(16.0), x.size)).astype(np.float32)
    if name.endswith(".ssm_d"):
        return (1.0 + 0.1 * x).astype(np.float32)
    if name.endswith("ssm_dt.bias"):
        dt = np.exp(rng.uniform(np.log(1e-3), np.log(0.1), x.size))
        return (dt + np.log(-np.expm1(-dt))).astype(np.float32)
    if name.endswith(("ssm_conv1d.weight", "shortconv.conv.weight")):
        return (0.5 * x).astype(np.float32)
    return None


def _random_blocks(qtype: GGMLQuantizationType, n_blocks: int, d: float,
                   rng: np.random.Generator) -> np.ndarray:
    """``n_blocks`` random blocks of ``qtype`` with scales ``d`` x U(0.75, 1.25): uint8
    (n_blocks, block_bytes). MXFP4's scale is a power of two (an E8M0 byte, 2^(e - 128)
    per unit of its codebook): ``d`` x U(0.75, 1.25) rounded to the nearest one."""
    size = BLOCK_FORMATS[qtype].type_size
    raw = np.frombuffer(rng.bytes(n_blocks * size), dtype=np.uint8).reshape(n_blocks, size).copy()
    if qtype == Q.MXFP4:  # block_mxfp4: [e: uint8][qs: 16 bytes of nibbles]
        e = 128 + np.rint(np.log2(d * rng.uniform(0.75, 1.25, n_blocks)))
        raw[:, 0] = np.clip(e, 2, 254).astype(np.uint8)
        return raw
    d_off, m_off, ratio = _SCALE_LAYOUT[qtype]
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

        block = BLOCK_FORMATS[qtype].block_size
        raw = _random_blocks(qtype, 512, 1.0, np.random.default_rng(1))
        x = dequantize(raw, qtype, (512, block), dtype=torch.float32)
        _UNIT_STD[qtype] = float(x.std())
    return _UNIT_STD[qtype]


def random_tensor(name: str, shape: tuple[int, ...], qtype: GGMLQuantizationType,
                  rng: np.random.Generator, std: float = WEIGHT_STD) -> np.ndarray:
    """Random data of one tensor as the bytes GGUF stores: uint8 (n_bytes,).

    Norm weights and Gemma 4's layer output scales are 1 + N(0, 0.02) (Gemma's GGUF norms
    already include its +1), other ``.scale`` vectors (Gemma 4's router input and
    per-expert output factors) 1 + N(0, 0.2); RoPE
    frequency factors (``rope_freqs``, ``rope_factors_*``) 1 + |N(0, 2)|; state-space
    parameters as :func:`_ssm_values` makes them; biases and float matrices are
    N(0, ``std``); quantized matrices dequantize to std ~``std``.
    """
    n = int(np.prod(shape))
    if qtype in (Q.F32, Q.F16, Q.BF16):
        x = rng.standard_normal(n, dtype=np.float32)
        ssm = _ssm_values(name, x, rng)
        if ssm is not None:
            x = ssm
        elif "norm" in name or "output_scale" in name:
            x *= WEIGHT_STD
            x += 1.0
        elif name.endswith(".scale"):
            x *= 0.2
            x += 1.0
        elif name.startswith("rope_f"):
            x = 1.0 + np.abs(x) * 2.0
        else:
            x *= std
        if qtype == Q.F32:
            return x.view(np.uint8)
        if qtype == Q.F16:
            return x.astype(np.float16).view(np.uint8)
        return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    if qtype not in _SCALE_LAYOUT and qtype != Q.MXFP4:
        raise LocalLLMError(f"synthetic weights of type {qtype.name} are not supported")
    n_blocks = n // BLOCK_FORMATS[qtype].block_size
    return _random_blocks(qtype, n_blocks, std / _unit_std(qtype), rng).reshape(-1)


# ---- files ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class PlannedTensor:
    """One tensor of a synthetic file: name, shape (GGUF order reversed: rows last), type."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape))

    @property
    def n_bytes(self) -> int:
        fmt = BLOCK_FORMATS[self.qtype]
        return self.n_elements // fmt.block_size * fmt.type_size


def planned_tensors(geometry: Geometry, quant: str) -> list[PlannedTensor]:
    """The tensors :func:`write_synthetic` writes for ``geometry`` at recipe ``quant``.

    Raises:
        ParameterError: unknown quant type.
    """
    types = tensor_types(geometry, quant.upper())
    return [PlannedTensor(name, shape, types[name]) for name, shape in tensor_shapes(geometry)]


# Header, metadata (the vocabulary) and alignment padding, over the tensor bytes; generous.
_FILE_OVERHEAD = 64 * 2**20


def check_disk(path: Path, n_bytes: int) -> None:
    """Refuse to start writing ``n_bytes`` at ``path`` when its file system has less free.

    Raises:
        LocalLLMError: one line with the bytes needed and free, and the directory.
    """
    try:
        free = shutil.disk_usage(path.parent).free
    except OSError:
        return  # unknown: the write itself reports a full disk
    if n_bytes > free:
        raise LocalLLMError(f"{path.name}: writing it needs {n_bytes / 2**30:.1f} GiB of disk "
                            f"but {free / 2**30:.1f} GiB is free in {path.parent}")


def cache_path(name: str, quant: str) -> Path:
    """``<user cache>/localllm/synthetic/NAME-QUANT.gguf``."""
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("localllm")) / "synthetic" / f"{name}-{quant.upper()}.gguf"


def write_synthetic(path: str | Path, geometry: Geometry, quant: str, *, seed: int = 0,
                    weight_std: float = WEIGHT_STD, stem_std: dict[str, float] | None = None,
                    progress: Callable[[int, int], None] | None = None) -> Path:
    """Write a random-weights GGUF of ``geometry`` with the tensor types of recipe ``quant``.

    ``stem_std``: another standard deviation for the tensors of some stems (``{"ssm_in":
    0.05}``: a state-space input projection whose time steps stay small, as trained ones
    do). ``weight_std``: standard deviation of the matrices (larger: a more peaked next-token
    distribution, as the llama.cpp comparison fixtures use). The file is a deterministic
    function of the arguments.

    Tensors are generated and written one at a time (memory: about the largest tensor, not
    the file). The free disk space is checked first. The file is written to a temporary name
    beside ``path`` and renamed when complete, so an interrupted write leaves nothing
    behind. ``progress(bytes_written, total_bytes)`` is called after each tensor.
    Returns ``path``.

    Raises:
        ParameterError: unknown quant type.
        LocalLLMError: not enough disk space, or the file cannot be written.
    """
    from ..quantize.recipe import FILE_TYPES
    from .base import layer_of

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
    total = sum(t.n_bytes for t in planned_tensors(geometry, quant))
    check_disk(path, total + _FILE_OVERHEAD)
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
            block, size = BLOCK_FORMATS[qt].block_size, BLOCK_FORMATS[qt].type_size
            row = shape[-1] // block * size
            w.add_tensor_info(name, (*shape[:-1], row), np.dtype(np.uint8),
                              row * int(np.prod(shape[:-1])), raw_dtype=qt)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        done = 0
        for name, shape in shapes:
            std = (stem_std or {}).get(layer_of(name)[1], weight_std)
            data = random_tensor(name, shape, types[name], rng, std)
            w.write_tensor_data(data)  # straight to the file: one tensor in memory at a time
            done += data.nbytes
            del data
            if progress is not None:
                progress(done, total)
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
        sub = (V.STRING if isinstance(value[0], str) else V.BOOL if isinstance(value[0], bool)
               else V.FLOAT32 if isinstance(value[0], float) else V.INT32)
        w.add_key_value(key, value, V.ARRAY, sub)
    else:
        raise TypeError(f"{key}: cannot store {type(value).__name__}")


def synthetic_model(name: str, quant: str = "Q4_K_M", *, cache_dir: str | Path | None = None,
                    before_write: Callable[[Geometry, list[PlannedTensor]], None] | None = None,
                    progress: Callable[[int, int], None] | None = None) -> Path:
    """Path of the synthetic model ``name`` (a key of :data:`GEOMETRIES`) at ``quant``,
    written on first use into the cache directory and reused afterwards.

    ``before_write(geometry, tensors)`` runs before a file is written (a memory check that
    raises to refuse); ``progress`` is :func:`write_synthetic`'s.

    Raises:
        ParameterError: unknown geometry name or quant type (naming ``--synthetic``/``--quant``).
        LocalLLMError: not enough disk space, or what ``before_write`` raises.
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
        if before_write is not None:
            before_write(GEOMETRIES[name], planned_tensors(GEOMETRIES[name], quant))
        write_synthetic(path, GEOMETRIES[name], quant, progress=progress)
    return path
