"""Fast Nyström Attention (FNA): Nyström-approximated softmax attention on landmark tokens.

Source: "Fast Nyström Attention" (arXiv 2507.16018).  With ``Q, K, V`` ``[N, D]`` per head
and the queries/keys of ``s`` landmark *tokens* ``Q~ = Q[L], K~ = K[L]``:

    softmax(Q K^T c) V  ~=  softmax(Q K~^T c) . pinv(softmax(Q~ K~^T c)) . softmax(Q~ K^T c) . V

(``c`` = the attention scale), the Nyström form of Nyströmformer (Xiong et al. 2021, Eq. 13)
with landmarks that are real tokens picked by farthest-point sampling (FPS) instead of
segment means.  It is evaluated right to left, ``F @ (pinv(A) @ (B @ V))``, so nothing of
size ``N x N`` is ever formed: time ``O(s N D)``, memory ``O(s N + N D)``; the two ``N x s``
products run as fused attention calls.

Landmark selection (:func:`select_landmarks`): ``fps`` (default), ``random`` (seeded),
``strided`` (evenly spaced) and ``kmeans`` (faiss k-means, nearest token to each centroid).
The ``prefix`` tokens (CLS and register tokens) are always landmarks.

Pseudo-inverse of the ``s x s`` landmark kernel (:func:`landmark_pinv`): ``"rtol"`` (truncated
pseudo-inverse with singular values below ``rtol x`` the largest dropped, computed in float32 from
the eigendecomposition of ``A^T A``),
``"newton"`` (the Newton-Schulz iteration of Nyströmformer, their Eq. 15-16, float32), and
``"exact"`` (float64 SVD pseudo-inverse with the default machine-precision cut-off).  The
landmark kernel of a pretrained ViT is badly conditioned (condition numbers of 1e4-1e6 on
DINOv2-S), so the exact pseudo-inverse amplifies the approximation error; the defaults in
:class:`attnpatch.patchers.vision.FNAConfig` were chosen by measurement.

All functions are pure tensor functions: ``q, k, v`` are ``[batch, heads, tokens, head_dim]``.
"""

from __future__ import annotations

import torch

from ..errors import OptionError

__all__ = [
    "STRATEGIES",
    "PINV_MODES",
    "farthest_point_sampling",
    "farthest_point_sampling_reference",
    "select_landmarks",
    "landmark_pinv",
    "nystrom_attention",
    "exact_attention",
]

STRATEGIES = ("fps", "random", "strided", "kmeans")
PINV_MODES = ("rtol", "newton", "exact")


