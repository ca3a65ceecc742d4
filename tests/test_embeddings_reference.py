"""Embeddings against llama.cpp's (issue #29): the default model's sentence embeddings, mean
and last-token pooled and L2-normalized, recorded by llama.cpp (``tests/data/embeddings/
record.py``, llama-cpp-python with ``embedding=True``). The two runtimes round differently
(llama.cpp's int8 activations and its own kernels, through 18 layers of a 4-bit model: the
two runtimes' last-position logits differ by up to about 1 on these texts, and the hidden
states as much as that implies), so vectors are compared by cosine similarity, by the largest
element difference and by the similarities between the texts; both sides tokenize alike."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from localllm.api.embeddings import embed

DATA = np.load(Path(__file__).parent / "data" / "embeddings" / "gemma3-270m-embed.npz")
TEXTS = [str(t) for t in DATA["texts"]]


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_default_model_embeddings_match_llama_cpp(llm, pooling):
    vectors, n_tokens = embed(llm, TEXTS, pooling=pooling)
    assert n_tokens == sum(len(DATA[f"ids_{i}"]) for i in range(len(TEXTS)))
    for i, (text, v) in enumerate(zip(TEXTS, vectors)):
        assert llm.tokenize(text) == DATA[f"ids_{i}"].tolist()
        ref = DATA[f"{pooling}_{i}"]
        assert v.shape == ref.shape and v.dtype == np.float32
        assert abs(np.linalg.norm(v) - 1.0) < 1e-5
        cos = float(v.astype(np.float64) @ ref.astype(np.float64))
        assert cos > 0.995, (i, cos)
        assert float(np.abs(v - ref).max()) < 0.06, (i, float(np.abs(v - ref).max()))
    # the texts are told apart as llama.cpp tells them apart: the same nearest neighbours
    ours = np.stack(vectors) @ np.stack(vectors).T
    theirs = np.stack([DATA[f"{pooling}_{i}"] for i in range(len(TEXTS))])
    theirs = theirs @ theirs.T
    np.testing.assert_allclose(ours, theirs, atol=0.03)
    np.fill_diagonal(ours, -1.0)
    np.fill_diagonal(theirs, -1.0)
    assert (ours.argmax(1) == theirs.argmax(1)).all()  # each text's nearest other text
