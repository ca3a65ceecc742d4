"""Torch reference of the gated delta rule (Yang, Kautz & Hatamizadeh 2024, "Gated Delta
Networks: Improving Mamba2 with Delta Rule"), the recurrent mixer of Qwen3-Next and Qwen3.5,
as llama.cpp computes it (``ggml_gated_delta_net`` in ``ggml/src/ggml-cpu/ops.cpp``; the
graph around it in ``src/models/delta-net-base.cpp``).

Per value head ``h`` the state is a matrix ``M`` (S_v, S_k) mapping keys to values (llama.cpp
stores it the same way: row ``j`` of a head's S_v x S_k block is value channel ``j``). One
token with query ``q``, key ``k`` (L2-normalized, S_k), value ``v`` (S_v), log-decay ``g``
(<= 0) and write strength ``beta`` (0..1)::

    M     = exp(g) * M
    delta = beta * (v - M @ k)          # what the memory gets wrong about v
    M     = M + outer(delta, k)
    o     = M @ q / sqrt(S_k)

A decode step runs this recurrence. A prompt runs the chunked form (the WY representation of
Yang et al. 2024, "Parallelizing Linear Transformers with the Delta Rule over Sequence Length",
as llama.cpp's ``build_delta_net_chunking`` and flash-linear-attention's
``chunk_gated_delta_rule``): within a chunk of ``L`` tokens the corrections ``delta`` solve a
unit lower-triangular system (one ``solve_triangular`` for every chunk and head at once) and
the outputs are GEMMs; only the state crosses chunks, one Python step per chunk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .ssm import softplus

# Tokens per chunk of the chunked form: the (heads, L, L) systems stay small while the
# products stay GEMMs (llama.cpp and flash-linear-attention use 64 too).
CHUNK = 64


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (llama.cpp's ``build_gdn_l2_norm``:
    an RMSNorm with eps / n, scaled by 1 / sqrt(n)), float32."""
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)


def key_heads(n_v_heads: int, n_k_heads: int, *, interleave: bool, device=None) -> torch.Tensor:
    """The key head each value head reads, (n_v_heads,) int64: ``h // (Hv / Hk)`` with
    ``interleave`` (Qwen3-Next: llama.cpp repeats each key head in place), else ``h % Hk``
    (Qwen3.5, whose converter reorders the value heads so that keys tile)."""
    h = torch.arange(n_v_heads, device=device)
    return h // (n_v_heads // n_k_heads) if interleave else h % n_k_heads


