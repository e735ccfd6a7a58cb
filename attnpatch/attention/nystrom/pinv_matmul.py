"""A regularised pseudo-inverse of small landmark kernels from matrix products only: no factorisation, no host sync.

:func:`landmark_pinv_matmul` is what ``pinv="rtol"`` of :func:`~attnpatch.attention.nystrom.pinv.landmark_pinv` runs on
CUDA tensors (its ``"products"`` kernel: :mod:`attnpatch.attention.backends.dispatch`): the eigendecomposition the CPU uses is a
cuSOLVER call there, which checks its status on the host (a device-to-host sync per call) and is slow for a batch of
``s x s`` matrices.  Here every step is a batched ``s x s`` product and the step count depends on ``rtol`` only, so
the whole pseudo-inverse is a fixed sequence of kernels: CUDA-graph capturable and ``torch.compile(fullgraph=True)``
traceable.

The filter.  With the SVD ``A = sum_i sigma_i u_i v_i^T``, the truncated pseudo-inverse of the CPU path is
``sum_{sigma_i > tau} v_i u_i^T / sigma_i`` with ``tau = rtol sigma_max``.  The product form of the Newton-Schulz
iteration for ``pinv(A)`` (Ben-Israel and Cohen 1966; Nyströmformer, Xiong et al. 2021, Eq. 15-16, uses a
higher-order variant) started from ``Z_0 = alpha A^T`` gives after ``k`` steps

    Z_k = alpha A^T prod_{j<k} (I + R^(2^j)),   R = I - alpha A A^T,
        = sum_i phi(sigma_i) v_i u_i^T / sigma_i,   phi(sigma) = 1 - (1 - alpha sigma^2)^(2^k),

a smooth cut-off, not an approximation that must converge: ``k`` and ``alpha`` are chosen so that
``alpha 2^k = ln 2 / tau^2``, i.e. ``phi(sigma) ~ 1 - 2^-(sigma/tau)^2``: ``phi(tau) ~ 1/2`` (the cut-off
sits at ``tau`` as in the truncated pseudo-inverse), ``phi >= 15/16`` from ``2 tau`` and ``phi >= 1 - 2^-9`` from
``3 tau`` (there the result is the truncated pseudo-inverse to 0.2%), ``phi < 0.18`` below ``tau / 2`` and
``phi(sigma) ~ ln 2 (sigma/tau)^2`` far below (those directions are damped, as truncation drops them).  The norm is
bounded like the truncated one's: ``||Z||_2 <= max_sigma phi(sigma)/sigma < 1/tau``.  The difference from hard
truncation is confined to singular values within a factor of about 2 of ``tau``, where the truncated pseudo-inverse
itself jumps by ``1/tau`` when a singular value crosses ``tau``.

``sigma_max^2`` is bounded without a factorisation by the trace of a power of ``G = A A^T``:
``lambda_max(G) <= tr(G^(2^m))^(2^-m) <= s^(2^-m) lambda_max(G)`` (``m`` squarings, each renormalised to trace 1);
with ``m = 8`` and ``s <= 256`` the estimate is at most 2.2% high, so ``tau`` at most 1.1% high.  ``alpha`` is taken
from that upper bound, which keeps ``alpha sigma^2 <= 1`` (the iteration's convergence condition) for every
singular value.

On CUDA, for ``s <= 64`` in float32, the same filter runs as one Triton launch instead (:mod:`.pinv_triton`, the
``"triton"`` kernel).

Cost: ``m + 2k`` batched ``s x s`` products (``k = ceil(log2(ln 2 / rtol^2))``: 13 at ``rtol = 1e-2``, 20 at
``1e-3``), no ``O(s^3)`` factorisation.  Precision: float32 for ``rtol >= 1e-2`` (``G``'s entries resolve singular
values down to ``sqrt(eps_32) sigma_max``, well below ``tau``), float64 below, as the CPU path chooses.
"""

from __future__ import annotations

import math

import torch

__all__ = ["SQUARINGS", "filter_steps", "landmark_pinv_matmul", "gram_norm_bound"]

#: Trace-power squarings of :func:`gram_norm_bound` used by :func:`landmark_pinv_matmul`.
SQUARINGS = 8


