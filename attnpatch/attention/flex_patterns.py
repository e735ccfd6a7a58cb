"""The kept sets of A-shape, vertical-slash and block top-k as FlexAttention tile tables and ``mask_mod``
functions, run by :func:`attnpatch.attention.flex.run_tiles` (compiled ``flex_attention``, length buckets).

Sources: FlexAttention, Dong et al., arXiv 2412.05496 (``BlockMask``, ``mask_mod``); attention-gym's
``attn_gym/masks/`` (``sliding_window.py``, ``sink_attn.py``: each pattern a ``mask_mod`` of a few lines);
MInference, arXiv 2407.02490, Sec. 3.2 (columns and diagonals); XAttention, arXiv 2503.16428 (kept blocks).

Geometry.  Tiles of :data:`~attnpatch.attention.flex.FLEX_BLOCK` queries and keys.  The keys are shifted right by
``s`` empty slots so that the call's queries start on a tile boundary of the shifted keys (``s = (-q_offset) mod
FLEX_BLOCK`` for columns and diagonals, ``(-q_offset) mod block_size`` for block top-k, whose own key blocks then
start on multiples of ``block_size``): the query at row ``r`` sits at shifted position ``base + r``, ``base =
q_offset + s``, and its own key at shifted index ``base + r``.  Per (query tile, key tile) the tile is *empty*
(skipped), *full* (every pair kept: causal for every query, every key valid and kept) or *partial* (computed with
the ``mask_mod``, which is the exact per-pair rule).  Tile tables come from the pattern at tile level (prefix sums
over kept columns, diagonals or blocks), never from a ``queries x keys`` mask.  Rows without a kept key give zeros,
as in the gather paths.
"""

from __future__ import annotations

import torch

from .flex import FLEX_BLOCK, flex_unavailable, padded_lengths, run_tiles

__all__ = ["column_diagonal_flex", "a_shape_flex", "block_flex", "column_diagonal_counts"]


def _scalar(x: int, device) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int64, device=device)


