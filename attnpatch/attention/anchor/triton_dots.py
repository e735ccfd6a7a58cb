"""The tile products of AnchorAttention's Triton kernels (:mod:`.triton_select`, :mod:`.triton_attend`): every product
on the tensor cores with float32 accumulation, in the precision :func:`qk_precision` picks for the input dtype.

* Half-precision tiles (bfloat16, float16) multiply as they are: their products are exact in float32, so a logit
  ``q . k`` is the float32 sum of exact products (the logit scale is applied to the sum).
* Float32 tiles multiply in three products of split operands, on the tensor cores rather than the CUDA cores (whose
  operand layouts hold whole tiles in registers and spilled tens of kilobytes per thread on sm_90:
  ``benchmarks/triton_compile.py``): three TF32 products (``"tf32x3"``, Triton's own: each operand split into a high
  and a low TF32 part, about 2^-21 relative error per product) up to head dim 64; three bfloat16 products
  (``"bf16x3"``, :func:`split_bf16` and :func:`dot3`: about 2^-16) for wider tiles, where three TF32 products of
  128-wide tiles do not fit the registers.

Under the Triton interpreter (``UPCAST``; its ``tl.dot`` on bfloat16 is broken, triton issue 11584) the bfloat16
parts are multiplied as float32 tiles: the same products, summed in another order.  What the precision means for the
kept stripes: docs/methods.md, "The Triton kernels' precision".

Source: the split products are the error-corrected low-precision GEMM of Ootomo and Yokota 2022 ("Recovering single
precision accuracy from Tensor Cores while surpassing the FP32 theoretical peak performance", Eq. 3-4: the
``a_lo b_lo`` term dropped); Triton's ``input_precision="tf32x3"`` for the TF32 form.
"""

from __future__ import annotations

import torch

from ..backends.triton_support import TRITON_AVAILABLE

if TRITON_AVAILABLE:  # imported here, on first use of a kernel: `import attnpatch` loads no Triton module
    from ..backends.triton_support import tl, triton

__all__ = ["head_tile", "qk_precision", "key_tile", "split_bf16", "dot3", "dot2", "qk"]


def head_tile(d: int) -> int:
    """Head-dim columns per tile: ``d`` (columns) rounded up to a power of two, at least 16 (columns past ``d`` are
    zeros)."""
    return max(16, 1 << (d - 1).bit_length())


def qk_precision(dtype: torch.dtype, head_dim: int) -> str:
    """How the kernels multiply tiles of ``dtype`` with ``head_dim`` columns: ``"native"`` for half precision,
    ``"tf32x3"`` for float32 up to 64 columns (:func:`head_tile`), ``"bf16x3"`` above (module docstring)."""
    if dtype != torch.float32:
        return "native"
    return "tf32x3" if head_tile(head_dim) <= 64 else "bf16x3"


def key_tile(interp: bool, dtype: torch.dtype) -> int:
    """Keys per tile of the selection and the probe masses: 64 on a GPU, 32 for float32 inputs (their split parts
    hold twice the registers: at 64 a head dim of 128 spills on sm_90, ``benchmarks/triton_compile.py``); 128 under
    the interpreter (its cost is per operation, not per element)."""
    if interp:
        return 128
    return 32 if dtype == torch.float32 else 64


if TRITON_AVAILABLE:

    @triton.jit
    def split_bf16(x):
        """A float32 tile ``x`` ``[M, K]`` as two bfloat16 tiles ``(hi, lo)`` of its shape, ``hi + lo = x`` to about
        2^-16 relative."""
        hi = x.to(tl.bfloat16)
        return hi, (x - hi.to(tl.float32)).to(tl.bfloat16)

    @triton.jit
    def dot3(a_hi, a_lo, b_hi, b_lo, acc, UPCAST: tl.constexpr):
        """``acc + (a_hi + a_lo) @ (b_hi + b_lo)`` less the ``a_lo @ b_lo`` term: ``a`` parts ``[M, K]``, ``b`` parts
        ``[K, N]`` bfloat16 (split by :func:`split_bf16`), ``acc`` ``[M, N]`` float32 (or 0.0); three bfloat16
        products accumulated in float32, small terms first."""
        if UPCAST:
            a_hi, a_lo, b_hi, b_lo = a_hi.to(tl.float32), a_lo.to(tl.float32), b_hi.to(tl.float32), b_lo.to(tl.float32)
        part = tl.dot(a_lo, b_hi)
        part = tl.dot(a_hi, b_lo, part)
        return tl.dot(a_hi, b_hi, part) + acc

    @triton.jit
    def dot2(a, b_hi, b_lo, UPCAST: tl.constexpr):
        """``a @ (b_hi + b_lo)``, ``[M, N]`` float32, for a bfloat16 ``a`` ``[M, K]`` that is exact (a 0/1 matrix) and
        the split parts ``[K, N]`` of a float32 tile: two bfloat16 products."""
        if UPCAST:
            a, b_hi, b_lo = a.to(tl.float32), b_hi.to(tl.float32), b_lo.to(tl.float32)
        part = tl.dot(a, b_lo)
        return tl.dot(a, b_hi, part)

    @triton.jit
    def qk(a, b, QK: tl.constexpr, UPCAST: tl.constexpr):
        """``a @ b^T``: ``a`` ``[M, D]`` and ``b`` ``[N, D]`` tiles of the input dtype (float32 under ``UPCAST``) ->
        ``[M, N]`` float32, in the precision ``QK`` (:func:`qk_precision`)."""
        if QK == "bf16x3":
            a_hi, a_lo = split_bf16(a)
            b_hi, b_lo = split_bf16(b)
            out = dot3(a_hi, a_lo, tl.trans(b_hi), tl.trans(b_lo), 0.0, UPCAST)
        elif QK == "tf32x3":
            out = tl.dot(a, tl.trans(b), input_precision="tf32x3")
        else:
            out = tl.dot(a, tl.trans(b))
        return out
