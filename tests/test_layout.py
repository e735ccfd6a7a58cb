"""The house rules of the package layout, checked over the source tree (tests may still reach in).

* No import statement in ``attnpatch/`` (nested ones included) imports a name that starts with a
  single ``_`` from another module, and no code reads ``module._name`` off an imported attnpatch module.
* A module whose own name starts with ``_`` is imported only from its own package.
* No folder holds more than 12 modules (one file per method in ``patchers/methods/`` aside; in
  ``attention/`` one method family is one folder), and no module runs past 450 lines unless its docstring says why
  (a paragraph starting "Kept whole:").
* One ``Log`` type.
* ``evals/run/`` (what every eval shares) imports no eval package, and each eval's table columns live in its own
  package, not in ``evals/run/report.py``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "attnpatch"
MODULES = sorted(p for p in PKG.rglob("*.py"))
MAX_MODULES = 12
MAX_LINES = 450
ONE_FILE_PER_METHOD = {PKG / "patchers" / "methods"}


def _dotted(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _package(path: Path) -> str:
    d = _dotted(path)
    return d if path.name == "__init__.py" else d.rpartition(".")[0]


def _absolute(path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = _package(path).split(".")
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def violations(modules=MODULES) -> list[str]:
    """Every breach of the import rules, as ``path:line: what``."""
    out = []
    for path in modules:
        tree = ast.parse(path.read_text(), filename=str(path))
        own_pkg = _package(path)
        imported_modules: set[str] = set()  # local names bound to attnpatch modules
        for node in ast.walk(tree):
            where = f"{path.relative_to(PKG.parent)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.ImportFrom):
                mod = _absolute(path, node)
                if not mod.startswith("attnpatch"):
                    continue
                for a in node.names:
                    full = f"{mod}.{a.name}"
                    is_module = (PKG.parent / full.replace(".", "/")).with_suffix(".py").exists() or (
                        PKG.parent / full.replace(".", "/") / "__init__.py").exists()
                    if is_module:
                        imported_modules.add(a.asname or a.name)
                        target_pkg, leaf = mod, a.name
                    else:
                        target_pkg, leaf = mod.rpartition(".")[0], mod.rpartition(".")[2]
                        if _private(a.name):
                            out.append(f"{where}: imports private name {a.name} from {mod}")
                    if _private(leaf) and target_pkg != own_pkg:
                        out.append(f"{where}: imports private module {target_pkg}.{leaf} from outside its package")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("attnpatch"):
                        imported_modules.add(a.asname or a.name.split(".")[0])
                        parts = a.name.split(".")
                        if any(_private(p) for p in parts) and ".".join(parts[:-1]) != own_pkg:
                            out.append(f"{where}: imports private module {a.name} from outside its package")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                base = node.value
                while isinstance(base, ast.Attribute):
                    base = base.value
                if isinstance(base, ast.Name) and base.id in imported_modules:
                    out.append(f"{path.relative_to(PKG.parent)}:{node.lineno}: reads private {node.attr} off module {base.id}")
    return out


def test_no_private_name_crosses_a_module():
    assert violations() == []


def test_the_check_catches_each_kind_of_breach(tmp_path):
    pkg = tmp_path / "attnpatch"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "_shared.py").write_text("x = 1\n")
    (pkg / "sub" / "a.py").write_text("def _helper():\n    pass\n")
    bad = pkg / "b.py"
    bad.write_text("from .sub.a import _helper\nfrom .sub import _shared\nfrom .sub import a\n\ndef f():\n    from .sub.a import _helper\n    return a._helper\n")
    fine = pkg / "sub" / "c.py"
    fine.write_text("from . import _shared\nfrom .a import __doc__\n")
    global PKG
    saved = PKG
    PKG = pkg
    try:
        found = violations([bad, fine])
    finally:
        PKG = saved
    assert [v.split(": ", 1)[1] for v in found] == [
        "imports private name _helper from attnpatch.sub.a",
        "imports private module attnpatch.sub._shared from outside its package",
        "imports private name _helper from attnpatch.sub.a",
        "reads private _helper off module a",
    ]


def test_folders_hold_at_most_twelve_modules():
    crowded = {}
    for folder in {p.parent for p in MODULES}:
        if folder in ONE_FILE_PER_METHOD:
            continue
        n = sum(1 for p in folder.glob("*.py") if p.name != "__init__.py")
        if n > MAX_MODULES:
            crowded[str(folder.relative_to(PKG.parent))] = n
    assert crowded == {}


def test_long_modules_say_why_they_are_kept_whole():
    long = {}
    for p in MODULES:
        n = len(p.read_text().splitlines())
        if n > MAX_LINES and "Kept whole:" not in (ast.get_docstring(ast.parse(p.read_text())) or ""):
            long[str(p.relative_to(PKG.parent))] = n
    assert long == {}


def test_one_log_type():
    defined = []
    for p in MODULES:
        for node in ast.parse(p.read_text()).body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, (ast.AnnAssign,)) else []
            if isinstance(node, ast.TypeAlias if hasattr(ast, "TypeAlias") else ()):
                targets = [node.name]
            if any(isinstance(t, ast.Name) and t.id == "Log" for t in targets):
                defined.append(str(p.relative_to(PKG.parent)))
    assert len(defined) == 1, defined


def test_the_shared_eval_layer_points_down():
    """``evals/<task>`` may import ``evals/run``, never the reverse; ``report.py`` keeps the table plumbing only (each
    eval's ``*_COLUMNS`` and rows live in its package)."""
    run = PKG / "evals" / "run"
    up = []
    for path in sorted(run.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([_absolute(path, node)] if isinstance(node, ast.ImportFrom) else
                     [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            for name in names:
                parts = name.split(".")
                if parts[:2] == ["attnpatch", "evals"] and len(parts) > 2 and parts[2] != "run":
                    up.append(f"{path.name}:{node.lineno}: {name}")
    assert up == []
    report = ast.parse((run / "report.py").read_text())
    own = [t.id for node in report.body if isinstance(node, ast.Assign) for t in node.targets if isinstance(t, ast.Name)]
    own += [node.name for node in report.body if isinstance(node, ast.FunctionDef)]
    assert [n for n in own if n.endswith("_COLUMNS") or n.endswith("_rows")] == []
    from attnpatch.evals.bench.table import BENCH_ATTENTION_COLUMNS, BENCH_LM_COLUMNS, BENCH_VISION_COLUMNS
    from attnpatch.evals.clip.table import CLIP_RETRIEVAL_COLUMNS, ZEROSHOT_COLUMNS, clip_rows
    from attnpatch.evals.ruler.table import RULER_COLUMNS
    from attnpatch.evals.vision.table import VISION_COLUMNS, vision_rows

    assert [c.key for c in RULER_COLUMNS][:3] == ["task", "length", "n"] and callable(vision_rows) and callable(clip_rows)
    assert all(len(cols) > 5 for cols in (BENCH_ATTENTION_COLUMNS, BENCH_LM_COLUMNS, BENCH_VISION_COLUMNS, CLIP_RETRIEVAL_COLUMNS,
                                          ZEROSHOT_COLUMNS, VISION_COLUMNS))
