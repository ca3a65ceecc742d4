"""Compile a kernel ahead of time for an NVIDIA GPU without a GPU, and read what came out.

Triton's own compiler (``triton.compile`` of an ``ASTSource``) turns a kernel specialization
(argument types, constexprs, launch options, the 16-byte alignment marks the JIT applies at
launch) into PTX and a cubin; ``ptxas``, ``cuobjdump`` and ``nvdisasm`` ship inside the
Triton wheel. Used by ``tests/test_kernel_compile.py`` (every kernel compiles) and
``bench/kernel_profile.py`` (registers, spills and the SASS of each main loop).

Checked with Triton 3.6 and 3.9 (the compiler API keyed by argument name).
"""

from __future__ import annotations

import inspect
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field

import torch
import triton

from ._jit import DualKernel


class CompileUnavailable(RuntimeError):
    """This Triton cannot compile for NVIDIA ahead of time (old API, no NVIDIA backend)."""


def compiler_api():
    """(ASTSource, GPUTarget, make_backend), or raise :class:`CompileUnavailable`."""
    try:
        from triton.backends import backends
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from triton.compiler.compiler import make_backend
    except ImportError as e:
        raise CompileUnavailable(f"Triton {triton.__version__} lacks the compiler API ({e})")
    if "nvidia" not in backends:
        raise CompileUnavailable(f"Triton {triton.__version__} has no NVIDIA backend")
    # Recent Triton (3.6 to 3.9 checked) keys the signature by argument name, constexprs
    # included as "constexpr"; older ones keyed it by argument index.
    if "constexprs" not in inspect.signature(ASTSource.__init__).parameters:
        raise CompileUnavailable(
            f"Triton {triton.__version__}: ASTSource predates name-keyed signatures"
        )
    return ASTSource, GPUTarget, make_backend


@dataclass
class Case:
    """One specialization of a kernel: its non-constexpr argument types and its constexprs.

    ``types`` maps argument names to Triton type strings ("*u8", "i32", "fp32", ...); the
    remaining arguments must be in ``constexprs``. ``aligned`` names the arguments the JIT
    would specialize as divisible by 16 (by default all of them: torch allocations and model
    dimensions); an int argument equal to 1 is a constexpr, as the JIT makes it.
    """

    kernel: DualKernel
    types: dict[str, str]
    constexprs: dict[str, object]
    num_warps: int = 4
    enable_fp_fusion: bool = True
    arch: int = 90
    aligned: tuple[str, ...] | None = None
    num_stages: int | None = None
    maxnreg: int | None = None
    extra: dict = field(default_factory=dict)


def compile_case(case: Case):
    """The kernel compiled for ``sm_<arch>`` (a Triton ``CompiledKernel``); no GPU needed.

    Raises:
        CompileUnavailable: this Triton cannot compile ahead of time.
        ValueError: the case does not name every argument exactly once.
    """
    ast_source, gpu_target, make_backend = compiler_api()
    # The variant for CUDA is a plain JITFunction; building it touches no GPU.
    fn = case.kernel.variant(torch.device("cuda"))
    names = list(fn.arg_names)
    unknown = set(case.types) ^ (set(names) - set(case.constexprs))
    if unknown:
        raise ValueError(
            f"{fn.__name__}: arguments not exactly one of typed or constexpr: {sorted(unknown)}"
        )
    signature = {n: case.types.get(n, "constexpr") for n in names}
    target = gpu_target("cuda", case.arch, 32)
    backend = make_backend(target)
    attrs = {}
    if hasattr(backend, "parse_attr"):  # how the JIT turns its "D" (divisible by 16) marks
        aligned = case.types if case.aligned is None else case.aligned
        attrs = {(names.index(n),): backend.parse_attr("D") for n in aligned}
    src = ast_source(fn=fn, signature=signature, constexprs=case.constexprs, attrs=attrs)
    options = {"num_warps": case.num_warps, "enable_fp_fusion": case.enable_fp_fusion}
    if case.num_stages is not None:
        options["num_stages"] = case.num_stages
    if case.maxnreg is not None:
        options["maxnreg"] = case.maxnreg
    return triton.compile(src, target=target, options=options)


