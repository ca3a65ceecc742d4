"""Write GGUF files byte by byte, valid or deliberately broken, for the validator's tests.

``GGUFBuilder`` assembles a little-endian GGUF v3 file from key/value pairs and tensors; every
field can be overridden (counts, lengths, types, dimensions, offsets) so that a test can break
exactly one thing. ``build()`` also records where each integer field landed
(:attr:`Built.fields`) so the fuzzer can aim integer extremes at real fields.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

# GGUF value types.
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL = range(8)
STRING, ARRAY, UINT64, INT64, FLOAT64 = range(8, 13)
SCALAR_CODES = {
    UINT8: "<B",
    INT8: "<b",
    UINT16: "<H",
    INT16: "<h",
    UINT32: "<I",
    INT32: "<i",
    FLOAT32: "<f",
    BOOL: "<B",
    UINT64: "<Q",
    INT64: "<q",
    FLOAT64: "<d",
}
# ggml tensor types used here: (id, block size, bytes per block).
F32, F16, Q8_0, Q4_K = (0, 1, 4), (1, 1, 2), (8, 32, 34), (12, 256, 144)


class _Out:
    """A byte buffer that remembers the position and width of every integer it writes."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.fields: list[tuple[str, int, int]] = []

    def int(self, label: str, code: str, value: int) -> None:
        self.fields.append((label, len(self.data), struct.calcsize(code)))
        self.data += struct.pack(code, value)

    def raw(self, b: bytes) -> None:
        self.data += b

    def string(self, label: str, s: str | bytes, length: int | None = None) -> None:
        b = s.encode("utf-8") if isinstance(s, str) else s
        self.int(f"{label}.len", "<Q", len(b) if length is None else length)
        self.data += b


@dataclass
class KV:
    """One metadata pair. ``value`` is written as ``vtype`` (and ``elem`` for arrays).

    ``count`` overrides an array's element count; ``key_len`` the key's length prefix;
    ``raw_value`` replaces the encoded value entirely.
    """

    key: str | bytes
    vtype: int
    value: object = None
    elem: int | None = None
    count: int | None = None
    key_len: int | None = None
    raw_value: bytes | None = None


@dataclass
class Tensor:
    """One tensor. ``ne`` is GGUF order (row length first); ``ttype`` is (id, block, size).

    ``offset`` None places it after the previous one (aligned); ``n_dims`` overrides the count
    written before the dimensions; ``type_id`` overrides the written type id.
    """

    name: str | bytes
    ne: tuple[int, ...]
    ttype: tuple[int, int, int] = F32
    offset: int | None = None
    n_dims: int | None = None
    type_id: int | None = None
    name_len: int | None = None

    def n_bytes(self) -> int:
        """Data size; 0 for broken or huge shapes so that crafting them allocates nothing."""
        n = 1
        for d in self.ne:
            n *= d
        if not self.ne or min(self.ne) <= 0 or n > 1 << 24:
            return 0
        return n // self.ttype[1] * self.ttype[2]


@dataclass
class Built:
    """A built file: its bytes and the (label, position, width) of every integer field."""

    data: bytes
    fields: list[tuple[str, int, int]]
    data_offset: int


def _value(out: _Out, label: str, vtype: int, value: object) -> None:
    if vtype == STRING:
        out.string(label, value)  # type: ignore[arg-type]
    elif vtype in SCALAR_CODES:
        out.int(label, SCALAR_CODES[vtype], value)  # type: ignore[arg-type]
    else:
        raise ValueError(f"cannot encode a scalar of type {vtype}")


