"""The fast subset (``pytest -m "not slow"``) starts no process and loads no real checkpoint.

Read from the test files' syntax trees: a test is *slow* when its body, a fixture it takes or a module-level function
it calls (followed through this folder's modules and conftest.py) starts a process (names ``subprocess``,
``sys.executable``, ``torchrun``, ``accelerate`` or the bench's ``background_load``) or passes a catalogue name (``smollm2-135m-instruct``,
``dinov2-small``, ...) to a checkpoint loader (``prepare``, ``load_causal_lm``, ``load_vision_model``, lm-eval's ``HFLM``)
outside ``pytest.raises``.  Such a test must carry ``pytest.mark.slow`` (on itself, its class or the module's
``pytestmark``).
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent

#: Calls that load a checkpoint when given a catalogue name.
LOADERS = {"prepare", "load_causal_lm", "load_vision_model", "HFLM"}
#: String constants that start a process (``accelerate launch``, ``torchrun``, the bench's competing process).
LAUNCHERS = {"accelerate", "torchrun", "--background-load"}
#: attnpatch functions that start a process: the bench's competing load (a ``python -c`` child).
STARTERS = {"background_load"}


def _catalogue() -> tuple[str, ...]:
    from attnpatch.checkpoints import CATALOGUE

    return tuple(CATALOGUE)


def _is_slow_mark(node: ast.AST) -> bool:
    """``pytest.mark.slow`` (or a list/tuple holding it)."""
    if isinstance(node, (ast.List, ast.Tuple)):
        return any(_is_slow_mark(e) for e in node.elts)
    return isinstance(node, ast.Attribute) and node.attr == "slow" and ast.unparse(node.value).endswith("mark")


class Module:
    """One file's module-level functions, imported names, assignments and whether ``pytestmark`` holds slow."""

    def __init__(self, path: Path, tree: ast.Module):
        self.path, self.tree = path, tree
        self.functions = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        self.imports = {a.asname or a.name: (n.module, a.name) for n in tree.body if isinstance(n, ast.ImportFrom) and n.level == 0
                        for a in n.names}
        self.assigned = {t.id: n.value for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
        self.slow = _is_slow_mark(self.assigned["pytestmark"]) if "pytestmark" in self.assigned else False


def _is_raises(expr: ast.AST) -> bool:
    """``pytest.raises(...)`` (any ``*.raises(...)`` or ``raises(...)`` call)."""
    f = expr.func if isinstance(expr, ast.Call) else None
    return isinstance(f, ast.Attribute) and f.attr == "raises" or isinstance(f, ast.Name) and f.id == "raises"


def _nodes(fn: ast.AST):
    """Every node under ``fn`` with whether it lies in the body of a ``with pytest.raises(...)`` block (one walk)."""
    stack = [(fn, False)]
    while stack:
        node, refused = stack.pop()
        yield node, refused
        inner = refused or isinstance(node, ast.With) and any(_is_raises(i.context_expr) for i in node.items)
        for name, value in ast.iter_fields(node):
            children = value if isinstance(value, list) else [value]
            stack.extend((c, inner if name == "body" else refused) for c in children if isinstance(c, ast.AST))


class Scan:
    """Why each function of the test folder is slow (an empty list: it is not), through what it calls."""

    def __init__(self, folder: Path = TESTS, catalogue: tuple[str, ...] | None = None):
        self.catalogue = _catalogue() if catalogue is None else catalogue
        self.modules = {p.stem: Module(p, ast.parse(p.read_text(), str(p))) for p in sorted(folder.glob("*.py"))}
        self._memo: dict[tuple[str, str], list[str]] = {}

    def _resolve(self, mod: Module, name: str) -> tuple[str, str] | None:
        """The (module, function) that ``name`` means in ``mod``: its own, an import from a test module, a conftest fixture."""
        if name in mod.functions:
            return mod.path.stem, name
        if name in mod.imports:
            src, real = mod.imports[name]
            if src in self.modules and real in self.modules[src].functions:
                return src, real
        if "conftest" in self.modules and name in self.modules["conftest"].functions:
            return "conftest", name
        return None

    def _names_catalogue(self, mod: Module, node: ast.AST, seen: frozenset = frozenset()) -> bool:
        for x in ast.walk(node):
            if isinstance(x, ast.Constant) and isinstance(x.value, str) and any(c in x.value for c in self.catalogue):
                return True
            if isinstance(x, ast.Name) and x.id in mod.assigned and x.id not in seen:
                if self._names_catalogue(mod, mod.assigned[x.id], seen | {x.id}):
                    return True
        return False

    def _direct(self, mod: Module, fn: ast.AST) -> tuple[list[str], set[str]]:
        """The reasons in ``fn``'s own body, and the names it uses."""
        why, used = [], set()
        for x, refused in _nodes(fn):
            if isinstance(x, ast.Name):
                used.add(x.id)
                if x.id == "subprocess":
                    why.append(f"line {x.lineno}: subprocess")
                elif x.id in STARTERS:
                    why.append(f"line {x.lineno}: {x.id} starts a process")
            elif isinstance(x, (ast.Import, ast.ImportFrom)) and any(a.name == "subprocess" for a in x.names):
                why.append(f"line {x.lineno}: import subprocess")
            elif isinstance(x, ast.Attribute) and x.attr == "executable" and isinstance(x.value, ast.Name) and x.value.id == "sys":
                why.append(f"line {x.lineno}: sys.executable")
            elif isinstance(x, ast.Attribute) and x.attr in STARTERS:
                why.append(f"line {x.lineno}: {x.attr} starts a process")
            elif isinstance(x, ast.Constant) and x.value in LAUNCHERS:
                why.append(f"line {x.lineno}: {x.value}")
            elif isinstance(x, ast.Call) and not refused:
                f = x.func
                name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
                if name in LOADERS and any(self._names_catalogue(mod, a) for a in [*x.args, *(k.value for k in x.keywords)]):
                    why.append(f"line {x.lineno}: {ast.unparse(x)[:80]}")
        return why, used

    def why(self, modname: str, fn: ast.AST, _stack: tuple = ()) -> list[str]:
        """Reasons ``fn`` (in ``modname``) is slow: its own, then those of the fixtures and functions it uses."""
        key = (modname, fn.name)
        if key in self._memo:
            return self._memo[key]
        if key in _stack:
            return []
        mod = self.modules[modname]
        direct, used = self._direct(mod, fn)
        why = [f"{modname}.{fn.name} {w}" for w in direct]
        used |= {a.arg for a in fn.args.args}
        for name in sorted(used - {fn.name}):
            target = self._resolve(mod, name)
            if target is not None:
                why += self.why(target[0], self.modules[target[0]].functions[target[1]], (*_stack, key))
        self._memo[key] = why
        return why

    def unmarked(self) -> dict[str, list[str]]:
        """``{"file::test": reasons}`` for every slow test without the slow mark."""
        out = {}
        for modname, mod in self.modules.items():
            if not modname.startswith("test_") or mod.slow:
                continue
            tests = [(fn, False) for fn in mod.tree.body if isinstance(fn, ast.FunctionDef)]
            for cls in (n for n in mod.tree.body if isinstance(n, ast.ClassDef)):
                tests += [(fn, any(_is_slow_mark(d) for d in cls.decorator_list)) for fn in cls.body if isinstance(fn, ast.FunctionDef)]
            for fn, cls_slow in tests:
                if not fn.name.startswith("test") or cls_slow or any(_is_slow_mark(d) for d in fn.decorator_list):
                    continue
                why = self.why(modname, fn)
                if why:
                    out[f"{mod.path.name}::{fn.name}"] = why
        return out


def test_every_test_that_starts_a_process_or_loads_a_real_checkpoint_is_marked_slow():
    unmarked = Scan().unmarked()
    assert not unmarked, "mark these @pytest.mark.slow:\n" + "\n".join(f"{t}: {w[0]}" for t, w in unmarked.items())


def test_the_check_finds_each_kind_unmarked(tmp_path):
    (tmp_path / "conftest.py").write_text(
        "import pytest\n"
        "from attnpatch.checkpoints import load_vision_model\n"
        "@pytest.fixture(scope='session')\n"
        "def dino():\n"
        "    return load_vision_model('dinov2-small')\n")
    (tmp_path / "test_helpers.py").write_text(
        "import shutil, subprocess\n"
        "def launch(argv):\n"
        "    return subprocess.run([shutil.which('accelerate'), 'launch', *argv])\n")
    (tmp_path / "test_x.py").write_text(
        "import sys, pytest\n"
        "from subprocess import run\n"
        "from attnpatch.checkpoints import load_causal_lm, prepare\n"
        "from test_helpers import launch\n"
        "NAME = 'smollm2-135m-instruct'\n"
        "def test_runs_python():\n"
        "    run([sys.executable, '-c', 'pass'])\n"
        "def test_a_torchrun_run():\n"
        "    run(['torchrun', 'x.py'])\n"
        "def test_loads():\n"
        "    load_causal_lm(NAME)\n"
        "def test_through_a_helper():\n"
        "    launch(['eval'])\n"
        "def test_a_competing_load():\n"
        "    from attnpatch.evals.bench import background_load\n"
        "    with background_load(5):\n"
        "        pass\n"
        "def test_through_a_fixture(dino):\n"
        "    pass\n"
        "@pytest.mark.slow\n"
        "def test_marked():\n"
        "    prepare(NAME)\n"
        "class TestSome:\n"
        "    def test_in_a_class(self):\n"
        "        prepare('dinov2-small')\n"
        "@pytest.mark.slow\n"
        "class TestMarked:\n"
        "    def test_in_a_marked_class(self):\n"
        "        prepare('dinov2-small')\n"
        "def test_a_refusal_is_not_a_load():\n"
        "    with pytest.raises(ValueError):\n"
        "        load_causal_lm('dinov2-small')\n"
        "def test_a_local_folder_is_not_a_catalogue_load(tmp_path):\n"
        "    load_causal_lm(tmp_path)\n")
    (tmp_path / "test_y.py").write_text(
        "import subprocess, pytest\n"
        "pytestmark = [pytest.mark.slow]\n"
        "def test_all_marked():\n"
        "    subprocess.run(['true'])\n")
    found = Scan(tmp_path).unmarked()
    assert sorted(found) == [f"test_x.py::test_{n}" for n in
                             ("a_competing_load", "a_torchrun_run", "in_a_class", "loads", "runs_python", "through_a_fixture", "through_a_helper")]
    assert any("sys.executable" in w for w in found["test_x.py::test_runs_python"])
    assert any("launch" in w and "subprocess" in w for w in found["test_x.py::test_through_a_helper"])
    assert any("conftest.dino" in w for w in found["test_x.py::test_through_a_fixture"])



def test_the_fast_subset_runs_every_methods_contract_battery():
    """``-m "not slow"`` keeps the contract battery: nothing in its two files is marked slow, and its exact-limit cases
    cover every registered method."""
    import importlib

    from attnpatch.patchers.registry import METHODS

    for name in ("test_contract_battery.py", "test_method_contract.py"):
        tree = ast.parse((TESTS / name).read_text())
        marks = [ast.unparse(n) for n in ast.walk(tree) if _is_slow_mark(n)]
        assert not marks and "pytestmark" not in Module(TESTS / name, tree).assigned, f"{name} marks tests slow: {marks}"
    battery = importlib.import_module("test_contract_battery")
    covered = {p.values[0] if hasattr(p, "values") else p[0] for p in battery._params("exact_limit", settings=True)}
    assert set(METHODS) <= covered, f"methods without a fast contract case: {sorted(set(METHODS) - covered)}"
