"""The ``localllm quantize`` command (typer function registered in :mod:`localllm.cli.app`)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from ..quantize.recipe import FILE_TYPES, parse_file_type


def quantize_command(
    input: Annotated[Path, typer.Argument(help="F32/F16/BF16 GGUF file to quantize")],
    output: Annotated[Path, typer.Argument(help="GGUF file to write")],
    type: Annotated[str, typer.Option("--type", "-t", help=", ".join(FILE_TYPES))] = "Q4_K_M",
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

    from ..quantize.convert import quantize_gguf

    ftype = parse_file_type(type)  # fail on a bad --type before touching any file
    console = Console(file=sys.stderr)
    with Progress(TextColumn("{task.description:<36}"), BarColumn(),
                  TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                  TimeRemainingColumn(), console=console, transient=True,
                  disable=not console.is_terminal) as bar:
        task = bar.add_task("quantizing", total=None)

        def progress(name: str, i: int, n: int) -> None:
            bar.update(task, description=name, completed=i, total=n)

        rep = quantize_gguf(input, output, ftype, allow_requantize=allow_requantize,
                            progress=progress)
    counts: dict[str, int] = {}
    for t in rep.types.values():
        counts[t.name] = counts.get(t.name, 0) + 1
    mix = ", ".join(f"{k}: {v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))
    console.print(f"{output}: {ftype}, {rep.out_bytes / 2**20:.2f} MiB "
                  f"({rep.bpw:.2f} bits per weight; input {rep.in_bytes / 2**20:.2f} MiB) "
                  f"in {rep.seconds:.1f} s; tensors: {mix}", highlight=False, markup=False,
                  soft_wrap=True)
