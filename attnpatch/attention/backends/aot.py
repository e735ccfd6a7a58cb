"""The project's Triton kernels compiled for a GPU that is not here: what ``ptxas`` makes of each variant the launchers
ask for (registers, spill bytes, shared memory), with no GPU and nothing launched.

:func:`compile_only` is a context manager.  Inside it Triton's active driver is a stand-in that reports the chosen
target (``GPUTarget("cuda", arch, 32)``: compute capability ``arch``, e.g. 90 for Hopper, 80 for Ampere) and the
project's launchers (:mod:`attnpatch.attention.landmarks.fps_triton`, :mod:`attnpatch.attention.nystrom.pinv_triton`,
:mod:`attnpatch.attention.anchor.triton_select`, :mod:`attnpatch.attention.anchor.triton_attend`) take CPU tensors as if
they were on that GPU (:func:`~.triton_support.on_gpu`, :func:`~.triton_support.sm_count`): each
``kernel[grid](...)`` goes through Triton's own argument binding and specialisation (the same dtypes, constexprs,
divisibility attributes and ``num_warps`` as on the GPU) and is compiled by Triton's own pipeline down to a cubin,
``ptxas`` from the Triton wheel included; then the launch is dropped (the output tensors keep whatever they held).
Each distinct variant is recorded once as a :class:`KernelVariant`, from ``ptxas -v``'s own report of the cubin
Triton built.

The kernels' modules must have been imported without ``TRITON_INTERPRET=1`` (under the interpreter there is nothing
to compile): run it in a process of its own (``benchmarks/triton_compile.py``).

Source: Triton's ``JITFunction.run`` / ``compile`` (``knobs.runtime.jit_cache_hook``, ``knobs.nvidia.dump_ptxas_log``).
"""

from __future__ import annotations

import contextlib
import io
import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from .triton_support import CompileTarget, interpreted, set_compile_target

__all__ = ["KernelVariant", "SUPPORTED_ARCHS", "SM_COUNTS", "compile_only", "parse_ptxas"]

#: Multiprocessors of the GPUs the targets stand for when the launchers size their grids (H100/H200 SXM: 132;
#: A100: 108; RTX 3090: 82; L40S: 142).
SM_COUNTS = {90: 132, 80: 108, 86: 82, 89: 142}

#: Compute capabilities :func:`compile_only` compiles for (Triton's NVIDIA backend; the kernels use bfloat16 tensor-core
#: products, which need sm_80 or later).
SUPPORTED_ARCHS = (80, 86, 89, 90)


@dataclass
class KernelVariant:
    """One compiled variant of a kernel.

    Attributes:
        kernel: the ``@triton.jit`` function's name; arch: compute capability (90, 80); name: the variant's
            entry name in the cubin; constexprs: its constexpr arguments (name: value); signature: argument
            name -> Triton type (``*bf16``, ``i32``, ...); num_warps, num_stages: launch options;
            registers: per thread; spill_stores, spill_loads, stack_frame: bytes per thread (``ptxas -v``);
            shared: bytes of shared memory per program (Triton's allocation); specialised: the integer
            arguments Triton made constants for this variant (a value of 1, e.g. a first step ``step_lo=1``);
            calls: launches that asked for this variant; error: the compile error (then the numbers are
            ``None``).
    """

    kernel: str
    arch: int
    constexprs: dict
    signature: dict
    num_warps: int
    num_stages: int
    name: str | None = None
    registers: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    stack_frame: int | None = None
    shared: int | None = None
    specialised: dict = field(default_factory=dict)
    calls: int = 1
    error: str | None = None
    ptxas: str = field(default="", repr=False)

    def as_dict(self) -> dict:
        d = asdict(self)
        d.pop("ptxas")
        return d


_PTXAS_USED = re.compile(r"Used (\d+) registers")
_PTXAS_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def parse_ptxas(log: str) -> dict:
    """``{"registers", "stack_frame", "spill_stores", "spill_loads"}`` from one kernel's ``ptxas -v`` report
    (``None`` where the report has no such line)."""
    used = _PTXAS_USED.search(log)
    frame = _PTXAS_FRAME.search(log)
    return {"registers": int(used.group(1)) if used else None,
            "stack_frame": int(frame.group(1)) if frame else None,
            "spill_stores": int(frame.group(2)) if frame else None,
            "spill_loads": int(frame.group(3)) if frame else None}


class _CompileOnlyDriver:
    """Triton's driver interface as far as ``JITFunction.run`` and ``compile`` read it, for a GPU that is not here."""

    def __init__(self, arch: int, sms: int):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)
        self.arch = arch
        self.sms = sms
        self.variants: dict[tuple, KernelVariant] = {}
        self.compiled: list[KernelVariant] = []  # the same, in the order first asked for
        self._inside = False

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 1000 + self.arch  # a device index of its own: the JIT caches stay apart from a real GPU's

    def get_current_stream(self, device=None):
        return 0

    def get_device_capability(self, device=None):
        return divmod(self.arch, 10)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_device_interface(self):
        return torch.cuda

    def is_active(self):
        return True

    def map_python_to_cpp_type(self, ty: str) -> str:
        from triton.backends.nvidia.driver import ty_to_cpp

        return ty_to_cpp(ty)


