"""Peak memory of a CPU run (issue #17): prefill attention's score blocks, and the default
model's peak RSS over load + prefill + decode against a bound from its tensor bytes."""

from __future__ import annotations

import math

import pytest
import torch

from localllm.models import common
from localllm.models.cache import attention_mask


@pytest.mark.parametrize("n_kv,group,t,s", [(8, 4, 512, 512), (1, 4, 512, 512), (2, 2, 37, 4096),
                                            (1, 3, 2000, 3000), (4, 1, 1, 100)])
def test_score_blocks_cover_every_row_once_within_the_limit(n_kv, group, t, s):
    seen = torch.zeros(n_kv, group * t, dtype=torch.int32)
    for h0, h1, r0, r1 in common.score_blocks(n_kv, group, t, s):
        assert h0 < h1 and r0 < r1
        assert (h1 - h0) * (r1 - r0) * s * 4 <= max(common.ATTEND_CHUNK_BYTES, s * 4)
        # rows of several queries are whole queries (the mask is applied per query then)
        assert (r1 - r0) % t == 0 or r0 // t == (r1 - 1) // t
        seen[h0:h1, r0:r1] += 1
    assert bool((seen == 1).all())


def _naive_attention(q, keys, values, q_pos, k_pos, window, scale, softcap):
    """Each query head against its KV head, unblocked (the oracle)."""
    n_heads, t, hd = q.shape
    group = n_heads // keys.shape[0]
    mask = attention_mask(q_pos, keys.shape[1] if k_pos is None else k_pos, window)
    outs = []
    for h in range(n_heads):
        sc = q[h] @ keys[h // group].float().T * scale
        if softcap is not None:
            sc = softcap * torch.tanh(sc / softcap)
        sc = sc.masked_fill(~mask, float("-inf"))
        outs.append(torch.softmax(sc, -1) @ values[h // group].float())
    return torch.stack(outs, 1).reshape(t, n_heads * hd)


@pytest.mark.parametrize("chunk", [1 << 30, 4 * 24 * 64 * 4, 24 * 64 * 4, 10 * 64 * 4])
@pytest.mark.parametrize("softcap,window", [(None, None), (50.0, 9)])
def test_attend_in_blocks_matches_unblocked(monkeypatch, chunk, softcap, window):
    # 4 query heads over 2 KV heads, 24 new tokens after 40 cached: blocks of whole KV heads,
    # of whole queries, and of part of one query's rows.
    monkeypatch.setattr(common, "ATTEND_CHUNK_BYTES", chunk)
    g = torch.Generator().manual_seed(0)
    t, s, hd = 24, 64, 16
    q = torch.randn(4, t, hd, generator=g)
    keys, values = torch.randn(2, s, hd, generator=g), torch.randn(2, s, hd, generator=g)
    q_pos = torch.arange(40, 40 + t)
    k_pos = torch.arange(s)
    k_pos[60:] = -1  # empty slots
    want = _naive_attention(q, keys, values, q_pos, k_pos, window, 0.25, softcap)
    got = common.attend(q, keys, values, q_pos, k_pos, window=window, scale=0.25,
                        softcap=softcap)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert math.isfinite(float(got.abs().sum()))
