"""Torch references of the state-space operations (every backend's ``ops`` starts from these):
the causal short convolution of Mamba, the gated delta-net and LFM2, and Mamba2's selective
state-space scan (SSD), in the recurrent form for a decode step and the chunked form for a
prompt.

Both read and write their part of a layer's :class:`~localllm.memory.RecurrentState` in
place: ``conv`` (d_conv - 1, channels), the last inputs of the convolution, and ``ssm``
(heads, head_dim, d_state), the SSM state. The math is llama.cpp's ``ggml_ssm_conv`` and
``ggml_ssm_scan`` (``ggml/src/ggml-cpu/ops.cpp``); the chunked scan is the state-space
duality of Dao & Gu 2024 ("Transformers are SSMs", section 6, ``ssd_minimal``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Tokens per chunk of the chunked scan: the (heads, L, L) decay and score matrices of one
# chunk stay small (48 heads x 64 x 64 floats = 0.8 MB) while the products are GEMMs.
SSD_CHUNK = 64


def short_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               state: torch.Tensor, *, silu: bool) -> torch.Tensor:
    """Depthwise causal convolution over time, continuing from ``state``.

    ``y[t, c] = sum_j w[c, j] * u[t + j, c]`` (+ ``bias[c]``, then SiLU when ``silu``), where
    ``u`` is the ``d_conv - 1`` remembered inputs followed by ``x``; afterwards ``state``
    holds the last ``d_conv - 1`` rows of ``u`` (llama.cpp's ``ggml_ssm_conv`` over the
    concatenation of the conv state and the new inputs).

    Args:
        x: (T, C) float32, unit column stride (a column slice of a projection is fine).
        weight: (C, d_conv) float32, tap ``j`` of channel ``c`` at ``[c, j]`` (oldest first).
        bias: (C,) float32 or None.
        state: (d_conv - 1, C) float32, updated in place.
    Returns:
        (T, C) float32.
    """
    t, k = x.shape[0], weight.shape[1]
    u = torch.cat([state, x], 0)  # (K - 1 + T, C)
    y = u[0:t] * weight[:, 0]
    for j in range(1, k):  # taps summed oldest first, as ggml does
        y = y + u[j:j + t] * weight[:, j]
    if bias is not None:
        y = y + bias
    state.copy_(u[t:])
    return F.silu(y) if silu else y


def softplus(x: torch.Tensor) -> torch.Tensor:
    """log(1 + exp(x)), and x itself above 20 (ggml's ``ggml_compute_softplus_f32``)."""
    return F.softplus(x, beta=1.0, threshold=20.0)


def ssm_scan(x: torch.Tensor, dt: torch.Tensor, dt_bias: torch.Tensor, a: torch.Tensor,
             b: torch.Tensor, c: torch.Tensor, d: torch.Tensor | None,
             state: torch.Tensor, *, chunk: int = SSD_CHUNK) -> torch.Tensor:
    """Mamba2's selective scan with a scalar decay per head, continuing from ``state``.

    Per token t and head h (group g = h // (H / G), llama.cpp's ``repeat_interleave``)::

        dt'  = softplus(dt[t, h] + dt_bias[h])
        S_h  = exp(dt' * A[h]) * S_h + dt' * x[t, h, :] (outer) B[t, g, :]
        y[t, h, :] = S_h @ C[t, g, :] + D[h] * x[t, h, :]

    One token runs this recurrence; more run the chunked form (chunks of ``chunk`` tokens:
    within a chunk a masked decay matrix times the C.B scores, between chunks the state),
    the same sums in another order.

    Args:
        x: (T, H, P) float32; dt: (T, H) float32 (before ``dt_bias`` and softplus).
        dt_bias, a: (H,) float32 (A < 0 in trained models); d: (H,) float32 or None.
        b, c: (T, G, N) float32.
        state: (H, P, N) float32, updated in place.
    Returns:
        y (T, H, P) float32.
    """
    t, h = dt.shape
    g = b.shape[1]
    dts = softplus(dt + dt_bias)  # (T, H)
    bh = b.repeat_interleave(h // g, dim=1)  # (T, H, N)
    ch = c.repeat_interleave(h // g, dim=1)
    if t == 1:
        decay = torch.exp(dts[0] * a)  # (H,)
        xdt = x[0] * dts[0, :, None]  # (H, P)
        state.mul_(decay[:, None, None]).add_(xdt[:, :, None] * bh[0, :, None, :])
        y = torch.einsum("hpn,hn->hp", state, ch[0])[None]
    else:
        y = torch.empty_like(x)
        for s0 in range(0, t, chunk):
            s1 = min(t, s0 + chunk)
            y[s0:s1] = _ssd_chunk(x[s0:s1], dts[s0:s1], a, bh[s0:s1], ch[s0:s1], state)
    if d is not None:
        y = y + x * d[:, None]
    return y


def _ssd_chunk(x: torch.Tensor, dts: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               c: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """One chunk of :func:`ssm_scan` (L tokens, B and C already per head): returns y (L, H, P)
    without the D skip and advances ``state``. ``cs[t] = sum_{s<=t} dt'_s A`` is the log
    decay from the chunk's start; the decay from token s to token t >= s is
    ``exp(cs[t] - cs[s])`` (<= 1 for A < 0: no overflow)."""
    cs = torch.cumsum(dts * a, 0)  # (L, H)
    xdt = x * dts[:, :, None]  # (L, H, P)
    seg = cs.T[:, :, None] - cs.T[:, None, :]  # (H, L, L): cs[t] - cs[s]
    causal = torch.ones(seg.shape[1:], dtype=torch.bool, device=seg.device).tril()
    decay = torch.exp(seg.masked_fill(~causal, float("-inf")))  # (H, t, s)
    scores = torch.einsum("thn,shn->hts", c, b) * decay
    y = torch.einsum("hts,shp->thp", scores, xdt)
    y += torch.einsum("thn,hpn->thp", c, state) * torch.exp(cs)[:, :, None]
    to_end = torch.exp(cs[-1][None, :] - cs)  # (L, H): decay from each token to the end
    state.mul_(torch.exp(cs[-1])[:, None, None])
    state.add_(torch.einsum("sh,shp,shn->hpn", to_end, xdt, b))
    return y