@dataclass
class GGUFBuilder:
    """Assemble a GGUF file; fields left at None get their correct values."""

    kvs: list[KV] = field(default_factory=list)
    tensors: list[Tensor] = field(default_factory=list)
    magic: bytes = b"GGUF"
    version: int = 3
    n_tensors: int | None = None
    n_kv: int | None = None
    alignment: int = 32  # used for placing data; write general.alignment yourself to change it
    big_endian_header: bool = False
    truncate_data: int = 0  # drop this many bytes from the end of the file

    def kv(self, key: str | bytes, vtype: int, value: object = None, **kw) -> GGUFBuilder:
        self.kvs.append(KV(key, vtype, value, **kw))
        return self

    def set(self, key: str, vtype: int, value: object = None, **kw) -> GGUFBuilder:
        """Replace the pair named ``key`` in place (same index), or append it."""
        new = KV(key, vtype, value, **kw)
        for i, kv in enumerate(self.kvs):
            if kv.key == key:
                self.kvs[i] = new
                return self
        self.kvs.append(new)
        return self

    def drop(self, key: str) -> GGUFBuilder:
        self.kvs = [kv for kv in self.kvs if kv.key != key]
        return self

    def array(self, key: str, elem: int, values: list, **kw) -> GGUFBuilder:
        self.kvs.append(KV(key, ARRAY, values, elem=elem, **kw))
        return self

    def tensor(self, name: str | bytes, ne: tuple[int, ...], ttype=F32, **kw) -> GGUFBuilder:
        self.tensors.append(Tensor(name, ne, ttype, **kw))
        return self

    def build(self) -> Built:
        out = _Out()
        out.raw(self.magic)
        e = ">" if self.big_endian_header else "<"
        out.int("version", f"{e}I", self.version)
        out.int(
            "n_tensors", f"{e}Q", len(self.tensors) if self.n_tensors is None else self.n_tensors
        )
        out.int("n_kv", f"{e}Q", len(self.kvs) if self.n_kv is None else self.n_kv)
        for i, kv in enumerate(self.kvs):
            out.string(f"kv{i}.key", kv.key, kv.key_len)
            out.int(f"kv{i}.type", "<I", kv.vtype)
            if kv.raw_value is not None:
                out.raw(kv.raw_value)
            elif kv.vtype == ARRAY:
                assert kv.elem is not None
                values = list(kv.value)  # type: ignore[call-overload]
                out.int(f"kv{i}.elem", "<I", kv.elem)
                out.int(f"kv{i}.count", "<Q", len(values) if kv.count is None else kv.count)
                for j, v in enumerate(values):
                    _value(out, f"kv{i}[{j}]", kv.elem, v)
            else:
                _value(out, f"kv{i}.value", kv.vtype, kv.value)
        offsets, pos = [], 0
        for t in self.tensors:
            off = pos if t.offset is None else t.offset
            offsets.append(off)
            pos = -(-(off + t.n_bytes()) // self.alignment) * self.alignment
        for i, (t, off) in enumerate(zip(self.tensors, offsets)):
            out.string(f"t{i}.name", t.name, t.name_len)
            out.int(f"t{i}.n_dims", "<I", len(t.ne) if t.n_dims is None else t.n_dims)
            for d, v in enumerate(t.ne):
                out.int(f"t{i}.ne{d}", "<q" if v < 0 else "<Q", v)
            out.int(f"t{i}.type", "<I", t.ttype[0] if t.type_id is None else t.type_id)
            out.int(f"t{i}.offset", "<Q", off)
        data_offset = -(-len(out.data) // self.alignment) * self.alignment
        out.raw(b"\0" * (data_offset - len(out.data)))
        # Offsets far past any real data are there to be refused: write no data for them.
        ends = [off + t.n_bytes() for t, off in zip(self.tensors, offsets) if off < 1 << 24]
        end = max(ends or [0])
        # Deterministic non-zero filler so byte flips in the data section change something.
        out.raw(bytes((k * 37 + 11) & 0xFF for k in range(end)))
        data = bytes(out.data)
        if self.truncate_data:
            data = data[: -self.truncate_data]
        return Built(data, out.fields, data_offset)

    def write(self, path) -> Built:
        built = self.build()
        with open(path, "wb") as f:
            f.write(built.data)
        return built


def minimal() -> GGUFBuilder:
    """A small valid model-like file: every scalar type, string and arrays, three tensors."""
    b = GGUFBuilder()
    b.kv("general.architecture", STRING, "llama")
    b.kv("general.alignment", UINT32, 32)
    b.kv("general.name", STRING, "tiny ünïcode")
    b.kv("test.u8", UINT8, 200).kv("test.i8", INT8, -5).kv("test.u16", UINT16, 60000)
    b.kv("test.i16", INT16, -300).kv("test.i32", INT32, -70000).kv("test.f32", FLOAT32, 0.5)
    b.kv("test.bool", BOOL, 1).kv("test.u64", UINT64, 2**40).kv("test.i64", INT64, -(2**40))
    b.kv("test.f64", FLOAT64, 1.25)
    b.kv("llama.block_count", UINT32, 1)
    tokens = ["<unk>", "<s>", "</s>", "▁a", "b", "▁ab"]
    b.array("tokenizer.ggml.tokens", STRING, tokens)
    b.array("tokenizer.ggml.scores", FLOAT32, [0.0, 0.0, 0.0, -1.0, -2.0, -3.0])
    b.array("tokenizer.ggml.token_type", INT32, [2, 3, 3, 1, 1, 1])
    b.array("tokenizer.ggml.merges", STRING, ["▁a b"])
    b.kv("tokenizer.ggml.bos_token_id", UINT32, 1)
    b.kv("tokenizer.ggml.eos_token_id", UINT32, 2)
    b.tensor("token_embd.weight", (32, 6), Q8_0)
    b.tensor("output_norm.weight", (32,), F32)
    b.tensor("blk.0.ffn_up.weight", (256, 2), Q4_K)
    return b


# ---- mutations for the fuzzers ----------------------------------------------------------

# Values that break parsers: small counts, type ids around the valid ranges, powers of two
# and their neighbours, sign boundaries and all-ones, each later cut to the field's width.
EXTREMES = (
    0,
    1,
    2,
    3,
    4,
    5,
    7,
    8,
    9,
    12,
    13,
    31,
    32,
    33,
    48,
    63,
    64,
    65,
    255,
    256,
    0x7FFF,
    0x8000,
    0xFFFF,
    0x10000,
    2**31 - 1,
    2**31,
    2**32 - 1,
    2**32,
    2**40,
    2**62,
    2**63 - 1,
    2**63,
    2**64 - 1,
)
N_OP_KINDS = 8


def apply_op(data: bytes, fields: list[tuple[str, int, int]], op: tuple) -> bytes:
    """Apply one mutation ``(kind, a, b, payload)`` to ``data``; a and b pick where and what.

    Kinds: 0 flip a bit, 1 set a byte, 2 truncate, 3 insert payload, 4 delete a span,
    5 set an integer field to an extreme value, 6 add a small delta to an integer field,
    7 copy a span over another place.
    """
    kind, a, b, payload = op
    n = len(data)
    if kind == 0 and n:
        pos = a % n
        return data[:pos] + bytes([data[pos] ^ (1 << (b % 8))]) + data[pos + 1 :]
    if kind == 1 and n:
        pos = a % n
        return data[:pos] + bytes([b & 0xFF]) + data[pos + 1 :]
    if kind == 2:
        return data[: a % (n + 1)]
    if kind == 3:
        pos = a % (n + 1)
        return data[:pos] + payload + data[pos:]
    if kind == 4 and n:
        pos = a % n
        return data[:pos] + data[pos + 1 + b % 16 :]
    if kind in (5, 6) and fields:
        _, pos, width = fields[a % len(fields)]
        if pos + width > n:
            return data
        mask = (1 << (8 * width)) - 1
        if kind == 5:
            value = EXTREMES[b % len(EXTREMES)]
        else:
            old = int.from_bytes(data[pos : pos + width], "little")
            value = old + (b % 33) - 16
        raw = (value & mask).to_bytes(width, "little")
        return data[:pos] + raw + data[pos + width :]
    if kind == 7 and n:
        src, dst, length = a % n, b % n, 1 + (a >> 16) % 32
        chunk = data[src : src + length]
        return data[:dst] + chunk + data[dst + len(chunk) :]
    return data


def random_op(rng) -> tuple:
    """A random mutation for :func:`apply_op` from a ``random.Random``."""
    kind = rng.randrange(N_OP_KINDS)
    return (kind, rng.getrandbits(32), rng.getrandbits(64), rng.randbytes(rng.randrange(1, 17)))


def fuzz_seeds() -> list[Built]:
    """Valid starting files for the fuzzers: the minimal model and two variants."""
    aligned = minimal().set("general.alignment", UINT32, 64)
    aligned.alignment = 64
    bare = GGUFBuilder().kv("general.architecture", STRING, "x").tensor("t", (4, 2), F16)
    return [minimal().build(), aligned.build(), bare.build()]


# ---- metadata values (issue 16 item 2) -------------------------------------------------------
# Hostile values for hyperparameter keys: zero, negatives, huge and boundary integers, non-finite
# and tiny/huge floats, wrong types (bool, string, arrays), and "delete the key" (None).
HOSTILE_VALUES: list = [
    0, 1, -1, 2, 3, 7, 15, 2**31 - 1, 2**31, 2**32 - 1, 2**40, 2**63 - 1, -(2**63), 2**64 - 1,
    0.0, -0.0, 0.5, 1e-30, 1e30, float("nan"), float("inf"), float("-inf"), True, False,
    "", "x", "yarn", "linear", "longrope", "llama", [], [0], [1, 2], [2, 2], [1.5], ["a"], None,
]
# Keys worth adding to a model that lacks them.
EXTRA_KEYS = ["rope.scaling.type", "rope.scaling.factor", "attention.sliding_window",
              "expert_count", "expert_used_count", "expert_feed_forward_length",
              "rope.dimension_count", "attention.scale", "embedding_scale", "logit_scale",
              "attn_logit_softcapping", "final_logit_softcapping", "expert_weights_norm",
              "rope.scaling.attn_factor", "rope.scaling.original_context_length",
              # hybrid and state-space models (issue #27)
              "ssm.conv_kernel", "ssm.inner_size", "ssm.state_size", "ssm.time_step_rank",
              "ssm.group_count", "shortconv.l_cache", "rope.scaling.finetuned",
              "expert_shared_feed_forward_length", "attention.layer_norm_epsilon",
              "residual_scale", "full_attention_interval", "attention.recurrent_layers",
              "rope.dimension_sections", "nextn_predict_layers",
              # issue 28: the RoPE scalings and the 2025 dense families
              "rope.scaling.yarn_log_multiplier", "rope.scaling.yarn_beta_fast",
              "rope.scaling.yarn_beta_slow", "rope.scaling.low_freq_factor",
              "rope.scaling.high_freq_factor", "rope.scaling.alpha", "rope.scale_linear",
              "rope.freq_base_swa", "attention.sliding_window_pattern",
              "attention.temperature_scale",
              # MoE routing variants (gpt-oss, glm4moe ...)
              "expert_shared_count", "leading_dense_block_count", "expert_gating_func",
              "expert_weights_scale", "nextn_predict_layers", "interleave_moe_layer_step",
              # Llama 4 and Gemma 4
              "attention.shared_kv_layers", "attention.key_length_swa",
              "attention.value_length_swa", "rope.dimension_count_swa",
              "embedding_length_per_layer_input",
              # multi-head latent attention and its routing (deepseek2)
              "attention.q_lora_rank", "attention.kv_lora_rank", "attention.key_length_mla",
              "attention.value_length_mla", "expert_group_count", "expert_group_used_count",
              "attention.temperature_length"]
# Keys outside the architecture's namespace (llama.cpp's names), added as they are.
GLOBAL_KEYS = ["xielu.alpha_n", "xielu.alpha_p", "xielu.beta", "xielu.eps"]


def mutate_metadata(md: dict, rng) -> dict:
    """A copy of ``md`` with 1-3 hyperparameter values replaced (``random.Random``): a hostile
    value, a near miss of the current one (x2, /2, +-1), a deleted key, or a new key; sometimes
    ``general.architecture`` is swapped for another family's (its tensors become foreign)."""
    from localllm.models import ARCHITECTURES

    out = dict(md)
    arch = md["general.architecture"]
    keys = [k for k in md if k.startswith((arch + ".", "xielu."))]
    for _ in range(rng.randrange(1, 4)):
        r = rng.random()
        if r < 0.05:
            out["general.architecture"] = rng.choice(sorted(ARCHITECTURES) + ["mamba9", 7])
            continue
        key = (rng.choice(GLOBAL_KEYS) if r < 0.08 else
               f"{arch}.{rng.choice(EXTRA_KEYS)}" if r < 0.25 or not keys
               else rng.choice(keys))
        cur = out.get(key)
        if isinstance(cur, (int, float)) and not isinstance(cur, bool) and rng.random() < 0.4:
            value = rng.choice([cur * 2, cur // 2 if isinstance(cur, int) else cur / 2,
                                cur + 1, cur - 1])
        else:
            value = rng.choice(HOSTILE_VALUES)
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


def metadata_fuzz_seeds(directory) -> list:
    """Small valid models of several families (opened ``GGUFFile``s) for the metadata fuzzer;
    the hybrid and state-space ones are their llama.cpp fixtures (tests/families.py), whose
    per-layer arrays the mutations cut, zero and retype."""
    from pathlib import Path

    from tiny_model import write_tiny_gguf

    from localllm.gguf.file import open_gguf

    moe = {"expert_count": 4, "expert_used_count": 2, "expert_feed_forward_length": 32}
    cases = [("llama", {}), ("qwen2", {}), ("gemma3", {"n_layers": 6}), ("gemma2", {}),
             ("qwen3moe", {"extra": moe}), ("phi3", {}), ("olmo2", {}), ("granite", {}),
             ("mistral3", {"extra": {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
                                     "rope.scaling.yarn_log_multiplier": 1.0,
                                     "attention.temperature_scale": 0.1}}),
             ("smollm3", {"n_layers": 4}), ("apertus", {}), ("seed_oss", {}),
             ("exaone4", {"n_layers": 64, "d_model": 32, "n_heads": 2, "n_kv_heads": 1,
                          "ffn_dim": 32}),
             ("hunyuan-dense", {"extra": {"rope.scaling.alpha": 1000.0}}), ("ernie4_5", {}),
             ("gpt-oss", {"extra": {**moe, "rope.scaling.type": "yarn",
                                    "rope.scaling.factor": 4.0,
                                    "rope.scaling.original_context_length": 16,
                                    "rope.freq_base_swa": 1000.0}}),
             ("glm4moe", {"n_layers": 3,
                          "extra": {**moe, "expert_shared_count": 1,
                                    "leading_dense_block_count": 1, "expert_gating_func": 2,
                                    "expert_weights_norm": True, "expert_weights_scale": 2.5,
                                    "rope.dimension_count": 8}}),
             ("olmoe", {"extra": {"expert_count": 4, "expert_used_count": 2}}),
             ("ernie4_5-moe", {"extra": {**moe, "expert_shared_feed_forward_length": 32,
                                         "leading_dense_block_count": 1,
                                         "interleave_moe_layer_step": 1}}),
             ("phimoe", {"extra": {"expert_count": 4, "expert_used_count": 2}})]
    from families import write_family

    hybrids = ["mamba2", "granitehybrid", "falcon-h1", "nemotron_h", "lfm2", "qwen35", "qwen35moe",
               "qwen3next", "llama4", "gemma4", "gemma4-moe", "deepseek2", "deepseek2-lite",
               "deepseek2-kvb"]
    return [open_gguf(write_tiny_gguf(Path(directory) / f"seed-{arch}.gguf", arch, **kw))
            for arch, kw in cases] + [open_gguf(write_family(f, directory)) for f in hybrids]


def load_with_metadata(f, md: dict, rng) -> str:
    """Load ``f`` with metadata ``md`` as ``localllm run`` does and evaluate a few tokens.

    Returns "loaded" or "refused" (a LocalLLMError); any other exception propagates.
    """
    import dataclasses

    from localllm.errors import LocalLLMError
    from localllm.runtime.session import Session, load_gguf

    try:
        m = load_gguf(dataclasses.replace(f, metadata=md), device="cpu", progress=False,
                      ctx_size=rng.choice([0, 16, 4096, 2**31]))
        s = Session(m, ctx_size=16)
        s.eval([1, 2, 3])
        s.eval([4])
        return "loaded"
    except LocalLLMError as e:
        msg = str(e)
        if "\n" in msg or not msg:
            raise AssertionError(f"not a one-line error: {msg!r}") from None
        return "refused"
