"""Qwen3-Next (``qwen3next``, Qwen3-Next-80B-A3B): the first gated delta-net hybrid, run by
:mod:`.qwen35`'s decoder with three differences in its declaration (llama.cpp's
``src/models/qwen3next.cpp``):

* plain NEOX RoPE on the first ``rope.dimension_count`` dims of each head (no M-RoPE
  sections);
* ``ssm_ba`` in place of ``ssm_beta`` + ``ssm_alpha``: per key head, ``Hv/Hk`` beta logits
  then ``Hv/Hk`` alphas; older files hold ``ssm_in`` (q, k, v and z grouped per key head) in
  place of ``attn_qkv`` + ``attn_gate`` (:mod:`.deltanet`);
* value head ``h`` reads key head ``h // (Hv/Hk)`` (llama.cpp repeats each key head in place;
  Qwen3.5's converter reorders the value heads so that keys tile instead).

Its FFN is :mod:`.qwen35moe`'s: routed experts plus a gated shared expert.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import qwen35
from .qwen35 import Layer, Model, memory_layout, tensor_specs

__all__ = ["Layer", "Model", "ModelArgs", "memory_layout", "tensor_specs"]


@dataclass(kw_only=True)
class ModelArgs(qwen35.ModelArgs):
    """Qwen3.5-MoE's hyperparameters without ``rope.dimension_sections``."""

    MOE = True
    MROPE = False
    FUSED_BA = True
    INTERLEAVE = True