def farthest_point_sampling(x: torch.Tensor, s: int, prefix: int = 1) -> torch.Tensor:
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

    Returns:
        ``[B, s]`` int64 indices, distinct per item, the prefix tokens first in order.

    Raises:
        OptionError: ``s`` outside ``[max(prefix, 1), N]``.

    Source: Gonzalez 1985 (farthest-first traversal); used for landmarks in FNA (arXiv 2507.16018, Sec. 3).
    """
    b, n, _ = x.shape
    if not max(prefix, 1) <= s <= n:
        raise OptionError(f"s={s}: farthest-point sampling needs {max(prefix, 1)} <= s <= N={n} tokens")
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


def _kmeans_landmarks(x: torch.Tensor, s: int, prefix: int, seed: int) -> torch.Tensor:
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
        return _kmeans_landmarks(features, s, prefix, seed)
    return torch.cat([pre, pick]).unsqueeze(0).expand(b, s).contiguous()


def landmark_pinv(a: torch.Tensor, mode: str = "rtol", *, rtol: float = 1e-2, iters: int = 6) -> torch.Tensor:
    """Pseudo-inverse of a batch of ``s x s`` landmark kernels.

    Args:
        a: ``[..., s, s]`` row-stochastic matrices ``softmax(Q~ K~^T c)``.
        mode: ``"rtol"`` — truncated pseudo-inverse dropping singular values below
            ``rtol x sigma_max`` (regularised), ``V diag(1/sigma^2) V^T A^T`` from the symmetric
            eigendecomposition ``A^T A = V diag(sigma^2) V^T``, in float32 whatever ``a``'s dtype
            when ``rtol >= 1e-2`` (the cut-off ``rtol^2`` on ``sigma^2`` is then far above float32's
            resolution: 5e-4 relative difference from a float64 truncated SVD at ``rtol=1e-2``,
            1e-2 at ``rtol=1e-3``), in float64 for smaller ``rtol`` or float64 input; a batched
            ``eigh`` is 3-4x faster than a batched SVD on the CPU; ``"newton"`` — ``iters`` Newton-Schulz steps in float32
            from Nyströmformer's start ``Z0 = A^T / (max_j sum_i |a_ij| . max_i sum_j |a_ij|)``
            (Xiong et al. 2021, Eq. 15-16; the scaling is per matrix here, so items do not
            influence each other); ``"exact"`` — float64 SVD pseudo-inverse, default cut-off.
        rtol: relative singular-value cut-off of ``"rtol"`` (> 0).
        iters: Newton-Schulz iterations (>= 1).

    Returns:
        ``[..., s, s]`` in ``a``'s dtype.

    Raises:
        OptionError: unknown mode.
    """
    if mode == "rtol":
        work = torch.float64 if a.dtype == torch.float64 or rtol < 1e-2 else torch.float32
        x = a.to(work)
        xt = x.transpose(-1, -2)
        lam, vec = torch.linalg.eigh(xt @ x)  # squared singular values of A (ascending) and right singular vectors
        inv = torch.where(lam > (rtol * rtol) * lam[..., -1:], 1.0 / lam.clamp(min=torch.finfo(work).tiny), 0.0)
        return ((vec * inv[..., None, :]) @ (vec.transpose(-1, -2) @ xt)).to(a.dtype)
    if mode == "exact":
        return torch.linalg.pinv(a.double()).to(a.dtype)
    if mode == "newton":
        k = a.float()
        eye = torch.eye(k.shape[-1], dtype=k.dtype, device=k.device)
        col = k.abs().sum(-2).amax(-1)
        row = k.abs().sum(-1).amax(-1)
        z = k.transpose(-1, -2) / (col * row)[..., None, None]
        for _ in range(iters):
            kz = k @ z
            z = 0.25 * z @ (13 * eye - kz @ (15 * eye - kz @ (7 * eye - kz)))
        return z.to(a.dtype)
    raise OptionError(f"pinv={mode!r}: allowed values are {', '.join(map(repr, PINV_MODES))}")


def _gather_tokens(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x[b, h, idx[b, j]]``: ``x`` ``[B, H, N, D]``, ``idx`` ``[B, s]`` -> ``[B, H, s, D]``."""
    b, h, _, d = x.shape
    return x.gather(2, idx[:, None, :, None].expand(b, h, idx.shape[1], d))