def cuda_tool(name: str) -> str:
    """Path of a CUDA binary tool (``cuobjdump``, ``nvdisasm``, ``ptxas``): the one shipped
    in the Triton wheel, else ``TRITON_<NAME>_PATH`` or the PATH.

    Raises:
        CompileUnavailable: not found.
    """
    env = os.environ.get(f"TRITON_{name.upper()}_PATH")
    if env and os.path.exists(env):
        return env
    here = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    if os.path.exists(here):
        return here
    found = shutil.which(name)
    if found:
        return found
    raise CompileUnavailable(f"{name} is not in the Triton wheel nor on the PATH")


def _run_on_cubin(tool: str, args: list[str], cubin: bytes) -> str:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        out = subprocess.run([cuda_tool(tool), *args, path], capture_output=True, text=True,
                             check=True)  # fmt: skip
    return out.stdout


def sass(cubin: bytes) -> str:
    """The SASS of a cubin (``cuobjdump -sass``)."""
    return _run_on_cubin("cuobjdump", ["-sass"], cubin)


def resource_usage(cubin: bytes) -> dict[str, int]:
    """``cuobjdump -res-usage``: REG, STACK, SHARED, LOCAL, ... of the (single) kernel."""
    text = _run_on_cubin("cuobjdump", ["-res-usage"], cubin)
    return {k: int(v) for k, v in re.findall(r"\b([A-Z]+):(\d+)", text)}


_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_PRED = re.compile(r"^@!?U?P[T0-9]+\s+")


@dataclass
class Instr:
    """One SASS instruction: address, opcode with modifiers (``LDG.E.128``), operands."""

    pc: int
    op: str
    operands: str

    @property
    def base(self) -> str:
        """The opcode without modifiers (``LDG``)."""
        return self.op.split(".")[0]


def parse_sass(text: str) -> list[Instr]:
    """The instructions of ``cuobjdump -sass`` output, in address order."""
    out = []
    for pc, body in _SASS_LINE.findall(text):
        body = _PRED.sub("", body.strip())
        op, _, operands = body.partition(" ")
        out.append(Instr(int(pc, 16), op, operands.strip()))
    return out


def loops(instrs: list[Instr]) -> list[tuple[int, int]]:
    """Index ranges ``[start, end]`` (inclusive) of the loops: each backward branch closes one."""
    index = {ins.pc: i for i, ins in enumerate(instrs)}
    found = []
    for i, ins in enumerate(instrs):
        if ins.base not in ("BRA", "JMP"):
            continue
        m = re.search(r"0x([0-9a-f]+)", ins.operands)
        if m is None:
            continue
        target = int(m.group(1), 16)
        if target <= ins.pc and target in index:
            found.append((index[target], i))
    return found


def global_loads(instrs) -> list[Instr]:
    """The loads from global memory (``LDG``, and ``LDGSTS``: global to shared, async)."""
    return [i for i in instrs if i.base in ("LDG", "LDGSTS")]


def load_bits(ins: Instr) -> int:
    """Bits one thread moves with a global load: the width modifier, 32 when none."""
    mods = ins.op.split(".")[1:]
    for m in mods:
        if m in ("64", "128", "U8", "S8", "U16", "S16"):
            return {"64": 64, "128": 128, "U8": 8, "S8": 8, "U16": 16, "S16": 16}[m]
    return 32


def main_loop(instrs: list[Instr]) -> list[Instr]:
    """The instructions of the loop with the most global loads (the innermost such loop); the
    whole kernel when it has no loop."""
    best = None
    for lo, hi in loops(instrs):
        body = instrs[lo : hi + 1]
        key = (len(global_loads(body)), -(hi - lo))
        if best is None or key > best[0]:
            best = (key, body)
    if best is None or best[0][0] == 0:
        return list(instrs)
    return best[1]


def counted(instrs: list[Instr]) -> list[Instr]:
    """Instructions that issue (``NOP`` padding dropped)."""
    return [i for i in instrs if i.base != "NOP"]
