"""Embeddings: a text's hidden states pooled into one vector (llama-server's
``/v1/embeddings``, llama.cpp's ``llama_get_embeddings_seq``).

The hidden state is the one the model's output projection reads (after the final norm), per
token, from a forward over the text in a fresh sequence; it is pooled as the GGUF's
``{arch}.pooling_type`` says (llama.cpp's ``LLAMA_POOLING_TYPE_*``: 1 mean, 2 CLS — the
first token —, 3 last), mean when the file says nothing (a generative model's files do not),
and L2-normalized, as llama-server's default ``embd_normalize`` (2).
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..errors import ContextOverflowError, LocalLLMError, ParameterError

if TYPE_CHECKING:
    from .core import LLM

POOLING_TYPES = {1: "mean", 2: "cls", 3: "last"}  # llama.cpp's enum values
POOLINGS = ("mean", "cls", "last")


def pooling_of(llm: LLM) -> str:
    """The model's pooling (its ``pooling_type`` key; mean when absent).

    Raises:
        LocalLLMError: the key names a pooling with no single vector (none, rank).
    """
    arch = llm.metadata.get("general.architecture", "")
    value = llm.metadata.get(f"{arch}.pooling_type")
    if value is None:
        return "mean"
    if value not in POOLING_TYPES:
        raise LocalLLMError(f"{arch}.pooling_type = {value!r} gives no sentence embedding "
                            "(serve with --pooling mean, cls or last)")
    return POOLING_TYPES[value]


class _Capture:
    """Stands in for the output projection during an embedding forward: keeps its input
    rows (the hidden states) and returns a one-column stand-in for the logits."""

    def __init__(self) -> None:
        self.rows: list[torch.Tensor] = []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.rows.append(x.detach().float().cpu())
        return x[..., :1]


def hidden_states(llm: LLM, ids: Sequence[int]) -> torch.Tensor:
    """float32 (len(ids), d_model) hidden states of ``ids`` in a fresh sequence (the caller
    holds the LLM's lock)."""
    from ..runtime.session import Session

    session = Session(llm.loaded, ctx_size=len(ids), batch_size=llm.batch_size,
                      static_decode=False)
    model = session.model
    capture = _Capture()
    original = model.output
    model.output = capture
    try:
        session.eval(ids, all_logits=True)
    finally:
        model.output = original
    return torch.cat(capture.rows)


def embed(llm: LLM, inputs: Sequence[str | Sequence[int]], *, pooling: str | None = None,
          normalize: bool = True, dimensions: int | None = None) -> tuple[list[np.ndarray], int]:
    """Embeddings of texts or token-id lists.

    Args:
        inputs: texts (tokenized with BOS, as llama-server does) or token ids.
        pooling: mean, cls or last (None: :func:`pooling_of`).
        normalize: L2-normalize each vector.
        dimensions: keep the first N values (then normalize), as OpenAI's ``dimensions``.
    Returns:
        (float32 vectors of d_model values (or ``dimensions``), prompt tokens in all).
    Raises:
        ParameterError: an empty input, a bad id, ``dimensions`` above d_model.
        ContextOverflowError: an input longer than the context.
    """
    pooling = pooling or pooling_of(llm)
    if pooling not in POOLINGS:
        raise ParameterError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
    encoded = []
    for i, item in enumerate(inputs):
        ids = llm.tokenize(item) if isinstance(item, str) else llm.check_ids(item)
        if not ids:
            raise ParameterError(f"input[{i}] is empty")
        if len(ids) > llm.ctx_size:
            raise ContextOverflowError(f"input[{i}] is {len(ids)} tokens; the context holds "
                                       f"{llm.ctx_size}")
        encoded.append(ids)
    out = []
    with llm._lock:
        for ids in encoded:
            h = hidden_states(llm, ids)
            v = h.mean(0) if pooling == "mean" else h[0] if pooling == "cls" else h[-1]
            if dimensions is not None:
                if dimensions > v.numel():
                    raise ParameterError(f"dimensions must be at most {v.numel()}, got "
                                         f"{dimensions}")
                v = v[:dimensions]
            if normalize:
                v = v / v.norm().clamp_min(1e-12)
            out.append(v.numpy().astype(np.float32))
    return out, sum(len(ids) for ids in encoded)


def encode_vector(v: np.ndarray, encoding_format: str) -> list[float] | str:
    """OpenAI's ``embedding`` value: a list of floats, or base64 of little-endian float32."""
    if encoding_format == "base64":
        return base64.b64encode(v.astype("<f4").tobytes()).decode("ascii")
    return v.tolist()


__all__ = ["POOLINGS", "embed", "encode_vector", "hidden_states", "pooling_of"]
