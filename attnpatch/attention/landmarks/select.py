"""Landmark selection: which ``s`` tokens of a layer stand for all ``N`` in a landmark method (FNA, AnchorFormer).

Strategies (:func:`select_landmarks`): ``fps`` (farthest-point sampling, :func:`~.fps.farthest_point_sampling`),
``random`` (seeded), ``strided`` (evenly spaced) and ``kmeans`` (faiss k-means, nearest token to each centroid:
:func:`kmeans_landmarks`).  The ``prefix`` tokens (CLS and register tokens) are always landmarks.
:func:`gather_tokens` picks the landmarks' rows out of a ``[batch, heads, tokens, head_dim]`` tensor.

Source: "Fast Nyström Attention" (arXiv 2507.16018), Sec. 3.  All functions are pure tensor functions.
"""

from __future__ import annotations

import torch

from ...errors import OptionError
from .fps import farthest_point_sampling

__all__ = ["STRATEGIES", "kmeans_landmarks", "select_landmarks", "gather_tokens"]

STRATEGIES = ("fps", "random", "strided", "kmeans")


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
