"""Bounds-checked GGUF header parser: the first and only reader of an untrusted file's header.

A GGUF file (format: ggml's ``docs/gguf.md``; reference reader: ggml's ``src/gguf.cpp``) is

    magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv x (string key | u32 value type | value)
    n_tensors x (string name | u32 n_dims | n_dims x u64 ne | u32 ggml type | u64 offset)
    padding to ``general.alignment`` (default 32) | tensor data

where a string is ``u64 length | bytes`` and an array value is ``u32 element type | u64 count |
elements``. Every count and length read here is checked against the bytes actually left in the
file *before* anything is allocated for it, so a crafted header cannot make us allocate or read
more than the file holds. :func:`validate_gguf` runs before any other loader (``gguf_file``,
``gguf.GGUFReader``) sees the file; what it accepts is a well-formed little-endian GGUF v2/v3
file whose tensors lie inside the file, aligned and without overlap.

Rules follow llama.cpp's reader where it has one (nested arrays, 64-byte tensor names, at most
4 dimensions, element-count overflow, power-of-two u32 alignment) and are stricter where a
malformed value could only be a corrupt file (empty keys, zero-sized dimensions). Metadata
arrays hold at most :data:`MAX_ARRAY_ELEMENTS` elements in all and the tensor table at most
:data:`MAX_TENSORS` entries, so that the Python objects they become stay bounded however large
the file is.
"""

from __future__ import annotations

import itertools
import mmap
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

from ..errors import GGUFError
from .quants import BLOCK_FORMATS

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME_BYTES = 64  # GGML_MAX_NAME: names must be shorter (they are NUL-terminated in C)
INT64_MAX = 2**63 - 1
# Metadata arrays become Python lists, which cost up to ~40 bytes per element (an int8 array is
# 1 byte per element in the file): without a cap a crafted 1 GB file would need ~40 GB of RAM.
# Real models hold ~1-2M elements in all (a 262k-token vocab: tokens, scores, token types, plus
# up to ~500k merges), so 2**24 in all arrays together leaves a wide margin and bounds the
# lists to well under 1 GB.
MAX_ARRAY_ELEMENTS = 2**24
# Each tensor info becomes ~400 bytes of Python objects from ~40 bytes of file (llama.cpp's
# ggml_tensor costs as much). The largest real models have tens of thousands of tensors (MoE
# files with one tensor per expert); 2**20 bounds the table to a few hundred MB.
MAX_TENSORS = 2**20

