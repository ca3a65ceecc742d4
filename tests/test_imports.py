"""The import graph has no loops, counting imports inside functions too: at the level of
modules, and at the level of localllm's subpackages (the layering of the README's layout
table). Importing the package has no side effects beyond defining names."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# package name -> directory (localllm.kernels lives at the top level: pyproject's package-dir)
ROOTS = {"localllm": REPO / "localllm", "localllm.kernels": REPO / "kernels"}


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for pkg, root in ROOTS.items():
        for path in root.rglob("*.py"):
            rel = path.relative_to(root).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            mods[".".join([pkg, *parts])] = path
    return mods


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _resolve(name: str, mods: dict[str, Path]) -> str | None:
    """The longest module of ours that ``name`` (dotted) starts with."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        cand = ".".join(parts[:i])
        if cand in mods:
            return cand
    return None


def import_graph() -> dict[str, set[str]]:
    """module -> modules of ours it imports (anywhere in its body, TYPE_CHECKING blocks
    excluded: they never run)."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        pkg = mod if _is_package(path) else mod.rsplit(".", 1)[0]
        tree = ast.parse(path.read_text(), str(path))
        skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    stem = ".".join(base + ([node.module] if node.module else []))
                else:
                    stem = node.module or ""
                # `from pkg import sub` imports the submodule when there is one
                targets = [f"{stem}.{a.name}" for a in node.names] or [stem]
                targets = [t if _resolve(t, mods) == t else stem for t in targets]
            for t in targets:
                r = _resolve(t, mods)
                if r is not None and r != mod:
                    graph[mod].add(r)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    sys.setrecursionlimit(10_000)

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def _subpackage(mod: str) -> str:
    """``localllm.models.llama`` -> ``localllm.models``; top-level modules stay themselves."""
    parts = mod.split(".")
    return ".".join(parts[:2])


def test_no_module_import_cycles():
    assert [c for c in cycles(import_graph())
            if not all(m.startswith("localllm.kernels") for m in c)] == []


def test_no_kernel_import_cycles():
    assert cycles(import_graph()) == []


def test_no_subpackage_import_cycles():
    graph: dict[str, set[str]] = {}
    for mod, deps in import_graph().items():
        a = _subpackage(mod)
        graph.setdefault(a, set()).update(d for d in map(_subpackage, deps) if d != a)
    assert cycles(graph) == []


def test_importing_the_package_registers_nothing():
    """Importing every module of localllm (the CLI's included) leaves the dequantization
    backends empty and imports no Triton: registration happens when a backend is chosen."""
    code = ("import importlib, pkgutil, sys, localllm, localllm.kernels\n"
            "for m in pkgutil.walk_packages(localllm.__path__, 'localllm.'):\n"
            "    if m.name.split('.')[1] not in ('kernels',):\n"
            "        importlib.import_module(m.name)\n"
            "from localllm.gguf.quants import backends\n"
            "print(backends(), 'triton' in sys.modules)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=False, timeout=300, cwd=REPO)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split("\n")[0] == "['torch'] False"
