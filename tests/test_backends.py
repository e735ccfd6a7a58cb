"""The house of ``attnpatch/attention/``: one backend layer at the bottom that alone imports Triton and FlexAttention and
alone chooses a kernel, method packages over it, no import circle, and ``import attnpatch`` loading neither Triton nor
FlexAttention."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnpatch.attention.backends import dispatch
from attnpatch.attention.backends.dispatch import Call, KernelError, allowed, choose, kernels_of, refusal
from attnpatch.errors import OptionError

PKG = Path(__file__).resolve().parents[1] / "attnpatch"
BACKENDS = PKG / "attention" / "backends"
CPU = torch.device("cpu")


# --------------------------------------------------------------------------- import circles


def _module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, at module level or inside a function (``from X import Y`` counts
    ``X.Y`` where that is a module, else ``X``); a package's ``__init__`` counts as the package."""
    mods = {_module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        base = m if p.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(p.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = base.split(".")
                    anchor = ".".join(parts[: len(parts) - node.level + 1])
                    mod = f"{anchor}.{node.module}" if node.module else anchor
                else:
                    mod = node.module or ""
                targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod for a in node.names]
            graph[m].update(t for t in targets if t in mods and t != m)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
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

    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))
    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_in_the_package():
    assert circles(import_graph(PKG)) == []


def test_the_circle_check_sees_imports_inside_functions(tmp_path):
    pkg = tmp_path / "attnpatch"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("from . import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .a import g\n")
    (pkg / "c.py").write_text("from .sub.b import f\n")
    assert circles(import_graph(pkg)) == [["attnpatch.sub.a", "attnpatch.sub.b"]]


# --------------------------------------------------------------------------- what importing the package loads


@pytest.mark.slow
def test_import_attnpatch_loads_no_triton_and_no_flex_attention():
    """``import attnpatch`` (and every method and attention package) adds no ``triton*`` module and no FlexAttention
    module to what ``import torch`` loads: both are imported by the first call that runs one of their kernels."""
    code = (
        "import sys, torch\n"
        "before = set(sys.modules)\n"
        "import attnpatch, attnpatch.patchers.methods, attnpatch.attention.sparse, attnpatch.attention.nystrom\n"
        "import attnpatch.attention.landmarks, attnpatch.attention.anchor, attnpatch.attention.backends.dispatch\n"
        "new = sorted(set(sys.modules) - before)\n"
        "print([m for m in new if m.split('.')[0] == 'triton' or 'flex_attention' in m])\n"
        "print(len(new))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PKG.parent).stdout.splitlines()
    assert out[0] == "[]"
    assert int(out[1]) > 50  # the package itself was imported


# --------------------------------------------------------------------------- one place chooses a kernel


def _is_device_type(node: ast.AST) -> bool:
    """``x.device.type`` or ``torch.device(...).type``."""
    if not (isinstance(node, ast.Attribute) and node.attr == "type"):
        return False
    v = node.value
    return (isinstance(v, ast.Attribute) and v.attr == "device") or (
        isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute) and v.func.attr == "device")


def _is_kernel_option(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id == "kernel") or (isinstance(node, ast.Attribute) and node.attr == "kernel")


def kernel_choices(path: Path) -> list[str]:
    """Every place in ``path`` that imports Triton or FlexAttention, or branches on a device type, on ``is_cuda`` or on
    the ``kernel`` option (a comparison that reads one of them), as ``path:line: what``."""
    out = []
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        where = f"{path.relative_to(PKG.parent)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "triton" or "flex_attention" in a.name:
                    out.append(f"{where}: imports {a.name}")
        elif isinstance(node, ast.ImportFrom) and not node.level:
            mod = node.module or ""
            if mod.split(".")[0] == "triton" or "flex_attention" in mod or (
                    mod == "torch.nn.attention" and any(a.name == "flex_attention" for a in node.names)):
                out.append(f"{where}: imports from {mod}")
        elif isinstance(node, ast.Attribute) and node.attr == "is_cuda":
            out.append(f"{where}: reads is_cuda")
        elif isinstance(node, ast.Compare):
            parts = [node.left, *node.comparators]
            if any(_is_device_type(p) for p in parts):
                out.append(f"{where}: branches on a device type")
            if any(_is_kernel_option(p) for p in parts):
                out.append(f"{where}: branches on the kernel option")
    return out


