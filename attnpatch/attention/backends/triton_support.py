"""The one guarded Triton import of the project, and what the Triton launchers ask before they launch.

Triton ships with PyTorch's CUDA wheels; without it every method runs its PyTorch (or compiled CPU) path.  The kernel
modules (:mod:`attnpatch.attention.landmarks.fps_triton`, :mod:`attnpatch.attention.nystrom.pinv_triton`,
:mod:`attnpatch.attention.anchor.triton_select`, :mod:`~attnpatch.attention.anchor.triton_attend`,
:mod:`~attnpatch.attention.anchor.triton_dots`) take ``triton`` and ``tl`` from here, and define their kernels only when
:data:`TRITON_AVAILABLE`.  Triton itself is imported on the first access to ``triton`` or ``tl`` (the kernel modules
are imported only by a call that runs one of their kernels): ``import attnpatch`` loads no Triton module, and
:data:`TRITON_AVAILABLE` only asks whether it is installed.

Three questions a launcher asks:

* :func:`interpreted`: were the kernels decorated under the Triton interpreter (``TRITON_INTERPRET=1`` in the
  environment when this module was imported; Triton reads the variable when a kernel is decorated, not when it is
  called)?  They then run on CPU tensors, in NumPy, one program after another.
* :func:`compiling`: is a compile-only block (:func:`attnpatch.attention.backends.aot.compile_only`) active?  The
  launchers then take CPU tensors as if they were on the target GPU, and the launch is compiled, never run.
* :func:`launchable`: may this tensor go to a compiled kernel (a CUDA tensor, or any tensor while compiling)?

Which kernel a call runs is not decided here: :mod:`attnpatch.attention.backends.dispatch` decides.
"""

from __future__ import annotations

import importlib
import importlib.util
import os

import torch

__all__ = ["TRITON_AVAILABLE", "TRITON_DTYPES", "interpreted", "compiling", "on_gpu", "launchable", "sm_count",
           "CompileTarget", "set_compile_target"]

TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None
#: Input dtypes the project's Triton kernels take (float64 runs the PyTorch paths).
TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_INTERPRETED = TRITON_AVAILABLE and os.environ.get("TRITON_INTERPRET", "0") == "1"


class CompileTarget:
    """The GPU a compile-only block compiles for: ``arch`` (compute capability, e.g. 90) and ``sms`` (multiprocessors
    the launchers size their grids for)."""

    def __init__(self, arch: int, sms: int):
        self.arch, self.sms = arch, sms


_TARGET: CompileTarget | None = None


def interpreted() -> bool:
    """Whether the kernels were decorated under ``TRITON_INTERPRET=1`` (read when this module was imported)."""
    return _INTERPRETED


def set_compile_target(target: CompileTarget | None) -> CompileTarget | None:
    """Make ``target`` the active compile-only target (``None``: none); returns the previous one.  Called by
    :func:`~attnpatch.attention.backends.aot.compile_only` only."""
    global _TARGET
    previous, _TARGET = _TARGET, target
    return previous


def compiling() -> bool:
    """Whether a compile-only block is active (the launchers then take CPU tensors as the target GPU's)."""
    return _TARGET is not None


def on_gpu(t: torch.Tensor) -> bool:
    """Whether ``t`` goes to a compiled (not interpreted) kernel: a CUDA tensor, or any tensor inside a compile-only
    block (then sized for the target GPU: :func:`sm_count`)."""
    return t.device.type == "cuda" or _TARGET is not None


def launchable(t: torch.Tensor) -> bool:
    """Whether the launchers may hand ``t`` to a kernel: :func:`on_gpu`, or any tensor under the interpreter."""
    return on_gpu(t) or _INTERPRETED


def sm_count(device: torch.device) -> int:
    """Multiprocessors of ``device`` (inside a compile-only block: of the target)."""
    if _TARGET is not None:
        return _TARGET.sms
    idx = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_properties(idx).multi_processor_count


def __getattr__(name: str):
    """``triton`` and ``tl`` (``triton.language``), imported on first access (PEP 562)."""
    if name in ("triton", "tl"):
        if not TRITON_AVAILABLE:
            raise ImportError("Triton is not installed (pip install triton)")
        mod = importlib.import_module("triton" if name == "triton" else "triton.language")
        globals()[name] = mod
        return mod
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
