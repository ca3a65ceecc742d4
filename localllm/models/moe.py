"""Routing of mixture-of-experts layers: which experts a token goes to, and with what weight
(llama.cpp's ``build_moe_ffn`` in ``src/llama-graph.cpp``, up to the expert products, which
are the backend's ``ops.experts``), shared by the MoE families (gpt-oss, glm4moe, olmoe ...).

Gating functions (llama.cpp's ``llama_expert_gating_func_type``, GGUF key
``expert_gating_func``: 1 softmax, 2 sigmoid):

* ``softmax``: scores = softmax over all experts of the router logits;
* ``sigmoid``: scores = sigmoid of each logit (GLM-4.5, DeepSeek-V3);
* ``softmax_weight``: scores = the logits; the weights are the softmax over the chosen
  ``k`` logits only (gpt-oss, ``LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT``).

The top ``k`` experts are chosen by score plus an optional per-expert selection bias
(``ffn_exp_probs_b``, DeepSeek-V3's ``e_score_correction_bias``), which does not enter the
weights; the weights are the chosen scores, renormalised to sum 1 with ``norm``
(``expert_weights_norm``; the sum clamped below at 2^-14 as llama.cpp does), then multiplied
by ``scale`` (``expert_weights_scale``; 0 means 1).
"""

from __future__ import annotations

import torch

GATINGS = ("softmax", "sigmoid", "softmax_weight")
# expert_gating_func values (llama.cpp's enum; 0 "none" means the family's default)
GATING_FUNCS = {1: "softmax", 2: "sigmoid"}
_MIN_WEIGHT_SUM = 6.103515625e-5  # llama.cpp's clamp of the sum (the smallest normal float16)


def route(logits: torch.Tensor, n_used: int, *, gating: str = "softmax", norm: bool = False,
          selection_bias: torch.Tensor | None = None,
          scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts and weights of each token from its router logits.

    Args:
        logits: (T, n_expert) float32, the router's output (with its bias, if any).
        n_used: experts per token (``expert_used_count``), 1 .. n_expert.
        gating: a name of :data:`GATINGS` (see the module docstring).
        norm: renormalise the chosen weights to sum 1 (a no-op for ``softmax_weight``).
        selection_bias: (n_expert,) float32 added to the scores for the choice only.
        scale: factor of the weights (0 or 1: none).
    Returns:
        (weights (T, n_used) float32, chosen (T, n_used) int64 expert ids), by decreasing
        selection score.
    Raises:
        ValueError: an unknown gating.
    """
    if gating == "softmax":
        scores = torch.softmax(logits, dim=-1)
    elif gating == "sigmoid":
        scores = torch.sigmoid(logits)
    elif gating == "softmax_weight":
        scores = logits
    else:
        raise ValueError(f"unknown expert gating {gating!r} (one of {', '.join(GATINGS)})")
    if selection_bias is None:
        weights, chosen = scores.topk(n_used, dim=-1)
    else:
        chosen = (scores + selection_bias).topk(n_used, dim=-1).indices
        weights = scores.gather(-1, chosen)
    if gating == "softmax_weight":
        weights = torch.softmax(weights, dim=-1)
    elif norm:
        weights = weights / weights.sum(-1, keepdim=True).clamp(min=_MIN_WEIGHT_SUM)
    if scale not in (0.0, 1.0):
        weights = weights * scale
    return weights, chosen
