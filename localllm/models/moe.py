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

A family declares what differs (:class:`Routing`: gating, renormalisation, scale, the
experts' activation), its layers hold :class:`ExpertWeights`, and :func:`moe_ffn` runs
them; :func:`expert_counts` and :func:`expert_specs` read and declare the experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..backends import ExpertMatrix, SharedExpert
from .base import MAX_EXPERTS, REQUIRED, DecoderArgs, HParams, TensorSpec, ffn_specs
from .common import Linear, Split, default_attention_scale
from .rope import read_rope

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


@dataclass(frozen=True)
class Routing:
    """What a family's MoE layers do with the router's logits (see :func:`route`) and the
    experts' activation (``ops.experts``: ``silu`` SwiGLU, gpt-oss's ``swiglu_oai``)."""

    gating: str = "softmax"
    norm: bool = False  # expert_weights_norm
    scale: float = 1.0  # expert_weights_scale (0: 1)
    act: str = "silu"


@dataclass(kw_only=True)
class ExpertArgs:
    """The expert counts of a MoE family's ``ModelArgs`` (:func:`expert_counts`)."""

    n_expert: int = 0  # expert_count
    n_expert_used: int = 0  # expert_used_count


@dataclass(kw_only=True)
class AllExpertsArgs(DecoderArgs, ExpertArgs):
    """Hyperparameters of a decoder whose every layer routes over experts
    ``feed_forward_length`` wide, RoPE over halves (NEOX): OLMoE, Phi-3.5-MoE."""

    ffn_dim: int  # feed_forward_length: each expert's width
    attention_scale: float = 0.0  # 1/sqrt(head_dim)

    @classmethod
    def from_gguf(cls, md: dict, n_vocab: int, source: str = ""):
        """Validated hyperparameters (see :class:`~localllm.models.base.HParams`).

        Raises:
            GGUFError: a key missing, mistyped, out of range or inconsistent (named): no
                experts, more used experts than experts.
        """
        hp, c = cls.read(md, n_vocab, source)
        rope = read_rope(hp, head_dim=c["head_dim"], context_length=c["context_length"],
                         neox=True)
        return cls(**c, rope=rope, ffn_dim=hp.int("feed_forward_length", REQUIRED, per_layer=True),
                   **expert_counts(hp), attention_scale=default_attention_scale(c["head_dim"]))


@dataclass(kw_only=True)
class ExpertWeights:
    """The MoE tensors of a block (``blk.{i}.*``), None where a layer has none (a dense
    layer, no selection bias, no shared expert). A family's ``Layer`` extends it."""

    ffn_gate_inp: Linear | None = None  # the router (float32, with its bias if any)
    exp_probs_b_bias: torch.Tensor | None = None  # (n_expert,) selection bias
    ffn_gate_exps: ExpertMatrix | None = None  # (n_expert, ffn, d), with biases if any
    ffn_up_exps: ExpertMatrix | None = None
    ffn_gate_up_exps: ExpertMatrix | None = None  # (n_expert, 2 ffn, d): gate rows, then up
    ffn_down_exps: ExpertMatrix | None = None
    ffn_down_exps_scale: torch.Tensor | None = None  # (n_expert,) each expert's output factor
    ffn_gate_up_shexp: Linear | Split | None = None  # fused shared experts' gate and up
    ffn_down_shexp: Linear | None = None


def routed_experts(ops, b: ExpertWeights, x: torch.Tensor, n_used: int, routing: Routing,
                   *, router_input: torch.Tensor | None = None,
                   shared: SharedExpert | None = None) -> torch.Tensor:
    """The routed part of a MoE layer on x (T, d) float32 -> (T, d) float32: :func:`route`
    the router's logits of ``router_input`` (T, d) (default x; Gemma 4 routes on another
    norm of the stream), with the layer's selection bias, then the chosen experts' weighted
    sum (``ops.experts``; the fused ``ffn_gate_up_exps`` where the layer has it), plus
    ``shared`` (:func:`shared_expert`) in the same backend call. A layer's
    ``ffn_down_exps_scale`` multiplies each chosen expert's output (llama.cpp's
    ``down_exps_s`` in ``build_moe_ffn``), folded here into its routing weight."""
    weights, chosen = route(b.ffn_gate_inp(x if router_input is None else router_input), n_used,
                            gating=routing.gating, norm=routing.norm,
                            selection_bias=b.exp_probs_b_bias, scale=routing.scale)
    if b.ffn_down_exps_scale is not None:
        weights = weights * b.ffn_down_exps_scale[chosen]
    if b.ffn_gate_up_exps is not None:
        return ops.experts(x, chosen, weights, b.ffn_gate_up_exps, None, b.ffn_down_exps,
                           routing.act, shared=shared)
    return ops.experts(x, chosen, weights, b.ffn_gate_exps, b.ffn_up_exps, b.ffn_down_exps,
                       routing.act, shared=shared)


def shared_expert(b: ExpertWeights, **kw) -> SharedExpert | None:
    """The layer's shared SwiGLU expert (``ffn_{gate,up,down}_shexp``) for ``ops.experts``,
    None where it has none; ``kw``: :class:`~localllm.backends.SharedExpert`'s weight or
    input."""
    if b.ffn_down_shexp is None:
        return None
    return SharedExpert(b.ffn_gate_up_shexp, b.ffn_down_shexp, **kw)


def moe_ffn(ops, b: ExpertWeights, x: torch.Tensor, n_used: int, routing: Routing
            ) -> torch.Tensor:
    """A MoE layer on its normed input x (T, d) float32 -> (T, d) float32: the
    :func:`routed_experts` plus the shared experts' SwiGLU where the layer has them
    (llama.cpp's ``build_moe_ffn`` and the families' ``ffn_shexp``), in one backend call."""
    return routed_experts(ops, b, x, n_used, routing, shared=shared_expert(b))


def expert_counts(hp: HParams, n_expert=REQUIRED, *, lo: int = 1) -> dict:
    """``n_expert`` (``expert_count``, default ``n_expert``) and ``n_expert_used``
    (``expert_used_count``, 1 .. n_expert; read only when there are experts).

    Raises:
        GGUFError: a count missing, out of range, or more used experts than experts.
    """
    n = hp.int("expert_count", n_expert, lo=lo, hi=MAX_EXPERTS)
    return {"n_expert": n, "n_expert_used": hp.int("expert_used_count", REQUIRED, hi=n)
            if n else 0}


def expert_specs(prefix: str, d_model: int, n_expert: int, ffn_dim: int, *,
                 selection_bias: str = "", shared_dim: int = 0,
                 fused_gate_up: bool = False, down_scale: bool = False) -> list[TensorSpec]:
    """A MoE layer's router ``ffn_gate_inp`` (n_expert, d), its ``exp_probs_b.bias``
    (``selection_bias`` ``"required"`` or ``"optional"``), the experts
    ``ffn_{gate,up}_exps`` (n_expert, ffn_dim, d) and ``ffn_down_exps`` (n_expert, d,
    ffn_dim), and a shared SwiGLU ``shared_dim`` wide when > 0. ``fused_gate_up``: a file
    may hold gate and up as one ``ffn_gate_up_exps`` (n_expert, 2 ffn_dim, d) instead
    (llama.cpp's ``LLM_TENSOR_FFN_GATE_UP_EXPS``); ``down_scale``: each expert's optional
    output factor ``ffn_down_exps.scale`` (n_expert,)."""
    p, e, f, d = prefix, n_expert, ffn_dim, d_model
    specs = [TensorSpec(p + "ffn_gate_inp.weight", (e, d))]
    if selection_bias:
        specs.append(TensorSpec(p + "exp_probs_b.bias", (e,), selection_bias == "optional"))
    fused = p + "ffn_gate_up_exps.weight" if fused_gate_up else None
    if fused:
        specs.append(TensorSpec(fused, (e, 2 * f, d), optional=True))
    if down_scale:
        specs.append(TensorSpec(p + "ffn_down_exps.scale", (e,), optional=True))
    specs += [TensorSpec(p + "ffn_gate_exps.weight", (e, f, d), unless=fused),
              TensorSpec(p + "ffn_up_exps.weight", (e, f, d), unless=fused),
              TensorSpec(p + "ffn_down_exps.weight", (e, d, f))]
    return specs + (ffn_specs(p, d, shared_dim, "_shexp") if shared_dim else [])