def column_diagonal_counts(columns: torch.Tensor, diagonals: torch.Tensor, *, heads: int, lq: int, q_offset: int = 0,
                           key_valid: torch.Tensor | None = None) -> torch.Tensor:
    """Kept causal pairs per (sequence, query head) over valid queries of a column/diagonal pattern: the
    ``kept`` of :func:`~attnpatch.attention.column_diagonal.column_diagonal_attention`, without attending.

    Per query ``i``: ``#{j <= i valid: columns[j]} + sum_d diagonals[d] w[i - d]`` with ``w`` the valid keys
    not in a kept column (a causal convolution, by FFT in float64, rounded).

    Args:
        columns, diagonals: bool ``[B, P, >= q_offset + lq]``, ``P`` dividing ``heads``.
        heads: query heads ``H``.
        lq, q_offset: the queries' count and first absolute position.
        key_valid: ``[B, >= q_offset + lq]`` bool or ``None``.

    Returns:
        float64 ``[B, H]``.
    """
    b, p = columns.shape[:2]
    lc = q_offset + lq
    dev = columns.device
    valid = torch.ones(b, lc, dtype=torch.bool, device=dev) if key_valid is None else key_valid[:, :lc]
    col = columns[..., :lc] & valid[:, None]
    w = (valid[:, None] & ~col).double()
    n = 1 << (2 * lc - 1).bit_length()
    conv = torch.fft.irfft(torch.fft.rfft(diagonals[..., :lc].double(), n) * torch.fft.rfft(w, n), n)[..., :lc].round()
    per_query = (col.double().cumsum(-1) + conv)[..., q_offset:lc]  # [B, P, Lq]
    total = (per_query * valid[:, None, q_offset:lc].double()).sum(-1)
    return total.repeat_interleave(heads // p, dim=1)


def _key_table(key_valid: torch.Tensor | None, b: int, lk: int, s: int, lkt: int, device) -> torch.Tensor:
    """``[B, lkt]`` bool: shifted key slot ``s + j`` holds a valid key ``j < lk``."""
    valid = torch.zeros(b, lkt, dtype=torch.bool, device=device)
    valid[:, s : s + lk] = True if key_valid is None else key_valid[:, :lk]
    return valid


def _tile_geometry(lq: int, base: int, lqt: int, lkt: int, device):
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


def _tile_any_all(x: torch.Tensor, nk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[..., nk * FLEX_BLOCK]`` bool -> per tile ``(any, all)`` ``[..., nk]``."""
    xt = x.reshape(*x.shape[:-1], nk, FLEX_BLOCK)
    return xt.any(-1), xt.all(-1)


def column_diagonal_flex(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    columns: torch.Tensor,
    diagonals: torch.Tensor,
    *,
    scale: float,
    q_offset: int = 0,
    key_valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`~attnpatch.attention.column_diagonal.column_diagonal_attention` (same arguments and kept set,
    its default ``block``) on FlexAttention.

    Query ``i`` (absolute position) attends with an exact softmax to key ``j`` when ``j <= i``,
    ``key_valid[j]`` and ``columns[j] or diagonals[i - j]`` (MInference, arXiv 2407.02490, Sec. 3.2).
    A (query tile, key tile) is computed where a kept column lies in the key tile or a kept diagonal crosses
    it, whole where every column of the key tile or every diagonal crossing it is kept (and it lies below
    the diagonal, its keys all valid); as in the gather path, a query tile without a valid query gives zeros.
    Memory: the padded copies of ``q``, ``k``, ``v`` (:mod:`attnpatch.attention.flex`), ``[B, P, bucket]`` tables and
    ``[B, P, Lq / 128, Lk / 128]`` tile tables.

    Args:
        q: ``[B, H, Lq, D]`` at absolute positions ``q_offset .. q_offset + Lq - 1``.
        k, v: ``[B, Hkv, Lk, D]``, ``[B, Hkv, Lk, Dv]``; keys after position ``q_offset + Lq - 1`` are ignored.
        columns, diagonals: bool ``[B, P, >= q_offset + Lq]``, ``P`` in ``{1, Hkv, H}``: kept key columns (by
            key position) and kept diagonals (by offset ``i - j``).
        scale: logit scale.
        q_offset: absolute position of the first query.
        key_valid: ``[B, Lk]`` bool, False at padding keys, or ``None``.

    Returns:
        ``[B, H, Lq, Dv]`` in ``q.dtype``.

    Raises:
        RuntimeError: the compiled kernel cannot take these inputs (why:
            :func:`~attnpatch.attention.flex.flex_unavailable`).
        FlexCompileError: ``torch.compile`` fails or has reached ``RECOMPILE_LIMIT`` compilations
            (:func:`~attnpatch.attention.flex.flex_attend` turns it into the gather path or a ``RuntimeError``).
    """
    g = _column_diagonal_tiles(q, columns, diagonals, q_offset, key_valid)
    valid, cols, diag = g["valid"], g["cols"], g["diag"]
    base_t, group_t = _scalar(g["base"], q.device), _scalar(q.shape[1] // columns.shape[1], q.device)

    def mask_mod(bi, hi_, qi, kj):
        i = qi + base_t
        causal = kj <= i
        pi = hi_ // group_t
        return causal & valid[bi, kj] & (cols[bi, pi, kj] | diag[bi, pi, torch.where(causal, i - kj, 0)])

    return run_tiles(q, k, v, g["partial"], g["full"], mask_mod, scale=scale, **g["geometry"])


def a_shape_flex(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    init_tokens: int,
    window: int,
    scale: float,
    q_offset: int = 0,
) -> torch.Tensor:
    """A-shape attention without key padding on FlexAttention: query ``i`` attends to key ``j <= i`` when
    ``j < init_tokens`` or ``i - j < window`` (StreamingLLM, arXiv 2309.17453, Sec. 3.2; attention-gym's sink +
    sliding-window ``mask_mod``, arithmetic only), the tiles of :func:`column_diagonal_flex` for those columns and
    diagonals; the kept set of :func:`~attnpatch.attention.streaming.a_shape_attention` without ``key_valid``.

    Args:
        q: ``[B, H, Lq, D]`` at absolute positions ``q_offset .. q_offset + Lq - 1``.
        k, v: ``[B, Hkv, Lk, D]``, ``[B, Hkv, Lk, Dv]``, ``Lk >= q_offset + Lq`` (later keys ignored).
        init_tokens: initial keys every query keeps (tokens, >= 0).
        window: keys ending at each query, itself included (tokens, >= 1).
        scale: logit scale.
        q_offset: absolute position of the first query.

    Returns:
        ``[B, H, Lq, Dv]`` in ``q.dtype``.

    Raises:
        RuntimeError: as :func:`column_diagonal_flex`.
    """
    b, lc, dev = q.shape[0], q_offset + q.shape[2], q.device
    pos = torch.arange(lc, device=dev)
    columns, diagonals = (pos < init_tokens).expand(b, 1, lc), (pos < window).expand(b, 1, lc)
    g = _column_diagonal_tiles(q, columns, diagonals, q_offset, None)
    s_t, base_t = _scalar(g["geometry"]["s"], dev), _scalar(g["base"], dev)
    init_t, window_t = _scalar(init_tokens, dev), _scalar(window, dev)

    def mask_mod(bi, hi, qi, kj):
        i = qi + base_t
        j = kj - s_t
        return (kj <= i) & (j >= 0) & ((j < init_t) | (i - kj < window_t))

    return run_tiles(q, k, v, g["partial"], g["full"], mask_mod, scale=scale, **g["geometry"])


def _column_diagonal_tiles(q, columns, diagonals, q_offset: int, key_valid) -> dict:
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
    valid = _key_table(key_valid, b, lc, s, lkt, dev)
    cols = torch.zeros(b, p, lkt, dtype=torch.bool, device=dev)
    cols[:, :, s : s + lc] = columns[..., :lc]
    cols &= valid[:, None]
    diag = torch.zeros(b, p, lkt + lqt, dtype=torch.bool, device=dev)  # by offset; covers every causal offset
    diag[:, :, :lc] = diagonals[..., :lc]

    # tile tables [B, P, nq, nk]
    some, every, qmin, qmax = _tile_geometry(lq, base, lqt, lkt, dev)
    kv_any, kv_all = _tile_any_all(valid, nk)
    col_any, col_all = _tile_any_all(cols, nk)
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
    valid = _key_table(key_valid, b, lc, s, lkt, dev)
    some, every, _, _ = _tile_geometry(lq, base, lqt, lkt, dev)
    kv_any, kv_all = _tile_any_all(valid, nk)
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

    base_t, bs_t = _scalar(base, dev), _scalar(bs, dev)

    def mask_mod(bi, hi, qi, kj):
        return (kj <= qi + base_t) & valid[bi, kj] & fine[bi, hi, qi // bs_t, kj // bs_t]

    return run_tiles(q, k, v, partial, full, mask_mod, scale=scale, s=s, lqp=lqp, lkp=lkp, lc=lc)
