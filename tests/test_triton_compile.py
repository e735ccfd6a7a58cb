"""Every Triton kernel compiled for Hopper (sm_90a) and Ampere (sm_80) with no GPU, through the project's own launchers
at the shapes ``benchmarks/gpu_check.py`` runs, in float32 and bfloat16 (``benchmarks/triton_compile.py``): no compile
error, no launch the launchers refuse, shared memory within the target's limit, and spill bytes within the budgets
below, from ``ptxas -v`` of the cubins Triton builds (the ptxas in the Triton wheel).

The compiles run in two subprocesses (one per target, side by side): the kernels must be decorated without
``TRITON_INTERPRET=1``, which conftest.py sets for this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia.compiler")

ROOT = Path(__file__).resolve().parents[1]

#: Largest dynamic shared memory one program may take (bytes): sm_90 (H100, H200) 227 KiB, sm_80 (A100) 163 KiB.
SHARED_LIMIT = {90: 232448, 80: 166912}


def _input(v: dict) -> str:
    """A variant's input tensor type (its first pointer argument: ``q_ptr``, ``x_ptr`` or ``a_ptr``), e.g. ``*bf16``."""
    sig = v["signature"]
    return sig.get("q_ptr", sig.get("x_ptr", sig.get("a_ptr")))


def spill_budget(arch: int, v: dict) -> int:
    """Bytes of spill stores per thread a variant may have.

    sm_90, where the GPU check runs: none, but float32 at head dim 128 (three bfloat16 products per tile; not a shape of
    the GPU check: 36 B measured).  sm_80, whose mma.sync keeps both operands in registers: half precision at head dim
    128 up to 64 B; the float32 attention, selection and probe masses, and the 64-wide pseudo-inverse, up to the
    kilobytes measured when the budget was written (docs/benchmarks/compile.md, "The Triton kernels compiled for
    sm_90 and sm_80")."""
    c = v["constexprs"]
    fp32 = _input(v) == "*fp32"
    if arch == 90:
        return 64 if fp32 and c.get("BD") == 128 else 0
    if v["kernel"] == "_pinv_kernel" and c.get("S") == 64:
        return 1024
    if fp32:
        return 4096 if c.get("BD") == 128 else 1024
    return 64 if c.get("BD") == 128 else 0


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("triton-compile")
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT)}
    procs = {arch: subprocess.Popen(
        [sys.executable, str(ROOT / "benchmarks" / "triton_compile.py"), "--arch", str(arch), "--json",
         str(out / f"sm_{arch}.json")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        for arch in SHARED_LIMIT}
    logs = {arch: p.communicate(timeout=1500)[0] for arch, p in procs.items()}
    results = {}
    for arch, p in procs.items():
        path = out / f"sm_{arch}.json"
        assert path.is_file(), logs[arch][-3000:]
        results[arch] = (p.returncode, json.loads(path.read_text()), logs[arch])
    return results


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(SHARED_LIMIT))
def test_every_kernel_compiles_within_its_budgets(compiled, arch):
    rc, res, log = compiled[arch]
    variants = res["archs"][str(arch)]
    print(f"\nsm_{arch}: {len(variants)} variants, triton {res['triton']}, {res['ptxas']}")
    for v in variants:
        print(f"  {v['kernel']} {_input(v)} "
              f"{ {k: c for k, c in v['constexprs'].items() if k.isupper()} } warps {v['num_warps']}: {v['registers']} regs, "
              f"spill {v['spill_stores']}/{v['spill_loads']} B, shared {v['shared']} B")
    assert res["launch_errors"] == [] and rc == 0, log[-3000:]
    assert not [v for v in variants if v["error"]]
    # every family, in both dtypes, and the variants a model adds (padding, the guard's dense blocks, bfloat16 selection)
    kinds = {(v["kernel"], _input(v)) for v in variants}
    assert kinds == {(k, t) for k in ("_fps_kernel", "_pinv_kernel", "_select_kernel", "_attend_kernel", "_mass_kernel")
                     for t in ("*fp32", "*bf16")}
    flags = {(v["kernel"], k, c) for v in variants for k, c in v["constexprs"].items() if k in ("HAS_PAD", "HAS_FLAGS",
                                                                                             "SEL_BF16", "DENSE", "SYNC", "SCORE")}
    for kernel, flag in (("_select_kernel", "HAS_PAD"), ("_select_kernel", "SEL_BF16"), ("_select_kernel", "SCORE"),
                         ("_attend_kernel", "HAS_PAD"), ("_attend_kernel", "HAS_FLAGS"), ("_attend_kernel", "DENSE"),
                         ("_mass_kernel", "HAS_FLAGS"), ("_fps_kernel", "SYNC")):
        assert {(kernel, flag, True), (kernel, flag, False)} <= flags, (kernel, flag)
    assert {v["constexprs"].get("BD") for v in variants if v["kernel"] == "_attend_kernel"} == {32, 64, 128}
    for v in variants:
        assert v["registers"] is not None and v["spill_stores"] is not None and v["shared"] is not None, v
        assert v["shared"] <= SHARED_LIMIT[arch], v
        assert v["spill_stores"] <= spill_budget(arch, v), v


@pytest.mark.slow
def test_compile_only_nests_and_refuses_an_unknown_target(tmp_path):
    """Leaving an inner block restores the outer one's target (its launches still compile, for its own target), the
    process's Triton state is as before after both, and an unsupported compute capability is one ValueError."""
    script = """
import torch
from attnpatch.attention.nystrom.pinv_triton import landmark_pinv_triton
from attnpatch.attention.backends.aot import compile_only
from attnpatch.attention.backends.triton_support import compiling
a = torch.softmax(torch.randn(1, 2, 16, 16), -1)
with compile_only(90) as outer:
    with compile_only(80) as inner:
        landmark_pinv_triton(a)
    landmark_pinv_triton(a)
assert not compiling()
assert [v.arch for v in inner] == [80] and [v.arch for v in outer] == [90], (inner, outer)
assert all(v.error is None and v.registers for v in [*inner, *outer])
try:
    with compile_only(75):
        pass
except ValueError as e:
    print("refused:", e)
"""
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "refused: arch=75: compute capabilities compiled for are 80, 86, 89, 90" in proc.stdout
