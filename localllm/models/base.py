"""What every architecture declares, and what is derived from the declaration.

An architecture module (``llama.py``, ``gemma.py`` ...) declares:

* ``ModelArgs.from_gguf(metadata, n_vocab)``: the hyperparameters, every one read through
  :class:`HParams`, which validates type, finiteness and range and raises one
  :class:`~localllm.errors.GGUFError` naming the key before anything is sized from it;
* ``tensor_specs(args)``: every tensor the model may read, as :class:`TensorSpec`
  (GGUF name, shape in torch order, optional or not): the tensor declaration, as gguf-py's
  ``MODEL_TENSORS`` table and llama.cpp's ``llama_model::load_tensors`` are;
* ``memory_layout(args)``: per layer, what it remembers between forward passes
  (:mod:`localllm.memory`: a KV cache, a sliding-window ring, a latent cache, a recurrent
  state);
* ``Layer`` and ``Weights`` dataclasses: the tensors of one block (``blk.{i}.{stem}``) and
  the top-level ones (``{stem}``) as typed fields named by their GGUF stem (fused
  projections by their fused name), optional ones defaulting to None.

From these alone follow: the check of a file's tensors before any weight is read
(:func:`check_tensors`), the memory estimate (``runtime/resources.py``), the memories
(``memory.make_memory``), the synthetic-model writer (``synthetic.py``) and the tiny test
models. The ``Model`` is built from ``args`` alone and :func:`bind` attaches the weights the
backend loads: matrices become one :class:`~localllm.models.common.Linear`, 3-D expert
tensors an :class:`~localllm.backends.ExpertMatrix`, vectors and the parameters of
:data:`DENSE_TENSORS` float32 tensors, ``.bias`` tensors the bias of the ``Linear`` of the
same stem, or the float32 bias of its ``ExpertMatrix`` (one row per expert; gpt-oss), or a
field ``{stem}_bias`` where the stem has no matrix (``ssm_dt_bias``); dots in a
stem become underscores in its field (``shortconv.in_proj``); projections of one input
(``model.FUSE``: Q/K/V, gate/up) are fused into one product where the backend can stack
them. A tensor without a field, or a required field without a tensor, fails at bind time
naming the GGUF tensor.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..backends.base import ExpertList
from ..errors import GGUFError
from .common import Embedding, Linear, fuse

if TYPE_CHECKING:
    from .rope import RopeSpec

# Bounds on hyperparameters (llama.cpp: LLAMA_MAX_LAYERS = 512, LLAMA_MAX_EXPERTS = 512).
MAX_LAYERS = 512
MAX_EXPERTS = 512
MAX_DIM = 1 << 20  # embedding, FFN and head sizes
MAX_HEADS = 1 << 12
MAX_CONTEXT = 1 << 24  # tokens
# Matrices kept in float32 whatever the load's dtype: MoE routers (small; llama.cpp keeps them
# F32, and rounding them moves tokens between experts at near-ties).
FLOAT32_MATRICES = ("ffn_gate_inp",)
# Tensors of rank 2 that are parameters, not matrices to multiply: bound as float32 tensors of
# their declared shape (state-space models' convolution kernels, decay and skip vectors, and
# grouped norm weights; llama.cpp keeps them F32 too).
DENSE_TENSORS = ("ssm_conv1d", "ssm_a", "ssm_d", "ssm_norm", "shortconv.conv")


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of an architecture: GGUF ``name``, ``shape`` in torch order (GGUF's ``ne``
    reversed: (rows, cols) for a matrix, (n_expert, rows, cols) for experts), whether a
    file may omit it (``optional``: a tied output, biases, RoPE factors), and for a matrix
    holding several projections stacked by rows (a file's fused ``attn_qkv``) their sizes
    (``parts``: its ``Linear`` returns one output each). ``unused``: a tensor a file may
    carry for something localllm does not run (Qwen3.5's multi-token-prediction block):
    its shape is checked, it is never read or bound. ``unless``: another tensor whose
    presence makes this one optional (an older layout of the same projections)."""

    name: str
    shape: tuple[int, ...]
    optional: bool = False
    parts: tuple[int, ...] | None = None
    unused: bool = False
    unless: str | None = None


