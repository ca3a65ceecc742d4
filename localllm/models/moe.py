"""Routing of mixture-of-experts layers: which experts a token goes to, and with what weight
(llama.cpp's ``build_moe_ffn`` in ``src/llama-graph.cpp``, up to the expert products, which
are the backend's ``ops.experts``).

Gating functions (llama.cpp's ``llama_expert_gating_func_type``):

* ``softmax``: probabilities = softmax over all experts of the router logits; the top
  ``k`` by probability, their probabilities as weights (renormalised to sum 1 with
  ``norm``, llama.cpp's ``norm_w``);
* ``softmax_weight``: the top ``k`` by router logit, weights = softmax over those ``k``
  logits only (gpt-oss, ``LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT``).
"""

from __future__ import annotations

import torch

GATINGS = ("softmax", "softmax_weight")


def route(logits: torch.Tensor, n_used: int, *, gating: str = "softmax",
          norm: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts and weights of each token from its router logits.

    Args:
        logits: (T, n_expert) float32, the router's output (with its bias, if any).
        n_used: experts per token (``expert_used_count``), 1 .. n_expert.
        gating: a name of :data:`GATINGS` (see the module docstring).
        norm: renormalise the weights to sum 1 (``softmax`` gating only; ``softmax_weight``
            weights already sum to 1).
    Returns:
        (weights (T, n_used) float32, chosen (T, n_used) int64 expert ids), by decreasing
        router score.
    Raises:
        ValueError: an unknown gating.
    """
    if gating == "softmax_weight":
        top, chosen = logits.topk(n_used, dim=-1)
        return torch.softmax(top, dim=-1), chosen
    if gating != "softmax":
        raise ValueError(f"unknown expert gating {gating!r} (one of {', '.join(GATINGS)})")
    weights, chosen = torch.softmax(logits, dim=-1).topk(n_used, dim=-1)
    if norm:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, chosen