def _own_ptxas(kernel, arch: int) -> str:
    """``ptxas -v`` on a compiled kernel's PTX (when Triton's own report was not captured)."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(kernel.asm["ptx"])
        proc = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name={sm_arch_from_capability(arch)}", str(src),
                               "-o", str(Path(tmp) / "k.cubin")], capture_output=True, text=True)
    return proc.stderr + proc.stdout


def _hook(drv: _CompileOnlyDriver):
    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled, **_):
        if drv._inside:  # our own compile below: let Triton compile
            return None
        jit = fn.jit_function
        constants = {k[0] if isinstance(k, tuple) and len(k) == 1 else k: v for k, v in compile["constants"].items()}
        names = [p.name for p in jit.params]
        const = {names[k] if isinstance(k, int) else str(k): _plain(v) for k, v in constants.items()}
        sig = {k: v for k, v in compile["signature"].items() if v != "constexpr"}
        ident = (jit.fn.__qualname__, tuple(sorted(sig.items())), tuple(sorted((k, str(v)) for k, v in const.items())),
                 compile["num_warps"], compile["num_stages"])
        seen = drv.variants.get(ident)
        if seen is not None:
            seen.calls += 1
            return True
        declared = {p.name for p in jit.params if p.is_constexpr}
        var = KernelVariant(kernel=jit.fn.__name__, arch=drv.arch,
                            constexprs={k: v for k, v in const.items() if k in declared}, signature=sig,
                            num_warps=compile["num_warps"], num_stages=compile["num_stages"],
                            specialised={k: v for k, v in const.items() if k not in declared})
        drv.variants[ident] = var
        drv.compiled.append(var)
        out = io.StringIO()
        drv._inside = True
        try:
            from triton import knobs

            with knobs.nvidia.scope(), knobs.compilation.scope(), contextlib.redirect_stdout(out):
                knobs.nvidia.dump_ptxas_log = True
                knobs.compilation.always_compile = True  # a cache hit would skip ptxas and its report
                kernel = jit.preload(compile["specialization_data"])
            # preload cached it for launching: drop it, so that the next launch of this variant comes here again
            jit.device_caches[drv.get_current_device()][0].pop(key, None)
            log = out.getvalue()
            if not _PTXAS_USED.search(log):
                log = _own_ptxas(kernel, drv.arch)
            var.ptxas = log
            var.name = kernel.metadata.name
            var.shared = int(kernel.metadata.shared)
            var.__dict__.update(parse_ptxas(log))
        except Exception as err:  # noqa: BLE001 - a compile error is a result here
            cause, chain = err, []
            while cause is not None:  # Triton's CompilationError carries the real message in its cause
                chain.append(f"{type(cause).__name__}: {cause}")
                cause = cause.__cause__
            var.error = " <- ".join(chain)[:4000]
        finally:
            drv._inside = False
        return True  # compiled (or failed) here: Triton neither compiles again nor launches

    return hook


def _plain(v):
    v = getattr(v, "value", v)
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    return str(v)


@contextlib.contextmanager
def compile_only(arch: int = 90, sms: int | None = None) -> Iterator[list[KernelVariant]]:
    """Compile, never launch, every Triton kernel launched inside the block for compute capability ``arch``.

    Args:
        arch: compute capability as Triton writes it: 90 (Hopper: H100, H200; ``sm_90a``), 80 (Ampere: A100), ...
        sms: multiprocessors the launchers size their grids for (:func:`sm_count`); default :data:`SM_COUNTS`'s
            value for ``arch`` (132 where it has none).

    Yields:
        the list of :class:`KernelVariant` compiled so far (filled as launches happen; one entry per distinct
        variant, ``calls`` counting the launches that asked for it).

    Raises:
        ValueError: an ``arch`` not in :data:`SUPPORTED_ARCHS`.
        RuntimeError: Triton is missing, or the kernels were decorated under the Triton interpreter.

    Blocks nest: leaving one restores the target of the block around it.
    """
    try:
        import triton  # noqa: F401
        from triton import knobs
        from triton.runtime.driver import driver
    except ImportError:
        raise RuntimeError("compile_only needs Triton (pip install triton)") from None

    if interpreted():
        raise RuntimeError("compile_only: the kernels were decorated under TRITON_INTERPRET=1; run it in a process "
                           "without it")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"arch={arch}: compute capabilities compiled for are {', '.join(map(str, SUPPORTED_ARCHS))}")
    drv = _CompileOnlyDriver(arch, sms or SM_COUNTS.get(arch, 132))
    previous = driver._active
    old_hook = knobs.runtime.jit_cache_hook
    driver.set_active(drv)
    knobs.runtime.jit_cache_hook = _hook(drv)
    outer = set_compile_target(CompileTarget(arch, drv.sms))
    try:
        yield drv.compiled
    finally:
        set_compile_target(outer)
        knobs.runtime.jit_cache_hook = old_hook
        driver._active = previous