def qkv_specs(prefix: str, d_model: int, n_heads: int, n_kv: int, head_dim: int, *,
              bias: str = "optional") -> list[TensorSpec]:
    """The separate Q/K/V projections of an attention block (llama.cpp's
    ``create_tensor_qkv``), (heads * head_dim, d_model) each, then their biases unless
    ``bias`` is ``"none"`` (``"optional"``: a file may omit them, ``"required"``)."""
    p, nq, nkv = prefix, n_heads * head_dim, n_kv * head_dim
    specs = [TensorSpec(p + "attn_q.weight", (nq, d_model)),
             TensorSpec(p + "attn_k.weight", (nkv, d_model)),
             TensorSpec(p + "attn_v.weight", (nkv, d_model))]
    if bias != "none":
        optional = bias == "optional"
        specs += [TensorSpec(p + "attn_q.bias", (nq,), optional),
                  TensorSpec(p + "attn_k.bias", (nkv,), optional),
                  TensorSpec(p + "attn_v.bias", (nkv,), optional)]
    return specs


def ffn_specs(prefix: str, d_model: int, ffn_dim: int, suffix: str = "", *,
              bias: bool = False) -> list[TensorSpec]:
    """A gated FFN's ``ffn_gate``, ``ffn_up`` (ffn_dim, d_model) and ``ffn_down``
    (d_model, ffn_dim), then their optional biases with ``bias``; ``suffix`` ``"_shexp"``:
    a MoE layer's shared expert."""
    p, f, d = prefix, ffn_dim, d_model
    specs = [TensorSpec(f"{p}ffn_gate{suffix}.weight", (f, d)),
             TensorSpec(f"{p}ffn_up{suffix}.weight", (f, d)),
             TensorSpec(f"{p}ffn_down{suffix}.weight", (d, f))]
    if bias:
        specs += [TensorSpec(f"{p}ffn_gate{suffix}.bias", (f,), optional=True),
                  TensorSpec(f"{p}ffn_up{suffix}.bias", (f,), optional=True),
                  TensorSpec(f"{p}ffn_down{suffix}.bias", (d,), optional=True)]
    return specs


def head_specs(d_model: int, n_vocab: int, *, tied: bool = True) -> list[TensorSpec]:
    """The output norm and projection; ``tied``: a file may omit ``output.weight``, the
    embedding then serves (llama.cpp's ``TENSOR_DUPLICATED`` fallback)."""
    return [TensorSpec("output_norm.weight", (d_model,)),
            TensorSpec("output.weight", (n_vocab, d_model), optional=tied)]


@dataclass(kw_only=True)
class DecoderArgs:
    """The hyperparameters every decoder here has (``common_hparams`` reads them); a
    family's ``ModelArgs`` extends it (keyword-only fields)."""

    arch: str  # general.architecture
    n_vocab: int
    n_layers: int  # block_count
    d_model: int  # embedding_length
    n_heads: int  # attention.head_count
    n_kv_heads: int  # attention.head_count_kv
    head_dim: int  # attention.key_length
    context_length: int
    rope: RopeSpec  # rope.* (models/rope.py)
    norm_eps: float = 1e-5  # attention.layer_norm_rms_epsilon

    @classmethod
    def read(cls, md: dict, n_vocab: int, source: str = "", **defaults) -> tuple[HParams, dict]:
        """The validated reader of a file's metadata ``md`` and the fields above but the
        RoPE (:func:`common_hparams`, ``defaults`` its keyword arguments): what a family's
        ``from_gguf`` starts from.

        Raises:
            GGUFError: a key missing, mistyped or out of range (named), an absurd vocabulary.
        """
        hp = HParams(md, source)
        return hp, common_hparams(hp, n_vocab, **defaults)


