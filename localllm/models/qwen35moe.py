"""Qwen3.5 MoE (``qwen35moe``, Qwen3.5-35B-A3B and larger): :mod:`.qwen35`'s hybrid of gated
delta-net and gated attention layers with a mixture of experts in every layer's FFN —
softmax routing over ``expert_count`` experts, the top ``expert_used_count`` renormalised —
plus a shared expert scaled by ``sigmoid(x . ffn_gate_inp_shexp)`` (llama.cpp's
``src/models/qwen35moe.cpp``). The decoder is :mod:`.qwen35`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import qwen35
from .qwen35 import Layer, Model, memory_layout, tensor_specs

__all__ = ["Layer", "Model", "ModelArgs", "memory_layout", "tensor_specs"]


@dataclass(kw_only=True)
class ModelArgs(qwen35.ModelArgs):
    """Qwen3.5's hyperparameters with ``expert_count``, ``expert_used_count``,
    ``expert_feed_forward_length`` and ``expert_shared_feed_forward_length``."""

    MOE = True
