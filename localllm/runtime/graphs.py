"""Decode steps with static shapes, replayed as a CUDA graph.

A decode step of a small model is a few hundred short kernels; launched one by one from
Python, launch overhead dominates the GPU time (llama.cpp's CUDA backend captures its decode
graph for the same reason). :class:`DecodeGraph` runs the model's one-token forward with the
token and its position held in device tensors (``Model.forward`` with a tensor ``pos``), so
every step has the same shapes and buffer addresses and reads nothing back to the host: the
KV caches write through ``index_copy_`` at device-computed slots and mask by position (see
:mod:`localllm.memory.kv`). That step is captured once with ``torch.cuda.graph`` and then
replayed, one launch per token.

On the CPU there is nothing to capture: the same static step runs eagerly, which is how the
tests check it against the ordinary forward.

``LOCALLLM_CUDA_GRAPHS=0`` turns capture off (as ``GGML_CUDA_DISABLE_GRAPHS`` does in
llama.cpp); a capture that fails with any exception (torch refusing an op during capture,
Triton failing to compile or launch a kernel) falls back to the eager step with a one-line
notice; KeyboardInterrupt and other BaseExceptions still propagate.
"""

from __future__ import annotations

import os
import sys

import torch

GRAPHS_ENV = "LOCALLLM_CUDA_GRAPHS"


def graphs_enabled(device: torch.device) -> bool:
    """Whether decode steps on ``device`` are captured (CUDA, unless the environment says 0)."""
    return device.type == "cuda" and os.environ.get(GRAPHS_ENV, "1") != "0"


class DecodeGraph:
    """One-token forward of ``model`` over ``memory`` with static shapes.

    Args:
        model: an architecture's ``Model`` (``forward(tokens, pos, memory)``).
        memory: the session's :class:`~localllm.memory.Memory`; its tensors are captured by
            address, so they must be preallocated and never replaced (every kind is).
        device: where the model runs; CUDA graphs are used when :func:`graphs_enabled`.
    """

    def __init__(self, model, memory, device: torch.device) -> None:
        self.model, self.memory = model, memory
        self.token = torch.zeros(1, dtype=torch.long, device=device)
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        self.capture = graphs_enabled(device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None  # the graph's output buffer (1, n_vocab)

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def step(self, token: int, pos: int) -> torch.Tensor:
        """Run ``token`` at position ``pos``; returns its next-token logits (n_vocab,) float32.

        The caller records the memory's new length (``set_length(pos + 1)``). With a graph the
        result is a copy: the graph's output buffer is overwritten by the next step.
        """
        # fill_ with a Python scalar is a kernel launch, not a host-to-device copy.
        self.token.fill_(token)
        self.pos.fill_(pos)
        if self.capture and self.graph is None:
            self._capture()
        if self.graph is None:
            return self._forward()[-1]
        self.graph.replay()
        return self.logits[-1].clone()

    def _forward(self) -> torch.Tensor:
        return self.model.forward(self.token, self.pos, self.memory)

    def _capture(self) -> None:
        """Warm up on a side stream (compiles the Triton kernels, fills the allocator's pool),
        then capture one step. Warm-up writes the same keys and values at the same position
        as the step itself, so it changes nothing in a KV cache; a recurrent state, which
        every step folds into, is put back as it was before (``rewritten``)."""
        try:
            saved = [(t, t.clone()) for m in self.memory for t in m.rewritten()]
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._forward()
            torch.cuda.current_stream().wait_stream(stream)
            for t, copy in saved:
                t.copy_(copy)
            del saved
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.logits = self._forward()
            self.graph = graph
        except Exception as e:  # noqa: BLE001 - any failure (torch's RuntimeError, Triton's
            # CompilationError / OutOfResources, ...) means: decode without graphs
            self.capture, self.graph, self.logits = False, None, None
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            print(f"notice: CUDA graph capture failed ({first}); decoding without graphs",
                  file=sys.stderr)
