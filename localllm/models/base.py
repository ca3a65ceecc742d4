"""What every architecture declares, and what is derived from the declaration.

An architecture module (``llama.py``, ``gemma.py`` ...) declares three things:

* ``ModelArgs.from_gguf(metadata, n_vocab)``: the hyperparameters, every one read through
  :class:`HParams`, which validates type, finiteness and range and raises one
  :class:`~localllm.errors.GGUFError` naming the key before anything is sized from it;
* ``tensor_specs(args)``: every tensor the model may read, as :class:`TensorSpec`
  (GGUF name, shape in torch order, optional or not): the tensor declaration, as gguf-py's
  ``MODEL_TENSORS`` table and llama.cpp's ``llama_model::load_tensors`` are;
* ``cache_layout(args)``: per layer, a :class:`LayerCache` (a full cache, or a ring of
  ``window`` cells for sliding-window attention).

From these alone follow: the check of a file's tensors before any weight is read
(:func:`check_tensors`), the memory estimate (``runtime/resources.py``), the KV caches
(``cache.make_caches``), the synthetic-model writer (``synthetic.py``) and the tiny test
models. The ``Model`` is built from ``args`` alone (its layers are empty
:class:`Layer` namespaces) and :func:`bind` attaches the weights afterwards: a tensor
``blk.{i}.{stem}.weight`` becomes attribute ``stem`` of ``model.layers[i]``, a tensor
``{stem}.weight`` attribute ``stem`` of the model; matrices become one
:class:`~localllm.models.common.Linear` (dense or quantized), 3-D expert tensors
:class:`~localllm.models.common.Experts`, vectors float32 tensors, ``.bias`` tensors the bias
of the ``Linear`` of the same stem. Projections of one input (``model.FUSE``: Q/K/V,
gate/up) are fused into one product where the bound types allow it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..errors import GGUFError, UnsupportedError
from .cache import make_caches
from .common import Embedding, Linear, Loader, TorchOps, default_ops, fuse

# Bounds on hyperparameters (llama.cpp: LLAMA_MAX_LAYERS = 512, LLAMA_MAX_EXPERTS = 512).
MAX_LAYERS = 512
MAX_EXPERTS = 512
MAX_DIM = 1 << 20  # embedding, FFN and head sizes
MAX_HEADS = 1 << 12
MAX_CONTEXT = 1 << 24  # tokens
# Matrices kept in float32 whatever the load's dtype: MoE routers (small; llama.cpp keeps them
# F32, and rounding them moves tokens between experts at near-ties).
FLOAT32_MATRICES = ("ffn_gate_inp",)


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of an architecture: GGUF ``name``, ``shape`` in torch order (GGUF's ``ne``
    reversed: (rows, cols) for a matrix, (n_expert, rows, cols) for experts) and whether a
    file may omit it (``optional``: a tied output, biases, RoPE factors)."""

    name: str
    shape: tuple[int, ...]
    optional: bool = False


@dataclass(frozen=True)
class LayerCache:
    """The KV cache of one layer: ``window`` None = every position up to the context size;
    an int = sliding-window attention over the last ``window`` positions (a ring of
    ``window + slack`` cells when that is smaller than the context)."""

    n_kv_heads: int
    head_dim: int
    window: int | None = None


