"""Nyströmformer: Nyström-approximated softmax attention on segment-mean landmarks.

Source: Xiong et al. 2021, "Nyströmformer: A Nyström-Based Algorithm for Approximating
Self-Attention" (arXiv 2102.03902), Sec. 3, Eq. 13-16.  With ``Q, K, V`` ``[N, D]`` per head and
the ``s`` landmarks ``Q~, K~`` ``[s, D]`` (segment means of the queries and of the keys):

    softmax(Q K^T c) V  ~=  softmax(Q K~^T c) . pinv(softmax(Q~ K~^T c)) . softmax(Q~ K^T c) . V

(``c`` = the attention scale; Eq. 13/14), with the pseudo-inverse of the ``s x s`` landmark kernel
by the paper's iteration (Eq. 16, from Razavi et al. 2014)::

    Z_0 = A^T / (||A||_1 ||A||_inf),   Z_{j+1} = 1/4 Z_j (13 I - A Z_j (15 I - A Z_j (7 I - A Z_j)))

The paper's depthwise convolution of ``V`` (a trained skip path) is not part of a training-free
patch and is left out.  Unlike FNA (:mod:`attnpatch.attention.nystrom`), whose landmarks are real
tokens picked by farthest-point sampling once per forward, the landmarks here are averages over
contiguous segments of the sequence, recomputed from each layer's own queries and keys.

**Segments** (:func:`segment_plan`).  The ``prefix`` leading tokens (CLS, register tokens) are each
their own one-token segment (their own landmark: a ViT's CLS and register keys differ from every
patch key, and averaging them into a patch segment would blur both).  The ``M = N - prefix``
other tokens are split into ``g = s - prefix`` contiguous segments, segment ``j`` covering tokens
``prefix + floor(j M / g)`` up to (not including) ``prefix + floor((j + 1) M / g)``: every segment
holds ``floor(M / g)`` or ``ceil(M / g)`` tokens, so ``N`` need not be divisible by ``s`` (the
paper's code requires it).  With ``s = N`` every segment is one token, the landmark kernel is the
full attention matrix and only the iterative pseudo-inverse keeps the result from being exact.

Cost: time ``O(s N D + s^3)``, extra memory ``O((s + D) N)``; ``N x N`` is never formed (the two
``N x s`` products run as fused attention calls).  Functions take ``[batch, heads, tokens, head_dim]``
tensors; keys and values may have fewer heads (grouped-query attention).
"""

from __future__ import annotations

import torch

from ...errors import OptionError
from ..backends.blas import local_blas_threads
from .pinv import landmark_pinv

__all__ = ["segment_plan", "segment_means", "nystromformer_attention"]

_HALF = (torch.float16, torch.bfloat16)


