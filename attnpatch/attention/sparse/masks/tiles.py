"""What the FlexAttention patterns of the block-sparse baselines share: the geometry of their ``BlockMask`` tiles.

Tiles of :data:`~attnpatch.attention.backends.flex.FLEX_BLOCK` queries and keys.  The keys are shifted right by
``s`` empty slots so that the call's queries start on a tile boundary of the shifted keys (``s = (-q_offset) mod
FLEX_BLOCK`` for columns and diagonals, ``(-q_offset) mod block_size`` for block top-k, whose own key blocks then
start on multiples of ``block_size``): the query at row ``r`` sits at shifted position ``base + r``, ``base =
q_offset + s``, and its own key at shifted index ``base + r``.  Per (query tile, key tile) the tile is *empty*
(skipped), *full* (every pair kept: causal for every query, every key valid and kept) or *partial* (computed with
the ``mask_mod``, which is the exact per-pair rule).  Tile tables come from the pattern at tile level (prefix sums
over kept columns, diagonals or blocks), never from a ``queries x keys`` mask.  Rows without a kept key give zeros,
as in the gather paths.

Sources: FlexAttention, Dong et al., arXiv 2412.05496 (``BlockMask``, ``mask_mod``); attention-gym's
``attn_gym/masks/``.
"""

from __future__ import annotations

import torch

from ...backends.flex import FLEX_BLOCK, flex_unavailable, padded_lengths

__all__ = ["scalar", "key_table", "tile_geometry", "tile_any_all", "column_diagonal_tiles"]


def scalar(x: int, device) -> torch.Tensor:
    """``x`` as a 0-d int64 tensor on ``device`` (a ``mask_mod`` reads positions and sizes as tensors: one compiled
    kernel per length bucket, not per value)."""
    return torch.tensor(x, dtype=torch.int64, device=device)


def key_table(key_valid: torch.Tensor | None, b: int, lk: int, s: int, lkt: int, device) -> torch.Tensor:
    """``[B, lkt]`` bool: shifted key slot ``s + j`` holds a valid key ``j < lk``."""
    valid = torch.zeros(b, lkt, dtype=torch.bool, device=device)
    valid[:, s : s + lk] = True if key_valid is None else key_valid[:, :lk]
    return valid


def tile_geometry(lq: int, base: int, lqt: int, lkt: int, device):
    """Per (query tile, key tile) ``[nq, nk]``: whether some pair is causal and whether every pair is (tiles holding
    a real query only), with the first/last shifted position of each query tile's real queries."""
    t = FLEX_BLOCK
    nq, nk = lqt // t, lkt // t
    m = torch.arange(nq, device=device)
    u = torch.arange(nk, device=device)
    qmin = base + m * t
    qmax = base + torch.minimum(m * t + t, torch.full_like(m, max(lq, 1))) - 1
    real = m * t < lq
    some = (u[None, :] * t <= qmax[:, None]) & real[:, None]
    every = (u[None, :] * t + t - 1 <= qmin[:, None]) & real[:, None]
    return some, every, qmin, qmax


def tile_any_all(x: torch.Tensor, nk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[..., nk * FLEX_BLOCK]`` bool -> per tile ``(any, all)`` ``[..., nk]``."""
    xt = x.reshape(*x.shape[:-1], nk, FLEX_BLOCK)
    return xt.any(-1), xt.all(-1)


def column_diagonal_tiles(q, columns, diagonals, q_offset: int, key_valid) -> dict:
    """The shifted tables (``valid``, ``cols``, ``diag``) and the partial/full tile tables ``[B, 1 or H, nq, nk]`` of a
    column/diagonal pattern (:func:`column_diagonal_flex`), with the call's geometry for
    :func:`~attnpatch.attention.flex.run_tiles`."""
    why = flex_unavailable(q)
    if why is not None:
        raise RuntimeError(why)
    b, h, lq, _ = q.shape
    dev = q.device
    lc = q_offset + lq
    p = columns.shape[1]
    t = FLEX_BLOCK
    s = (-q_offset) % t
    base = q_offset + s
    lqp, lkp, lqt, lkt = padded_lengths(lq, base)
    nk = lkt // t
    valid = key_table(key_valid, b, lc, s, lkt, dev)
    cols = torch.zeros(b, p, lkt, dtype=torch.bool, device=dev)
    cols[:, :, s : s + lc] = columns[..., :lc]
    cols &= valid[:, None]
    diag = torch.zeros(b, p, lkt + lqt, dtype=torch.bool, device=dev)  # by offset; covers every causal offset
    diag[:, :, :lc] = diagonals[..., :lc]

    # tile tables [B, P, nq, nk]
    some, every, qmin, qmax = tile_geometry(lq, base, lqt, lkt, dev)
    kv_any, kv_all = tile_any_all(valid, nk)
    col_any, col_all = tile_any_all(cols, nk)
    u = torch.arange(nk, device=dev)
    lo = (qmin[:, None] - (u[None, :] * t + t - 1)).clamp(min=0, max=lc)  # offsets a tile spans: lo .. hi
    hi = (qmax[:, None] - u[None, :] * t).clamp(min=-1, max=lc - 1)
    csum = torch.nn.functional.pad(diag[..., :lc].to(torch.int32).cumsum(-1), (1, 0))  # [B, P, lc + 1]
    n_diag = (csum[..., (hi + 1).clamp(min=0).reshape(-1)] - csum[..., lo.reshape(-1)]).reshape(b, p, *lo.shape)
    width = (hi - lo + 1).clamp(min=0)
    q_ok = torch.ones(b, lqt, dtype=torch.bool, device=dev)
    if key_valid is not None:  # a query tile without a valid query gives zeros (as the gather path)
        q_ok[:, :lq] = valid[:, s + q_offset : s + lc]
    q_any = q_ok.reshape(b, -1, t).any(-1)  # [B, nq]
    near = some[None, None] & kv_any[:, None, None, :] & q_any[:, None, :, None]
    partial = near & (col_any[:, :, None, :] | (n_diag > 0))
    full = partial & every & kv_all[:, None, None, :] & (col_all[:, :, None, :] | ((n_diag == width) & (width > 0)))
    partial &= ~full
    if p not in (1, h):
        partial, full = partial.repeat_interleave(h // p, dim=1), full.repeat_interleave(h // p, dim=1)
    return dict(valid=valid, cols=cols, diag=diag, partial=partial, full=full, base=base,
                geometry=dict(s=s, lqp=lqp, lkp=lkp, lc=lc))
