"""The pseudo-inverse of the ``s x s`` landmark kernels of the Nyström methods, and its one dispatcher.

Modes (:data:`PINV_MODES`): ``"rtol"`` (regularised: singular values below ``rtol x`` the largest dropped),
``"newton"`` (Nyströmformer's Newton-Schulz iteration, Xiong et al. 2021, Eq. 15-16) and ``"exact"`` (float64 SVD,
unregularised).  ``"rtol"`` has three kernels, chosen by :func:`attnpatch.attention.backends.dispatch.choose`
(operation ``"pinv"``):

* ``"eigh"``: the truncated pseudo-inverse from the symmetric eigendecomposition of ``A^T A`` (the CPU's; a batched
  ``eigh`` is faster than a batched SVD there);
* ``"products"``: a smooth cut-off at the same ``rtol`` from batched matrix products only
  (:func:`~.pinv_matmul.landmark_pinv_matmul`: no factorisation, no cuSOLVER call, no host sync; CUDA's);
* ``"triton"``: the same filter as one Triton launch (:func:`~.pinv_triton.landmark_pinv_triton`; CUDA, ``s <= 64``,
  float32 work).

With FPS's Triton kernel the whole FNA layer is then CUDA-graph capturable on CUDA; ``"exact"`` stays an SVD
(cuSOLVER, a host sync) on every device.

Source: FNA (arXiv 2507.16018), Eq. 3; Nyströmformer (arXiv 2102.03902), Eq. 13-16.
"""

from __future__ import annotations

import torch

from ...errors import OptionError
from ..backends.blas import local_blas_threads
from ..backends.dispatch import Call, choose
from .pinv_matmul import landmark_pinv_matmul

__all__ = ["PINV_MODES", "landmark_pinv", "landmark_pinv_work"]

PINV_MODES = ("rtol", "newton", "exact")


def _work_dtype(a: torch.Tensor, rtol: float) -> torch.dtype:
    """The working precision of ``"rtol"``: float32 when ``rtol >= 1e-2`` (the cut-off ``rtol^2`` on ``sigma^2`` is far
    above float32's resolution), float64 for smaller ``rtol`` or float64 input."""
    return torch.float64 if a.dtype == torch.float64 or rtol < 1e-2 else torch.float32


def _eigh_pinv(a: torch.Tensor, rtol: float) -> torch.Tensor:
    """Truncated pseudo-inverse ``V diag(1/sigma^2) V^T A^T`` from ``A^T A = V diag(sigma^2) V^T``, singular values
    below ``rtol x sigma_max`` dropped."""
    work = _work_dtype(a, rtol)
    x = a.to(work)
    xt = x.transpose(-1, -2)
    lam, vec = torch.linalg.eigh(xt @ x)  # squared singular values of A (ascending) and right singular vectors
    inv = torch.where(lam > (rtol * rtol) * lam[..., -1:], 1.0 / lam.clamp(min=torch.finfo(work).tiny), 0.0)
    return (vec * inv[..., None, :]) @ (vec.transpose(-1, -2) @ xt)


def landmark_pinv_work(a: torch.Tensor, mode: str, rtol: float, iters: int, *, kernel: str = "auto") -> torch.Tensor:
    """:func:`landmark_pinv` in its working precision (float32, or float64), never cast to a half dtype, and
    without the one-thread BLAS block (callers that run it inside :func:`local_blas_threads` themselves).

    Args:
        a: ``[..., s, s]`` landmark kernels.
        mode, rtol, iters, kernel: see :func:`landmark_pinv`.

    Returns:
        ``[..., s, s]`` float32 (``"newton"``, ``"rtol"`` with ``rtol >= 1e-2`` on non-float64 input) or float64.

    Raises:
        OptionError: unknown mode or kernel (``"newton"`` and ``"exact"`` have one kernel each, of their name and
            ``"svd"``).
        KernelError: a kernel asked for by name that cannot run here.
    """
    op = {"rtol": "pinv", "newton": "pinv_newton", "exact": "pinv_exact"}.get(mode)
    if op is None:
        raise OptionError(f"pinv={mode!r}: allowed values are {', '.join(map(repr, PINV_MODES))}")
    use = choose(op, kernel, Call(a.device, a.dtype, side=a.shape[-1], work_dtype=_work_dtype(a, rtol)))
    if use == "triton":
        from .pinv_triton import landmark_pinv_triton  # imports Triton: only where its kernel runs

        return landmark_pinv_triton(a, rtol)
    if use == "products":
        return landmark_pinv_matmul(a, rtol)
    if use == "eigh":
        return _eigh_pinv(a, rtol)
    if use == "svd":
        return torch.linalg.pinv(a.double())
    k = a.float()
    eye = torch.eye(k.shape[-1], dtype=k.dtype, device=k.device)
    col = k.abs().sum(-2).amax(-1)
    row = k.abs().sum(-1).amax(-1)
    z = k.transpose(-1, -2) / (col * row)[..., None, None]
    for _ in range(iters):
        kz = k @ z
        z = 0.25 * z @ (13 * eye - kz @ (15 * eye - kz @ (7 * eye - kz)))
    return z