@dataclass
class Weights:
    """The top-level tensors of a decoder; a family's ``Weights`` adds its own (RoPE factor
    tensors ...). ``output`` is the embedding's tied head when the file has none."""

    token_embd: Embedding
    output_norm: torch.Tensor
    output: Linear | None = None


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
        """The full key of ``name``: ``{arch}.{name}``, except for the namespaces llama.cpp
        keeps outside the architecture's (``general.``, ``tokenizer.``, ``xielu.``)."""
        return name if name.startswith(UNPREFIXED) else f"{self.arch}.{name}"

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

    def int_layers(self, name: str, n_layers: int, default: Any = None, *, lo: int = 0,
                   hi: int = MAX_DIM) -> tuple[int, ...]:
        """One integer in ``lo .. hi`` per layer (llama.cpp's ``get_key_or_arr``): an array
        of exactly ``n_layers`` values, or one value for every layer; ``default`` (an int,
        or :data:`REQUIRED`) when absent. Hybrid models say which layers attend this way
        (``attention.head_count_kv`` 0: a recurrent layer)."""
        key, v = self._get(name, default)
        if isinstance(v, list):
            if len(v) != n_layers:
                raise self._fail(key, f"has {len(v)} values for {n_layers} layers "
                                      f"({self.key('block_count')})")
            return tuple(self._int(key, x, lo, hi) for x in v)
        return (self._int(key, v, lo, hi),) * n_layers

    def bool_layers(self, name: str, n_layers: int) -> tuple[bool, ...] | None:
        """One boolean per layer (an array of exactly ``n_layers`` booleans, llama.cpp's
        ``get_key_or_arr`` of ``attention.recurrent_layers``), or None when absent."""
        key, v = self._get(name, None)
        if v is None:
            return None
        if not isinstance(v, list):
            raise self._fail(key, f"must be an array of booleans, got {_show(v)}")
        if len(v) != n_layers:
            raise self._fail(key, f"has {len(v)} values for {n_layers} layers "
                                  f"({self.key('block_count')})")
        if not all(isinstance(x, bool) for x in v):
            raise self._fail(key, "must hold booleans only")
        return tuple(v)

    def int_array(self, name: str, n_max: int, default: Any = None, *, lo: int = 0,
                  hi: int = MAX_DIM) -> Any:
        """An array of 1 .. ``n_max`` integers in ``lo .. hi``, padded with zeros to
        ``n_max`` (llama.cpp's ``get_key_or_arr`` into a fixed array: RoPE sections);
        ``default`` when absent."""
        key, v = self._get(name, default)
        if v is default and key not in self.md:
            return v
        if not isinstance(v, list) or not 1 <= len(v) <= n_max:
            raise self._fail(key, f"must be an array of 1 to {n_max} integers, got {_show(v)}")
        return tuple(self._int(key, x, lo, hi) for x in v) + (0,) * (n_max - len(v))

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

    def floats(self, name: str, n: int, default: Any = None, *, lo: float = -math.inf,
               hi: float = math.inf) -> Any:
        """``n`` finite numbers in [lo, hi] (one per layer): llama.cpp's ``get_key_or_arr``,
        a number for every layer or an array of exactly ``n``; ``default`` when absent."""
        key, v = self._get(name, default)
        if v is default and key not in self.md:
            return v
        vals = v if isinstance(v, list) else [v] * n
        if len(vals) != n:
            raise self._fail(key, f"has {len(vals)} values for {n} layers")
        out = []
        for x in vals:
            if isinstance(x, bool) or not isinstance(x, (int, float)):
                raise self._fail(key, f"must be numbers, got {_show(x)}")
            if not math.isfinite(x) or not lo <= x <= hi:
                raise self._fail(key, f"must be finite and in [{lo:g}, {hi:g}], got {x:g}")
            out.append(float(x))
        return out

    def str(self, name: str, default: Any = None) -> Any:
        """A string; ``default`` when absent."""
        return self._of_type(name, default, str, "a string")

    def bool(self, name: str, default: Any = None) -> Any:
        """A boolean (an integer is refused); ``default`` when absent."""
        return self._of_type(name, default, bool, "a boolean")

    def _of_type(self, name: str, default: Any, kind: type, what: str) -> Any:
        key, v = self._get(name, default)
        if v is default and key not in self.md:
            return v
        if not isinstance(v, kind):
            raise self._fail(key, f"must be {what}, got {_show(v)}")
        return v

    def require(self, cond: bool, name: str, what: str) -> None:
        """Raise naming ``name``'s key unless ``cond`` (consistency between keys)."""
        if not cond:
            raise self._fail(self.key(name), what)

class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


