"""Attention sinks (gpt-oss; llama.cpp's ``ggml_soft_max_add_sinks``) in the torch attention
(``attend``) and the SDPA prefill (``prefill_attention``), against the definition written
out: the sink is one more logit per query head in the softmax, whose value is zero. The
native decode kernel is checked against ``attend`` in tests/test_cpu_ops.py."""

from __future__ import annotations

import pytest
import torch

from localllm.backends.dense import attend, prefill_attention


def reference(q, keys, values, q_pos, k_pos, sinks, window, scale):
    """Per query head h (KV head h // group): softmax over [scores of the visible keys,
    sinks[h]], the sink's weight dropped; float64."""
    n_heads, t, hd = q.shape
    group = n_heads // keys.shape[0]
    out = torch.zeros(t, n_heads, hd, dtype=torch.float64)
    for h in range(n_heads):
        k, v = keys[h // group].double(), values[h // group].double()
        for i in range(t):
            visible = k_pos <= q_pos[i]
            if window is not None:
                visible &= q_pos[i] - k_pos < window
            s = (k[visible] @ q[h, i].double()) * scale
            p = torch.softmax(torch.cat([s, sinks[h:h + 1].double()]), 0)[:-1]
            out[i, h] = p @ v[visible]
    return out.reshape(t, n_heads * hd)


@pytest.mark.parametrize("n_heads,n_kv,t,s,window", [
    (4, 2, 5, 9, None),   # GQA, a prompt after a cached prefix
    (8, 2, 7, 7, 3),      # a window shorter than the prompt (gpt-oss's sliding layers)
    (2, 2, 1, 6, None),   # one decode token
    (4, 1, 3, 3, None),   # the first position sees only itself: the sink still takes a share
])
def test_sinks_match_definition(n_heads, n_kv, t, s, window):
    g = torch.Generator().manual_seed(n_heads * 100 + t)
    hd = 16
    q = torch.randn(n_heads, t, hd, generator=g)
    keys = torch.randn(n_kv, s, hd, generator=g)
    values = torch.randn(n_kv, s, hd, generator=g)
    sinks = torch.randn(n_heads, generator=g) * 2
    k_pos = torch.arange(s)
    q_pos = torch.arange(s - t, s)
    ref = reference(q, keys, values, q_pos, k_pos, sinks, window, 0.25).float()
    got = attend(q, keys, values, q_pos, k_pos, window=window, scale=0.25, sinks=sinks)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    pre = prefill_attention(q, keys, values, q_pos, k_pos, window=window, scale=0.25,
                            sinks=sinks)
    torch.testing.assert_close(pre, ref, rtol=1e-5, atol=1e-5)
    # without sinks the rows sum to one: the sinks must have changed the result
    plain = attend(q, keys, values, q_pos, k_pos, window=window, scale=0.25)
    assert not torch.allclose(plain, got, atol=1e-3)


def test_very_negative_sink_is_plain_softmax():
    g = torch.Generator().manual_seed(1)
    q, keys, values = (torch.randn(2, 4, 8, generator=g), torch.randn(2, 4, 8, generator=g),
                       torch.randn(2, 4, 8, generator=g))
    pos = torch.arange(4)
    got = attend(q, keys, values, pos, pos, window=None, scale=0.3,
                 sinks=torch.full((2,), -1e4))
    torch.testing.assert_close(got, attend(q, keys, values, pos, pos, window=None, scale=0.3))
