"""The ``localllm quantize`` command (typer function registered in :mod:`localllm.cli.app`)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

# quantize.recipe.FILE_TYPES, spelled out so that building the CLI does not import gguf and
# numpy (tests/test_newcomer.py checks that they agree).
TYPE_NAMES = ("Q8_0, Q6_K, Q5_K_M, Q5_K_S, Q4_K_M, Q4_K_S, Q3_K_L, Q3_K_M, Q3_K_S, Q2_K, Q4_0, Q4_1, "
              "Q5_0, Q5_1, IQ4_NL, IQ4_XS, MXFP4_MOE")


def quantize_command(
    input: Annotated[str, typer.Argument(
        help="F32/F16/BF16 model to quantize: a models.toml name or a GGUF file")],
    output: Annotated[Path, typer.Argument(help="GGUF file to write")],
    type: Annotated[str, typer.Option("--type", "-t", help=TYPE_NAMES)] = "Q4_K_M",
    allow_requantize: Annotated[bool, typer.Option(
        "--allow-requantize", help="accept an already quantized input (quality drops)")] = False,
) -> None:
    """Quantize INPUT to OUTPUT with llama.cpp's K-quant/legacy recipes (llama-quantize)."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from ..atomic import check_output_path
    from ..quantize.convert import quantize_gguf
    from ..quantize.recipe import parse_file_type
    from ..registry import load_registry

    ftype = parse_file_type(type)  # fail on a bad --type before touching any file
    check_output_path(output, "OUTPUT")  # a device, FIFO or foreign link: refused up front
    source, _ = load_registry().resolve(input)  # a name in models.toml or a path
    console = Console(file=sys.stderr)
    with Progress(TextColumn("{task.description:<36}"), BarColumn(),
                  TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                  TimeRemainingColumn(), console=console, transient=True,
                  disable=not console.is_terminal) as bar:
        task = bar.add_task("quantizing", total=None)

        def progress(name: str, i: int, n: int) -> None:
            bar.update(task, description=name, completed=i, total=n)

        rep = quantize_gguf(source, output, ftype, allow_requantize=allow_requantize,
                            progress=progress)
    counts: dict[str, int] = {}
    for t in rep.types.values():
        counts[t.name] = counts.get(t.name, 0) + 1
    mix = ", ".join(f"{k}: {v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))
    console.print(f"{output}: {ftype}, {rep.out_bytes / 2**20:.2f} MiB "
                  f"({rep.bpw:.2f} bits per weight; input {rep.in_bytes / 2**20:.2f} MiB) "
                  f"in {rep.seconds:.1f} s; tensors: {mix}", highlight=False, markup=False,
                  soft_wrap=True)