_REQUIRED: Any = _Required()
UNPREFIXED = ("general.", "tokenizer.", "xielu.")  # key namespaces outside ``{arch}.``
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
            if not s.optional and (s.unless is None or s.unless not in tensors):
                instead = f", nor is {s.unless!r}" if s.unless else ""
                raise GGUFError(f"{pre}tensor {s.name!r} is missing (the hyperparameters need "
                                f"shape {s.shape}{instead})")
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
    "weight"); a name without a ``weight`` / ``bias`` suffix (Mamba's ``blk.3.ssm_a``,
    Falcon-H1's ``blk.3.ffn_norm``) -> (3, "ssm_a", "")."""
    parts = name.split(".")
    i = None
    if parts[0] == "blk":
        i, parts = int(parts[1]), parts[2:]
    if parts[-1] in ("weight", "bias") and len(parts) > 1:
        return i, ".".join(parts[:-1]), parts[-1]
    return i, ".".join(parts), ""


def field_name(stem: str) -> str:
    """The ``Layer`` / ``Weights`` field of a GGUF stem: dots become underscores
    (``shortconv.in_proj`` -> ``shortconv_in_proj``)."""
    return stem.replace(".", "_")


def check_vocab(hp: HParams, n_vocab: int) -> int:
    """``n_vocab`` (the tokenizer's size), or one GGUFError when it is absurd."""
    if isinstance(n_vocab, bool) or not isinstance(n_vocab, int) or not 1 <= n_vocab <= 1 << 24:
        raise GGUFError(f"{hp.pre}the vocabulary has {n_vocab} tokens")
    return n_vocab


def common_hparams(hp: HParams, n_vocab: int, *, eps_key: str = "attention.layer_norm_rms_epsilon",
                   eps: float = 1e-5, context_length: int = 4096) -> dict:
    """The hyperparameters every decoder here has, validated: n_vocab, n_layers, d_model,
    heads, head_dim, context_length, norm_eps (see :class:`HParams`; the RoPE is
    :func:`~localllm.models.rope.read_rope`'s)."""
    check_vocab(hp, n_vocab)
    d_model = hp.int("embedding_length", REQUIRED)
    n_heads, n_kv, hd, _ = attention_heads(hp, d_model)
    return {
        "arch": hp.arch, "n_vocab": n_vocab,
        "n_layers": hp.int("block_count", REQUIRED, hi=MAX_LAYERS),
        "d_model": d_model, "n_heads": n_heads, "n_kv_heads": n_kv, "head_dim": hd,
        "context_length": hp.int("context_length", context_length, hi=MAX_CONTEXT),
        "norm_eps": hp.float(eps_key, eps, hi=1.0),
    }


def swa_layers(hp: HParams, n_layers: int, pattern: int, *, dense_first: bool = False) -> list[bool]:
    """Which layers use sliding-window attention (llama.cpp's ``load_swa_pattern``):
    ``attention.sliding_window_pattern`` as one boolean per layer, or as a period ``n``
    (default ``pattern``) where layer il slides when il % n < n - 1 (``dense_first``: when
    il % n != 0); a period of 0 makes every layer slide.

    Raises:
        GGUFError: an array whose length is not ``n_layers``, or of other values than
            booleans (0/1).
    """
    key = hp.key("attention.sliding_window_pattern")
    v = hp.md.get(key, pattern)
    if isinstance(v, list):
        if len(v) != n_layers:
            raise hp._fail(key, f"has {len(v)} values for {n_layers} layers")
        if not all(x in (0, 1) and not isinstance(x, float) for x in v):
            raise hp._fail(key, "must be booleans, one per layer")
        return [bool(x) for x in v]
    n = hp.int("attention.sliding_window_pattern", pattern, lo=0, hi=MAX_LAYERS)
    if dense_first:
        return [n == 0 or il % n != 0 for il in range(n_layers)]
    return [n == 0 or il % n < n - 1 for il in range(n_layers)]


class BaseModel:
    """A decoder built from its ``args`` alone; :func:`bind` attaches weights.

    Attributes:
        args: the architecture's ModelArgs.
        layers: one ``LAYER`` per block (``args.n_layers``), set by :func:`bind`.
        weights: the top-level tensors (a ``WEIGHTS``), set by :func:`bind`; its fields
            are also attributes of the model (``self.token_embd`` ...).
        ops: the backend's layer operations (:class:`~localllm.backends.dense.TorchOps` or
            a subclass), set by :func:`bind`.
    """

    LAYER: ClassVar[type]  # the family's per-block dataclass
    WEIGHTS: ClassVar[type] = Weights
    # Projections of one input fused at bind time: fused name -> part stems.
    FUSE: ClassVar[dict[str, tuple[str, ...]]] = {
        "attn_qkv": ("attn_q", "attn_k", "attn_v"),
        "ffn_gate_up": ("ffn_gate", "ffn_up"),
        "ffn_gate_up_shexp": ("ffn_gate_shexp", "ffn_up_shexp"),  # a MoE's shared expert
    }
    # Products over many rows in bfloat16 where the backend has the choice (Triton's GEMM):
    # models whose activations outgrow float16's 65504 (Gemma's unnormalized FFN product).
    PREFILL_BF16: ClassVar[bool] = False

    token_embd: Embedding
    output_norm: torch.Tensor
    output: Linear

    def __init__(self, args) -> None:
        self.args = args
        self.layers: list = []
        self.device = torch.device("cpu")
        self.ops = None

    def prepare(self) -> None:
        """Called by :func:`bind` once weights are on ``self.device`` (RoPE tables ...)."""


_DENSE_FIELDS = frozenset(field_name(s) for s in DENSE_TENSORS)


def bind(model: BaseModel, gguf, backend, specs: list[TensorSpec], *,
         progress=None) -> list[str]:
    """Attach the weights of ``gguf`` to ``model``, loaded by ``backend``.

    The file's tensors must have been checked against ``specs`` (the architecture's
    ``tensor_specs(model.args)``) by :func:`check_tensors`, so nothing is read from a file
    that contradicts its metadata.

    Args:
        backend: a :class:`~localllm.backends.Backend` (its device, weight kinds and ops).
        progress: called with the bytes of each tensor read.
    Returns:
        the tensors that stayed dequantized for lack of a kernel (``"name (TYPE)"``).
    Raises:
        GGUFError: a tensor has no field in the family's ``Layer`` / ``Weights``, or a
            required field has no tensor.
        UnsupportedError: a tensor's type cannot be dequantized.
    """
    backend.source = gguf.path.name
    if progress is not None:
        backend.progress = progress
    model.device, model.ops = backend.device, backend.ops
    top: dict[str, Any] = {}
    blocks: list[dict[str, Any]] = [{} for _ in range(model.args.n_layers)]
    names: dict[tuple[int | None, str], str] = {}  # (layer, stem) -> GGUF name, for errors
    present = [s for s in specs if s.name in gguf.tensors and not s.unused]
    for s in sorted(present, key=lambda s: s.name.endswith(".bias")):  # weights first
        i, stem, suffix = layer_of(s.name)
        owner = top if i is None else blocks[i]
        info = gguf.tensor(s.name)
        stem = field_name(stem)
        if suffix == "bias" and isinstance(owner.get(stem), Linear):
            owner[stem].bias = backend.dense(info)
            continue
        if suffix == "bias" and isinstance(owner.get(stem), ExpertList):
            owner[stem].bias = backend.dense(info, torch.float32)  # (n_expert, out)
            continue
        if suffix == "bias":  # the bias of no matrix (Mamba's ssm_dt.bias): its own field
            stem += "_bias"
        names[(i, stem)] = s.name
        if stem == "token_embd":
            owner[stem] = Embedding(backend.matrix(info))
        elif stem in FLOAT32_MATRICES:
            owner[stem] = Linear(backend.dense_matrix(info, torch.float32))
        elif stem in _DENSE_FIELDS:
            owner[stem] = backend.dense(info, torch.float32)
        elif len(s.shape) == 3:
            owner[stem] = backend.experts(info)
        elif len(s.shape) == 2:
            owner[stem] = Linear(backend.matrix(info), sizes=s.parts)
        else:
            owner[stem] = backend.dense(info)
    for i, fields in enumerate(blocks):
        for fused, stems in model.FUSE.items():
            if all(isinstance(fields.get(st), Linear) for st in stems):
                fields[fused] = fuse([fields.pop(st) for st in stems])
                names[(i, fused)] = f"blk.{i}.{stems[0]}.weight"
    top.setdefault("output", None)
    model.weights = _typed(model.WEIGHTS, top, None, names, gguf.path.name)
    if model.weights.output is None:
        model.weights.output = model.weights.token_embd.head
    for f in dataclasses.fields(model.weights):
        setattr(model, f.name, getattr(model.weights, f.name))
    model.layers = [_typed(model.LAYER, fields, i, names, gguf.path.name)
                    for i, fields in enumerate(blocks)]
    model.prepare()
    return backend.fallbacks


def _typed(cls: type, values: dict[str, Any], layer: int | None,
           names: dict[tuple[int | None, str], str], source: str):
    """``cls(**values)``, a family's ``Layer`` or ``Weights`` dataclass, or one GGUFError
    naming the tensor without a field or the field without a tensor."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for stem in values:
        if stem not in fields:
            raise GGUFError(f"{source}: tensor {names.get((layer, stem), stem)!r} has no "
                            f"place in the model's {cls.__name__} (a declaration error)")
    for name, f in fields.items():
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if required and name not in values:
            where = f"blk.{layer}.{name}" if layer is not None else name
            raise GGUFError(f"{source}: tensor {where!r} is missing")
    return cls(**values)