def filter_steps(rtol: float) -> int:
    """Newton-Schulz steps ``k = ceil(log2(ln 2 / rtol^2))`` of :func:`landmark_pinv_matmul` for the cut-off ``rtol``
    (a Python int: fixed by the argument, never by the data).

    Raises:
        ValueError: ``rtol`` outside ``(0, 1)``.
    """
    if not 0.0 < rtol < 1.0:
        raise ValueError(f"rtol={rtol}: must be in (0, 1)")
    return max(1, math.ceil(math.log2(math.log(2.0) / (rtol * rtol))))


def gram_norm_bound(g: torch.Tensor, squarings: int = SQUARINGS) -> torch.Tensor:
    """An upper bound of the largest eigenvalue of symmetric positive semi-definite ``g`` from matrix products only.

    ``tr(g^(2^m))^(2^-m)`` with ``m = squarings``, computed as ``t_0 prod_j t_j^(2^-j)`` where ``t_j`` is the trace
    after the ``j``-th squaring of ``g / t_0`` (each renormalised to trace 1, so nothing overflows).  For
    ``s x s`` ``g``: ``lambda_max <= bound <= s^(2^-m) lambda_max`` (exact arithmetic).

    Args:
        g: ``[..., s, s]`` symmetric PSD (e.g. ``A A^T``), float32 or float64.
        squarings: ``m >= 0``.

    Returns:
        ``[..., 1, 1]`` in ``g``'s dtype.
    """
    tiny = torch.finfo(g.dtype).tiny
    t = torch.diagonal(g, dim1=-2, dim2=-1).sum(-1)[..., None, None].clamp(min=tiny)
    m = g / t
    log_bound = torch.log(t)
    for j in range(1, squarings + 1):
        m = m @ m
        t = torch.diagonal(m, dim1=-2, dim2=-1).sum(-1)[..., None, None].clamp(min=tiny)
        m = m / t
        log_bound = log_bound + torch.log(t) * (0.5**j)
    return torch.exp(log_bound)


def landmark_pinv_matmul(a: torch.Tensor, rtol: float = 1e-2, *, squarings: int = SQUARINGS) -> torch.Tensor:
    """Smoothly truncated pseudo-inverse of a batch of ``s x s`` landmark kernels from batched products (module
    docstring): ``sum_i phi(sigma_i) v_i u_i^T / sigma_i`` with ``phi(sigma) ~ 1 - 2^-(sigma/tau)^2`` and
    ``tau = rtol sigma_max``.

    Args:
        a: ``[..., s, s]`` landmark kernels (any float dtype; row-stochastic ``softmax(Q~ K~^T c)`` in FNA, or
            ``exp`` of shifted logits in the local-window hybrid).
        rtol: relative cut-off ``tau / sigma_max``, in ``(0, 1)``.
        squarings: trace-power squarings of the ``sigma_max`` bound (:func:`gram_norm_bound`).

    Returns:
        ``[..., s, s]`` in float32 (``rtol >= 1e-2`` and non-float64 ``a``) or float64.

    Raises:
        ValueError: ``rtol`` outside ``(0, 1)``.

    Source: Newton-Schulz pseudo-inverse iteration (Ben-Israel and Cohen 1966; Nyströmformer, Xiong et al. 2021,
    Sec. 3, Eq. 15-16) with a fixed step count chosen as a spectral filter; used by FNA (arXiv 2507.16018) on CUDA.
    """
    k = filter_steps(rtol)
    work = torch.float64 if a.dtype == torch.float64 or rtol < 1e-2 else torch.float32
    x = a.to(work)
    xt = x.transpose(-1, -2)
    g = x @ xt  # [.., s, s] = A A^T
    bound = gram_norm_bound(g, squarings)  # >= sigma_max^2
    alpha = math.log(2.0) / (rtol * rtol * 2.0**k) / bound  # alpha 2^k = ln 2 / tau^2, alpha sigma_max^2 <= 1
    eye = torch.eye(g.shape[-1], dtype=work, device=g.device)
    r = eye - alpha * g
    p = eye + r
    for _ in range(k - 1):
        r = r @ r
        p = p + p @ r  # p (I + r): polynomials in A A^T commute
    return (alpha * xt) @ p
