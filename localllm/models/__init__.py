"""Architectures, one file each, found by ``general.architecture`` (llama.cpp's names).

How to add an architecture (see :mod:`localllm.models.base` for the pieces):

1. Write ``localllm/models/NAME.py`` with

   * ``ModelArgs``: a dataclass with at least ``arch``, ``n_vocab``, ``n_layers``,
     ``context_length``; ``ModelArgs.from_gguf(metadata, n_vocab)`` reads every
     hyperparameter through ``base.HParams`` (typed, finite, in range, consistent: one
     ``GGUFError`` naming the key otherwise; ``base.common_hparams`` reads the usual ones);
   * ``tensor_specs(args)``: every tensor as ``base.TensorSpec(gguf_name, torch_shape,
     optional)``, with llama.cpp's names (``gguf.constants.MODEL_TENSORS``);
   * ``memory_layout(args)``: what its layers remember, in layer order (:mod:`localllm.memory`:
     ``KVSpec`` full or sliding-window, ``LatentSpec``, ``RecurrentSpec``; usually one per
     layer, but a hybrid layer may hold two and an FFN-only layer none: the forward takes
     them in the same order, see :mod:`.hybrid`);
   * ``Layer`` (and, for top-level tensors beyond ``base.Weights``, a ``Weights``
     subclass): dataclasses whose fields are the GGUF stems (``attn_norm`` ...; fused
     projections by their fused name, ``attn_qkv``, ``ffn_gate_up``), optional ones
     ``= None``;
   * ``Model(base.BaseModel)`` with ``LAYER = Layer`` (``WEIGHTS = ...``), built from
     ``args`` alone; ``forward(tokens, pos, memory, *, all_logits=False, logits_start=0)``
     composes the bound weights (each ``Linear`` multiplies itself, whatever the backend
     holds) with ``self.ops`` (the backend's norms, RoPE, attention over a layer's memory,
     activations, experts), as llama.cpp's ``src/models/NAME.cpp`` graph does.

   Most of this is shared, so a family file states only what differs: ``base.DecoderArgs.read``
   (the common hyperparameters), ``base.qkv_specs`` / ``ffn_specs`` / ``head_specs`` and
   :mod:`.decoder`'s ``Block`` / ``DenseFFN`` (the usual tensors), :class:`.decoder.Decoder`
   (the forward loop: embedding, RoPE, one ``block()`` per layer that the family writes, the
   output head; hooks for an embedding scale, attention temperature, a logit soft-cap, more
   than one memory per layer), :class:`.decoder.PostNormDecoder` (OLMo 2-style blocks),
   :mod:`.moe` (``ExpertArgs``, ``expert_specs``, ``moe_ffn`` with one ``Routing`` entry per
   family: gating function, weight normalisation and scale, activation) and :mod:`.hybrid`
   (``HybridArgs`` / ``AttendingArgs`` and ``HybridDecoder`` for recurrent/attention mixes).

2. Add one line to :data:`ARCHITECTURES` (several GGUF names may share a module).

Loading, memory estimate, shape checks, memories, synthetic files (``synthetic.py``,
``bench --synthetic``) and the tiny test models then follow from the declaration. Check the
new family against llama.cpp with a fixture in ``tests/data/families/`` (``record.py`` there).
"""

from __future__ import annotations

from types import ModuleType

from ..errors import UnsupportedError
from . import (
    apertus,
    deepseek2,
    ernie4_5_moe,
    exaone4,
    falcon_h1,
    gemma,
    gemma4,
    glm4moe,
    gptoss,
    granite_hybrid,
    lfm2,
    llama,
    llama4,
    mamba2,
    nemotron_h,
    olmo2,
    olmoe,
    phi3,
    phimoe,
    qwen3next,
    qwen35,
    qwen35moe,
)

ARCHITECTURES: dict[str, ModuleType] = {
    "llama": llama,
    "mistral": llama,
    "granite": llama,
    "qwen2": llama,
    "qwen3": llama,
    "qwen3moe": llama,
    "mistral3": llama,
    "smollm3": llama,
    "ernie4_5": llama,
    "seed_oss": llama,
    "hunyuan-dense": llama,
    "llama4": llama4,
    "apertus": apertus,
    "exaone4": exaone4,
    "gemma": gemma,
    "gemma2": gemma,
    "gemma3": gemma,
    "gemma4": gemma4,
    "phi3": phi3,
    "olmo2": olmo2,
    "mamba2": mamba2,
    "granitehybrid": granite_hybrid,
    "falcon-h1": falcon_h1,
    "nemotron_h": nemotron_h,
    "lfm2": lfm2,
    "qwen35": qwen35,
    "qwen35moe": qwen35moe,
    "qwen3next": qwen3next,
    "gpt-oss": gptoss,
    "glm4moe": glm4moe,
    "olmoe": olmoe,
    "ernie4_5-moe": ernie4_5_moe,
    "phimoe": phimoe,
    "deepseek2": deepseek2,
}


def architecture(name: str) -> ModuleType:
    """The module implementing ``general.architecture`` = ``name``.

    Raises:
        UnsupportedError: no module implements it.
    """
    try:
        return ARCHITECTURES[name]
    except (KeyError, TypeError):
        supported = ", ".join(sorted(ARCHITECTURES))
        raise UnsupportedError(
            f"architecture {name!r} is not supported (supported: {supported})"
        ) from None


def model_args(metadata: dict, n_vocab: int, source: str = ""):
    """The validated ``ModelArgs`` of a file's metadata (see each module's ``from_gguf``).

    Raises:
        GGUFError: a hyperparameter is missing, mistyped, out of range or inconsistent.
        UnsupportedError: unknown architecture or an unsupported feature (RoPE scaling ...).
    """
    return architecture(metadata.get("general.architecture")).ModelArgs.from_gguf(
        metadata, n_vocab, source)


def tensor_specs(args) -> list:
    """The tensor declaration (``base.TensorSpec`` list) of a model's ``args``."""
    return architecture(args.arch).tensor_specs(args)


def memory_layout(args) -> list:
    """The memory plan (one :mod:`localllm.memory` spec per layer) of a model's ``args``."""
    return architecture(args.arch).memory_layout(args)
