"""Landmark selection: which ``s`` tokens of a layer stand for all ``N`` in a landmark method (FNA, AnchorFormer).

Strategies (:func:`select_landmarks`): ``fps`` (farthest-point sampling, :func:`farthest_point_sampling`,
with a slow float64 reference for tests; on CUDA tensors one Triton kernel launch,
:mod:`.landmarks_triton`), ``random`` (seeded), ``strided`` (evenly spaced) and
``kmeans`` (faiss k-means, nearest token to each centroid: :func:`kmeans_landmarks`).  The
``prefix`` tokens (CLS and register tokens) are always landmarks.  :func:`gather_tokens` picks the
landmarks' rows out of a ``[batch, heads, tokens, head_dim]`` tensor.

Source: "Fast Nyström Attention" (arXiv 2507.16018), Sec. 3.  All functions are pure tensor functions.
"""

from __future__ import annotations

import torch

from ..errors import OptionError

__all__ = [
    "STRATEGIES",
    "FPS_KERNEL",
    "farthest_point_sampling",
    "farthest_point_sampling_reference",
    "kmeans_landmarks",
    "select_landmarks",
    "gather_tokens",
]

STRATEGIES = ("fps", "random", "strided", "kmeans")


#: :func:`farthest_point_sampling`'s ``kernel="auto"``: ``"triton"`` runs CUDA tensors through the one-launch Triton
#: kernel (:mod:`.landmarks_triton`), ``"torch"`` keeps every device on the PyTorch loop below (for comparison).
FPS_KERNEL = "triton"
FPS_KERNELS = ("auto", "torch", "triton")


def farthest_point_sampling(x: torch.Tensor, s: int, prefix: int = 1, *, kernel: str = "auto") -> torch.Tensor:
    """Farthest-point sampling of ``s`` token indices per item, batched.

    Greedy: the ``prefix`` first tokens (CLS, registers) are taken first; then, ``s - prefix``
    times, the token whose squared Euclidean distance to the nearest already-taken token is
    largest (ties: lowest index).  Time ``O(s N D)``, extra memory ``O(N)`` per item (a running
    minimum distance; no pairwise distance matrix).

    Args:
        x: ``[B, N, D]`` features (computed in float32 whatever the input dtype).
        s: number of indices per item, ``prefix <= s <= N``.
        prefix: leading tokens always included (CLS, registers); with ``prefix = 0`` the
            traversal starts from token 0, as with ``prefix = 1``.
        kernel: ``"torch"`` this PyTorch loop (one small batched step per landmark; distances
            ``|x_i|^2 + |x_c|^2 - 2 x_i.x_c``); ``"triton"`` the one-launch Triton kernel
            (:func:`~attnpatch.attention.landmarks_triton.farthest_point_sampling_triton`: exact
            squared differences, no host sync, CUDA-graph capturable; CPU tensors only under
            ``TRITON_INTERPRET=1``); ``"auto"`` the Triton kernel for CUDA tensors when Triton is
            installed and :data:`FPS_KERNEL` is ``"triton"``, else the loop.  The two round
            distances differently, so on near-ties they can pick different tokens.

    Returns:
        ``[B, s]`` int64 indices, distinct per item, the prefix tokens first in order.

    Raises:
        OptionError: ``s`` outside ``[max(prefix, 1), N]``, or an unknown ``kernel``.

    Source: Gonzalez 1985 (farthest-first traversal); used for landmarks in FNA (arXiv 2507.16018, Sec. 3).
    """
    b, n, _ = x.shape
    if not max(prefix, 1) <= s <= n:
        raise OptionError(f"s={s}: farthest-point sampling needs {max(prefix, 1)} <= s <= N={n} tokens")
    if kernel not in FPS_KERNELS:
        raise OptionError(f"kernel={kernel!r}: allowed values are {', '.join(map(repr, FPS_KERNELS))}")
    if kernel == "triton" or (kernel == "auto" and x.is_cuda and FPS_KERNEL == "triton"):
        from . import landmarks_triton

        if kernel == "triton" or landmarks_triton.TRITON_AVAILABLE:
            return landmarks_triton.farthest_point_sampling_triton(x, s, prefix)
    x = x.float()
    sq = (x * x).sum(-1)  # [B, N]
    xt = x.transpose(1, 2)  # [B, D, N] (a view; bmm reads it strided)
    dist = torch.full((b, n), float("inf"), device=x.device)
    first = max(prefix, 1)
    picks = [torch.arange(first, device=x.device).expand(b, first)]
    # d(i, c) = |x_i|^2 + |x_c|^2 - 2 x_i.x_c, one fused baddbmm per new centre (few small ops per step:
    # at small N the loop is bound by operator overhead, at large N by reading x once per step)
    for j in range(first):
        c = x[:, j : j + 1]  # [B, 1, D]
        d = torch.baddbmm((sq + sq[:, j : j + 1])[:, None, :], c, xt, alpha=-2.0)[:, 0]
        torch.minimum(dist, d, out=dist)
    dist[:, :first] = -1.0
    d_ = x.shape[2]
    for _ in range(first, s):
        nxt = dist.argmax(-1, keepdim=True)  # [B, 1]
        picks.append(nxt)
        c = x.gather(1, nxt[:, :, None].expand(b, 1, d_))  # [B, 1, D]
        d = torch.baddbmm((sq + sq.gather(1, nxt))[:, None, :], c, xt, alpha=-2.0)[:, 0]
        torch.minimum(dist, d, out=dist)
        dist.scatter_(1, nxt, -1.0)
    idx = torch.cat(picks, 1)
    return idx


