"""The product pseudo-inverse of :mod:`.pinv_matmul` as one Triton kernel: one program per ``s x s`` matrix.

:func:`landmark_pinv_triton` computes exactly the filter of
:func:`~attnpatch.attention.nystrom.pinv_matmul.landmark_pinv_matmul` (the trace-power bound of ``sigma_max^2``, then
``alpha A^T prod_{j<k} (I + R^(2^j))``, ``R = I - alpha A A^T``), but the ``m + 2k`` products and the
element-wise steps between them (about ninety small kernels in PyTorch) run inside one program per matrix, on
zero-padded ``S x S`` register tiles (``S`` = ``s`` rounded up to a power of two, 16 to 64), with float32 ``tl.dot``
(IEEE FMA products up to ``S = 32``, three-pass TF32 tensor-core products at 64: :data:`_TILE_SETTINGS`).  Zero
padding changes nothing: the padded rows and columns of ``A A^T`` are zero,
so the padded block of ``R`` is the identity and the padded rows and columns of the result are zero.

Source: as :mod:`.pinv_matmul` (Newton-Schulz with a fixed step count as a spectral filter; Nyströmformer, Xiong
et al. 2021, Eq. 15-16); used by FNA (arXiv 2507.16018) on CUDA.
"""

from __future__ import annotations

import math

import torch

from ..backends.triton_support import TRITON_AVAILABLE, interpreted, launchable

if TRITON_AVAILABLE:  # imported here, on first use of a kernel: `import attnpatch` loads no Triton module
    from ..backends.triton_support import tl, triton
from .pinv_matmul import SQUARINGS, filter_steps

__all__ = ["MAX_SIDE", "landmark_pinv_triton"]

#: Largest ``s`` the register-tile kernel takes (four to six ``64 x 64`` float32 tiles live at once).
MAX_SIDE = 64

#: ``tl.dot`` precision and warps per padded side, chosen from the sm_90 compiler's register report (no spills):
#: float32 FMA products ("ieee") up to 32; at 64 they spill (a 5 KB stack per thread), so 64 uses three TF32
#: tensor-core products per product ("tf32x3": the operands split into high and low TF32 parts, about float32's
#: accuracy) on 4 warps (240 registers, no stack).
_TILE_SETTINGS = {16: ("ieee", 4), 32: ("ieee", 8), 64: ("tf32x3", 4)}


if TRITON_AVAILABLE:

    @triton.jit
    def _trace(m, diag):
        return tl.sum(tl.where(diag, m, 0.0))

    @triton.jit
    def _pinv_kernel(a_ptr, z_ptr, s, stride_ab, stride_ai, stride_aj, stride_zb, stride_zi, stride_zj, coef, k,
                     SQUARINGS: tl.constexpr, S: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """``Z = landmark_pinv_matmul(A)`` for matrix ``program_id(0)``; ``coef = ln 2 / (rtol^2 2^k)``."""
        pid = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, S)
        inside = (i[:, None] < s) & (i[None, :] < s)
        diag = i[:, None] == i[None, :]
        a = tl.load(a_ptr + pid * stride_ab + i[:, None] * stride_ai + i[None, :] * stride_aj, mask=inside,
                    other=0.0).to(tl.float32)
        at = tl.trans(a)
        g = tl.dot(a, at, input_precision=DOT_PRECISION)  # A A^T
        # sigma_max^2 <= tr(G^(2^m))^(2^-m) = t_0 prod_j t_j^(2^-j), each squaring renormalised to trace 1
        t = tl.maximum(_trace(g, diag), 1.1754943508222875e-38)
        m = g / t
        log_bound = tl.log(t)
        w = 0.5
        for _ in tl.static_range(SQUARINGS):
            m = tl.dot(m, m, input_precision=DOT_PRECISION)
            t = tl.maximum(_trace(m, diag), 1.1754943508222875e-38)
            m = m / t
            log_bound += tl.log(t) * w
            w = w * 0.5
        alpha = coef / tl.exp(log_bound)
        eye = tl.where(diag, 1.0, 0.0)
        r = eye - alpha * g
        p = eye + r
        for _ in range(k - 1):
            r = tl.dot(r, r, input_precision=DOT_PRECISION)
            p = p + tl.dot(p, r, input_precision=DOT_PRECISION)
        z = tl.dot(at, p, input_precision=DOT_PRECISION) * alpha
        tl.store(z_ptr + pid * stride_zb + i[:, None] * stride_zi + i[None, :] * stride_zj, z, mask=inside)


def landmark_pinv_triton(a: torch.Tensor, rtol: float = 1e-2) -> torch.Tensor:
    """:func:`~attnpatch.attention.nystrom.pinv_matmul.landmark_pinv_matmul` (float32 work) in one kernel launch.

    Args:
        a: ``[..., s, s]`` with ``s <= MAX_SIDE`` (64), any float dtype but float64 (read as float32), on a CUDA device
            (or on the CPU under ``TRITON_INTERPRET=1``).
        rtol: relative cut-off, in ``[1e-2, 1)`` (below ``1e-2`` the work needs float64: use ``landmark_pinv_matmul``).

    Returns:
        ``[..., s, s]`` float32.

    Raises:
        ValueError: ``s > MAX_SIDE``, ``rtol`` outside ``[1e-2, 1)``, or float64 input.
        RuntimeError: Triton missing, or a CPU tensor without ``TRITON_INTERPRET=1``.
    """
    s = a.shape[-1]
    if a.shape[-2] != s or s > MAX_SIDE:
        raise ValueError(f"landmark kernel of shape {tuple(a.shape[-2:])}: needs square s x s with s <= {MAX_SIDE}")
    if not 1e-2 <= rtol < 1.0 or a.dtype == torch.float64:
        raise ValueError(
            f"rtol={rtol}, dtype {a.dtype}: the float32 kernel needs rtol in [1e-2, 1) and no float64 input")
    if not TRITON_AVAILABLE:
        raise RuntimeError("landmark_pinv_triton needs Triton; use landmark_pinv_matmul")
    if not launchable(a):
        raise RuntimeError(f"landmark_pinv_triton on a {a.device.type} tensor needs TRITON_INTERPRET=1 set before "
                           "attnpatch is imported")
    k = filter_steps(rtol)
    lead = a.shape[:-2]
    a3 = a.reshape(-1, s, s)
    if interpreted() and a3.dtype != torch.float32:
        a3 = a3.float()  # the interpreter's NumPy has no bfloat16; the kernel reads float32 anyway
    z = torch.empty(a3.shape, dtype=torch.float32, device=a.device)
    if a3.shape[0]:
        side = max(16, triton.next_power_of_2(s))
        precision, warps = _TILE_SETTINGS[side]
        _pinv_kernel[(a3.shape[0],)](
            a3, z, s, a3.stride(0), a3.stride(1), a3.stride(2), z.stride(0), z.stride(1), z.stride(2),
            math.log(2.0) / (rtol * rtol * 2.0**k), k, SQUARINGS=SQUARINGS, S=side, DOT_PRECISION=precision,
            num_warps=warps,
        )
    return z.reshape(*lead, s, s)
