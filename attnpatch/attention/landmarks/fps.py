"""Farthest-point sampling (FPS) of landmark tokens, in three forms: a PyTorch loop, the compiled CPU kernel
(``csrc/anchor_cpu.cpp``, :mod:`attnpatch.attention.backends.cpu_kernel`) and one Triton launch (:mod:`.fps_triton`);
:func:`farthest_point_sampling` asks :func:`attnpatch.attention.backends.dispatch.choose` (operation ``"fps"``) which
runs.  A slow float64 reference (:func:`farthest_point_sampling_reference`) is for tests.

Source: Gonzalez 1985 (farthest-first traversal); the landmarks of FNA (arXiv 2507.16018, Sec. 3).  Pure tensor
functions.
"""

from __future__ import annotations

import torch

from ...errors import OptionError
from ..backends.cpu_kernel import stripe_kernel
from ..backends.dispatch import Call, choose

__all__ = ["farthest_point_sampling", "farthest_point_sampling_reference"]

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
            cache-sized chunks); ``"compiled"`` the compiled CPU kernel
            (:mod:`attnpatch.attention.backends.cpu_kernel`: one parallel pass per landmark; CPU tensors);
            ``"triton"`` the one-launch Triton kernel
            (:func:`~.fps_triton.farthest_point_sampling_triton`: no host sync, CUDA-graph capturable; CPU tensors
            only under ``TRITON_INTERPRET=1``); ``"auto"`` the Triton kernel for CUDA tensors when Triton is
            installed, the compiled kernel for CPU tensors where it builds, else the loop
            (:func:`attnpatch.attention.backends.dispatch.choose`, operation ``"fps"``).  The
            paths sum the squares in different orders, so on near-ties (distances equal to float32
            rounding) they can pick different tokens; on exact ties they agree.

    Returns:
        ``[B, s]`` int64 indices, distinct per item, the prefix tokens first in order.  A token with a NaN
        feature counts as infinitely far (it is taken early), on every path.

    Raises:
        OptionError: ``x`` not ``[B, N, D]``, ``s`` not an integer in ``[max(prefix, 1), N]``, or an unknown
            ``kernel``.
        KernelError: a kernel asked for by name that cannot run here (``"compiled"`` for a tensor not on the CPU or
            where it cannot be built; ``"triton"`` without Triton, or for a CPU tensor outside the interpreter).

    Source: Gonzalez 1985 (farthest-first traversal); used for landmarks in FNA (arXiv 2507.16018, Sec. 3).
    """
    if x.dim() != 3:
        raise OptionError(f"features of shape {tuple(x.shape)}: farthest-point sampling takes [B, N, D] features")
    if isinstance(s, bool) or not isinstance(s, int):
        raise OptionError(f"s={s!r}: farthest-point sampling takes an integer number of tokens")
    b, n, d_ = x.shape
    if not max(prefix, 1) <= s <= n:
        raise OptionError(f"s={s}: farthest-point sampling needs {max(prefix, 1)} <= s <= N={n} tokens")
    use = choose("fps", kernel, Call.of(x))
    if use == "triton":
        from .fps_triton import farthest_point_sampling_triton  # imports Triton: only where its kernel runs

        return farthest_point_sampling_triton(x, s, prefix)
    first = max(prefix, 1)
    if use == "compiled":
        return stripe_kernel().farthest_point_sampling(x.detach().float().contiguous(), s, first)
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