def landmark_pinv(a: torch.Tensor, mode: str = "rtol", *, rtol: float = 1e-2, iters: int = 6,
                  kernel: str = "auto") -> torch.Tensor:
    """Pseudo-inverse of a batch of ``s x s`` landmark kernels.

    Args:
        a: ``[..., s, s]`` row-stochastic matrices ``softmax(Q~ K~^T c)``.
        mode: ``"rtol"`` — truncated pseudo-inverse dropping singular values below
            ``rtol x sigma_max`` (regularised), in float32 whatever ``a``'s dtype when ``rtol >= 1e-2`` (the cut-off
            ``rtol^2`` on ``sigma^2`` is then far above float32's resolution; ``tests/test_fna.py`` checks the
            agreement with a float64 truncated SVD), in float64 for smaller ``rtol`` or float64 input; computed by the
            kernel of ``kernel`` (module docstring: the eigendecomposition on the CPU; on CUDA the smooth cut-off of
            :func:`~.pinv_matmul.landmark_pinv_matmul`, singular values ``sigma`` weighted by ``phi ~ 1 -
            2^-(sigma/tau)^2``, ``tau = rtol x sigma_max``: equal to the truncated pseudo-inverse within 0.2% on
            ``sigma >= 3 tau``, different within a factor of 2 of ``tau``); ``"newton"`` — ``iters`` Newton-Schulz
            steps in float32 from Nyströmformer's start ``Z0 = A^T / (max_j sum_i |a_ij| . max_i sum_j |a_ij|)``
            (Xiong et al. 2021, Eq. 15-16; the scaling is per matrix here, so items do not influence each other);
            ``"exact"`` — float64 SVD pseudo-inverse, default cut-off.  On the CPU the factorisation runs on one MKL
            thread (:func:`~attnpatch.attention.backends.blas.local_blas_threads`): it is tiny, and a multi-threaded
            ``eigh`` stalls when another process holds the cores (docs/benchmarks/contention.md).
        rtol: relative singular-value cut-off of ``"rtol"`` (> 0).
        iters: Newton-Schulz iterations (>= 1).
        kernel: ``"auto"`` or the ``"rtol"`` kernel by name: ``"eigh"``, ``"products"``, ``"triton"``
            (:func:`~attnpatch.attention.backends.dispatch.choose`, operation ``"pinv"``; ``"newton"`` and ``"exact"``
            have one form each, operations ``"pinv_newton"`` and ``"pinv_exact"``).

    Returns:
        ``[..., s, s]`` in ``a``'s dtype.  For a half-precision ``a`` the entries can exceed the
        dtype's range (``"exact"`` on a badly conditioned kernel can exceed float16's largest
        value, 65504); :func:`~.fna.nystrom_attention` therefore keeps the pseudo-inverse in float32 and never
        casts it back.

    Raises:
        OptionError: unknown mode or kernel.
        KernelError: a kernel asked for by name that cannot run here.
    """
    with local_blas_threads(1, a.device):
        return landmark_pinv_work(a, mode, rtol, iters, kernel=kernel).to(a.dtype)
