"""One Fast Nyström Attention layer from ``q, k, v`` alone, and the inputs a benchmark times it on.

:func:`fna_layer` is what the ``fna`` method runs in a layer that samples its landmarks (``features="keys"``,
``strategy="fps"``, no local window, no sink mask), without the method's per-forward state: farthest-point sampling
on the keys (heads concatenated), then :func:`~.fna.nystrom_attention`.  On CUDA every stage
stays on the device (FPS as one Triton launch, :mod:`attnpatch.attention.landmarks.fps_triton`; ``pinv="rtol"`` from
batched products, :mod:`.pinv_matmul`, or one Triton launch, :mod:`.pinv_triton`; two fused attention calls), so the call never waits on the GPU and can be captured in a CUDA
graph.  :func:`fna_layer_case` builds random inputs and the two callables a benchmark compares (FNA against SDPA).

Source: "Fast Nyström Attention" (arXiv 2507.16018), Sec. 3 (landmarks) and Eq. 3 (the Nyström form).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..landmarks.fps import farthest_point_sampling
from .fna import nystrom_attention

__all__ = ["fna_layer", "fna_layer_case"]


def fna_layer(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    s: int,
    *,
    prefix: int = 1,
    scale: float | None = None,
    pinv: str = "rtol",
    rtol: float = 1e-2,
    iters: int = 6,
    fps_kernel: str = "auto",
    pinv_kernel: str = "auto",
) -> torch.Tensor:
    """FNA attention of one layer: ``s`` landmarks by FPS on the keys, then Nyström attention on them.

    Args:
        q, k, v: ``[B, H, N, D]`` (same head count; non-causal), float32, float16 or bfloat16.
        s: landmarks per item (tokens, prefix included), ``max(prefix, 1) <= s <= N``.
        prefix: leading tokens always landmarks (CLS, registers).
        scale: attention scale (``None``: ``D ** -0.5``).
        pinv, rtol, iters: the landmark kernel's pseudo-inverse (:func:`~.pinv.landmark_pinv`).
        fps_kernel: :func:`~attnpatch.attention.landmarks.fps.farthest_point_sampling`'s ``kernel``.
        pinv_kernel: :func:`~.pinv.landmark_pinv`'s ``kernel`` (the ``"rtol"`` pseudo-inverse).

    Returns:
        ``[B, H, N, D]`` in ``q``'s dtype.

    Raises:
        OptionError: ``s`` out of range, an unknown ``pinv``, ``fps_kernel`` or ``pinv_kernel``.
        KernelError: a kernel asked for by name that cannot run here.
    """
    b, h, n, d = k.shape
    feats = k.transpose(1, 2).reshape(b, n, h * d)  # [B, N, H*D]: the fna method's features="keys"
    landmarks = farthest_point_sampling(feats, s, prefix, kernel=fps_kernel)
    return nystrom_attention(q, k, v, landmarks, scale=d**-0.5 if scale is None else scale, pinv=pinv, rtol=rtol,
                             iters=iters, pinv_kernel=pinv_kernel)


def fna_layer_case(
    n: int,
    s: int = 64,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cuda",
    *,
    batch: int = 1,
    heads: int = 6,
    head_dim: int = 64,
    seed: int = 0,
) -> dict:
    """Random inputs of one attention layer and the calls a benchmark times on them.

    Args:
        n: tokens per item (e.g. 1025, 4097, 16385, 65537: CLS plus a square patch grid).
        s: FNA landmarks.
        dtype: dtype of ``q, k, v``.
        device: where they live.
        batch, heads, head_dim: the ``[B, H, N, D]`` shape (defaults: DINOv2-S's 6 heads of 64).
        seed: seed of the standard-normal ``q, k, v`` (drawn in float32 on the CPU, then moved and cast).

    Returns:
        ``{"q", "k", "v"}`` (``[batch, heads, n, head_dim]``), ``"fna"``: a no-argument callable running
        :func:`fna_layer` ``(q, k, v, s)`` (prefix 1, default ``pinv="rtol"``), ``"sdpa"``: a no-argument callable
        running ``F.scaled_dot_product_attention(q, k, v)`` (exact attention), ``"shape"``: the shape as a tuple.
    """
    g = torch.Generator().manual_seed(seed)
    shape = (batch, heads, n, head_dim)
    q, k, v = (torch.randn(shape, generator=g).to(device=device, dtype=dtype) for _ in range(3))
    return {
        "q": q,
        "k": k,
        "v": v,
        "shape": shape,
        "fna": lambda: fna_layer(q, k, v, s),
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v),
    }
