"""Opening GGUF files: validated header, metadata dict, memory-mapped tensor views.

The file is first checked by :func:`localllm.gguf.validate.validate_gguf`, a bounds-checked
parser of the header, metadata and tensor table (see the GGUF spec in llama.cpp's
``docs/gguf.md`` / ggml's ``gguf.cpp``), so that nothing else reads an unchecked count or
offset. Tensor data is then viewed through one read-only ``numpy.memmap`` of the file:
no tensor is copied until the runtime dequantizes it.

A model split by llama.cpp's ``gguf-split`` (``NAME-00001-of-00003.gguf`` ...) opens from its
first part as one model: the metadata is the first part's, the tensors those of every part
(each part validated and mapped alike), as llama.cpp's loader does with the keys
``split.no``, ``split.count`` and ``split.tensors.count``.
"""

from __future__ import annotations

import re
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
    parts: tuple[Path, ...] = ()  # every file of a split model, the first one included

    @property
    def files(self) -> tuple[Path, ...]:
        """The files holding the model: ``parts``, or ``(path,)`` for an unsplit file."""
        return self.parts or (self.path,)

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
    """Validate and memory-map a GGUF file (every part of a split model, from its first).

    Raises:
        GGUFError: the file is missing, unreadable, malformed or truncated (one-line message
            naming the field); a split model's part is missing, misnamed, of another split,
            or the parts' tensors do not add up to ``split.tensors.count``.
    """
    path = Path(path)
    header = validate_gguf(path)
    count = header.metadata.get("split.count")
    if count is None:
        return GGUFFile(path, header.version, header.metadata, _map_tensors(path, header))
    parts = split_parts(path, header.metadata)
    tensors = _map_tensors(path, header)
    for i, part in enumerate(parts[1:], start=1):
        part_header = validate_gguf(part)
        md = part_header.metadata
        if md.get("split.no") != i or md.get("split.count") != len(parts):
            raise GGUFError(f"{part.name}: split.no / split.count are {md.get('split.no')!r} / "
                            f"{md.get('split.count')!r}, expected {i} / {len(parts)}")
        for name, info in _map_tensors(part, part_header).items():
            if name in tensors:
                raise GGUFError(f"{part.name}: tensor {name!r} is also in an earlier part")
            tensors[name] = info
    expected = header.metadata.get("split.tensors.count")
    if expected is not None and expected != len(tensors):
        raise GGUFError(f"{path.name}: the {len(parts)} parts hold {len(tensors)} tensors, "
                        f"split.tensors.count says {expected}")
    return GGUFFile(path, header.version, header.metadata, tensors, tuple(parts))


# llama.cpp's split file names (llama_split_path: "%s-%05d-of-%05d.gguf").
SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>[0-9]{5})-of-(?P<count>[0-9]{5})\.gguf$",
                        re.IGNORECASE)
MAX_SPLITS = 9999  # five digits in the name, u16 in split.count


def split_parts(first: Path, metadata: dict) -> list[Path]:
    """The files of the split model whose first part is ``first`` (with ``metadata``), in
    order, named as llama.cpp's ``gguf-split`` names them.

    Raises:
        GGUFError: ``first`` is not part 1, is not named ``PREFIX-00001-of-0000N.gguf``, its
            split keys are malformed, or a part is missing.
    """
    count, no = metadata.get("split.count"), metadata.get("split.no", 0)
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_SPLITS:
        raise GGUFError(f"{first.name}: split.count must be 1..{MAX_SPLITS}, got {count!r}")
    if isinstance(no, bool) or not isinstance(no, int) or not 0 <= no < count:
        raise GGUFError(f"{first.name}: split.no must be 0..{count - 1}, got {no!r}")
    m = SPLIT_NAME.match(first.name)
    if no != 0:
        hint = (f" ({m.group('prefix')}-00001-of-{count:05d}.gguf)" if m else "")
        raise GGUFError(f"{first.name} is part {no + 1} of {count} of a split model: "
                        f"open its first part{hint}")
    if count == 1:
        return [first]
    if m is None or int(m.group("no")) != 1 or int(m.group("count")) != count:
        raise GGUFError(f"{first.name}: the first part of a model split in {count} must be "
                        f"named PREFIX-00001-of-{count:05d}.gguf")
    parts = [first.with_name(f"{m.group('prefix')}-{i:05d}-of-{count:05d}.gguf")
             for i in range(1, count + 1)]
    missing = [p.name for p in parts[1:] if not p.exists()]
    if missing:
        raise GGUFError(f"{first.name}: split model part {missing[0]} is missing"
                        + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    return parts


def _map_tensors(path: Path, header) -> dict[str, TensorInfo]:
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
    return tensors