def segment_plan(n: int, s: int, prefix: int = 0, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``s`` landmark segments of a sequence of ``n`` tokens, as a gather plan.

    Args:
        n: tokens.
        s: landmarks (segments), ``prefix < s <= n``.
        prefix: leading tokens (CLS, registers), each its own segment; the other ``n - prefix``
            tokens are split into ``s - prefix`` contiguous segments of ``floor`` or ``ceil`` of
            ``(n - prefix) / (s - prefix)`` tokens (module docstring).
        device: device of the returned tensors.

    Returns:
        ``(index, weight)``, both ``[s, L]`` with ``L`` the longest segment: ``index[j]`` the tokens
        of segment ``j`` (padded by repeating its last token), ``weight[j]`` ``1 / len(segment j)``
        on its tokens and ``0`` on the padding (float32), so that the mean of segment ``j`` is
        ``sum_l weight[j, l] x[index[j, l]]``.

    Raises:
        OptionError: ``s`` outside ``(prefix, n]``, or a negative ``prefix``.
    """
    if prefix < 0 or not prefix < s <= n:
        raise OptionError(
            f"s={s}: the number of landmarks must be in ({prefix}, N={n}] (the {prefix} prefix tokens, CLS and "
            "registers, are landmarks of their own and at least one segment must hold the other tokens)"
        )
    m, g = n - prefix, s - prefix
    bounds = prefix + (torch.arange(g + 1, dtype=torch.long) * m) // g  # [g + 1], exact integer arithmetic
    starts = torch.cat([torch.arange(prefix, dtype=torch.long), bounds[:-1]])  # [s]
    ends = torch.cat([torch.arange(1, prefix + 1, dtype=torch.long), bounds[1:]])  # [s]
    lengths = ends - starts  # >= 1
    width = int(lengths.max())
    offs = torch.arange(width, dtype=torch.long)
    index = torch.minimum(starts[:, None] + offs[None, :], (ends - 1)[:, None])
    weight = torch.where(offs[None, :] < lengths[:, None], 1.0 / lengths[:, None].float(), torch.zeros(()))
    return index.to(device), weight.to(device)


def segment_means(x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Segment means of ``x`` ``[B, H, N, D]`` by the plan of :func:`segment_plan` -> ``[B, H, s, D]``,
    in ``x``'s dtype (``weight`` is cast to it; pass float32 ``x`` for float32 averaging of half inputs).
    Extra memory ``O(B H (N + s) D)`` (one gathered copy)."""
    b, h, _, d = x.shape
    s, width = index.shape
    g = x.index_select(2, index.reshape(-1)).view(b, h, s, width, d)
    return (g * weight.to(x.dtype)[:, :, None]).sum(-2)


def nystromformer_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    s: int,
    *,
    scale: float,
    prefix: int = 0,
    pinv_iters: int = 6,
) -> torch.Tensor:
    """Nyströmformer attention (Xiong et al. 2021, Eq. 13-16), evaluated right to left.

    ``out = F (Z (B V))`` with ``Q~, K~`` ``[s, D]`` the segment means of ``Q`` and ``K``
    (:func:`segment_plan`), ``F = softmax(Q K~^T c)`` ``[N, s]``, ``A = softmax(Q~ K~^T c)``
    ``[s, s]``, ``Z`` = ``pinv_iters`` steps of the paper's iterative pseudo-inverse of ``A``
    (Eq. 16; :func:`attnpatch.attention.nystrom.pinv.landmark_pinv` with ``mode="newton"``, float32,
    scaled per matrix so that items and heads do not influence each other) and
    ``B = softmax(Q~ K^T c)`` ``[s, N]``.  ``B V`` and ``F W`` are fused attention calls (``s``
    queries over ``N`` keys; ``N`` queries over ``s`` keys): no ``N x s`` buffer either.

    Half-precision inputs (bfloat16, float16): the segment means, the landmark kernel, its
    pseudo-inverse, ``W = Z (B V)`` and ``F W`` are float32 (``Z`` of a few iterations is not
    bounded, so ``W`` may leave float16's range; the float16 output saturates at +-65504 instead
    of becoming inf), and the result is cast back.  The ``s x s`` work runs on one MKL thread on the
    CPU (:func:`attnpatch.attention.backends.blas.local_blas_threads`).

    Args:
        q: ``[B, H, N, D]`` queries; k: ``[B, Hkv, N, D]`` keys; v: ``[B, Hkv, N, Dv]`` values
            (``H`` a multiple of ``Hkv``: grouped-query attention).  Non-causal, no padding.
        s: landmarks, ``prefix < s <= N``.
        scale: attention scale ``c`` (usually ``D ** -0.5``).
        prefix: leading tokens (CLS, registers) that are landmarks of their own.
        pinv_iters: iterations of the pseudo-inverse (>= 1; the paper uses 6).

    Returns:
        ``[B, H, N, Dv]`` in ``q``'s dtype.  Peak extra memory ``O(B H (s + D) N)`` elements.

    Raises:
        OptionError: ``s`` outside ``(prefix, N]`` or ``pinv_iters < 1``.
    """
    b, h, n, _ = q.shape
    if pinv_iters < 1:
        raise OptionError(f"pinv_iters={pinv_iters}: must be an integer >= 1")
    index, weight = segment_plan(n, s, prefix, q.device)
    if k.shape[1] != h:
        k = k.repeat_interleave(h // k.shape[1], dim=1)
        v = v.repeat_interleave(h // v.shape[1], dim=1)
    half = q.dtype in _HALF
    wd = torch.float32 if half else q.dtype
    q_l = segment_means(q.to(wd), index, weight)  # [B,H,s,D]
    k_l = segment_means(k.to(wd), index, weight)
    with local_blas_threads(1, q.device):
        a = torch.softmax((q_l * scale) @ k_l.transpose(-1, -2), dim=-1)  # [B,H,s,s]
        z = landmark_pinv(a, "newton", iters=pinv_iters)  # float32 work; wd out
    sdpa = torch.nn.functional.scaled_dot_product_attention
    bv = sdpa(q_l.to(q.dtype), k, v, scale=scale)  # [B,H,s,Dv]: convex combinations of V rows
    with local_blas_threads(1, q.device):
        w = z @ bv.to(wd)  # [B,H,s,Dv]
    if not half:
        return sdpa(q, k_l, w, scale=scale)
    out = sdpa(q.to(wd), k_l, w, scale=scale)
    if q.dtype == torch.float16:
        big = torch.finfo(torch.float16).max
        out = out.clamp(-big, big)
    return out.to(q.dtype)
