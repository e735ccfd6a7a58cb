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
#: kernel (:mod:`.landmarks_triton`), ``"torch"`` keeps CUDA tensors on the PyTorch loop below (for comparison).
FPS_KERNEL = "triton"
FPS_KERNELS = ("auto", "torch", "compiled", "triton")

#: Elements of the PyTorch loop's difference buffer per chunk of tokens (1 MiB of float32: stays in cache).
_CHUNK_ELEMENTS = 1 << 18


def farthest_point_sampling(x: torch.Tensor, s: int, prefix: int = 1, *, kernel: str = "auto") -> torch.Tensor:
    """Farthest-point sampling of ``s`` token indices per item, batched.

    Greedy: the ``prefix`` first tokens (CLS, registers) are taken first; then, ``s - prefix``
    times, the token whose squared Euclidean distance to the nearest already-taken token is
    largest (ties: lowest index).  Distances are exact squared differences ``sum_k (x_ik - x_ck)^2``
    in float32 on every path: a copy of a taken token is at distance exactly 0, so copies are taken
    only once every other token is, and then in index order.  Time ``O(s N D)``, extra memory
    ``O(N)`` per item (a running minimum distance; no pairwise distance matrix).

    Args:
        x: ``[B, N, D]`` features (computed in float32 whatever the input dtype).
        s: number of indices per item, ``prefix <= s <= N``.
        prefix: leading tokens always included (CLS, registers); with ``prefix = 0`` the
            traversal starts from token 0, as with ``prefix = 1``.
        kernel: ``"torch"`` a PyTorch loop (a few batched operations per landmark, tokens in
            cache-sized chunks); ``"compiled"`` the compiled CPU kernel (:mod:`.cpu_kernel`: one
            parallel pass per landmark; CPU tensors; an error where it cannot be built);
            ``"triton"`` the one-launch Triton kernel
            (:func:`~attnpatch.attention.landmarks_triton.farthest_point_sampling_triton`: no host
            sync, CUDA-graph capturable; CPU tensors only under ``TRITON_INTERPRET=1``); ``"auto"``
            the Triton kernel for CUDA tensors when Triton is installed and :data:`FPS_KERNEL` is
            ``"triton"``, the compiled kernel for CPU tensors where it builds, else the loop.  The
            paths sum the squares in different orders, so on near-ties (distances equal to float32
            rounding) they can pick different tokens; on exact ties they agree.

    Returns:
        ``[B, s]`` int64 indices, distinct per item, the prefix tokens first in order.  A token with a NaN
        feature counts as infinitely far (it is taken early), on every path.

    Raises:
        OptionError: ``x`` not ``[B, N, D]``, ``s`` not an integer in ``[max(prefix, 1), N]``, or an unknown
            ``kernel``.
        RuntimeError: ``kernel="compiled"`` where the compiled kernel cannot be built, or for a tensor
            not on the CPU.

    Source: Gonzalez 1985 (farthest-first traversal); used for landmarks in FNA (arXiv 2507.16018, Sec. 3).
    """
    if x.dim() != 3:
        raise OptionError(f"features of shape {tuple(x.shape)}: farthest-point sampling takes [B, N, D] features")
    if isinstance(s, bool) or not isinstance(s, int):
        raise OptionError(f"s={s!r}: farthest-point sampling takes an integer number of tokens")
    b, n, d_ = x.shape
    if not max(prefix, 1) <= s <= n:
        raise OptionError(f"s={s}: farthest-point sampling needs {max(prefix, 1)} <= s <= N={n} tokens")
    if kernel not in FPS_KERNELS:
        raise OptionError(f"kernel={kernel!r}: allowed values are {', '.join(map(repr, FPS_KERNELS))}")
    if kernel == "triton" or (kernel == "auto" and x.is_cuda and FPS_KERNEL == "triton"):
        from . import landmarks_triton

        if kernel == "triton" or landmarks_triton.TRITON_AVAILABLE:
            return landmarks_triton.farthest_point_sampling_triton(x, s, prefix)
    first = max(prefix, 1)
    if kernel == "compiled" or (kernel == "auto" and x.device.type == "cpu"):
        from .cpu_kernel import kernel_status, stripe_kernel

        mod = stripe_kernel() if x.device.type == "cpu" else None
        if mod is not None:
            return mod.farthest_point_sampling(x.detach().float().contiguous(), s, first)
        if kernel == "compiled":
            raise RuntimeError(f"kernel='compiled' runs CPU tensors (this one is on {x.device.type})"
                               if x.device.type != "cpu" else f"kernel='compiled': {kernel_status()}")
    with torch.no_grad():  # indices only: no gradient, and the loop writes into buffers
        return _fps_loop(x.detach().float().contiguous(), s, first)


def _fps_loop(x: torch.Tensor, s: int, first: int) -> torch.Tensor:
    """:func:`farthest_point_sampling`'s PyTorch loop on float32 ``[B, N, D]`` ``x``: exact squared differences in
    chunks of :data:`_CHUNK_ELEMENTS`, the running minimum by ``fmin`` (a NaN distance leaves it as it was)."""
    b, n, d_ = x.shape
    dist = torch.full((b, n), float("inf"), device=x.device)
    rows = max(1, min(n, _CHUNK_ELEMENTS // max(d_, 1)))
    diff = torch.empty(b, rows, d_, device=x.device)
    part = torch.empty(b, rows, device=x.device)

    def update(c: torch.Tensor) -> None:  # dist = min(dist, |x - c|^2), c [B, 1, D], exact squared differences
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            t = torch.sub(x[:, r0:r1], c, out=diff[:, : r1 - r0])
            torch.sum(t.square_(), -1, out=part[:, : r1 - r0])
            torch.fmin(dist[:, r0:r1], part[:, : r1 - r0], out=dist[:, r0:r1])

    picks = [torch.arange(first, device=x.device).expand(b, first)]
    for j in range(first):
        update(x[:, j : j + 1])
    dist[:, :first] = -1.0
    for _ in range(first, s):
        nxt = dist.argmax(-1, keepdim=True)  # [B, 1]: the first of equal largest distances
        picks.append(nxt)
        update(x.gather(1, nxt[:, :, None].expand(b, 1, d_)))
        dist.scatter_(1, nxt, -1.0)
    return torch.cat(picks, 1)


def farthest_point_sampling_reference(x: torch.Tensor, s: int, prefix: int = 1) -> torch.Tensor:
    """Slow, explicit FPS (Python loops, float64, exact distances) for tests; same contract as :func:`farthest_point_sampling`
    (ties: distances within a relative 1e-12 of each other, the lowest index; a NaN distance is ignored, so a token
    with a NaN feature counts as infinitely far)."""
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
                ds = [float(((pts[t] - pts[c]) ** 2).sum()) for c in chosen]
                d = min([v for v in ds if v == v], default=float("inf"))  # NaN distances ignored, as fmin does
                if best is None or d > best_d * (1 + 1e-12):
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
