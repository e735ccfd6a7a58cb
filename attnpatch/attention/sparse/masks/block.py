"""Kept key blocks (XAttention's block top-k) as a FlexAttention ``mask_mod`` over :mod:`.tiles`' tile tables, run by
:func:`attnpatch.attention.backends.flex.run_tiles`.

Source: XAttention, arXiv 2503.16428; FlexAttention, arXiv 2412.05496.
"""

from __future__ import annotations

import torch

from ...backends.flex import FLEX_BLOCK, flex_unavailable, padded_lengths, run_tiles
from .tiles import key_table, scalar, tile_any_all, tile_geometry

__all__ = ["block_flex"]


def block_flex(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    blocks: torch.Tensor,
    *,
    block_size: int,
    scale: float,
    q_offset: int = 0,
    key_valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact causal attention of each query block over its kept key blocks, on FlexAttention: the attention of
    :func:`~attnpatch.attention.block_topk.block_topk_attention` (same kept set) for one call without padding
    to strip.

    Query ``i`` (row ``r``, absolute position ``q_offset + r``) attends to key ``j`` when ``j <= i``,
    ``key_valid[j]`` and ``blocks[r // block_size, (j + lp) // block_size]``, ``lp = (-q_offset) mod
    block_size`` (the block grid of :func:`~attnpatch.attention.block_topk.block_geometry`).  A tile is
    computed whole where every block it overlaps is kept and it lies below the diagonal with valid keys.

    Args:
        q: ``[B, H, Lq, D]`` at absolute positions ``q_offset .. q_offset + Lq - 1``.
        k, v: ``[B, Hkv, Lk, D]``, ``Lk >= q_offset + Lq`` (later keys ignored).
        blocks: ``[B, H, ceil(Lq / block_size), nbk]`` bool kept key blocks (causal ones only).
        block_size: tokens per query and key block.
        scale: logit scale.
        q_offset: absolute position of the first query.
        key_valid: ``[B, Lk]`` bool or ``None``.

    Returns:
        ``[B, H, Lq, D]`` in ``q.dtype``; a query without a kept valid key gives zeros.

    Raises:
        RuntimeError: as :func:`column_diagonal_flex`.
    """
    why = flex_unavailable(q)
    if why is not None:
        raise RuntimeError(why)
    b, h, lq, _ = q.shape
    dev = q.device
    lc = q_offset + lq
    t, bs = FLEX_BLOCK, block_size
    s = (-q_offset) % bs
    base = q_offset + s
    lqp, lkp, lqt, lkt = padded_lengths(lq, base)
    nq, nk = lqt // t, lkt // t
    nfq, nfk = -(-lqt // bs), -(-lkt // bs)
    fine = torch.zeros(b, h, nfq, nfk, dtype=torch.bool, device=dev)
    cq, ck = min(blocks.shape[2], nfq), min(blocks.shape[3], nfk)  # blocks past the buckets hold no key
    fine[:, :, :cq, :ck] = blocks[:, :, :cq, :ck]
    valid = key_table(key_valid, b, lc, s, lkt, dev)
    some, every, _, _ = tile_geometry(lq, base, lqt, lkt, dev)
    kv_any, kv_all = tile_any_all(valid, nk)
    # kept blocks per tile: 2-D prefix sums of the block table over the blocks each tile overlaps
    cs = torch.nn.functional.pad(fine.to(torch.int32).cumsum(2).cumsum(3), (1, 0, 1, 0))
    r0, r1 = torch.arange(nq, device=dev) * t // bs, ((torch.arange(nq, device=dev) + 1) * t - 1) // bs + 1
    c0, c1 = torch.arange(nk, device=dev) * t // bs, ((torch.arange(nk, device=dev) + 1) * t - 1) // bs + 1
    r1, c1 = r1.clamp(max=nfq), c1.clamp(max=nfk)

    def rect(ra, ca):
        return cs[:, :, ra[:, None], ca[None, :]]

    kept = rect(r1, c1) - rect(r0, c1) - rect(r1, c0) + rect(r0, c0)  # [B, H, nq, nk]
    area = (r1 - r0)[:, None] * (c1 - c0)[None, :]
    near = some[None, None] & kv_any[:, None, None, :]
    partial = near & (kept > 0)
    full = partial & every & kv_all[:, None, None, :] & (kept == area)
    partial &= ~full

    base_t, bs_t = scalar(base, dev), scalar(bs, dev)

    def mask_mod(bi, hi, qi, kj):
        return (kj <= qi + base_t) & valid[bi, kj] & fine[bi, hi, qi // bs_t, kj // bs_t]

    return run_tiles(q, k, v, partial, full, mask_mod, scale=scale, s=s, lqp=lqp, lkp=lkp, lc=lc)
