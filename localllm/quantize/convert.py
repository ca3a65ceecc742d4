"""``localllm quantize IN.gguf OUT.gguf --type TYPE``: a GGUF file to a quantized GGUF file.

Like llama.cpp's ``llama-quantize`` (``src/llama-quant.cpp``): metadata is copied,
``general.file_type`` and ``general.quantization_version`` are set, each tensor gets the type of
the file type's recipe (:mod:`.recipe`) and is quantized with :mod:`.blocks`. Tensors are
quantized and written one at a time (the header is written first, from the planned types and
sizes), into a temporary file in the output's directory that replaces OUT only when complete;
any failure or Ctrl-C removes it.
"""

from __future__ import annotations

import contextlib
import os
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFEndian, GGUFValueType, GGUFWriter

from ..atomic import atomic_output
from ..errors import LocalLLMError, ParameterError
from .blocks import dequantize_rows, quantize_rows, row_bytes
from .recipe import FILE_TYPES, FLOAT_TYPES, parse_file_type, plan

Q = GGMLQuantizationType
QUANTIZATION_VERSION = 2  # GGML_QNT_VERSION
_SKIP_KEYS = ("general.architecture", "general.file_type", "general.quantization_version",
              "general.alignment", "split.no", "split.count", "split.tensors.count")


@dataclass
class QuantizeReport:
    """What :func:`quantize_gguf` did: sizes in bytes, element count, seconds, per-tensor types."""

    in_bytes: int
    out_bytes: int
    n_elements: int
    seconds: float
    types: dict[str, GGMLQuantizationType]

    @property
    def bpw(self) -> float:
        """Bits per weight of the output's tensor data."""
        return 8.0 * self.out_bytes / max(self.n_elements, 1)


_ARRAY_DTYPES = {
    GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1", GGUFValueType.UINT16: "<u2",
    GGUFValueType.INT16: "<i2", GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4",
    GGUFValueType.FLOAT32: "<f4", GGUFValueType.BOOL: "<u1", GGUFValueType.UINT64: "<u8",
    GGUFValueType.INT64: "<i8", GGUFValueType.FLOAT64: "<f8",
}


class _Writer(GGUFWriter):
    """GGUFWriter with a fast path for flat arrays: gguf packs them value by value, which
    takes seconds for a 262k-token vocabulary; here they are packed with numpy / one join."""

    def _pack_val(self, val, vtype, add_vtype, sub_type=None) -> bytes:
        if (vtype != GGUFValueType.ARRAY or sub_type is None or not len(val)
                or self.endianess != GGUFEndian.LITTLE):
            return super()._pack_val(val, vtype, add_vtype, sub_type)
        head = struct.pack("<IQ", int(sub_type), len(val))
        if add_vtype:
            head = struct.pack("<I", int(vtype)) + head
        if sub_type == GGUFValueType.STRING:
            enc = [v.encode("utf-8") if isinstance(v, str) else bytes(v) for v in val]
            lens = np.array([len(e) for e in enc], dtype="<u8")
            parts = [None] * (2 * len(enc))
            parts[0::2] = [b.tobytes() for b in lens.reshape(-1, 1)]
            parts[1::2] = enc
            return head + b"".join(parts)
        if sub_type in _ARRAY_DTYPES:
            return head + np.asarray(val, dtype=_ARRAY_DTYPES[sub_type]).tobytes()
        return super()._pack_val(val, vtype, add_vtype, sub_type)


def _copy_metadata(header, writer: GGUFWriter) -> None:
    """All key/values of the validated header, with their original GGUF value types."""
    for key, value in header.metadata.items():
        if key in _SKIP_KEYS:
            continue
        vtype, sub = header.value_types[key]
        writer.add_key_value(key, value, GGUFValueType(vtype),
                             GGUFValueType(sub) if sub is not None else None)


def quantize_gguf(src: str | Path, dst: str | Path, ftype: str, *,
                  allow_requantize: bool = False,
                  progress: Callable[[str, int, int], None] | None = None) -> QuantizeReport:
    """Quantize the GGUF file ``src`` to ``dst`` with file type ``ftype`` (``"Q4_K_M"`` ...).

    ``progress(name, i, n)`` is called before each tensor. Returns a :class:`QuantizeReport`.

    Raises:
        ParameterError: unknown type; dst is src; src already quantized without
            ``allow_requantize``.
        GGUFError: src missing, unreadable or malformed (from the validator).
        LocalLLMError: dst cannot be written (nothing is left behind).
    """
    from ..gguf.file import open_gguf
    from ..gguf.validate import validate_gguf

    ftype = parse_file_type(ftype)
    src, dst = Path(src), Path(dst)
    if src.resolve() == dst.resolve() or (dst.exists() and src.exists()
                                          and os.path.samefile(src, dst)):
        raise ParameterError(f"{dst}: the output path is the input file; choose another path")
    header = validate_gguf(src)  # raises GGUFError naming the problem
    gf = open_gguf(src)
    infos = list(gf.tensors.values())
    types = plan([(t.name, t.shape, t.qtype) for t in infos], gf.metadata, ftype)
    if not allow_requantize:
        for t in infos:
            if t.qtype not in FLOAT_TYPES and types[t.name] != t.qtype:
                raise ParameterError(
                    f"{src}: tensor {t.name} is already quantized ({t.qtype.name}); "
                    "pass --allow-requantize to requantize it (quality will be lower)")
    if not dst.parent.is_dir():
        raise LocalLLMError(f"{dst}: the directory {dst.parent} does not exist")

    t0 = time.perf_counter()
    out_bytes = 0
    with atomic_output(dst) as tmp:
        writer = _Writer(tmp, gf.architecture)
        try:
            _copy_metadata(header, writer)
            if "general.alignment" in header.metadata:  # the writer pads tensor data to it
                writer.add_custom_alignment(int(header.metadata["general.alignment"]))
            writer.add_file_type(int(FILE_TYPES[ftype][0]))
            writer.add_quantization_version(QUANTIZATION_VERSION)
            for t in infos:
                new = types[t.name]
                n_rows = t.n_elements // t.shape[-1]
                nbytes = row_bytes(new, t.shape[-1]) * n_rows
                byte_shape = (*t.shape[:-1], nbytes // n_rows)
                writer.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), nbytes,
                                       raw_dtype=new)
                out_bytes += nbytes
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            for i, t in enumerate(infos):
                if progress is not None:
                    progress(t.name, i, len(infos))
                new = types[t.name]
                if new == t.qtype:
                    data = np.asarray(t.data)
                else:
                    x = dequantize_rows(t.data, t.qtype, t.shape).reshape(-1, t.shape[-1])
                    data = quantize_rows(x, new)
                writer.write_tensor_data(np.ascontiguousarray(data).view(np.uint8).reshape(-1))
        finally:
            with contextlib.suppress(Exception):  # release the handle before the file goes
                writer.close()
    in_bytes = sum(t.n_bytes for t in infos)
    return QuantizeReport(in_bytes, out_bytes, sum(t.n_elements for t in infos),
                          time.perf_counter() - t0, types)

