"""BLAS thread control: run the small matrix work of one OS thread on fewer MKL threads.

The landmark methods factorise ``s x s`` kernels and multiply ``[s, s] @ [s, D]`` blocks: microseconds
of arithmetic that MKL splits over its OpenMP team.  :func:`local_blas_threads` sets MKL's
thread-local thread count (``MKL_Set_Num_Threads_Local``, found by :func:`mkl_local_setter` in the
MKL that PyTorch links) for a block of code.  ``ATTNPATCH_LOCAL_BLAS_THREADS=0`` turns it off.
"""

from __future__ import annotations

import contextlib
import os

import torch

__all__ = ["local_blas_threads", "mkl_local_setter"]

_MKL_LOCAL: object = None  # resolved on first use: MKL's thread-local thread-count setter, or False


def mkl_local_setter():
    """``MKL_Set_Num_Threads_Local`` of the MKL inside PyTorch (C ABI, ``int f(int)``), or ``False`` where there is none.

    PyTorch's x86 wheels link MKL statically into ``libtorch_cpu`` and export MKL's service
    functions; other builds (OpenBLAS, Accelerate) have no such symbol and get ``False``.
    ``ATTNPATCH_LOCAL_BLAS_THREADS=0`` turns the lookup off.  The answer is looked up once per process
    (cached in ``_MKL_LOCAL``).

    Returns:
        A ``ctypes`` function ``int f(int n)`` that sets this OS thread's MKL thread count to ``n`` and
        returns the previous count, or ``False``.
    """
    global _MKL_LOCAL
    if _MKL_LOCAL is None:
        _MKL_LOCAL = False
        if os.environ.get("ATTNPATCH_LOCAL_BLAS_THREADS", "1") != "0" and torch.backends.mkl.is_available():
            import ctypes
            import glob

            libdir = os.path.join(os.path.dirname(torch.__file__), "lib")
            for path in sorted(glob.glob(os.path.join(libdir, "*torch_cpu*"))) + [None]:
                try:
                    fn = ctypes.CDLL(path).MKL_Set_Num_Threads_Local  # C interface (by value), not the Fortran alias
                except Exception:  # no such library or symbol (OSError, AttributeError; TypeError on some platforms)
                    continue
                fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_int]
                _MKL_LOCAL = fn
                break
    return _MKL_LOCAL


@contextlib.contextmanager
def local_blas_threads(n: int = 1, device: torch.device | str | None = None):
    """Run MKL (BLAS/LAPACK) calls of *this* OS thread on ``n`` threads inside the block; other threads are untouched.

    Small matrix work (the ``s x s`` landmark kernel, its eigendecomposition, ``[s, s] @ [s, D]``
    products) is microseconds of arithmetic split over MKL's OpenMP team.  On an idle machine
    that costs nothing, but while another process keeps the cores busy every parallel region
    waits for a descheduled team thread, and work of a few milliseconds takes far longer (measured
    beside a competing process: docs/benchmarks/contention.md).  One thread has nothing to
    wait for.  The setting is MKL's thread-local ``mkl_set_num_threads_local`` (restored on exit),
    so unlike ``torch.set_num_threads`` it is safe with other Python threads (PyTorch sets the same
    thread-local count to its thread count when a thread first runs an operator); ATen's own
    ``parallel_for`` (SDPA, element-wise kernels) is not affected.  A no-op on CUDA tensors and
    on builds without MKL.

    Args:
        n: MKL threads of this OS thread inside the block.
        device: the device the block's tensors are on; anything but the CPU (or ``None``) makes it a no-op.
    """
    fn = mkl_local_setter() if device is None or torch.device(device).type == "cpu" else False
    if not fn:
        yield
        return
    torch.get_num_threads()  # PyTorch's lazy per-thread init sets MKL's local count itself: run it first, not inside
    prev = fn(int(n))
    try:
        yield
    finally:
        fn(prev)