def gates(alpha: torch.Tensor, beta_logit: torch.Tensor, dt_bias: torch.Tensor,
          a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-decay ``g``, write strength ``beta``) of each token and value head, float32
    (T, Hv) each: ``g = softplus(alpha + dt_bias) * A`` (``A = -exp(A_log)`` as the GGUF
    stores ``ssm_a``), ``beta = sigmoid(beta_logit)``."""
    return softplus(alpha + dt_bias) * a, torch.sigmoid(beta_logit)


def delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               beta: torch.Tensor, state: torch.Tensor, *, interleave: bool = False,
               chunk: int = CHUNK) -> torch.Tensor:
    """The gated delta rule over ``T`` tokens, continuing from ``state`` (module docstring).

    Args:
        q, k: (T, Hk, S) float32, L2-normalized (q is scaled by 1/sqrt(S) here).
        v: (T, Hv, S) float32; Hv a multiple of Hk (see :func:`key_heads` for ``interleave``).
        g: (T, Hv) float32 log-decay; beta: (T, Hv) float32.
        state: (Hv, S, S) float32, value x key per head, updated in place.
        chunk: tokens per chunk of the chunked form (prompts of more than one token).
    Returns:
        (T, Hv, S) float32.
    """
    t, hv, s = v.shape
    idx = key_heads(hv, q.shape[1], interleave=interleave, device=q.device)
    if q.shape[1] != hv:
        q, k = q.index_select(1, idx), k.index_select(1, idx)
    scale = s ** -0.5
    if t == 1:
        m = state * torch.exp(g[0])[:, None, None]  # (Hv, S, S)
        delta = (v[0] - torch.einsum("hjk,hk->hj", m, k[0])) * beta[0, :, None]
        m += delta[:, :, None] * k[0][:, None, :]
        state.copy_(m)
        return (torch.einsum("hjk,hk->hj", m, q[0]) * scale)[None]
    return _chunked(q * scale, k, v, g, beta, state, chunk)


def _chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
             beta: torch.Tensor, state: torch.Tensor, chunk: int) -> torch.Tensor:
    """:func:`delta_rule` of a prompt, q already scaled and every tensor per value head.

    Within a chunk, with ``G`` the cumulative log-decay from the chunk's start, the
    corrections are ``D = (I + A)^-1 (beta V - beta exp(G) K M0^T)`` where ``A[i, j] =
    beta_i k_i.k_j exp(G_i - G_j)`` below the diagonal; the outputs ``exp(G) Q M0^T +
    ((Q K^T) * exp(G_i - G_j))_{j<=i} D`` and the state ``exp(G_L) M0 + D^T (exp(G_L - G) K)``.
    Every exponent is <= 0 (no overflow). The chunk's padding (zero keys and write strength,
    zero log-decay) changes nothing."""
    t, h, s = v.shape
    n = -(-t // chunk)
    pad = n * chunk - t

    def blocks(x: torch.Tensor) -> torch.Tensor:  # (T, H, ...) -> (H, n, L, ...)
        x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, 0, 0, pad))
        return x.reshape(n, chunk, h, *x.shape[2:]).movedim(2, 0)

    q, k, v, g, beta = blocks(q), blocks(k), blocks(v), blocks(g), blocks(beta)
    cum = g.cumsum(-1)  # (H, n, L)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    kb = k * beta[..., None]
    a = (kb @ k.transpose(-1, -2) * decay).tril(-1)  # (H, n, L, L), strictly lower
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    inv = torch.linalg.solve_triangular(eye + a, eye.expand_as(a), upper=False,
                                        unitriangular=True)  # (I + A)^-1
    u = inv @ (v * beta[..., None])  # (H, n, L, S)
    w = inv @ (kb * cum.exp()[..., None])  # (H, n, L, S)
    qk = q @ k.transpose(-1, -2) * decay  # (H, n, L, L), lower with the diagonal
    qg = q * cum.exp()[..., None]
    last = cum[..., -1]  # (H, n)
    kd = k * (last[..., None] - cum).exp()[..., None]  # decay from each token to the end
    m = state
    out = torch.empty_like(v)
    for c in range(n):
        d = u[:, c] - w[:, c] @ m.transpose(1, 2)  # (H, L, S): the corrections
        out[:, c] = qg[:, c] @ m.transpose(1, 2) + qk[:, c] @ d
        m = m * last[:, c].exp()[:, None, None] + d.transpose(1, 2) @ kd[:, c]
    state.copy_(m)
    return out.movedim(0, 2).reshape(n * chunk, h, s)[:t]


def gated_delta_net(qkv: torch.Tensor, alpha: torch.Tensor, beta_logit: torch.Tensor,
                    dt_bias: torch.Tensor, a: torch.Tensor, state: torch.Tensor, *,
                    n_k_heads: int, eps: float, interleave: bool) -> torch.Tensor:
    """A delta-net layer's recurrence from its convolved projections (after the short
    convolution and SiLU): split ``qkv`` (T, 2 Hk S + Hv S) into q, k, v, L2-normalize q and k
    (``eps``: the file's RMS epsilon), compute the gates (:func:`gates`) and run
    :func:`delta_rule` on ``state`` (Hv, S, S). alpha, beta_logit: (T, Hv); dt_bias, a: (Hv,).
    Returns (T, Hv, S) float32."""
    t = qkv.shape[0]
    hv, s = state.shape[0], state.shape[1]
    kd = n_k_heads * s
    q = l2_norm(qkv[:, :kd].reshape(t, n_k_heads, s), eps)
    k = l2_norm(qkv[:, kd:2 * kd].reshape(t, n_k_heads, s), eps)
    v = qkv[:, 2 * kd:].reshape(t, hv, s)
    g, beta = gates(alpha, beta_logit, dt_bias, a)
    return delta_rule(q, k, v, g, beta, state, interleave=interleave)
