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
landmark kernel of a pretrained ViT is badly conditioned, so the exact pseudo-inverse amplifies
the approximation error; the defaults of :class:`attnpatch.patchers.methods.fna.FNAConfig` were
chosen by measurement (README and BENCHMARKS.md).

All functions are pure tensor functions: ``q, k, v`` are ``[batch, heads, tokens, head_dim]``.
"""

from __future__ import annotations

import contextlib
import os

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
    "local_blas_threads",
]

STRATEGIES = ("fps", "random", "strided", "kmeans")
PINV_MODES = ("rtol", "newton", "exact")
_HALF = (torch.float16, torch.bfloat16)


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


# --------------------------------------------------------------------------- threads

_MKL_LOCAL: object = None  # resolved on first use: MKL's thread-local thread-count setter, or False


def _mkl_local_setter():
    """``MKL_Set_Num_Threads_Local`` of the MKL inside PyTorch (C ABI, ``int f(int)``), or ``False`` where there is none.

    PyTorch's x86 wheels link MKL statically into ``libtorch_cpu`` and export MKL's service
    functions; other builds (OpenBLAS, Accelerate) have no such symbol and get ``False``.
    ``ATTNPATCH_LOCAL_BLAS_THREADS=0`` turns the lookup off.
    """
    global _MKL_LOCAL
    if _MKL_LOCAL is None:
        _MKL_LOCAL = False
        if os.environ.get("ATTNPATCH_LOCAL_BLAS_THREADS", "1") != "0" and torch.backends.mkl.is_available():
            import ctypes
            import glob

            libdir = os.path.join(os.path.dirname(torch.__file__), "lib")
            for path in sorted(glob.glob(os.path.join(libdir, "*torch_cpu*"))) + [None]:
                try:
                    fn = ctypes.CDLL(path).MKL_Set_Num_Threads_Local  # C interface (by value), not the Fortran alias
                except Exception:  # no such library or symbol (OSError, AttributeError; TypeError on some platforms)
                    continue
                fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_int]
                _MKL_LOCAL = fn
                break
    return _MKL_LOCAL


@contextlib.contextmanager
def local_blas_threads(n: int = 1, device: torch.device | str | None = None):
    """Run MKL (BLAS/LAPACK) calls of *this* OS thread on ``n`` threads inside the block; other threads are untouched.

    Small matrix work (the ``s x s`` landmark kernel, its eigendecomposition, ``[s, s] @ [s, D]``
    products) is microseconds of arithmetic split over MKL's OpenMP team.  On an idle machine
    that costs nothing, but while another process keeps the cores busy every parallel region
    waits for a descheduled team thread, and work of a few milliseconds takes far longer (measured
    beside a competing process: BENCHMARKS.md).  One thread has nothing to
    wait for.  The setting is MKL's thread-local ``mkl_set_num_threads_local`` (restored on exit),
    so unlike ``torch.set_num_threads`` it is safe with other Python threads (PyTorch sets the same
    thread-local count to its thread count when a thread first runs an operator); ATen's own
    ``parallel_for`` (SDPA, element-wise kernels) is not affected.  A no-op on CUDA tensors and
    on builds without MKL.
    """
    fn = _mkl_local_setter() if device is None or torch.device(device).type == "cpu" else False
    if not fn:
        yield
        return
    torch.get_num_threads()  # PyTorch's lazy per-thread init sets MKL's local count itself: run it first, not inside
    prev = fn(int(n))
    try:
        yield
    finally:
        fn(prev)


# --------------------------------------------------------------------------- pseudo-inverse


def _pinv_work(a: torch.Tensor, mode: str, rtol: float, iters: int) -> torch.Tensor:
    """:func:`landmark_pinv` in its working precision (float32, or float64), never cast to a half dtype."""
    if mode == "rtol":
        work = torch.float64 if a.dtype == torch.float64 or rtol < 1e-2 else torch.float32
        x = a.to(work)
        xt = x.transpose(-1, -2)
        lam, vec = torch.linalg.eigh(xt @ x)  # squared singular values of A (ascending) and right singular vectors
        inv = torch.where(lam > (rtol * rtol) * lam[..., -1:], 1.0 / lam.clamp(min=torch.finfo(work).tiny), 0.0)
        return (vec * inv[..., None, :]) @ (vec.transpose(-1, -2) @ xt)
    if mode == "exact":
        return torch.linalg.pinv(a.double())
    if mode == "newton":
        k = a.float()
        eye = torch.eye(k.shape[-1], dtype=k.dtype, device=k.device)
        col = k.abs().sum(-2).amax(-1)
        row = k.abs().sum(-1).amax(-1)
        z = k.transpose(-1, -2) / (col * row)[..., None, None]
        for _ in range(iters):
            kz = k @ z
            z = 0.25 * z @ (13 * eye - kz @ (15 * eye - kz @ (7 * eye - kz)))
        return z
    raise OptionError(f"pinv={mode!r}: allowed values are {', '.join(map(repr, PINV_MODES))}")


def landmark_pinv(a: torch.Tensor, mode: str = "rtol", *, rtol: float = 1e-2, iters: int = 6) -> torch.Tensor:
    """Pseudo-inverse of a batch of ``s x s`` landmark kernels.

    Args:
        a: ``[..., s, s]`` row-stochastic matrices ``softmax(Q~ K~^T c)``.
        mode: ``"rtol"`` — truncated pseudo-inverse dropping singular values below
            ``rtol x sigma_max`` (regularised), ``V diag(1/sigma^2) V^T A^T`` from the symmetric
            eigendecomposition ``A^T A = V diag(sigma^2) V^T``, in float32 whatever ``a``'s dtype
            when ``rtol >= 1e-2`` (the cut-off ``rtol^2`` on ``sigma^2`` is then far above float32's
            resolution; ``tests/test_fna.py`` checks the agreement with a float64 truncated SVD), in
            float64 for smaller ``rtol`` or float64 input; a batched ``eigh`` is faster than a batched
            SVD on the CPU; ``"newton"`` — ``iters`` Newton-Schulz steps in float32
            from Nyströmformer's start ``Z0 = A^T / (max_j sum_i |a_ij| . max_i sum_j |a_ij|)``
            (Xiong et al. 2021, Eq. 15-16; the scaling is per matrix here, so items do not
            influence each other); ``"exact"`` — float64 SVD pseudo-inverse, default cut-off.
            On the CPU the factorisation runs on one MKL thread (:func:`local_blas_threads`): it
            is tiny, and a multi-threaded ``eigh`` stalls when another process holds the cores
            (BENCHMARKS.md).
        rtol: relative singular-value cut-off of ``"rtol"`` (> 0).
        iters: Newton-Schulz iterations (>= 1).

    Returns:
        ``[..., s, s]`` in ``a``'s dtype.  For a half-precision ``a`` the entries can exceed the
        dtype's range (``"exact"`` on a badly conditioned kernel can exceed float16's largest
        value, 65504); :func:`nystrom_attention` therefore keeps the pseudo-inverse in float32 and never
        casts it back.

    Raises:
        OptionError: unknown mode.
    """
    with local_blas_threads(1, a.device):
        return _pinv_work(a, mode, rtol, iters).to(a.dtype)


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
    as fused ``scaled_dot_product_attention`` calls (no ``[N, s]`` buffer either; the speed against
    SDPA over all keys is in BENCHMARKS.md).

    Half-precision inputs (bfloat16, float16): the landmark kernel's logits, its
    pseudo-inverse and ``W = pinv(A) (B V)`` are computed in float32 and the pseudo-inverse is
    never cast back (``pinv="exact"`` can exceed float16's range); ``F W`` runs in the
    input dtype for ``pinv="rtol"`` (``||pinv|| <= 1/rtol`` keeps ``W`` small; in float16 ``W``
    is also scaled by an exact power of two when ``max|W| > 2^12``) and in float32 for
    ``"exact"`` and ``"newton"``; with ``key_keep`` and ``renormalize`` every logit and product
    is float32.  The small ``s x s`` work runs on one MKL thread on the CPU
    (:func:`local_blas_threads`).

    Args:
        q, k, v: ``[B, H, N, D]`` (same head count; non-causal).
        landmarks: ``[B, s]`` token indices (shared by the heads).
        scale: attention scale ``c`` (usually ``D ** -0.5``).
        pinv, rtol, iters: see :func:`landmark_pinv`.
        key_keep: ``[B, N]`` bool or ``None``; keys marked ``False`` get zero attention
            probability (sink masking in Nyström form: their columns of ``B`` are zeroed after
            the softmax, FNA Sec. 4; computed as ``B (keep * V)``, the same fused calls as
            without a mask).
        renormalize: with ``key_keep``, renormalise each output row to its remaining attention
            mass instead of leaving the mass removed (the estimator, one that cannot divide by a
            mass near or below zero, is described in :func:`_renormalized`).

    Returns:
        ``[B, H, N, D]`` in ``q``'s dtype.  Peak extra memory ``O(B H (s + D) N)`` elements
        (``O(B H s N)`` more with ``renormalize``).
    """
    half = q.dtype in _HALF
    wd = torch.float32 if half else q.dtype  # the small s x s work: float32 for half inputs
    if key_keep is not None and not renormalize:
        # B_kept V = B (keep * V): zeroing the masked keys' values is zeroing their columns of B
        # after the softmax, so plain sink masking takes the fused path below
        v = v * key_keep[:, None, :, None].to(v.dtype)
        key_keep = None
    q_l = _gather_tokens(q, landmarks)
    k_l = _gather_tokens(k, landmarks)
    with local_blas_threads(1, q.device):
        a = torch.softmax((q_l.to(wd) * scale) @ k_l.to(wd).transpose(-1, -2), dim=-1)  # [B,H,s,s]
        z = _pinv_work(a, pinv, rtol, iters).to(wd)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if key_keep is None:
        # B V = softmax(Q~ K^T c) V and F W = softmax(Q K~^T c) W are attention calls themselves
        # (s queries over N keys; N queries over s keys): two fused kernels, no [N, s] buffer.
        bv = sdpa(q_l, k, v, scale=scale)  # [B,H,s,D], convex combinations of V rows
        with local_blas_threads(1, q.device):
            w = z @ bv.to(wd)  # [B,H,s,D] in float32 for half inputs
        if not half:
            return sdpa(q, k_l, w.to(q.dtype), scale=scale)
        if pinv != "rtol":
            # exact / Newton-Schulz: z is unbounded (1e5-1e6 on a ViT's kernel) and W cancels in
            # F W, so the last product runs in float32 too (rounding W to half would cost
            # |W| x 2^-11 absolutely, and float16 cannot even hold it).  Where the unregularised
            # estimate itself leaves float16's range (9.5e3 in float32 where exact attention
            # gives 1.2, on a kernel sharpened 200x) the cast saturates instead of making inf.
            out = sdpa(q.to(wd), k_l.to(wd), w, scale=scale)
            if q.dtype == torch.float16:
                big = torch.finfo(torch.float16).max
                out = out.clamp(-big, big)
            return out.to(q.dtype)
        # rtol: ||z||_2 <= 1 / (rtol sigma_max) <= 1 / rtol (sigma_max >= 1 for a row-stochastic
        # kernel), so W stays within a few hundred x max|V|; float16 still gets a guard: W is
        # divided by a power of two (exact; 1 unless max|W| > 2^12) and the output multiplied back.
        if q.dtype == torch.float16:
            c = torch.exp2(torch.ceil(torch.log2(w.abs().amax((-2, -1), keepdim=True) / 4096.0)).clamp(min=0.0))
            return sdpa(q, k_l, (w / c).to(q.dtype), scale=scale).mul_(c.to(q.dtype))
        return sdpa(q, k_l, w.to(q.dtype), scale=scale)
    # renormalised sink masking: the masked B is needed explicitly ([B,H,s,N] and [B,H,N,s]; O(s N)
    # memory), with the logits in float32 for half inputs (the raw products overflow float16 first)
    qw, kw, vw = q.to(wd), k.to(wd), v.to(wd)
    q_lw, k_lw = q_l.to(wd), k_l.to(wd)
    f = torch.softmax(qw @ (k_lw * scale).transpose(-1, -2), dim=-1)  # [B,H,N,s]
    bm = torch.softmax((q_lw * scale) @ kw.transpose(-1, -2), dim=-1)  # [B,H,s,N]
    bm = bm * key_keep[:, None, None, :].to(wd)
    return _renormalized(f, z, bm, vw).to(q.dtype)