class Layer:
    """The tensors of one block, as attributes named by their GGUF stem (``attn_q`` ...);
    filled by :func:`bind`. Tensors a file does not have stay None."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)


class HParams:
    """Validated reads of ``{arch}.*`` metadata keys (llama.cpp's ``llama_model_loader::get_key``).

    Every getter raises :class:`GGUFError` naming the full key when the value is missing
    (and required), of the wrong type, not finite, or out of range.
    """

    def __init__(self, metadata: dict, source: str = "") -> None:
        self.md = metadata
        self.pre = f"{source}: " if source else ""
        arch = metadata.get("general.architecture")
        if not isinstance(arch, str) or not arch:
            raise GGUFError(f"{self.pre}metadata general.architecture is missing")
        self.arch = arch

    def key(self, name: str) -> str:
        return name if name.startswith(("general.", "tokenizer.")) else f"{self.arch}.{name}"

    def _fail(self, key: str, what: str) -> GGUFError:
        return GGUFError(f"{self.pre}metadata {key}: {what}")

    def _get(self, name: str, default: Any):
        key = self.key(name)
        if key not in self.md:
            if default is _REQUIRED:
                raise self._fail(key, "is missing")
            return key, default
        return key, self.md[key]

    def int(self, name: str, default: Any = None, *, lo: int = 1, hi: int = MAX_DIM,
            per_layer: bool = False) -> Any:
        """An integer in ``lo .. hi`` (a bool or float is refused); ``default`` when absent
        (pass :data:`REQUIRED` to require the key). ``per_layer``: llama.cpp also accepts an
        array with one value per layer; localllm accepts it when all values are equal."""
        key, v = self._get(name, default)
        if v is default and key not in self.md:
            return v
        if isinstance(v, list) and per_layer:
            if not v:
                raise self._fail(key, "is an empty array")
            vals = {self._int(key, x, lo, hi) for x in v}
            if len(vals) != 1:
                raise self._fail(key, "differs between layers, which localllm does not support")
            return vals.pop()
        return self._int(key, v, lo, hi)

    def _int(self, key: str, v: Any, lo: int, hi: int) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise self._fail(key, f"must be an integer, got {_show(v)}")
        if not lo <= v <= hi:
            raise self._fail(key, f"must be in {lo}..{hi}, got {v}")
        return v

    def float(self, name: str, default: Any = None, *, lo: float = 0.0, hi: float = math.inf,
              lo_open: bool = True) -> Any:
        """A finite number in (lo, hi] (``lo_open``) or [lo, hi]; ``default`` when absent."""
        key, v = self._get(name, default)
        if v is default and key not in self.md:
            return v
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise self._fail(key, f"must be a number, got {_show(v)}")
        v = float(v)
        if not math.isfinite(v):
            raise self._fail(key, f"must be finite, got {v}")
        if (v <= lo if lo_open else v < lo) or v > hi:
            bound = f"> {lo:g}" if lo_open else f">= {lo:g}"
            raise self._fail(key, f"must be {bound} and <= {hi:g}, got {v:g}")
        return v

    def str(self, name: str, default: Any = None) -> Any:
        key, v = self._get(name, default)
        if v is default and key not in self.md:
            return v
        if not isinstance(v, str):
            raise self._fail(key, f"must be a string, got {_show(v)}")
        return v

    def bool(self, name: str, default: Any = None) -> Any:
        key, v = self._get(name, default)
        if v is default and key not in self.md:
            return v
        if not isinstance(v, bool):
            raise self._fail(key, f"must be a boolean, got {_show(v)}")
        return v

    def require(self, cond: bool, name: str, what: str) -> None:
        """Raise naming ``name``'s key unless ``cond`` (consistency between keys)."""
        if not cond:
            raise self._fail(self.key(name), what)

    def rope_scaling(self, supported: tuple[str, ...]) -> tuple[str, float]:
        """(type, factor) of ``{arch}.rope.scaling.*``: type ``none`` when absent; a type
        outside ``supported`` raises :class:`UnsupportedError` naming the key."""
        factor = self.float("rope.scaling.factor", None)
        kind = self.str("rope.scaling.type", "linear" if factor and factor != 1.0 else "none")
        if kind not in ("none", *supported):
            raise UnsupportedError(
                f"{self.pre}metadata {self.key('rope.scaling.type')} = {kind!r} is not supported "
                f"for {self.arch} (supported: none, {', '.join(supported)})")
        return kind, (factor or 1.0)


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


_REQUIRED: Any = _Required()
REQUIRED: Any = _REQUIRED  # the ``default`` of a required key


def _show(v: Any) -> str:
    if isinstance(v, list):
        return f"an array of {len(v)}"
    s = repr(v)
    return f"{type(v).__name__} {s[:40]}"


def attention_heads(hp: HParams, d_model: int) -> tuple[int, int, int, int]:
    """(n_heads, n_kv_heads, head_dim (keys), head_dim_v) validated against each other:
    heads a multiple of KV heads, an even head size (RoPE rotates pairs)."""
    n_heads = hp.int("attention.head_count", REQUIRED, hi=MAX_HEADS, per_layer=True)
    n_kv = hp.int("attention.head_count_kv", n_heads, hi=MAX_HEADS, per_layer=True)
    hp.require(n_heads % n_kv == 0, "attention.head_count_kv",
               f"{n_heads} heads are not a multiple of {n_kv} KV heads")
    default_hd = d_model // n_heads if d_model % n_heads == 0 else None
    hd = hp.int("attention.key_length", default_hd if default_hd else REQUIRED)
    hd_v = hp.int("attention.value_length", hd)
    hp.require(hd % 2 == 0, "attention.key_length", f"head size {hd} is odd (RoPE needs pairs)")
    hp.require(hd_v == hd, "attention.value_length",
               f"{hd_v} differs from attention.key_length {hd}, which localllm does not support")
    return n_heads, n_kv, hd, hd_v


def check_tensors(specs: list[TensorSpec], tensors: dict, source: str = "") -> None:
    """Check a file's tensors against the declaration before any weight is read.

    Args:
        specs: the architecture's :class:`TensorSpec` list for the file's hyperparameters.
        tensors: name -> object with ``shape`` (torch order), e.g. ``GGUFFile.tensors``.
    Raises:
        GGUFError: a required tensor is missing, a tensor's shape contradicts the
            hyperparameters, or the file has a tensor the architecture does not declare
            (tensors of another architecture; llama.cpp refuses these too).
    """
    pre = f"{source}: " if source else ""
    declared = {s.name for s in specs}
    for s in specs:
        t = tensors.get(s.name)
        if t is None:
            if not s.optional:
                raise GGUFError(f"{pre}tensor {s.name!r} is missing (the hyperparameters need "
                                f"shape {s.shape})")
            continue
        if tuple(t.shape) != tuple(s.shape):
            raise GGUFError(f"{pre}tensor {s.name!r} has shape {tuple(t.shape)}, but the "
                            f"hyperparameters need {s.shape}")
    for name in tensors:
        if name not in declared:
            raise GGUFError(f"{pre}tensor {name!r} is not part of this architecture "
                            "(or its layer is past block_count)")


def layer_of(name: str) -> tuple[int | None, str, str]:
    """(layer index or None, stem, suffix) of a GGUF tensor name:
    ``blk.3.attn_q.weight`` -> (3, "attn_q", "weight"); ``output.weight`` -> (None, "output",
    "weight")."""
    parts = name.split(".")
    if parts[0] == "blk":
        return int(parts[1]), ".".join(parts[2:-1]), parts[-1]
    return None, ".".join(parts[:-1]), parts[-1]


def common_hparams(hp: HParams, n_vocab: int, *, eps_key: str = "attention.layer_norm_rms_epsilon",
                   eps: float = 1e-5, context_length: int = 4096) -> dict:
    """The hyperparameters every decoder here has, validated: n_vocab, n_layers, d_model,
    heads, head_dim, context_length, norm_eps, rope_base (see :class:`HParams`)."""
    if isinstance(n_vocab, bool) or not isinstance(n_vocab, int) or not 1 <= n_vocab <= 1 << 24:
        raise GGUFError(f"{hp.pre}the vocabulary has {n_vocab} tokens")
    d_model = hp.int("embedding_length", REQUIRED)
    n_heads, n_kv, hd, _ = attention_heads(hp, d_model)
    rope_dims = hp.int("rope.dimension_count", hd)
    if rope_dims != hd:
        raise UnsupportedError(f"{hp.pre}metadata {hp.key('rope.dimension_count')} = {rope_dims}: "
                               f"partial RoPE (head size {hd}) is not supported")
    return {
        "arch": hp.arch, "n_vocab": n_vocab,
        "n_layers": hp.int("block_count", REQUIRED, hi=MAX_LAYERS),
        "d_model": d_model, "n_heads": n_heads, "n_kv_heads": n_kv, "head_dim": hd,
        "context_length": hp.int("context_length", context_length, hi=MAX_CONTEXT),
        "norm_eps": hp.float(eps_key, eps, hi=1.0),
        "rope_base": hp.float("rope.freq_base", 10_000.0),
    }


class BaseModel:
    """A decoder built from its ``args`` alone; :func:`bind` attaches weights.

    Attributes:
        args: the architecture's ModelArgs.
        layers: one :class:`Layer` per block (``args.n_layers``).
        token_embd, output_norm, output: set by :func:`bind` (``output`` is the embedding's
            tied head when the file has no ``output.weight``).
        ops: :class:`~localllm.models.common.TorchOps`, ``KernelOps`` (Triton) or
            ``NativeOps`` (native CPU kernels), from the device and backend.
    """

    # Projections of one input fused at bind time: fused name -> part stems.
    FUSE: ClassVar[dict[str, tuple[str, ...]]] = {
        "attn_qkv": ("attn_q", "attn_k", "attn_v"),
        "ffn_gate_up": ("ffn_gate", "ffn_up"),
    }

    def __init__(self, args) -> None:
        self.args = args
        self.layers = [Layer() for _ in range(args.n_layers)]
        self.token_embd: Embedding | None = None
        self.output_norm: torch.Tensor | None = None
        self.output: Linear | None = None
        self.device = torch.device("cpu")
        self.ops = TorchOps()

    def __getattr__(self, name: str):
        # Optional top-level tensors (rope_freqs, rope_factors_long ...) read as None.
        if name.startswith("__") or name in ("args", "layers"):
            raise AttributeError(name)

    def prepare(self) -> None:
        """Called by :func:`bind` once weights are on ``self.device`` (RoPE tables ...)."""

    def make_caches(self, ctx_size: int, *, slack: int) -> list:
        """The per-layer KV caches of ``cache_layout(args)`` at ``ctx_size`` tokens."""
        from . import cache_layout

        return make_caches(cache_layout(self.args), ctx_size, slack=slack, device=self.device,
                           half=self.ops.kv_half)


def bind(model: BaseModel, gguf, device, *, dtype: torch.dtype = torch.float16,
         quantized: bool = False, native: bool = False, ops=None,
         progress=None) -> list[str]:
    """Attach the weights of ``gguf`` to ``model`` on ``device``.

    The file's tensors are first checked against ``tensor_specs(model.args)``
    (:func:`check_tensors`), so nothing is read from a file that contradicts its metadata.

    Args:
        dtype: dtype of dequantized matrices (float16; float32 for exact checks).
        quantized: keep matrices in their ggml blocks for the Triton kernels.
        native: keep matrices in their ggml blocks (a view of the file) for the native CPU
            kernels (:mod:`localllm.cpu`).
        ops: the op backend (default: :func:`~localllm.models.common.default_ops` of device).
        progress: called with the bytes of each tensor read.
    Returns:
        the tensors that stayed dequantized for lack of a kernel (``"name (TYPE)"``).
    Raises:
        GGUFError: a tensor is missing, mis-shaped or foreign to the architecture.
        UnsupportedError: a tensor's type cannot be dequantized.
    """
    from . import tensor_specs

    specs = tensor_specs(model.args)
    check_tensors(specs, gguf.tensors, gguf.path.name)
    loader = Loader(gguf, device, dtype, quantized=quantized, native=native,
                    progress=progress)
    model.device = torch.device(device)
    model.ops = ops if ops is not None else default_ops(device, native=native,
                                                        kv_half=dtype != torch.float32)
    present = [s for s in specs if s.name in gguf.tensors]
    for s in sorted(present, key=lambda s: s.name.endswith(".bias")):  # weights first
        i, stem, suffix = layer_of(s.name)
        owner = model if i is None else model.layers[i]
        if suffix == "bias":
            getattr(owner, stem).bias = loader.dense(s.name)
        elif stem == "token_embd":
            owner.token_embd = Embedding(loader.matrix(s.name))
        elif stem in FLOAT32_MATRICES:
            setattr(owner, stem, Linear(loader.dense(s.name, torch.float32)))
        elif len(s.shape) == 3:
            setattr(owner, stem, loader.experts(s.name))
        elif len(s.shape) == 2:
            setattr(owner, stem, Linear(loader.matrix(s.name)))
        else:
            setattr(owner, stem, loader.dense(s.name))
    for layer in model.layers:
        for fused, stems in model.FUSE.items():
            parts = [getattr(layer, st) for st in stems]
            if all(isinstance(p, Linear) for p in parts):
                setattr(layer, fused, fuse(parts))
                for st in stems:
                    delattr(layer, st)
    if model.output is None:
        model.output = model.token_embd.head
    model.prepare()
    return loader.fallbacks
