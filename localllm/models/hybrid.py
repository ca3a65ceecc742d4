"""Pieces shared by the hybrid families (``granitehybrid``, ``falcon-h1``, ``nemotron_h``,
``lfm2``): which layers attend, their attention hyperparameters and tensors, and the
attention sublayer itself.

A hybrid file says per layer whether it attends: ``{arch}.attention.head_count_kv`` is an
array with 0 for the recurrent layers (llama.cpp's ``hparams.is_recr``), and ``nemotron_h``
adds ``feed_forward_length`` > 0 for its FFN-only layers. A model's memories are listed in
layer order (:func:`localllm.memory.make_memory`): a layer that attends takes the next KV
cache, a recurrent one the next recurrent state, a layer with both (Falcon-H1) one of each,
a layer with neither (Nemotron-H's FFN layers) none; the forward consumes them with
``next(memories)`` in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .base import (
    MAX_CONTEXT,
    MAX_HEADS,
    MAX_LAYERS,
    REQUIRED,
    HParams,
    TensorSpec,
    check_vocab,
    qkv_specs,
)
from .common import Linear, Split
from .decoder import Decoder, Step
from .rope import GLOBAL, RopeSpec, read_rope


@dataclass(kw_only=True)
class HybridArgs:
    """What every recurrent and hybrid family's ``ModelArgs`` has (:func:`hybrid_hparams`
    reads it; keyword-only fields, a family adds its own)."""

    arch: str  # general.architecture
    n_vocab: int
    n_layers: int  # block_count
    d_model: int  # embedding_length
    context_length: int
    norm_eps: float = 1e-5  # attention.layer_norm_rms_epsilon

    @classmethod
    def read(cls, md: dict, n_vocab: int, source: str = "", **defaults) -> tuple[HParams, dict]:
        """The validated reader of a file's metadata ``md`` and the fields above
        (:func:`hybrid_hparams`, ``defaults`` its keyword arguments).

        Raises:
            GGUFError: a key missing, mistyped or out of range (named), an absurd vocabulary.
        """
        hp = HParams(md, source)
        return hp, hybrid_hparams(hp, n_vocab, **defaults)


def hybrid_hparams(hp: HParams, n_vocab: int, *, context_length=REQUIRED,
                   eps=REQUIRED) -> dict:
    """The :class:`HybridArgs` fields of a file, validated: ``context_length`` and
    ``eps`` the defaults of ``context_length`` and ``attention.layer_norm_rms_epsilon``
    (:data:`~localllm.models.base.REQUIRED`: the key must be there).

    Raises:
        GGUFError: a key missing, mistyped or out of range (named), an absurd vocabulary.
    """
    return {"arch": hp.arch, "n_vocab": check_vocab(hp, n_vocab),
            "n_layers": hp.int("block_count", REQUIRED, hi=MAX_LAYERS),
            "d_model": hp.int("embedding_length", REQUIRED),
            "context_length": hp.int("context_length", context_length, hi=MAX_CONTEXT),
            "norm_eps": hp.float("attention.layer_norm_rms_epsilon", eps, hi=1.0)}


@dataclass(frozen=True)
class HeadArgs:
    """Attention heads of every layer (0 where a layer does not attend) and the head size."""

    n_heads: tuple[int, ...]  # attention.head_count
    n_kv_heads: tuple[int, ...]  # attention.head_count_kv
    head_dim: int  # attention.key_length


def layer_heads(hp: HParams, n_layers: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(``attention.head_count``, ``attention.head_count_kv``) per layer, each an array of
    ``n_layers`` values or one value for all (KV heads default to the heads).

    Raises:
        GGUFError: an array of the wrong length, a value out of range (named).
    """
    heads = hp.int_layers("attention.head_count", n_layers, REQUIRED, hi=MAX_HEADS)
    kv = hp.int_layers("attention.head_count_kv", n_layers, list(heads), hi=MAX_HEADS)
    return heads, kv


def head_args(hp: HParams, heads: Sequence[int], kv: Sequence[int], attends: Sequence[bool],
              d_model: int) -> HeadArgs:
    """The attention geometry of the layers where ``attends``: heads > 0, a multiple of the KV
    heads, an even head size (``attention.key_length``, default ``d_model / heads``) equal to
    ``attention.value_length``.

    Raises:
        GGUFError: naming the key that contradicts the others.
    """
    first = next((i for i, a in enumerate(attends) if a), None)
    for i, a in enumerate(attends):
        if a:
            hp.require(heads[i] > 0, "attention.head_count",
                       f"layer {i} attends but has 0 heads")
            hp.require(kv[i] > 0 and heads[i] % kv[i] == 0, "attention.head_count_kv",
                       f"layer {i}: {heads[i]} heads are not a multiple of {kv[i]} KV heads")
    default = d_model // heads[first] if first is not None and heads[first] else None
    hd = hp.int("attention.key_length",
                default if default and d_model % heads[first] == 0 else
                (REQUIRED if first is not None else 1))
    hd_v = hp.int("attention.value_length", hd)
    hp.require(hd % 2 == 0 or first is None, "attention.key_length",
               f"head size {hd} is odd (RoPE needs pairs)")
    hp.require(hd_v == hd, "attention.value_length",
               f"{hd_v} differs from attention.key_length {hd}, which localllm does not support")
    return HeadArgs(tuple(heads), tuple(kv), hd)