def farthest_point_sampling_reference(x: torch.Tensor, s: int, prefix: int = 1) -> torch.Tensor:
    """Slow, explicit FPS (Python loops, float64, exact distances) for tests; same contract as :func:`farthest_point_sampling`."""
    b, n, _ = x.shape
    out = []
    first = max(prefix, 1)
    for bi in range(b):
        pts = x[bi].double()
        chosen = list(range(first))
        while len(chosen) < s:
            best, best_d = None, -1.0
            for t in range(n):
                if t in chosen:
                    continue
                d = min(float(((pts[t] - pts[c]) ** 2).sum()) for c in chosen)
                if d > best_d + 1e-9 * max(1.0, abs(best_d)):
                    best, best_d = t, d
            chosen.append(best)
        out.append(chosen)
    return torch.tensor(out, dtype=torch.long)


def kmeans_landmarks(x: torch.Tensor, s: int, prefix: int, seed: int) -> torch.Tensor:
    """``s`` landmark indices per item by k-means: the ``prefix`` tokens, then the nearest unused token to each of
    ``s - prefix`` faiss k-means centroids (20 iterations, seeded by ``seed``) of the other tokens' features.

    Args:
        x: ``[B, N, D]`` features (clustered in float32 on the CPU).
        s: landmarks per item, ``prefix < s <= N``.
        prefix: leading tokens always included.
        seed: k-means seed.

    Returns:
        ``[B, s]`` int64 indices on ``x``'s device, distinct per item, prefix tokens first.

    Raises:
        ImportError: faiss is not installed.
    """
    import faiss
    import numpy as np

    b, n, d = x.shape
    k = s - prefix
    out = torch.empty(b, s, dtype=torch.long)
    out[:, :prefix] = torch.arange(prefix)
    for bi in range(b):
        pts = np.ascontiguousarray(x[bi, prefix:].detach().float().cpu().numpy())
        km = faiss.Kmeans(d, k, niter=20, seed=seed, verbose=False, min_points_per_centroid=1)
        km.train(pts)
        # nearest unused token to each centroid, in order of the centroid's distance
        dist = ((pts[None, :, :] - km.centroids[:, None, :]) ** 2).sum(-1)  # [k, N-p]
        used: set[int] = set()
        picks = []
        for ci in np.argsort(dist.min(1)):
            for t in np.argsort(dist[ci]):
                if int(t) not in used:
                    used.add(int(t))
                    picks.append(int(t) + prefix)
                    break
        out[bi, prefix:] = torch.tensor(picks)
    return out.to(x.device)


def select_landmarks(
    features: torch.Tensor, s: int, *, prefix: int = 1, strategy: str = "fps", seed: int = 0
) -> torch.Tensor:
    """Pick ``s`` landmark tokens per item; the ``prefix`` tokens (CLS, registers) are always included.

    Args:
        features: ``[B, N, D]`` per-token features (e.g. the layer's keys, heads concatenated).
        s: landmarks per item (tokens), ``prefix < s <= N`` (``prefix <= s`` for ``fps``).
        prefix: number of leading special tokens always kept.
        strategy: ``"fps"`` farthest-point sampling; ``"random"`` a seeded random subset of the
            other tokens (the same for every item, so an item's landmarks never depend on its batch
            mates); ``"strided"`` evenly spaced over the other tokens; ``"kmeans"`` faiss k-means
            (20 iterations, seeded) on the other tokens' features with ``s - prefix`` centroids,
            the nearest unused token to each centroid.
        seed: seed of ``random`` and ``kmeans``.

    Returns:
        ``[B, s]`` int64 token indices, distinct per item, prefix tokens first.

    Raises:
        OptionError: unknown strategy, or ``s`` out of range.
    """
    b, n, _ = features.shape
    if strategy not in STRATEGIES:
        raise OptionError(f"strategy={strategy!r}: allowed values are {', '.join(map(repr, STRATEGIES))}")
    if not prefix <= s <= n or s < 1:
        raise OptionError(f"s={s}: must be in [{max(prefix, 1)}, N={n}] tokens (prefix tokens: {prefix})")
    if strategy == "fps":
        return farthest_point_sampling(features, s, prefix)
    rest = n - prefix
    k = s - prefix
    pre = torch.arange(prefix, device=features.device)
    if strategy == "random":
        g = torch.Generator().manual_seed(seed)
        pick = torch.randperm(rest, generator=g)[:k].sort().values.to(features.device) + prefix
    elif strategy == "strided":
        pick = (torch.arange(k, dtype=torch.float64) * rest / max(k, 1)).floor().long().to(features.device) + prefix
    else:
        return kmeans_landmarks(features, s, prefix, seed)
    return torch.cat([pre, pick]).unsqueeze(0).expand(b, s).contiguous()


def gather_tokens(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x[b, h, idx[b, j]]``: ``x`` ``[B, H, N, D]``, ``idx`` ``[B, s]`` int64 token indices (shared by the heads) -> ``[B, H, s, D]``."""
    b, h, _, d = x.shape
    return x.gather(2, idx[:, None, :, None].expand(b, h, idx.shape[1], d))
