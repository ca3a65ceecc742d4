"""The Gemma family: ``gemma`` (1), ``gemma2``, ``gemma3`` (text), as llama.cpp's
``src/models/gemma.cpp``, ``gemma2-iswa.cpp`` and ``gemma3-iswa.cpp`` compute them.

Per layer::

    h   = x + post_attn_norm(attn(attn_norm(x)))              # gemma2/3: post-norms
    out = h + post_ffw_norm(down(gelu_tanh(gate(n)) * up(n))),  n = ffn_norm(h)

The input embedding is scaled by sqrt(d_model); the output projection is tied to it. RoPE
rotates halves (NEOX). Queries are scaled by 1/sqrt(head_dim), or by
1/sqrt(d_model / n_heads) for the 27B models (llama.cpp's ``f_attention_scale``: Gemma 2 with
46 layers, Gemma 3 with 62).

* ``gemma2``: attention scores soft-capped (``attn_logit_softcapping``: cap * tanh(s / cap))
  and so are the final logits (``final_logit_softcapping``); even layers use sliding-window
  attention (``attention.sliding_window``, default 4096), odd layers are global; the
  sliding layers' RoPE base is ``rope.freq_base_swa`` (default: the global one).
* ``gemma3``: QK-norm; where the file gives ``attention.sliding_window``, five of every six
  layers slide with their own RoPE base (``rope.freq_base_swa``, default 10,000) and no
  frequency scaling, the sixth is global (base and scaling from the metadata); without it
  every layer is global.

The pattern of sliding layers may be given by ``attention.sliding_window_pattern`` (a period
or one boolean per layer, llama.cpp's ``load_swa_pattern``).

The GGUF norm weights already include Gemma's "+1" (llama.cpp's converter adds it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..memory import KVSpec
from .base import MAX_CONTEXT, REQUIRED, DecoderArgs, TensorSpec, ffn_specs, qkv_specs, swa_layers
from .common import Linear, Split
from .decoder import Block, Decoder, Step
from .rope import GLOBAL, SWA, read_rope

SWA_PATTERN = {"gemma2": 2, "gemma3": 6}  # every n-th layer global (gemma: no SWA)
LAYERS_27B = {"gemma2": 46, "gemma3": 62}


@dataclass(kw_only=True)
class ModelArgs(DecoderArgs):
    """Hyperparameters from ``{gemma,gemma2,gemma3}.*`` metadata keys."""

    ffn_dim: int  # feed_forward_length
    norm_eps: float = 1e-6
    sliding_window: int | None = None
    swa: tuple[bool, ...] = ()  # per layer: sliding-window attention
    attn_softcap: float | None = None  # gemma2
    final_softcap: float | None = None  # gemma2
    attention_scale: float = 0.0

    @classmethod
    def from_gguf(cls, md: dict, n_vocab: int, source: str = "") -> ModelArgs:
        """Validated hyperparameters (see :class:`~localllm.models.base.HParams`).

        Raises:
            GGUFError: a key missing, mistyped, out of range or inconsistent (named).
        """
        hp, c = cls.read(md, n_vocab, source, eps=1e-6, context_length=8192)
        arch = hp.arch
        ffn = hp.int("feed_forward_length", REQUIRED, per_layer=True)
        # llama.cpp: gemma2 slides by default (window 4096), gemma3 where the file says so
        window = None
        if arch == "gemma2":
            window = hp.int("attention.sliding_window", 4096, hi=MAX_CONTEXT)
        elif arch == "gemma3":
            window = hp.int("attention.sliding_window", 0, lo=0, hi=MAX_CONTEXT) or None
        swa = (tuple(swa_layers(hp, c["n_layers"], SWA_PATTERN[arch])) if window
               else (False,) * c["n_layers"])
        rope = read_rope(hp, head_dim=c["head_dim"], context_length=c["context_length"],
                         neox=True, base=1_000_000.0 if arch == "gemma3" else 10_000.0,
                         swa_base=10_000.0 if arch == "gemma3" else None,
                         swa_scale=1.0 if arch == "gemma3" else None)
        big = c["n_layers"] == LAYERS_27B.get(arch)
        hd = c["head_dim"]
        scale = 1.0 / math.sqrt(c["d_model"] / c["n_heads"] if big else hd)
        kw = {}
        if arch == "gemma2":
            kw["attn_softcap"] = hp.float("attn_logit_softcapping", 50.0)
            kw["final_softcap"] = hp.float("final_logit_softcapping", 30.0)
        elif arch == "gemma3":
            kw["final_softcap"] = hp.float("final_logit_softcapping", None)
        return cls(**c, rope=rope, ffn_dim=ffn, sliding_window=window, swa=swa,
                   attention_scale=scale, **kw)

    def is_sliding(self, layer: int) -> bool:
        return self.swa[layer]


def tensor_specs(a: ModelArgs) -> list[TensorSpec]:
    """llama.cpp's tensors of the family, torch shapes (the output is tied; gemma3 files may
    carry ``output.weight``)."""
    d, hd, nq = a.d_model, a.head_dim, a.n_heads * a.head_dim
    specs = [TensorSpec("token_embd.weight", (a.n_vocab, d))]
    post = a.arch != "gemma"
    for i in range(a.n_layers):
        p = f"blk.{i}."
        specs += [TensorSpec(p + "attn_norm.weight", (d,)),
                  *qkv_specs(p, d, a.n_heads, a.n_kv_heads, hd, bias="none")]
        if a.arch == "gemma3":
            specs += [TensorSpec(p + "attn_q_norm.weight", (hd,)),
                      TensorSpec(p + "attn_k_norm.weight", (hd,))]
        specs.append(TensorSpec(p + "attn_output.weight", (d, nq)))
        if post:
            specs.append(TensorSpec(p + "post_attention_norm.weight", (d,)))
        specs += [TensorSpec(p + "ffn_norm.weight", (d,)), *ffn_specs(p, d, a.ffn_dim)]
        if post:
            specs.append(TensorSpec(p + "post_ffw_norm.weight", (d,)))
    specs.append(TensorSpec("output_norm.weight", (d,)))
    if a.arch == "gemma3":
        specs.append(TensorSpec("output.weight", (a.n_vocab, d), optional=True))
    return specs


def memory_layout(a: ModelArgs) -> list[KVSpec]:
    return [KVSpec(a.n_kv_heads, a.head_dim, a.sliding_window if a.is_sliding(i) else None)
            for i in range(a.n_layers)]


@dataclass
class Layer(Block):
    """The tensors of one block (``blk.{i}.*``)."""

    ffn_norm: torch.Tensor
    ffn_gate_up: Linear | Split  # fused ffn_gate, ffn_up
    ffn_down: Linear
    attn_q_norm: torch.Tensor | None = None  # gemma3: QK-norm
    attn_k_norm: torch.Tensor | None = None
    post_attention_norm: torch.Tensor | None = None  # gemma2/3
    post_ffw_norm: torch.Tensor | None = None


class Model(Decoder):
    """A Gemma-family decoder; weights attached by :func:`localllm.models.base.bind`."""

    LAYER = Layer
    PREFILL_BF16 = True  # Gemma's activations outgrow float16

    def prepare(self) -> None:
        a = self.args
        self.set_rope(a.attention_scale,
                      [SWA if a.is_sliding(i) else GLOBAL for i in range(a.n_layers)])
        for b in self.layers:
            b.attn_q_norm = self.rope.arrange_weight(b.attn_q_norm)
            b.attn_k_norm = self.rope.arrange_weight(b.attn_k_norm)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.token_embd(tokens) * math.sqrt(self.args.d_model)  # (T, d)

    def head(self, n: torch.Tensor) -> torch.Tensor:
        logits, cap = self.output(n), self.args.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def block(self, i: int, b: Layer, cache, x: torch.Tensor, n: torch.Tensor,
              next_norm: torch.Tensor, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        a, ops = self.args, self.ops
        # QK-norm: gemma3. A sliding layer whose window covers the whole context has a full
        # cache (no window).
        o = self.attention(b, n, cache, step, self.kinds[i], q_norm=b.attn_q_norm,
                           k_norm=b.attn_k_norm, softcap=a.attn_softcap)
        del n  # each intermediate dropped once used: prefill's peak holds fewer of them
        h, n = ops.residual_norm(x, o, b.post_attention_norm, b.ffn_norm, a.norm_eps)
        del o, x
        gate, up = b.ffn_gate_up(n)
        del n
        f = b.ffn_down(ops.gated(gate, up, "gelu_tanh", overwrite=True))
        del gate, up
        return ops.residual_norm(h, f, b.post_ffw_norm, next_norm, a.norm_eps)