#: Renormalised sink masking keeps the ratio estimate where the estimated kept mass is above this.
RENORM_MIN_MASS = 0.1


def _renormalized(f: torch.Tensor, z: torch.Tensor, bm: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Sink-masked Nyström attention with each row renormalised to its kept attention mass.

    ``f`` ``[.., N, s]``, ``z`` ``[.., s, s]``, ``bm`` ``[.., s, N]`` (B with the masked keys'
    columns zeroed), ``v`` ``[.., N, D]``.  Two estimates of row ``i`` of ``P_kept / m_i``:

    * ratio: ``F z (B_kept V) / F z (B_kept 1)``: consistent with unmasked FNA (exact with
      every token a landmark), but the Nyström estimate of the kept mass ``m_i`` in the
      denominator can be near or below zero (where the exact kept mass is not), and dividing by
      it amplifies the
      Nyström error without bound (the earlier ``clamp(min=1e-6)`` multiplied such rows by 1e6);
    * rows: ``F z (B' V)`` with each landmark query's row of ``B_kept`` renormalised over the kept
      keys (``B`` holds complete softmax rows, so their kept mass is exact and ``B' V`` is a
      convex combination of V rows): bounded by construction, but it interpolates the landmarks'
      normalisations instead of using the query's own.

    The ratio is used where the estimated mass exceeds :data:`RENORM_MIN_MASS` (0.1: the
    division amplifies the Nyström error at most 10x), rows elsewhere.  The rule and its threshold
    were chosen by measurement (final-CLS cosine to dense of ``fna+sink_mask`` with
    ``renormalize=True`` on dinov2-small: BENCHMARKS.md); ``tests/test_precision.py`` holds the
    image whose estimated kept mass goes below zero.
    """
    kept = bm.sum(-1, keepdim=True)  # [.., s, 1] exact kept mass of each landmark query's row
    bn = torch.where(kept > 0, bm / kept.clamp(min=torch.finfo(bm.dtype).tiny), bm)
    d = v.shape[-1]
    # one chain for the three right-hand sides: [B_kept V | B_kept 1 | B' V]
    rhs = torch.cat([bm @ v, kept, bn @ v], dim=-1)
    with local_blas_threads(1, f.device):
        w = z @ rhs
    y = f @ w
    num, mass, rows = y[..., :d], y[..., d : d + 1], y[..., d + 1 :]
    ok = mass > RENORM_MIN_MASS
    return torch.where(ok, num / torch.where(ok, mass, 1.0), rows)


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
    the attention probabilities into masked keys are set to zero after the softmax (sink
    masking, FNA arXiv 2507.16018 Sec. 4: "multiply the softmax output by the mask"), and rows
    are optionally renormalised to sum to one.  Both are one fused SDPA call, no ``N x N``
    buffer: ``softmax(Q K^T c) diag(keep) V = softmax(Q K^T c) (keep * V)`` (the masked keys
    stay in the softmax's normaliser and their values are zeroed), and the renormalised form is
    SDPA with ``-inf`` on the masked keys.  SDPA scales before the product and accumulates in
    float32 for half-precision inputs, so float16 stays finite where the unpatched model does
    (the earlier explicit ``(q @ k^T) * scale`` overflowed float16 on sharp attention).

    Args:
        q, k, v: ``[B, H, N, D]``.
        scale: attention scale.
        key_keep: ``[B, N]`` bool or ``None``.
        renormalize: renormalise rows after masking.
        chunk: unused (the masked path used to run in query chunks of this size); kept so that
            callers passing it keep working.

    Returns:
        ``[B, H, N, D]`` in ``q``'s dtype.
    """
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if key_keep is None:
        return sdpa(q, k, v, scale=scale)
    if renormalize:
        bias = torch.zeros(key_keep.shape, dtype=q.dtype, device=q.device).masked_fill(~key_keep, float("-inf"))
        return sdpa(q, k, v, attn_mask=bias[:, None, None, :], scale=scale)
    return sdpa(q, k, v * key_keep[:, None, :, None].to(v.dtype), scale=scale)