def _outside_backends() -> list[Path]:
    attention = [p for p in (PKG / "attention").rglob("*.py") if BACKENDS not in p.parents]
    return attention + sorted((PKG / "patchers" / "methods").rglob("*.py"))


def test_no_kernel_is_chosen_outside_the_backend_layer():
    """No module of the attention math or of the methods imports Triton or FlexAttention, or picks a kernel by the
    device type, ``is_cuda`` or the ``kernel`` option: they ask :func:`dispatch.choose` and run what it names."""
    found = [v for p in _outside_backends() for v in kernel_choices(p)]
    assert found == []
    # nor anywhere else in the package (evals and adapters have no kernels to choose): Triton and FlexAttention are
    # imported in the backend layer only
    imports = [v for p in PKG.rglob("*.py") if BACKENDS not in p.parents for v in kernel_choices(p) if "imports" in v]
    assert imports == []


def test_the_kernel_check_catches_each_kind(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import triton\nfrom triton import language as tl\nfrom torch.nn.attention.flex_attention import BlockMask\n"
        "def f(x, cfg, kernel):\n"
        "    if x.device.type == 'cuda' or x.is_cuda:\n        pass\n"
        "    if torch.device(x).type in ('cpu',):\n        pass\n"
        "    if kernel == 'flex' or cfg.kernel in ('torch',):\n        pass\n"
        "    use = choose('fps', kernel, call)\n    if use == 'triton':\n        pass\n")
    global PKG
    saved, PKG = PKG, tmp_path
    try:
        found = [v.split(": ", 1)[1] for v in kernel_choices(bad)]
    finally:
        PKG = saved
    assert sorted(found) == sorted(["imports triton", "imports from triton", "imports from torch.nn.attention.flex_attention",
                                    "branches on a device type", "reads is_cuda", "branches on a device type",
                                    "branches on the kernel option", "branches on the kernel option"])


def test_every_kernel_option_is_the_table_of_its_operation():
    """The methods' ``kernel`` options take exactly the names the dispatch table holds."""
    from attnpatch.attention.anchor.config import _KERNELS
    from attnpatch.attention.sparse.block_topk import KERNELS
    from attnpatch.patchers.methods import a_shape, block_topk, vertical_slash

    assert set(_KERNELS) == {"auto", *kernels_of("anchor_attend")} == {"auto", *kernels_of("anchor_select")}
    assert a_shape.KERNEL_CHOICES == ("auto", *kernels_of("a_shape"))
    assert vertical_slash.KERNEL_CHOICES == ("auto", *kernels_of("vertical_slash"))
    assert set(block_topk.KERNEL_CHOICES) <= set(KERNELS) == {"auto", *kernels_of("block_topk")}


def test_auto_on_this_cpu():
    """``"auto"`` on CPU float32 tensors: the compiled kernel where it builds, PyTorch's CPU flash attention for the
    merge, the gather paths of the block-sparse baselines (FlexAttention measured slower on the CPU), the
    eigendecomposition pseudo-inverse; never a Triton kernel, even under the interpreter."""
    from attnpatch.attention.backends.cpu_kernel import stripe_kernel

    built = stripe_kernel() is not None
    call = Call(CPU, torch.float32, head_dim=64, keys=1 << 20, side=32, work_dtype=torch.float32)
    assert choose("fps", "auto", call) == ("compiled" if built else "torch")
    assert choose("anchor_select", "auto", call) == ("compiled" if built else "torch")
    assert choose("anchor_attend", "auto", call) == ("compiled" if built else "torch")
    assert choose("anchor_merge", "auto", call) == "flash_lse"
    assert choose("pinv", "auto", call) == "eigh"
    for op in ("a_shape", "vertical_slash", "block_topk"):
        assert choose(op, "auto", call) == "gather"
    # what the call's facts change
    assert choose("anchor_attend", "auto", Call(CPU, torch.bfloat16)) == "torch"  # compiled takes float32
    assert choose("anchor_attend", "auto", Call(CPU, torch.float32, inner_padding=True)) == "torch"
    assert choose("anchor_merge", "auto", Call(CPU, torch.float32, inner_padding=True)) == "masked"
    assert choose("anchor_select", "compiled", Call(CPU, torch.float32, select_dtype="bfloat16")) == "torch"
    meta = Call(torch.device("meta"), torch.float32)
    assert [choose(op, "auto", meta) for op in ("fps", "pinv", "anchor_attend", "a_shape")] == [
        "torch", "eigh", "torch", "gather"]


