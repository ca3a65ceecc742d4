"""Opening GGUF files: validated header, metadata dict, memory-mapped tensor views.

The file is first checked by :func:`localllm.gguf.validate.validate_gguf`, a bounds-checked
parser of the header, metadata and tensor table (see the GGUF spec in llama.cpp's
``docs/gguf.md`` / ggml's ``gguf.cpp``), so that nothing else reads an unchecked count or
offset. Tensor data is then viewed through one read-only ``numpy.memmap`` of the file:
no tensor is copied until the runtime dequantizes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType

from ..errors import GGUFError
from .validate import validate_gguf


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file.

    Attributes:
        name: llama.cpp tensor name (``blk.0.attn_q.weight``).
        qtype: ggml type of the stored data.
        shape: logical shape in torch order (rows, cols): GGUF's ``ne`` reversed.
        data: uint8 view of the tensor's bytes inside the memory map (``n_bytes`` long).
    """

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray

    @property
    def n_bytes(self) -> int:
        return int(self.data.nbytes)

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape))


@dataclass
class GGUFFile:
    """A validated GGUF file: ``metadata`` (key -> value) and ``tensors`` (name -> info)."""

    path: Path
    version: int
    metadata: dict
    tensors: dict[str, TensorInfo]

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str) or not arch:
            raise GGUFError(f"{self.path.name}: general.architecture is missing")
        return arch

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFError(f"{self.path.name}: tensor {name!r} is missing") from None


def open_gguf(path: str | Path) -> GGUFFile:
    """Validate and memory-map a GGUF file.

    Raises:
        GGUFError: the file is missing, unreadable, malformed or truncated (one-line message
            naming the field).
    """
    path = Path(path)
    header = validate_gguf(path)
    try:
        mm = np.memmap(path, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as e:
        raise GGUFError(f"{path.name}: cannot map file: {e}") from None
    tensors = {}
    for t in header.tensors:
        shape = tuple(int(d) for d in reversed(t.ne))
        start = header.data_offset + t.offset
        tensors[t.name] = TensorInfo(
            t.name, GGMLQuantizationType(t.type), shape, mm[start : start + t.n_bytes]
        )
    return GGUFFile(path, header.version, header.metadata, tensors)
