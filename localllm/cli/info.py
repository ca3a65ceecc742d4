"""``localllm info``: what a GGUF file holds, without loading its weights."""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from rich.console import Console
from rich.table import Table

from ..gguf.file import open_gguf
from ..gguf.quants import bits_per_weight
from ..gguf.validate import validate_vocab
from ..models import architecture
from ..models.base import check_tensors
from ..registry import load_registry
from ..tokenizer import Tokenizer
from .terminal import shown


def file_type_name(value) -> str:
    """``general.file_type`` as llama.cpp names it: 15 -> ``Q4_K_M`` (gguf's LlamaFileType);
    an unknown number is shown as is, a missing key as ``?``."""
    from gguf import LlamaFileType

    if value is None:
        return "?"
    try:
        name = LlamaFileType(int(value)).name
    except (ValueError, TypeError):
        return f"{value} (unknown)"
    for prefix in ("MOSTLY_", "ALL_"):
        name = name.removeprefix(prefix)
    return name


# The context size info states a sequence's memory at (the model's own when smaller).
INFO_CTX = 4096


def memory_line(layout: list, context_length: int, types: tuple | None = None) -> str:
    """A sequence's memory by kind: the KV caches at ``INFO_CTX`` tokens of the K and V cache
    ``types`` (:class:`~localllm.memory.CacheType`, ``-ctk`` / ``-ctv``; default float16,
    llama.cpp's default cache type), the latent (MLA) caches in float16, the recurrent states
    (fixed: float32 whatever the context)."""
    from ..memory import CACHE_TYPES, LatentSpec, RecurrentSpec

    types = types or (CACHE_TYPES["f16"], CACHE_TYPES["f16"])
    ctx = min(INFO_CTX, context_length)
    rec = [s for s in layout if isinstance(s, RecurrentSpec)]
    latent = [s for s in layout if isinstance(s, LatentSpec)]
    kv = [s for s in layout if not isinstance(s, (RecurrentSpec, LatentSpec))]
    parts = []
    if kv:
        mib = sum(s.nbytes(ctx, 2, types=types) for s in kv) / 2**20
        names = types[0].name if types[0] == types[1] else f"K {types[0].name}, V {types[1].name}"
        parts.append(f"KV cache {mib:.1f} MiB at {ctx} tokens ({len(kv)} layers, {names})")
    if latent:  # MLA: one latent per position instead of every head's keys and values
        per_token = sum(s.nbytes(1, 2) for s in latent)
        parts.append(f"latent cache {per_token * ctx / 2**20:.1f} MiB at {ctx} tokens "
                     f"({len(latent)} layers, float16: {per_token} bytes per token)")
    if rec:
        mib = sum(s.nbytes(ctx, 4) for s in rec) / 2**20
        parts.append(f"recurrent state {mib:.1f} MiB ({len(rec)} layers, fixed, float32; "
                     "context checkpoints: a copy each)")
    return "memory per sequence: " + ", ".join(parts)


def print_info(model: str | None, console: Console | None = None,
               types: tuple | None = None) -> None:
    """Architecture, hyperparameters, tokenizer, a sequence's memory (KV caches of the K and
    V cache ``types``, default f16) and tensor bytes per quant type."""
    console = console or Console()
    path, _ = load_registry().resolve(model)
    gguf = open_gguf(path)
    md = gguf.metadata
    validate_vocab(md, path.name)  # the checks `run` makes before loading
    tok = Tokenizer(md)
    arch = architecture(gguf.architecture)
    args = arch.ModelArgs.from_gguf(md, tok.n_vocab, path.name)
    check_tensors(arch.tensor_specs(args), gguf.tensors, path.name)
    console.print(f"[bold]{shown(md.get('general.name', path.name))}[/bold]  {shown(path)}")
    console.print(f"GGUF v{gguf.version}, architecture {shown(gguf.architecture)}, "
                  f"file type {shown(file_type_name(md.get('general.file_type')))}", highlight=False)
    hp = Table("hyperparameter", "value", title="model")
    for f in dataclasses.fields(args):
        value = getattr(args, f.name)
        hp.add_row(f.name, f"{value:g}" if isinstance(value, float) else shown(value))
    console.print(hp)
    console.print(
        f"tokenizer: {tok.model_type} (pre: {shown(md.get('tokenizer.ggml.pre', '-'))}), "
        f"{tok.n_vocab} tokens, BOS {tok.bos_id}, EOS {tok.eos_id}, "
        f"end of generation {sorted(tok.eog_ids)}, add_bos {tok.add_bos}, "
        f"chat template: {'yes' if 'tokenizer.chat_template' in md else 'none'}"
    )
    console.print(memory_line(arch.memory_layout(args), args.context_length, types),
                  highlight=False)
    per_type: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for t in gguf.tensors.values():
        row = per_type[t.qtype.name]
        row[0] += 1
        row[1] += t.n_elements
        row[2] += t.n_bytes
    table = Table("type", "tensors", "parameters", "MiB", "bits/weight", title="tensors")
    total_e = total_b = 0
    for name, (n, elems, nbytes) in sorted(per_type.items(), key=lambda kv: -kv[1][2]):
        bpw = bits_per_weight(gguf.tensors[next(k for k, t in gguf.tensors.items()
                                                 if t.qtype.name == name)].qtype)
        table.add_row(name, str(n), f"{elems:,}", f"{nbytes / 2**20:.1f}", f"{bpw:.2f}")
        total_e += elems
        total_b += nbytes
    table.add_row("total", str(len(gguf.tensors)), f"{total_e:,}", f"{total_b / 2**20:.1f}",
                  f"{8 * total_b / total_e:.2f}")
    console.print(table)
