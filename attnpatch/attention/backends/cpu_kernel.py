"""The compiled CPU kernels (``csrc/anchor_cpu.cpp``): AnchorAttention's stripe selection and attention, and FNA's
farthest-point sampling.

Built on first use with :func:`torch.utils.cpp_extension.load` (a C++ compiler, the Python headers
and ``ninja`` are needed; once, then cached by PyTorch under ``TORCH_EXTENSIONS_DIR``).  A build (not a load from the
cache) says so on stderr before it starts, with how long it usually takes, and again when it is done, with its time
(measured build times: docs/benchmarks/cpu.md).
Where it cannot be built, :func:`stripe_kernel` returns ``None`` and says why in
:func:`kernel_status` (a failed build also warns once); AnchorAttention's ``kernel="auto"`` and
farthest-point sampling then run their PyTorch paths (the same results, more slowly).
"""

from __future__ import annotations

import functools
import logging
import platform
import threading
import time
import warnings
from pathlib import Path
from types import ModuleType

import torch

from ...log import Log, log_stderr

_SOURCE = Path(__file__).with_name("csrc") / "anchor_cpu.cpp"
_lock = threading.Lock()
_state: dict[str, object] = {}


def _flags() -> list[str]:
    """Compiler flags: optimised for this CPU, with PyTorch's vector width (``at::vec``) for it."""
    flags = ["-O3", "-march=native", "-fopenmp"]  # OpenMP symbols resolve to PyTorch's own runtime
    cap = torch.backends.cpu.get_cpu_capability()
    if cap in ("AVX512", "AVX2"):
        flags += [f"-DCPU_CAPABILITY_{cap}", f"-DCPU_CAPABILITY={cap}"]
    return flags


#: What a first build usually takes (seconds; 2 CPU cores, idle: about 20 s; beside other work up to about 90 s).
BUILD_SECONDS = (20, 90)


def _name() -> str:
    # -march=native: one build per CPU capability (a home folder shared by different machines)
    return f"attnpatch_anchor_cpu_{torch.backends.cpu.get_cpu_capability().lower()}"


def built_before() -> bool:
    """Whether PyTorch's extension cache holds a build of the kernel at least as new as its source (a load, not a
    build, then follows); ``False`` where the cache cannot be read."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        folder = Path(_get_build_directory(_name(), verbose=False))
    except Exception:  # noqa: BLE001 - a PyTorch without that helper: say "building" to be safe
        return False
    libs = list(folder.glob(f"{_name()}*.so")) + list(folder.glob(f"{_name()}*.pyd"))
    return any(lib.stat().st_mtime >= _SOURCE.stat().st_mtime for lib in libs) if _SOURCE.exists() else False


@functools.lru_cache(maxsize=None)
def kernel_supported() -> str | None:
    """``None`` when this platform can build the kernel, else the reason it cannot (asked once per process)."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"the compiled kernel is built on x86-64 Linux only (this is {platform.system()} {platform.machine()})"
    if not torch.backends.mkldnn.is_available() or "BLAS_INFO=mkl" not in torch.__config__.show():
        return "the compiled kernel calls MKL's sgemm, and this PyTorch build is not linked with MKL"
    return None


def stripe_kernel(log: Log = log_stderr) -> ModuleType | None:
    """The built extension, or ``None`` if it cannot be built here (the reason: :func:`kernel_status`).

    The extension's functions take float32 CPU tensors only (AnchorAttention, arXiv 2505.23520, Sec. 3;
    online softmax as in FlashAttention, Dao et al. 2022, Alg. 1):

    * ``stripe_attention(q, k, v, keep, q_offset, block, scale, kv_tile, q_tile)``: ``q`` ``[B, H, Lq, D]``,
      ``k, v`` ``[B, Hkv, Lk, D]``, ``keep`` ``[B, H, ceil(Lq / block), Lk]`` bool, all contiguous;
      returns ``[B, H, Lq, D]``: each query block's exact attention over its kept keys before the block
      and its own keys causally.  ``q_offset``, ``block``, ``kv_tile``, ``q_tile`` in tokens.
    * ``kept_mass(q, k, keep, blocks, q_offset, block, scale, kv_tile, q_tile)``: ``blocks`` int64 ``[P]``;
      returns float64 ``[B, H, P * block]``: each query's exact softmax mass on its kept causal keys.
    * ``stripe_select(...)``: AnchorAttention's kept keys (:func:`~attnpatch.attention.anchor.select.select_kept`).
    * ``farthest_point_sampling(x, s, first)``: ``x`` ``[B, N, D]`` contiguous; returns int64 ``[B, s]``, the
      farthest-point traversal with exact squared differences, ties to the lowest index
      (:func:`~attnpatch.attention.landmarks.fps.farthest_point_sampling`).

    Both raise ``RuntimeError`` for inputs of another dtype, layout or shape.  This function raises
    nothing: a failed build warns once (``RuntimeWarning``) and returns ``None``.  Thread-safe; the
    build is attempted once per process.  A build (no cached one: :func:`built_before`) calls ``log`` once before it
    starts, naming :data:`BUILD_SECONDS`, and once when it ends, with its time in seconds.
    """
    with _lock:
        if "module" not in _state:
            reason = kernel_supported()
            mod = None
            if reason is None:
                # importing cpp_extension logs a warning about CUDA on machines without it; not ours to show
                quiet = logging.getLogger("torch.utils.cpp_extension")
                level = quiet.level
                quiet.setLevel(logging.ERROR)
                building = not built_before()
                if building:
                    log(f"building the compiled CPU kernel ({_SOURCE.name}) once for this machine: about "
                        f"{BUILD_SECONDS[0]} s on an idle 2-core machine, up to {BUILD_SECONDS[1]} s beside other work; "
                        "later runs load it from PyTorch's extension cache")
                t0 = time.perf_counter()
                try:
                    from torch.utils.cpp_extension import load

                    mod = load(name=_name(), sources=[str(_SOURCE)], extra_cflags=_flags(), verbose=False)
                    if building:
                        log(f"built the compiled CPU kernel in {time.perf_counter() - t0:.0f} s")
                except Exception as exc:  # a missing compiler, headers or ninja: the PyTorch path remains
                    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
                    reason = f"building {_SOURCE.name} failed: {type(exc).__name__}: {' | '.join(lines[-4:])}"
                finally:
                    quiet.setLevel(level)
                if mod is None:
                    warnings.warn(f"the compiled CPU kernels are unavailable, AnchorAttention and farthest-point sampling "
                                  f"run their PyTorch paths: {reason}", RuntimeWarning, stacklevel=3)
            _state["module"], _state["reason"] = mod, reason
        return _state["module"]  # type: ignore[return-value]


def kernel_status() -> str:
    """One line: whether the compiled kernel is in use, and why not if it is not (builds it if needed)."""
    mod = stripe_kernel()
    return "compiled CPU kernel: built" if mod is not None else f"compiled CPU kernel: unavailable ({_state['reason']})"
