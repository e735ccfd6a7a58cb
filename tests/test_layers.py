"""Layering of the package: every module imports on its own, the static import graph has no cycle,
and inside ``attnpatch.patchers`` imports only point down (state/options -> bench_hook -> contract -> config_file -> registry ->
runtime / break_even -> methods / adapters -> api -> the package); the adapters never import the public API."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "attnpatch"


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _imports(name: str, *, module_level: bool) -> set[str]:
    """attnpatch modules ``name`` imports (module level only, or anywhere), ``if TYPE_CHECKING:`` blocks excluded."""
    tree = ast.parse(MODULES[name].read_text())
    package = name if _is_package(name) else name.rsplit(".", 1)[0]
    found: set[str] = set()

    def resolve(level: int, module: str | None) -> str:
        if level == 0:
            return module or ""
        base = package.split(".")
        base = base[: len(base) - (level - 1)]
        return ".".join(base + ([module] if module else []))

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for sub in child.orelse:
                    visit(ast.Module(body=[sub], type_ignores=[]), top)
                continue
            inner = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef))
            if isinstance(child, ast.ClassDef):
                inner = top  # a class body runs at import time
            if isinstance(child, ast.Import) and (top or not module_level):
                for alias in child.names:
                    if alias.name.split(".")[0] == "attnpatch":
                        found.add(alias.name)
            elif isinstance(child, ast.ImportFrom) and (top or not module_level):
                target = resolve(child.level, child.module)
                if target.split(".")[0] != "attnpatch":
                    continue
                subs = [f"{target}.{a.name}" for a in child.names if f"{target}.{a.name}" in MODULES]
                if len(subs) < len(child.names):  # names defined by the package itself
                    found.add(target)
                found.update(subs)  # ``from pkg import submodule`` needs the submodule, not the package's __init__
            visit(child, inner)

    visit(tree, True)
    return {m for m in found if m in MODULES and m != name}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if state.get(m) is None:
                found = dfs(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if state.get(n) is None:
            found = dfs(n)
            if found:
                return found
    return None


def test_static_import_graph_has_no_cycle():
    graph = {name: _imports(name, module_level=True) for name in MODULES}
    assert sum(len(v) for v in graph.values()) > 30  # the walk found the package's imports
    cyc = _cycle(graph)
    assert cyc is None, " -> ".join(cyc)


def _rank(name: str) -> int | None:
    """Layer of a module of attnpatch.patchers (higher may import lower, never the reverse)."""
    p = "attnpatch.patchers"
    if not name.startswith(p):
        return None
    rest = name[len(p) + 1:]
    if rest in ("state", "options"):
        return 0
    if rest == "bench_hook":
        return 1
    if rest == "contract":
        return 2
    if rest == "config_file":
        return 3
    if rest == "registry":
        return 4
    if rest in ("runtime", "adapter", "class_swap", "features", "method_table", "break_even") or rest.startswith("methods"):
        return 5
    if rest.startswith("adapters"):
        return 6
    if rest == "api":
        return 7
    return 8  # the package itself


@pytest.mark.parametrize("module_level", [True, False])
def test_patchers_imports_only_point_down(module_level):
    bad = []
    for name in MODULES:
        r = _rank(name)
        if r is None:
            continue
        for dep in _imports(name, module_level=module_level):
            rd = _rank(dep)
            if rd is not None and rd > r:
                bad.append(f"{name} -> {dep}")
    assert not bad, bad


def test_adapters_never_import_the_api():
    adapters = [n for n in MODULES if n.startswith("attnpatch.patchers.adapter")]
    assert "attnpatch.patchers.adapters.hf" in adapters and "attnpatch.patchers.adapter" in adapters
    for name in adapters:
        deps = _imports(name, module_level=False)
        assert not deps & {"attnpatch.patchers.api", "attnpatch.patchers", "attnpatch"}, (name, deps)


_ALONE = r"""
import importlib, os, sys, traceback
import torch  # third-party imports are shared; attnpatch is imported afresh in each child
failed = []
for name in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:
        try:
            importlib.import_module(name)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    if status != 0:
        failed.append(name)
print("FAILED", failed)
sys.exit(1 if failed else 0)
"""


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
def test_every_module_imports_alone():
    """Each module imported first, in a fresh interpreter state (a forked child that has imported no attnpatch module)."""
    names = sorted(n for n in MODULES if not n.endswith(".__main__"))  # ``python -m`` entry points run on import
    proc = subprocess.run([sys.executable, "-c", _ALONE, *names], capture_output=True, text=True, cwd=ROOT.parent, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