# GGUF metadata value types (gguf_type) -> (name, struct code, size) for the fixed-size ones.
_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32, _BOOL = range(8)
_STRING, _ARRAY, _UINT64, _INT64, _FLOAT64 = range(8, 13)
_SCALARS: dict[int, tuple[str, str, int]] = {
    _UINT8: ("uint8", "<B", 1),
    _INT8: ("int8", "<b", 1),
    _UINT16: ("uint16", "<H", 2),
    _INT16: ("int16", "<h", 2),
    _UINT32: ("uint32", "<I", 4),
    _INT32: ("int32", "<i", 4),
    _FLOAT32: ("float32", "<f", 4),
    _BOOL: ("bool", "<B", 1),
    _UINT64: ("uint64", "<Q", 8),
    _INT64: ("int64", "<q", 8),
    _FLOAT64: ("float64", "<d", 8),
}
_STRUCTS = {code: struct.Struct(code) for _, code, _ in _SCALARS.values()}
TYPE_NAMES = {t: spec[0] for t, spec in _SCALARS.items()} | {_STRING: "string", _ARRAY: "array"}
_NP_DTYPES = {
    _UINT8: "<u1",
    _INT8: "<i1",
    _UINT16: "<u2",
    _INT16: "<i2",
    _UINT32: "<u4",
    _INT32: "<i4",
    _FLOAT32: "<f4",
    _BOOL: "<u1",
    _UINT64: "<u8",
    _INT64: "<i8",
    _FLOAT64: "<f8",
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")
_HEADER = struct.Struct("<4sIQQ")

# Smallest possible encodings, used to bound counts by the bytes left: a key/value pair is at
# least a 1-byte key (8 + 1), a type (4) and a 1-byte value; a tensor info at least a 1-byte
# name (8 + 1), n_dims (4), one dimension (8), a type (4) and an offset (8).
_MIN_KV_BYTES = 8 + 1 + 4 + 1
_MIN_TENSOR_INFO_BYTES = 8 + 1 + 4 + 8 + 4 + 8


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One entry of the tensor-info table.

    Attributes:
        name: tensor name (``blk.0.attn_q.weight``), under 64 bytes.
        ne: GGUF dimension order, fastest-varying first (``ne[0]`` is the row length).
        type: ggml type id (a :class:`gguf.GGMLQuantizationType` value).
        offset: byte offset of the data, relative to :attr:`GGUFHeader.data_offset`.
        n_bytes: size of the data in bytes (``prod(ne) / block_size * type_size``).
    """

    name: str
    ne: tuple[int, ...]
    type: int
    offset: int
    n_bytes: int


@dataclass
class GGUFHeader:
    """Everything before the tensor data of a validated GGUF file.

    Attributes:
        version: GGUF version (2 or 3).
        metadata: key -> Python value (int, float, bool, str; arrays as lists).
        value_types: key -> (gguf value type, element type for arrays else None).
        tensors: tensor infos in file order.
        data_offset: absolute file offset where tensor data starts (aligned).
        alignment: ``general.alignment`` or 32.
        file_size: size of the file in bytes.
        tensor_index: tensor name -> its index in ``tensors``.
    """

    version: int
    metadata: dict[str, Any]
    value_types: dict[str, tuple[int, int | None]]
    tensors: list[GGUFTensorInfo]
    data_offset: int
    alignment: int
    file_size: int
    tensor_index: dict[str, int] = field(default_factory=dict)


def _short(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to about ``limit`` characters: a crafted key, name or value can be
    megabytes long, and error messages must stay one readable line."""
    if isinstance(value, (str, bytes)) and len(value) > limit:
        return repr(value[:limit]) + f"... ({len(value)} long)"
    if isinstance(value, list) and len(value) > 4:
        return f"a list of {len(value)} items"
    text = repr(value)
    return text if len(text) <= limit + 20 else text[:limit] + "..."


class _Reader:
    """Cursor over the file bytes; every read checks it stays inside the file."""

    __slots__ = ("array_budget", "buf", "name", "pos", "size")

    def __init__(self, buf: Any, size: int, name: str) -> None:
        self.buf, self.size, self.pos, self.name = buf, size, 0, name
        self.array_budget = MAX_ARRAY_ELEMENTS  # elements left for all metadata arrays

    def left(self) -> int:
        return self.size - self.pos

    def fail(self, where: str, what: str) -> GGUFError:
        return GGUFError(f"{self.name}: {where}: {what}")

    def need(self, n: int, where: str, what: str) -> None:
        if n > self.size - self.pos:
            raise self.fail(
                where,
                f"{what} ({n} bytes) runs past the end of the file "
                f"(at byte {self.pos}, {self.size - self.pos} bytes left; truncated file?)",
            )

    def number(self, fmt: struct.Struct, where: str, what: str) -> Any:
        """The one value of ``fmt`` at the position, which moves past it."""
        self.need(fmt.size, where, what)
        (v,) = fmt.unpack_from(self.buf, self.pos)
        self.pos += fmt.size
        return v

    def u32(self, where: str, what: str) -> int:
        return self.number(_U32, where, what)

    def u64(self, where: str, what: str) -> int:
        return self.number(_U64, where, what)

    def i64(self, where: str, what: str) -> int:
        return self.number(_I64, where, what)

    def raw_string(self, where: str, what: str) -> bytes:
        n = self.u64(where, f"{what} length")
        if n > self.size - self.pos:
            raise self.fail(
                where,
                f"{what} length {n} runs past the end of the file "
                f"(at byte {self.pos - 8}, {self.size - self.pos} bytes left)",
            )
        start = self.pos
        self.pos += n
        return bytes(self.buf[start : self.pos])

    def string(self, where: str, what: str) -> str:
        start = self.pos
        raw = self.raw_string(where, what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(
                where, f"{what} at byte {start} is not valid UTF-8 ({e.reason})"
            ) from None


def _value_type(r: _Reader, where: str, what: str) -> int:
    at = r.pos
    t = r.u32(where, what)
    if t not in TYPE_NAMES:
        raise r.fail(where, f"unknown {what} {t} at byte {at} (valid: 0..12)")
    return t


def _read_scalar(r: _Reader, t: int, where: str) -> Any:
    name, code, _ = _SCALARS[t]
    v = r.number(_STRUCTS[code], where, f"{name} value")
    return bool(v) if t == _BOOL else v


def _read_string_array(r: _Reader, count: int, where: str) -> list[str]:
    # Each element's offset depends on every previous length, so this walk is sequential;
    # it is kept to one unpack, one slice and one decode per element (the 262k-token vocab of
    # the default model takes ~0.1 s). The count was already bounded by count * 8 <= bytes left.
    buf, size, pos = r.buf, r.size, r.pos
    unpack = _U64.unpack_from
    out: list[str] = []
    append = out.append
    for i in range(count):
        if size - pos < 8:
            r.pos = pos
            raise r.fail(
                where, f"element #{i} length runs past the end of the file (at byte {pos})"
            )
        (n,) = unpack(buf, pos)
        pos += 8
        if n > size - pos:
            raise r.fail(
                where,
                f"element #{i} string length {n} runs past the end of the file "
                f"(at byte {pos - 8}, {size - pos} bytes left)",
            )
        try:
            append(buf[pos : pos + n].decode("utf-8"))
        except UnicodeDecodeError as e:
            raise r.fail(
                where, f"element #{i} at byte {pos} is not valid UTF-8 ({e.reason})"
            ) from None
        pos += n
    r.pos = pos
    return out


def _read_array(r: _Reader, where: str) -> tuple[list, int]:
    elem = _value_type(r, where, "array element type")
    if elem == _ARRAY:
        # llama.cpp's gguf.cpp refuses arrays of arrays; so do we.
        raise r.fail(where, "nested arrays (array of arrays) are not allowed")
    count_at = r.pos
    count = r.u64(where, "array count")
    min_size = 8 if elem == _STRING else _SCALARS[elem][2]
    if count > r.left() // min_size:
        raise r.fail(
            where,
            f"array count {count} at byte {count_at} needs at least {count * min_size} bytes, "
            f"only {r.left()} left in the file",
        )
    if count > r.array_budget:
        raise r.fail(
            where,
            f"array count {count} at byte {count_at} exceeds the limit of {MAX_ARRAY_ELEMENTS} "
            "elements in all metadata arrays together",
        )
    r.array_budget -= count
    if elem == _STRING:
        return _read_string_array(r, count, where), elem
    n_bytes = count * min_size
    values = np.frombuffer(r.buf[r.pos : r.pos + n_bytes], dtype=_NP_DTYPES[elem]).tolist()
    r.pos += n_bytes
    if elem == _BOOL:
        values = [bool(v) for v in values]
    return values, elem


def _read_header(r: _Reader) -> tuple[int, int, int]:
    if r.size < 4 or bytes(r.buf[0:4]) != GGUF_MAGIC:
        got = bytes(r.buf[0 : min(4, r.size)])
        raise r.fail("header", f"not a GGUF file (magic {got!r}, expected b'GGUF')")
    if r.size < _HEADER.size:
        raise r.fail("header", f"file is {r.size} bytes, shorter than the 24-byte GGUF header")
    _, version, n_tensors, n_kv = _HEADER.unpack_from(r.buf, 0)
    if version not in SUPPORTED_VERSIONS:
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        if swapped in (1, 2, 3):
            raise r.fail(
                "header",
                f"byte-swapped header: this is a big-endian GGUF file (version {swapped}); "
                "only little-endian files are supported",
            )
        if version == 1:
            raise r.fail("header", "GGUF version 1 is obsolete and not supported (need 2 or 3)")
        raise r.fail("header", f"unsupported GGUF version {version} (need 2 or 3)")
    r.pos = _HEADER.size
    return version, n_tensors, n_kv


def _read_metadata(r: _Reader, n_kv: int):
    if n_kv > r.left() // _MIN_KV_BYTES:
        raise r.fail(
            "header",
            f"metadata count {n_kv} cannot fit in the {r.left()} bytes after the header "
            f"(each key/value takes at least {_MIN_KV_BYTES} bytes)",
        )
    metadata: dict[str, Any] = {}
    types: dict[str, tuple[int, int | None]] = {}
    for i in range(n_kv):
        where = f"metadata key #{i}"
        key_at = r.pos
        key = r.string(where, "key")
        if not key:
            raise r.fail(where, f"empty key at byte {key_at}")
        where = f"metadata key #{i} {_short(key)}"
        if key in metadata:
            raise r.fail(where, "duplicate key")
        t = _value_type(r, where, "value type")
        elem = None
        if t == _STRING:
            value: Any = r.string(where, "string value")
        elif t == _ARRAY:
            value, elem = _read_array(r, where)
        else:
            value = _read_scalar(r, t, where)
        metadata[key] = value
        types[key] = (t, elem)
    return metadata, types


def _alignment(r: _Reader, metadata: dict, types: dict) -> int:
    if "general.alignment" not in metadata:
        return DEFAULT_ALIGNMENT
    index = list(metadata).index("general.alignment")
    where = f"metadata key #{index} 'general.alignment'"
    t, _ = types["general.alignment"]
    if t != _UINT32:
        raise r.fail(where, f"must be a uint32, got {TYPE_NAMES[t]}")
    a = metadata["general.alignment"]
    if a == 0 or a & (a - 1):
        raise r.fail(where, f"must be a power of two, got {a}")
    return a


def _read_tensor_info(r: _Reader, i: int, seen: dict[str, int]) -> GGUFTensorInfo:
    where = f"tensor #{i}"
    name_at = r.pos
    name = r.string(where, "name")
    if not name:
        raise r.fail(where, f"empty tensor name at byte {name_at}")
    nbytes_name = len(name.encode("utf-8"))
    where = f"tensor #{i} {_short(name)}"
    if nbytes_name >= MAX_NAME_BYTES:
        raise r.fail(where, f"name is {nbytes_name} bytes, must be under {MAX_NAME_BYTES}")
    if name in seen:
        raise r.fail(where, f"duplicate tensor name (also tensor #{seen[name]})")
    n_dims = r.u32(where, "n_dims")
    if not 1 <= n_dims <= MAX_DIMS:
        raise r.fail(where, f"n_dims must be 1..{MAX_DIMS}, got {n_dims}")
    ne = []
    n_elements = 1
    for d in range(n_dims):
        v = r.i64(where, f"ne[{d}]")
        if v <= 0:
            raise r.fail(where, f"dimension ne[{d}] must be positive, got {v}")
        n_elements *= v
        if n_elements > INT64_MAX:
            raise r.fail(where, f"element count overflows int64 at ne[{d}] = {v}")
        ne.append(v)
    type_at = r.pos
    ttype = r.u32(where, "type")
    try:
        qtype = GGMLQuantizationType(ttype)
        fmt = BLOCK_FORMATS[qtype]
        block, type_size = fmt.block_size, fmt.type_size
    except (ValueError, KeyError):
        raise r.fail(where, f"unknown tensor type {ttype} at byte {type_at}") from None
    if ne[0] % block:
        raise r.fail(
            where,
            f"row length ne[0] = {ne[0]} is not a multiple of {qtype.name}'s block size {block}",
        )
    offset = r.u64(where, "offset")
    seen[name] = i
    return GGUFTensorInfo(name, tuple(ne), ttype, offset, n_elements // block * type_size)


def _check_layout(r: _Reader, tensors: list[GGUFTensorInfo], data_offset: int, align: int) -> None:
    for i, t in enumerate(tensors):
        where = f"tensor #{i} {t.name!r}"
        if t.offset % align:
            raise r.fail(where, f"offset {t.offset} is not a multiple of the alignment {align}")
        end = data_offset + t.offset + t.n_bytes
        if end > r.size:
            raise r.fail(
                where,
                f"data [{data_offset + t.offset}, {end}) runs past the end of the file "
                f"({r.size} bytes; truncated file?)",
            )
    order = sorted(range(len(tensors)), key=lambda k: tensors[k].offset)
    for a, b in itertools.pairwise(order):
        ta, tb = tensors[a], tensors[b]
        if ta.offset + ta.n_bytes > tb.offset:
            raise r.fail(
                f"tensor #{b} {tb.name!r}",
                f"data at offset {tb.offset} overlaps tensor #{a} {ta.name!r} "
                f"[{ta.offset}, {ta.offset + ta.n_bytes})",
            )


def parse_gguf(buf: Any, size: int, name: str = "<bytes>") -> GGUFHeader:
    """Parse and validate the header, metadata and tensor table held in ``buf``.

    Args:
        buf: the file's bytes as ``bytes`` or ``mmap`` (slices must give ``bytes``); only the
            header region is read, never the tensor data.
        size: number of valid bytes in ``buf`` (the file size).
        name: file name used as the prefix of error messages.

    Raises:
        GGUFError: the first problem found, as ``"<name>: <field and where>: <what>"``.
    """
    r = _Reader(buf, size, name)
    version, n_tensors, n_kv = _read_header(r)
    metadata, types = _read_metadata(r, n_kv)
    align = _alignment(r, metadata, types)
    if n_tensors > r.left() // _MIN_TENSOR_INFO_BYTES:
        raise r.fail(
            "header",
            f"tensor count {n_tensors} cannot fit in the {r.left()} bytes after the metadata "
            f"(each tensor info takes at least {_MIN_TENSOR_INFO_BYTES} bytes)",
        )
    if n_tensors > MAX_TENSORS:
        raise r.fail("header", f"tensor count {n_tensors} exceeds the limit of {MAX_TENSORS}")
    seen: dict[str, int] = {}
    tensors = [_read_tensor_info(r, i, seen) for i in range(n_tensors)]
    data_offset = -(-r.pos // align) * align
    _check_layout(r, tensors, data_offset, align)
    return GGUFHeader(version, metadata, types, tensors, data_offset, align, size, seen)


def validate_gguf(path: str | Path) -> GGUFHeader:
    """Validate a GGUF file's header, metadata and tensor table without reading tensor data.

    The file is memory-mapped read-only and only its header pages are touched; every count is
    checked against the bytes left before it is used (see the module docstring for the rules).

    Args:
        path: the ``.gguf`` file.

    Returns:
        The parsed :class:`GGUFHeader` (metadata values as Python objects, arrays as lists).

    Raises:
        GGUFError: the file is missing, unreadable or malformed; the one-line message names the
            file, the field (``metadata key #3 'general.alignment'``, ``tensor #5 'output.weight'``)
            and what is wrong with it.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size < _HEADER.size:
                f.seek(0)
                head = f.read()
                return parse_gguf(head, len(head), path.name)
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                return parse_gguf(mm, size, path.name)
    except OSError as e:
        raise GGUFError(f"{path.name}: cannot read file: {e.strerror or e}") from None


_SPECIAL_ID_KEY = re.compile(r"^tokenizer\.ggml\.(\w+)_token_id$")
_MAX_TOKEN_TYPE = 6  # llama_token_type: UNDEFINED=0 ... BYTE=6
_BYTE = 6
_BYTE_PIECE = re.compile(r"<0x([0-9A-F]{2})>")
# Longest token text. Real vocabularies stay under 200 bytes; sentencepiece refuses pieces of
# 8,000 bytes and more.
MAX_PIECE_BYTES = 4096


def _validate_sentencepiece(metadata: dict, tokens: list[str], pre: str) -> None:
    """What sentencepiece requires of a ``llama`` vocabulary (``sentencepiece/src/model_interface.cc``),
    checked here so the error names the token: BYTE tokens spelled ``<0xXX>``, all 256 of them
    once each if any. (Several unknown tokens, or an unknown token that is also BOS, EOS or
    padding, are accepted as llama.cpp does: the tokenizer tells sentencepiece only one.)"""
    types = metadata.get("tokenizer.ggml.token_type")
    if types is None:
        return
    byte_ids = [i for i, kind in enumerate(types) if kind == _BYTE]
    values: dict[str, int] = {}
    for i in byte_ids:
        m = _BYTE_PIECE.fullmatch(tokens[i])
        if not m:
            raise GGUFError(f"{pre}tokenizer.ggml.tokens: token #{i} {_short(tokens[i])} has "
                            "type BYTE but is not spelled <0xXX>")
        if m.group(1) in values:
            raise GGUFError(f"{pre}tokenizer.ggml.tokens: byte token {tokens[i]} appears twice "
                            f"(#{values[m.group(1)]} and #{i})")
        values[m.group(1)] = i
    if byte_ids and len(values) != 256:
        raise GGUFError(f"{pre}tokenizer.ggml.token_type: {len(values)} BYTE tokens; a "
                        "vocabulary with byte fallback needs all 256")


def validate_vocab(metadata: dict, source: str = "") -> None:
    """Check the ``tokenizer.ggml.*`` arrays and special-token ids against each other.

    Checks (llama.cpp ``llama-vocab.cpp`` loads these without cross-checks and can index past
    its arrays): ``tokens`` is a non-empty list of strings; ``scores`` (floats) and
    ``token_type`` (ints in 0..6) have one entry per token; ``merges`` entries are ``"a b"``
    pairs; every ``tokenizer.ggml.<name>_token_id`` is an integer id inside the vocabulary.
    A file with no ``tokenizer.ggml.tokens`` passes (it has no vocabulary to check).

    Args:
        metadata: GGUF metadata (key -> value) as returned by :func:`validate_gguf`.
        source: file name used as the prefix of error messages.

    Raises:
        GGUFError: naming the key and the mismatch.
    """
    pre = f"{source}: " if source else ""
    tokens = metadata.get("tokenizer.ggml.tokens")
    if tokens is None:
        return
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise GGUFError(f"{pre}tokenizer.ggml.tokens: must be an array of strings")
    n = len(tokens)
    if n == 0:
        raise GGUFError(f"{pre}tokenizer.ggml.tokens: the vocabulary is empty")
    for key, kind in (("tokenizer.ggml.scores", (int, float)), ("tokenizer.ggml.token_type", int)):
        values = metadata.get(key)
        if values is None:
            continue
        if not isinstance(values, list):
            raise GGUFError(f"{pre}{key}: must be an array, got {type(values).__name__}")
        if len(values) != n:
            raise GGUFError(
                f"{pre}{key}: has {len(values)} entries but tokenizer.ggml.tokens has {n}"
            )
        if values and not all(isinstance(v, kind) and not isinstance(v, bool) for v in values):
            raise GGUFError(f"{pre}{key}: must be an array of numbers")
        if key.endswith("token_type"):
            lo, hi = min(values), max(values)
            if lo < 0 or hi > _MAX_TOKEN_TYPE:
                bad = lo if lo < 0 else hi
                raise GGUFError(
                    f"{pre}{key}: token #{values.index(bad)} has type {bad} "
                    f"(valid: 0..{_MAX_TOKEN_TYPE})"
                )
    long = next((i for i, t in enumerate(tokens) if len(t) > MAX_PIECE_BYTES // 4
                 and len(t.encode("utf-8", "surrogatepass")) > MAX_PIECE_BYTES), None)
    if long is not None:
        raise GGUFError(f"{pre}tokenizer.ggml.tokens: token #{long} is longer than "
                        f"{MAX_PIECE_BYTES} bytes")
    merges = metadata.get("tokenizer.ggml.merges")
    if merges is not None:
        if not isinstance(merges, list):
            raise GGUFError(f"{pre}tokenizer.ggml.merges: must be an array of strings")
        known = set(tokens)
        for i, m in enumerate(merges):
            if not isinstance(m, str) or m.find(" ", 1) in (-1, len(m) - 1):
                raise GGUFError(
                    f"{pre}tokenizer.ggml.merges: entry #{i} {_short(m)} is not a 'left right' pair"
                )
            left, right = m.split(" ", 1)
            for part in (left, right, left + right):
                if part not in known:
                    raise GGUFError(f"{pre}tokenizer.ggml.merges: entry #{i} {_short(m)} names "
                                    f"{_short(part)}, which is not a token of the vocabulary")
    for key, value in metadata.items():
        m = _SPECIAL_ID_KEY.match(key)
        if not m:
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            raise GGUFError(f"{pre}{key}: must be an integer token id, got {_short(value)}")
        if not 0 <= value < n:
            raise GGUFError(f"{pre}{key} = {value} is outside the vocabulary (ids 0..{n - 1})")
    if metadata.get("tokenizer.ggml.model") == "llama":
        _validate_sentencepiece(metadata, tokens, pre)


def check_tensor_shape(
    name: str, expected: tuple[int, ...], actual: tuple[int, ...], source: str = ""
) -> None:
    """Raise if a tensor's shape contradicts the hyperparameters.

    Args:
        name: tensor name (``blk.0.attn_q.weight``).
        expected: shape implied by the metadata hyperparameters (same order as ``actual``).
        actual: shape stored in the file.
        source: file name used as the prefix of the message.

    Raises:
        GGUFError: ``"<source>: tensor 'blk.0.attn_q.weight' has shape (a, b), but the
            hyperparameters need (c, d)"``.
    """
    if tuple(expected) != tuple(actual):
        pre = f"{source}: " if source else ""
        raise GGUFError(
            f"{pre}tensor {name!r} has shape {tuple(actual)}, but the hyperparameters need "
            f"{tuple(expected)}"
        )


def check_tensor_shapes(
    expected: Mapping[str, tuple[int, ...]],
    actual: Mapping[str, tuple[int, ...]],
    source: str = "",
) -> None:
    """Check every tensor the hyperparameters call for exists with the implied shape.

    Args:
        expected: tensor name -> shape derived from the metadata (``n_embd``, ``n_head`` ...).
        actual: tensor name -> shape stored in the file, in the same axis order as ``expected``.
        source: file name used as the prefix of messages.

    Raises:
        GGUFError: the first missing tensor or shape mismatch (see :func:`check_tensor_shape`).
    """
    pre = f"{source}: " if source else ""
    for name, shape in expected.items():
        if name not in actual:
            raise GGUFError(f"{pre}tensor {name!r} is missing (the hyperparameters need {shape})")
        check_tensor_shape(name, shape, actual[name], source)