def test_auto_on_a_cuda_device_as_the_table_reads_it():
    """On a CUDA device (only the call is described; nothing runs) ``"auto"`` takes the Triton kernels where Triton is
    installed, the product pseudo-inverse above 64 landmarks, and FlexAttention for the baselines."""
    from attnpatch.attention.backends.triton_support import TRITON_AVAILABLE

    cuda = Call(torch.device("cuda"), torch.bfloat16, head_dim=64, keys=8192, side=64, work_dtype=torch.float32)
    tri = "triton" if TRITON_AVAILABLE else None
    assert choose("fps", "auto", cuda) == (tri or "torch")
    assert choose("anchor_attend", "auto", cuda) == (tri or "torch")
    assert choose("pinv", "auto", cuda) == (tri or "products")
    assert choose("pinv", "auto", Call(cuda.device, torch.float32, side=96, work_dtype=torch.float32)) == "products"
    assert choose("pinv", "auto", Call(cuda.device, torch.float32, side=32, work_dtype=torch.float64)) == "products"
    assert choose("a_shape", "auto", cuda) == "flex"
    assert choose("anchor_attend", "auto", Call(cuda.device, torch.float64)) == "torch"  # Triton takes no float64
    # AnchorAttention's Triton tiles are compiled and budget-checked up to head dim 128: wider heads take PyTorch
    assert choose("anchor_attend", "auto", Call(cuda.device, torch.bfloat16, head_dim=256)) == "torch"
    if TRITON_AVAILABLE:
        with pytest.raises(KernelError, match="^kernel='triton' takes head dims up to 128, not 256; allowed here: "):
            choose("anchor_attend", "triton", Call(cuda.device, torch.bfloat16, head_dim=256))


def test_one_error_text_for_a_kernel_that_cannot_run():
    with pytest.raises(OptionError, match=r"^kernel='cuda': allowed values are 'auto', 'triton', 'compiled', 'torch'$"):
        choose("fps", "cuda", Call(CPU, torch.float32))
    with pytest.raises(KernelError, match=r"^kernel='compiled' takes float32 tensors, not torch.bfloat16; allowed here: "
                                          r"'auto'(, 'triton')?, 'torch'$"):
        choose("anchor_attend", "compiled", Call(CPU, torch.bfloat16))
    with pytest.raises(KernelError, match=r"^kernel='compiled' does not take padding inside the keys; allowed here: "):
        choose("stripe_attend", "compiled", Call(CPU, torch.float32, inner_padding=True))
    with pytest.raises(KernelError, match=r"^kernel='compiled' runs on CPU tensors, not cuda tensors; allowed here: "):
        choose("fps", "compiled", Call(torch.device("cuda"), torch.float32))
    with pytest.raises(KernelError, match=r"^kernel='triton' takes s <= 64 landmarks .*not s=65; allowed here: "):
        choose("pinv", "triton", Call(torch.device("cuda"), torch.float32, side=65, work_dtype=torch.float32))
    with pytest.raises(KernelError, match=r"^kernel='flex' flex_attention's compiled kernel takes .* not torch.float64"):
        choose("vertical_slash", "flex", Call(CPU, torch.float64))
    # a KernelError is an OptionError (a ValueError) and a RuntimeError
    assert issubclass(KernelError, OptionError) and issubclass(KernelError, RuntimeError)
    # refusal() gives the same text without raising; a fitting kernel, or one that falls back, has none
    text = refusal("anchor_attend", "compiled", Call(CPU, torch.bfloat16))
    assert text is not None and text.startswith("kernel='compiled' takes float32 tensors, not torch.bfloat16; allowed")
    assert refusal("anchor_attend", "torch", Call(CPU, torch.bfloat16)) is None
    assert refusal("anchor_select", "compiled", Call(CPU, torch.bfloat16, select_dtype="bfloat16")) is None
    assert allowed("a_shape", Call(CPU, torch.float64)) == ["auto", "gather"]


