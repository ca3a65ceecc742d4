"""A CUDA-graph capture that fails, whatever the exception, falls back to the eager step.

No GPU here: CUDA's stream API is replaced by stand-ins that do nothing, so the capture's own
code runs up to the model's forward, which raises what Triton raises when a kernel cannot be
built (``OutOfResources``, ``CompilationError``: not RuntimeErrors).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from localllm.runtime import graphs

triton_errors = pytest.importorskip("triton.runtime.errors")


class Model:
    """A stand-in model: logits from the token; raises ``exc`` on its first ``fail`` calls."""

    def __init__(self, exc: BaseException | None, fail: int = 1) -> None:
        self.exc, self.fail, self.calls = exc, fail, 0

    def forward(self, token, pos, caches):
        self.calls += 1
        if self.exc is not None and self.calls <= self.fail:
            raise self.exc
        return torch.arange(5, dtype=torch.float32)[None, :] * (token + pos).float()


class Stream:
    def wait_stream(self, other) -> None:
        pass


@pytest.fixture
def fake_cuda_streams(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: Stream())


@pytest.mark.parametrize("exc", [
    triton_errors.OutOfResources(300000, 232448, "shared memory"),
    ValueError("a launcher refused its arguments"),
    RuntimeError("operation not permitted when stream is capturing"),
], ids=lambda e: type(e).__name__)  # fmt: skip
def test_failed_capture_decodes_eagerly(exc, fake_cuda_streams, capsys):
    model = Model(exc)
    g = graphs.DecodeGraph(model, [], torch.device("cpu"))
    g.capture = True  # as on CUDA
    logits = g.step(3, 4)
    assert model.calls == 2  # the warm-up forward that raised, then the eager step
    assert not g.captured and g.capture is False
    assert torch.equal(logits, torch.arange(5, dtype=torch.float32) * 7)
    err = capsys.readouterr().err
    assert err.startswith("notice: CUDA graph capture failed (") and err.count("\n") == 1
    # later steps run eagerly without trying again
    assert torch.equal(g.step(1, 1), torch.arange(5, dtype=torch.float32) * 2)
    assert capsys.readouterr().err == ""


def test_interrupt_during_capture_propagates(fake_cuda_streams):
    g = graphs.DecodeGraph(Model(KeyboardInterrupt()), [], torch.device("cpu"))
    g.capture = True
    with pytest.raises(KeyboardInterrupt):
        g.step(0, 0)