def nystrom_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    landmarks: torch.Tensor,
    *,
    scale: float,
    pinv: str = "rtol",
    rtol: float = 1e-2,
    iters: int = 6,
    key_keep: torch.Tensor | None = None,
    renormalize: bool = False,
) -> torch.Tensor:
    """Nyström attention on landmark tokens, evaluated right to left (no ``N x N`` tensor).

    ``out = F @ (pinv(A) @ (B @ V))`` with ``F = softmax(Q K~^T c)`` ``[N, s]``,
    ``A = softmax(Q~ K~^T c)`` ``[s, s]``, ``B = softmax(Q~ K^T c)`` ``[s, N]`` (FNA, arXiv
    2507.16018, Eq. 3; Nyströmformer Eq. 13).  With every token a landmark and ``pinv="exact"``
    this equals exact attention up to floating-point error.

    Without ``key_keep``, ``B @ V`` is attention of the ``s`` landmark queries over all ``N``
    keys and ``F @ W`` attention of all ``N`` queries over the ``s`` landmark keys, so both run
    as fused ``scaled_dot_product_attention`` calls (no ``[N, s]`` buffer either; 20x faster
    than SDPA over all keys at ``N = 4097, s = 64`` on 2 CPU cores, see BENCHMARKS.md).  The
    ``s x s`` pseudo-inverse is computed in float32 also for half-precision inputs.

    Args:
        q, k, v: ``[B, H, N, D]`` (same head count; non-causal).
        landmarks: ``[B, s]`` token indices (shared by the heads).
        scale: attention scale ``c`` (usually ``D ** -0.5``).
        pinv, rtol, iters: see :func:`landmark_pinv`.
        key_keep: ``[B, N]`` bool or ``None``; keys marked ``False`` get zero attention
            probability (sink masking in Nyström form: their columns of ``B`` are zeroed after
            the softmax, FNA Sec. 4).
        renormalize: with ``key_keep``, divide each output row by its remaining attention mass
            (``F pinv(A) B 1``) instead of leaving the mass removed.

    Returns:
        ``[B, H, N, D]`` in ``q``'s dtype.  Peak extra memory ``O(B H s N)`` elements.
    """
    q_l = _gather_tokens(q, landmarks)
    k_l = _gather_tokens(k, landmarks)
    a = torch.softmax((q_l * scale) @ k_l.transpose(-1, -2), dim=-1)  # [B,H,s,s]
    z = landmark_pinv(a, pinv, rtol=rtol, iters=iters)
    if key_keep is None:
        # B V = softmax(Q~ K^T c) V and F W = softmax(Q K~^T c) W are attention calls themselves
        # (s queries over N keys; N queries over s keys): two fused kernels, no [N, s] buffer.
        sdpa = torch.nn.functional.scaled_dot_product_attention
        w = z @ sdpa(q_l, k, v, scale=scale)  # [B,H,s,D]
        return sdpa(q, k_l, w.to(q.dtype), scale=scale)
    f = torch.softmax(q @ (k_l * scale).transpose(-1, -2), dim=-1)  # [B,H,N,s]
    bm = torch.softmax((q_l * scale) @ k.transpose(-1, -2), dim=-1)  # [B,H,s,N]
    if key_keep is not None:
        bm = bm * key_keep[:, None, None, :].to(bm.dtype)
    w = z @ (bm @ v)  # [B,H,s,D]
    out = f @ w
    if key_keep is not None and renormalize:
        mass = f @ (z @ bm.sum(-1, keepdim=True))  # [B,H,N,1]
        out = out / mass.clamp(min=1e-6)
    return out


def exact_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    key_keep: torch.Tensor | None = None,
    renormalize: bool = False,
    chunk: int = 1024,
) -> torch.Tensor:
    """Exact (non-causal) softmax attention, optionally with some keys' probabilities zeroed.

    Without ``key_keep`` this is ``torch.nn.functional.scaled_dot_product_attention``.  With it,
    ``P = softmax(Q K^T c)`` is computed in query chunks, the columns of masked keys are set to
    zero after the softmax (sink masking, FNA arXiv 2507.16018 Sec. 4: "multiply the softmax
    output by the mask"), and rows are optionally renormalised to sum to one.

    Args:
        q, k, v: ``[B, H, N, D]``.
        scale: attention scale.
        key_keep: ``[B, N]`` bool or ``None``.
        renormalize: renormalise rows after masking.
        chunk: queries per chunk (bounds the ``[B, H, chunk, N]`` score buffer).

    Returns:
        ``[B, H, N, D]``.
    """
    if key_keep is None:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)
    if renormalize:
        bias = torch.zeros(key_keep.shape, dtype=q.dtype, device=q.device).masked_fill(~key_keep, float("-inf"))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias[:, None, None, :], scale=scale)
    keep = key_keep[:, None, None, :].to(q.dtype)
    outs = []
    for i in range(0, q.shape[2], chunk):
        p = torch.softmax((q[:, :, i : i + chunk] @ k.transpose(-1, -2)) * scale, dim=-1) * keep
        outs.append(p @ v)
    return torch.cat(outs, dim=2)
