"""Nyström attention with an exact local 2-D window: a low-rank far field plus a sparse exact near field.

The hybrid of :mod:`attnpatch.attention.nystrom.fna` (FNA, arXiv 2507.16018) and exact local attention, combined as in
Scatterbrain (Chen et al., arXiv 2110.15343, Sec. 3.2: "sparse + low-rank", the sparse part replacing the low-rank
estimate on its entries).  For query ``i`` with exact logits ``s_ij = c q_i . k_j``:

* its *window* ``W(i)`` is the prefix tokens (CLS, registers) and the patch tokens of a box around it on the patch
  grid: the patches are cut into query tiles of ``tile x tile`` patches and every query of a tile has the keys of
  the tile grown by ``radius`` patches on each side (clipped at the image border), so each query sees at least its
  ``radius``-neighbourhood (Chebyshev distance) and the sink/CLS keys exactly;
* the unnormalised kernel ``exp(s_ij)`` is estimated by Nyström on the landmarks ``L`` (real tokens, as in FNA):
  ``phi_ij = exp(S(q_i, K_L)) . pinv(exp(S(Q_L, K_L))) . exp(S(Q_L, k_j))`` (Nyströmformer's form without the row
  normalisations, which Scatterbrain's correction needs: the estimate and the exact entries must be in one unit);
* the output is the softmax over the union, exact inside the window and estimated outside it::

      out_i = (sum_{j in W(i)} e^{s_ij} v_j + sum_{j not in W(i)} phi_ij v_j)
            / (sum_{j in W(i)} e^{s_ij}     + sum_{j not in W(i)} phi_ij)

  with the far sums computed as the low-rank sum over every key minus its window entries,
  ``sum_j phi_ij v_j - sum_{j in W(i)} phi_ij v_j``, so nothing of size ``N x N`` is formed.

Stabilisation.  Each query row is shifted by ``m_i`` = its largest logit over its window and the landmark keys,
each landmark query row by ``n_l`` = its largest logit over all keys; the shifts cancel exactly in the ratio
(``pinv(D^-1 A) = pinv(A) D`` for an invertible diagonal ``D``, so the landmark kernel is taken as
``exp(S(Q_L, K_L) - n)``, entries in ``(0, 1]``, whose pseudo-inverse is the truncated one of
:func:`~attnpatch.attention.nystrom.pinv.landmark_pinv`).  The low-rank estimate of the far mass can be negative (a
Nyström estimate is not a kernel); a row whose estimated far mass is not positive keeps its exact window
attention alone (its denominator is then at least ``e^{s_ii - m_i} > 0``: the query's own key is in its window).

Exact limits: a window covering every patch gives exact attention whatever the landmarks (computed as such:
``radius >= max(rows, cols) - 1`` runs fused exact attention); every token a landmark
with ``pinv="exact"`` gives exact attention whatever the window (the estimate is then the kernel itself, up to
rounding).  Prefix queries (CLS, registers) attend to every key exactly (``prefix`` rows of fused attention).

Cost per head: ``O(N (3 s D + s^2 + b (s + 2 D)))`` for ``N`` tokens, ``s`` landmarks, ``b = (tile + 2 radius)^2``
window keys per query and head size ``D``; memory ``O(N (s + b))``.  Pure tensor functions on ``[batch, heads,
tokens, head_dim]`` tensors.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from ..backends.blas import local_blas_threads
from ..landmarks.select import gather_tokens
from .pinv import landmark_pinv_work

__all__ = ["grid_of", "window_keys", "nystrom_local_attention", "nystrom_local_reference"]

_HALF = (torch.float16, torch.bfloat16)


def grid_of(patches: int, grid: tuple[int, int] | None = None) -> tuple[int, int]:
    """The patch grid ``(rows, cols)`` of ``patches`` tokens: ``grid`` when given (it must hold ``rows * cols ==
    patches``), else square when ``patches`` is a perfect square, else one row (windows then run along the token
    order: the layout is not known).

    Raises:
        ValueError: a given ``grid`` that does not hold ``patches`` tokens.
    """
    if grid is not None:
        r, c = int(grid[0]), int(grid[1])
        if r * c != patches or r < 1 or c < 1:
            raise ValueError(f"grid={tuple(grid)} does not hold the {patches} patch tokens")
        return r, c
    side = math.isqrt(patches)
    return (side, side) if side * side == patches else (1, patches)


def window_keys(patches: int, grid: tuple[int, int] | None, radius: int, tile: int) -> int:
    """Window keys of one query (at most; fewer at the border), prefix tokens not counted: ``min(rows, tile + 2
    radius) x min(cols, tile + 2 radius)``."""
    r, c = grid_of(patches, grid)
    return min(r, tile + 2 * radius) * min(c, tile + 2 * radius)


@functools.lru_cache(maxsize=64)
def _layout(rows: int, cols: int, tile: int, radius: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Index tensors of the tiling (CPU; ``P = rows * cols`` patches, ``T`` tiles of ``tile x tile`` slots):

    ``qidx`` ``[T, tile^2]`` int64, the patch of each tile slot (0 where the tile overhangs the image: such slots are
    computed and never read back); ``kidx`` ``[T, (tile+2r)^2]`` int64, the patch of each key-box slot (0 outside the
    image); ``valid`` ``[T, (tile+2r)^2]`` bool, whether a key-box slot is inside the image; ``back`` ``[P]`` int64, the
    flat slot ``t * tile^2 + j`` of each patch.
    """
    tr, tc = -(-rows // tile), -(-cols // tile)
    ti, tj = torch.meshgrid(torch.arange(tr), torch.arange(tc), indexing="ij")
    ti, tj = ti.reshape(-1, 1), tj.reshape(-1, 1)  # [T, 1]
    di, dj = torch.meshgrid(torch.arange(tile), torch.arange(tile), indexing="ij")
    r, c = ti * tile + di.reshape(1, -1), tj * tile + dj.reshape(1, -1)  # [T, t2]
    inside = (r < rows) & (c < cols)
    qidx = torch.where(inside, r * cols + c, 0)
    side = tile + 2 * radius
    bi, bj = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    kr, kc = ti * tile - radius + bi.reshape(1, -1), tj * tile - radius + bj.reshape(1, -1)  # [T, box]
    valid = (kr >= 0) & (kr < rows) & (kc >= 0) & (kc < cols)
    kidx = torch.where(valid, kr * cols + kc, 0)
    back = torch.empty(rows * cols, dtype=torch.long)
    back[qidx[inside]] = torch.nonzero(inside.reshape(-1)).flatten()
    return qidx, kidx, valid, back


@functools.lru_cache(maxsize=64)
def _layout_on(rows: int, cols: int, tile: int, radius: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """:func:`_layout`'s tensors on ``device``, copied once per device: a host-to-device copy on every call would sync
    the host and cannot be captured in a CUDA graph (the first call, a graph's warm-up, makes the copy)."""
    return tuple(t.to(device) for t in _layout(rows, cols, tile, radius))


def _pick(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Rows ``idx`` ``[T, m]`` of ``x`` ``[B, H, P, C]`` -> ``[B, H, T, m, C]``."""
    b, h, _, ch = x.shape
    return x.index_select(2, idx.reshape(-1)).reshape(b, h, idx.shape[0], idx.shape[1], ch)


def nystrom_local_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    landmarks: torch.Tensor,
    *,
    scale: float,
    prefix: int,
    radius: int,
    tile: int = 4,
    grid: tuple[int, int] | None = None,
    pinv: str = "rtol",
    rtol: float = 1e-2,
    iters: int = 6,
    pinv_kernel: str = "auto",
) -> torch.Tensor:
    """Nyström attention on landmark tokens with exact attention on each query's local 2-D window (module docstring).

    Args:
        q, k, v: ``[B, H, N, D]`` (same head count; non-causal); ``N = prefix + rows * cols``.
        landmarks: ``[B, s]`` token indices (shared by the heads), the ``prefix`` tokens among them.
        scale: attention scale ``c``.
        prefix: leading special tokens (CLS, registers): in every window, and their own queries exact.
        radius: window radius in patches (``>= 0``).
        tile: query tile side in patches (``>= 1``): the queries of one tile share their window box.
        grid: ``(rows, cols)`` of the patch tokens, or ``None`` (see :func:`grid_of`).
        pinv, rtol, iters, pinv_kernel: the landmark kernel's pseudo-inverse and the ``"rtol"`` kernel
            (:func:`~attnpatch.attention.nystrom.pinv.landmark_pinv`).

    Returns:
        ``[B, H, N, D]`` in ``q``'s dtype (computed in float32 for half-precision inputs, float64 for float64).

    Raises:
        ValueError: ``radius < 0``, ``tile < 1``, or a ``grid`` that does not hold ``N - prefix`` tokens.
    """
    if radius < 0 or tile < 1:
        raise ValueError(f"radius={radius} must be >= 0 and tile={tile} >= 1 (patches)")
    b, h, n, d = q.shape
    p = prefix
    rows, cols = grid_of(n - p, grid)
    wd = torch.float32 if q.dtype in _HALF else q.dtype
    qw, kw, vw = q.to(wd), k.to(wd), v.to(wd)
    if radius >= max(rows, cols) - 1:
        # every window holds every key: exact attention (the hybrid's own value), without the (tile + 2r)^2 boxes
        return F.scaled_dot_product_attention(qw, kw, vw, scale=scale).to(q.dtype)
    qs = qw * scale
    q_l, k_l = gather_tokens(qs, landmarks), gather_tokens(kw, landmarks)
    # far field: the low-rank estimate, rows shifted by m (queries) and n (landmark queries)
    s_f = qs @ k_l.transpose(-1, -2)  # [B,H,N,s] logits vs landmark keys
    s_b = q_l @ kw.transpose(-1, -2)  # [B,H,s,N] landmark queries vs all keys
    n_l = s_b.amax(-1, keepdim=True)
    b_ = torch.exp(s_b - n_l)  # [B,H,s,N], entries in (0, 1]
    a_ = gather_tokens(b_.transpose(-1, -2), landmarks).transpose(-1, -2)  # [B,H,s,s] = B'[:, L]
    with local_blas_threads(1, q.device):
        z = landmark_pinv_work(a_, pinv, rtol, iters, kernel=pinv_kernel).to(wd)  # [B,H,s,s]
    g = z @ b_  # [B,H,s,N]: phi'_ij = F'_i . g_j
    # near field, in tile layout: each tile's queries against its key box (slots outside the image masked)
    qidx, kidx, valid, back = _layout_on(rows, cols, tile, radius, q.device)
    t_n, t2 = qidx.shape
    qp, kp, vp = qs[:, :, p:], kw[:, :, p:], vw[:, :, p:]
    s_fp = s_f[:, :, p:]  # [B,H,P,s] the patch queries' landmark logits (token order)
    s_w = (_pick(qp, qidx) @ _pick(kp, kidx).transpose(-1, -2)).masked_fill(~valid[:, None, :], float("-inf"))
    # row shift m: the largest logit over the window and the landmark keys, in token order
    m_w = s_w.amax(-1).reshape(b, h, t_n * t2).index_select(2, back)[..., None]  # [B,H,P,1]
    m = torch.maximum(m_w, s_fp.amax(-1, keepdim=True))
    f_ = torch.exp(s_fp - m)  # [B,H,P,s]
    e_w = torch.exp(s_w - _pick(m, qidx))  # [B,H,T,t2,box] exact window weights (0 on padding)
    phi_w = _pick(f_, qidx) @ _pick(g.transpose(-1, -2)[:, :, p:], kidx).transpose(-1, -2)  # the estimate there
    phi_w = phi_w.masked_fill(~valid[:, None, :], 0.0)
    vb = _pick(vp, kidx)  # [B,H,T,box,D]
    both = torch.cat([e_w, phi_w], dim=3) @ vb  # [B,H,T,2*t2,D]: [exact | estimated] window sums of v
    near = torch.cat([both[:, :, :, :t2], both[:, :, :, t2:], e_w.sum(-1, keepdim=True), phi_w.sum(-1, keepdim=True)], -1)
    near = near.reshape(b, h, t_n * t2, 2 * d + 2).index_select(2, back)  # [B,H,P,2D+2] token order
    # prefix keys: exact and estimated weights (they are the first landmarks: their logits are columns of s_f)
    e_p = torch.exp(s_fp[..., :p] - m)  # [B,H,P,p]
    phi_p = f_ @ g[:, :, :, :p]  # [B,H,P,p]
    vpre = vw[:, :, :p]  # [B,H,p,D]
    # low-rank sums over every key: [sum_j phi'_ij v_j | sum_j phi'_ij]
    rhs = torch.cat([b_ @ vw, b_.sum(-1, keepdim=True)], dim=-1)  # [B,H,s,D+1]
    with local_blas_threads(1, q.device):
        w = z @ rhs
    lr = f_ @ w  # [B,H,P,D+1]
    ep_phip = torch.cat([e_p, phi_p], dim=2) @ vpre  # [B,H,2P,D]
    npch = n - p
    exact_num = near[..., :d] + ep_phip[:, :, :npch]
    exact_den = near[..., 2 * d : 2 * d + 1] + e_p.sum(-1, keepdim=True)
    far_num = lr[..., :d] - near[..., d : 2 * d] - ep_phip[:, :, npch:]
    far_den = lr[..., d:] - near[..., 2 * d + 1 :] - phi_p.sum(-1, keepdim=True)
    # the far field's mean value far_num / far_den is a convex combination of value rows, inside the box
    # [min_j v_j, max_j v_j] per channel: a row whose estimate has no positive mass or leaves the box is inconsistent
    # (cancellation between the low-rank sums) and keeps its exact window attention alone
    use = far_den > 0
    u = far_num / torch.where(use, far_den, 1.0)
    use = use & ((u >= vw.amin(-2, keepdim=True)) & (u <= vw.amax(-2, keepdim=True))).all(-1, keepdim=True)
    out_p = torch.where(use, (exact_num + far_num) / (exact_den + far_den), exact_num / exact_den)
    if p:
        # prefix queries (CLS, registers) attend to every key exactly: p rows of fused attention
        out_pre = F.scaled_dot_product_attention(qw[:, :, :p], kw, vw, scale=scale)
        out_p = torch.cat([out_pre, out_p], dim=2)
    return out_p.to(q.dtype)


def nystrom_local_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    landmarks: torch.Tensor,
    *,
    scale: float,
    prefix: int,
    radius: int,
    tile: int = 4,
    grid: tuple[int, int] | None = None,
    pinv: str = "rtol",
    rtol: float = 1e-2,
) -> torch.Tensor:
    """Slow float64 reference of :func:`nystrom_local_attention` for tests: explicit ``N x N`` kernel estimate and
    an explicit window mask built position by position (Python loops).  Same contract, float64 output."""
    b, h, n, d = q.shape
    p = prefix
    rows, cols = grid_of(n - p, grid)
    qd, kd, vd = q.double(), k.double(), v.double()
    s = (qd @ kd.transpose(-1, -2)) * scale  # [B,H,N,N]
    mask = torch.zeros(n, n, dtype=torch.bool)
    mask[:, :p] = True
    mask[:p, :] = True
    for i in range(n - p):
        r, c = divmod(i, cols)
        r0, c0 = (r // tile) * tile, (c // tile) * tile
        for j in range(n - p):
            rj, cj = divmod(j, cols)
            if r0 - radius <= rj < r0 + tile + radius and c0 - radius <= cj < c0 + tile + radius:
                mask[p + i, p + j] = True
    out = torch.empty(b, h, n, d, dtype=torch.float64)
    for bi in range(b):
        lm = landmarks[bi].cpu()
        for hi in range(h):
            sb = s[bi, hi][lm]  # [s, N]
            nl = sb.max(-1, keepdim=True).values
            bb = torch.exp(sb - nl)
            a = bb[:, lm]
            z = landmark_pinv_work(a, pinv, rtol, 6) if pinv != "exact" else torch.linalg.pinv(a)
            mrow = torch.where(mask, s[bi, hi], torch.tensor(-math.inf, dtype=torch.float64))
            m = torch.maximum(mrow.max(-1, keepdim=True).values, s[bi, hi][:, lm].max(-1, keepdim=True).values)
            ff = torch.exp(s[bi, hi][:, lm] - m)
            phi = ff @ z.double() @ bb  # [N, N] estimate of exp(s - m)
            ex = torch.exp(s[bi, hi] - m)
            near = torch.where(mask, ex, torch.zeros_like(ex))
            far = torch.where(mask, torch.zeros_like(phi), phi)
            far_den = far.sum(-1, keepdim=True)
            far_num = far @ vd[bi, hi]
            use = far_den > 0
            u = far_num / torch.where(use, far_den, torch.ones(1, dtype=torch.float64))
            vv = vd[bi, hi]
            use = use & ((u >= vv.min(0).values) & (u <= vv.max(0).values)).all(-1, keepdim=True)
            num = near @ vd[bi, hi] + torch.where(use, far_num, torch.zeros(1, dtype=torch.float64))
            den = near.sum(-1, keepdim=True) + torch.where(use, far_den, torch.zeros(1, dtype=torch.float64))
            out[bi, hi] = num / den
            if p:
                out[bi, hi, :p] = torch.softmax(s[bi, hi, :p], -1) @ vd[bi, hi]
    return out