@dataclass(kw_only=True)
class AttendingArgs(HybridArgs):
    """A hybrid whose layers may attend: their heads (:func:`layer_heads`)."""

    heads: HeadArgs  # per layer; 0 KV heads: a layer without attention
    rope: RopeSpec | None = None  # rope.* (None: no positions, nemotron_h)

    @property
    def recurrent(self) -> tuple[bool, ...]:
        """Per layer: it does not attend (0 KV heads, llama.cpp's ``hparams.is_recr``)."""
        return tuple(k == 0 for k in self.heads.n_kv_heads)

    @staticmethod
    def whole_head_rope(hp: HParams, head_dim: int, context_length: int, *, neox: bool
                        ) -> RopeSpec:
        """The file's RoPE (:func:`~localllm.models.rope.read_rope`: every scaling type), which
        must rotate whole heads: the hybrids' attention sublayer rotates queries and keys as
        they are, without :class:`~localllm.models.rope.Rope`'s partial-RoPE arrangement.

        Raises:
            GGUFError: a RoPE key out of range (named).
            UnsupportedError: ``rope.dimension_count`` below the head size (partial RoPE).
        """
        from ..errors import UnsupportedError

        spec = read_rope(hp, head_dim=head_dim, context_length=context_length, neox=neox)
        if spec.n_rot != head_dim:
            raise UnsupportedError(f"{hp.pre}metadata {hp.key('rope.dimension_count')} = "
                                   f"{spec.n_rot}: partial RoPE (head size {head_dim}) is not "
                                   "supported")
        return spec

    @staticmethod
    def read_heads(hp: HParams, c: dict, attends=None) -> HeadArgs:
        """The heads of a hybrid's layers (:func:`layer_heads`, :func:`head_args`) for the
        :func:`hybrid_hparams` ``c``; ``attends``: a function of the KV heads per layer
        saying which layers attend (default: those with KV heads).

        Raises:
            GGUFError: naming the key that contradicts the others.
        """
        heads, kv = layer_heads(hp, c["n_layers"])
        which = attends(kv) if attends is not None else [k > 0 for k in kv]
        return head_args(hp, heads, kv, which, c["d_model"])


def attention_specs(prefix: str, d_model: int, n_heads: int, n_kv: int, head_dim: int, *,
                    qk_norm: bool = False, out_bias: bool = False) -> list[TensorSpec]:
    """Separate Q/K/V projections with optional biases (llama.cpp's ``create_tensor_qkv``),
    the output projection (its bias optional when ``out_bias``), and per-head QK-norm
    weights when ``qk_norm``."""
    p = prefix
    specs = [*qkv_specs(p, d_model, n_heads, n_kv, head_dim),
             TensorSpec(p + "attn_output.weight", (d_model, n_heads * head_dim))]
    if out_bias:
        specs.append(TensorSpec(p + "attn_output.bias", (d_model,), optional=True))
    if qk_norm:
        specs += [TensorSpec(p + "attn_q_norm.weight", (head_dim,)),
                  TensorSpec(p + "attn_k_norm.weight", (head_dim,))]
    return specs


@dataclass
class AttentionWeights:
    """A layer's attention tensors; None in the layers that do not attend."""

    attn_qkv: Linear | Split | None = None  # fused attn_q, attn_k, attn_v
    attn_output: Linear | None = None
    attn_q_norm: torch.Tensor | None = None
    attn_k_norm: torch.Tensor | None = None


class HybridDecoder(Decoder):
    """A hybrid of the :class:`~localllm.models.decoder.Decoder` loop: its attention
    layers rotate whole heads (:meth:`AttendingArgs.whole_head_rope`) as they come, with the
    heads of ``args.heads``."""

    def attend(self, b: AttentionWeights, n: torch.Tensor, cache, step: Step,
               kind: str = GLOBAL) -> torch.Tensor:
        """:func:`attention` of layer ``b`` on its normed input n (T, d) -> (T, d) with the
        layer kind's angles and scale."""
        a = self.args
        return attention(b, n, cache, self.ops, step.angles[kind], step.pos, step.positions,
                         head_dim=a.heads.head_dim, neox=a.rope.neox, scale=self.scales[kind],
                         eps=a.norm_eps)


def attention(w: AttentionWeights, x: torch.Tensor, cache, ops, rope, pos, positions, *,
              head_dim: int, neox: bool, scale: float, eps: float) -> torch.Tensor:
    """The attention sublayer on a normed x (T, d) -> (T, d): Q/K/V, QK-norm where the
    layer has it, RoPE by ``rope`` (``ops.rope_angles``; zero frequencies for the models
    without positions: an exact identity), the KV-cache write and attention, the output
    projection."""
    q, k, v = w.attn_qkv(x)
    out = ops.self_attention(q, k, v, w.attn_q_norm, w.attn_k_norm, eps, rope, cache, pos,
                             positions, head_dim=head_dim, neox=neox, scale=scale)
    del q, k, v
    return w.attn_output(out)