def test_the_triton_kernels_run_cpu_tensors_only_under_the_interpreter(monkeypatch):
    from attnpatch.attention.backends import triton_support

    if not triton_support.TRITON_AVAILABLE:
        pytest.skip("Triton is not installed")
    monkeypatch.setattr(triton_support, "_INTERPRETED", True)
    assert choose("fps", "triton", Call(CPU, torch.float32)) == "triton"
    assert choose("fps", "auto", Call(CPU, torch.float32)) != "triton"  # "auto" never picks it on the CPU
    monkeypatch.setattr(triton_support, "_INTERPRETED", False)
    with pytest.raises(KernelError, match=r"^kernel='triton' runs on CUDA tensors \(on CPU tensors only under the "
                                          r"Triton interpreter, TRITON_INTERPRET=1 set before attnpatch is imported\), "
                                          r"not cpu tensors; allowed here: 'auto'"):
        choose("fps", "triton", Call(CPU, torch.float32))
    monkeypatch.setattr(triton_support, "TRITON_AVAILABLE", False)
    with pytest.raises(KernelError, match=r"^kernel='triton' needs Triton \(pip install triton\)"):
        choose("anchor_attend", "triton", Call(torch.device("cuda"), torch.float16))
    assert choose("anchor_attend", "auto", Call(torch.device("cuda"), torch.float16)) == "torch"


def test_needs_warm_up_names_the_kernels_with_a_one_time_cost():
    from attnpatch.attention.backends.cpu_kernel import stripe_kernel

    call = Call(CPU, torch.float32)
    assert dispatch.needs_warm_up("fps", "auto", call) == (stripe_kernel() is not None)
    assert not dispatch.needs_warm_up("fps", "torch", call)
    assert not dispatch.needs_warm_up("pinv", "auto", call)


# --------------------------------------------------------------------------- the compiled CPU kernel's build


def test_the_first_build_of_the_compiled_kernel_says_so_and_how_long_it_took(monkeypatch, capfd):
    """``patch(model, "anchor_attention", kernel="compiled")`` builds the C++ extension the first time on a machine
    (88 s beside other work): it says that the build runs and how long it usually takes before it starts, and its time
    when it ends; a load from PyTorch's extension cache says nothing."""
    import attnpatch.attention.backends.cpu_kernel as ck
    from attnpatch import patch, unpatch
    from tiny_models import tiny_causal_lm

    if ck.kernel_supported() is not None:
        pytest.skip(ck.kernel_supported())
    assert ck.stripe_kernel() is not None and ck.built_before()  # the cache holds this build now
    model = tiny_causal_lm()
    monkeypatch.setattr(ck, "_state", {})
    monkeypatch.setattr(ck, "built_before", lambda: False)  # as on a machine that never built it
    capfd.readouterr()
    patch(model, "anchor_attention", kernel="compiled")
    err = capfd.readouterr().err
    unpatch(model)
    lines = [ln for ln in err.splitlines() if "compiled CPU kernel" in ln]
    assert len(lines) == 2, err
    assert lines[0].startswith("[attnpatch] building the compiled CPU kernel (anchor_cpu.cpp) once for this machine: "
                               f"about {ck.BUILD_SECONDS[0]} s on an idle 2-core machine, up to {ck.BUILD_SECONDS[1]} s")
    assert lines[1].startswith("[attnpatch] built the compiled CPU kernel in ") and lines[1].endswith(" s")
    monkeypatch.setattr(ck, "_state", {})
    monkeypatch.setattr(ck, "built_before", lambda: True)
    patch(model, "anchor_attention", kernel="compiled")
    unpatch(model)
    assert "compiled CPU kernel" not in capfd.readouterr().err
