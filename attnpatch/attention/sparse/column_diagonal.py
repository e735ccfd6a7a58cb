"""Exact softmax attention over kept key columns and kept diagonals: the sparse attention that vertical-slash and
A-shape run on.

Source: MInference 1.0, Jiang et al., arXiv 2407.02490, Sec. 3.2 and Alg. 2 (step 4 of the vertical-slash head):
query ``i`` attends with an exact softmax to key ``j`` when ``j <= i``, ``j`` is not padding and
``col[j] or diag[i - j]``.  The A-shape pattern (:mod:`attnpatch.attention.sparse.a_shape`) is the special case of
the initial columns and the diagonals ``0 .. window - 1``; vertical-slash (:mod:`attnpatch.attention.sparse.vertical_slash`)
chooses its columns and diagonals from the last queries.

:func:`column_diagonal_attention` never forms a ``queries x keys`` matrix: queries go in blocks of ``BLOCK`` rows,
keys in tiles of the same size on a grid aligned with the query blocks; a (query block, key tile) pair is computed
only where some kept column or diagonal crosses it, with the exact per-query mask inside it, so the result does
not depend on the block size beyond float rounding.  MInference's own kernel computes whole key blocks that a
kept diagonal crosses (a superset of the diagonal); here only the diagonal itself is attended.
:func:`column_diagonal_recall` measures the softmax mass such a pattern keeps (a diagnostic).

Pure tensor functions on ``[batch, heads, tokens, head_dim]`` tensors; keys and values may have fewer heads than
queries (grouped-query attention).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..backends.dispatch import masked_rows_are_zero
from ..prefill import check_inputs

__all__ = ["BLOCK", "CHUNK_ELEMENTS", "RECALL_ELEMENTS", "column_diagonal_attention", "column_diagonal_recall",
           "column_diagonal_counts"]

#: Queries per block and keys per tile of :func:`column_diagonal_attention` (MInference's GPU kernel uses 64;
#: on the CPU, 128 halves the gathering and indexing per kept pair).
BLOCK = 128
#: Score elements (query rows x keys) per fused attention call of :func:`column_diagonal_attention` (its mask,
#: one float per element, then stays in the cache between being built and being read).
CHUNK_ELEMENTS = 1 << 20
#: Scores per query chunk of :func:`column_diagonal_recall` (float32; a few such buffers live at once).
RECALL_ELEMENTS = 1 << 22


def column_diagonal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    columns: torch.Tensor,
    diagonals: torch.Tensor,
    *,
    scale: float,
    q_offset: int = 0,
    key_valid: torch.Tensor | None = None,
    block: int = BLOCK,
    return_counts: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Exact softmax attention of each query over kept key columns and kept diagonals (causal).

    Query ``i`` (absolute position) attends to key ``j`` when ``j <= i``, ``key_valid[j]`` and
    ``columns[j] or diagonals[i - j]`` (MInference, arXiv 2407.02490, Sec. 3.2, vertical-slash step 4;
    the A-shape pattern is the special case of the initial columns and the diagonals ``0 .. window - 1``).

    Queries go in blocks of ``block`` rows; keys in tiles of ``block`` on a grid aligned with the query
    blocks.  A (query block, key tile) pair is computed where some kept column lies in the tile or some
    kept diagonal crosses it; per key/value head (or per query head, for per-head patterns), the crossed
    tiles of a block are gathered and attended in one fused ``scaled_dot_product_attention`` call with
    the per-query mask (additive, in ``q``'s dtype), blocks of similar tile counts batched together (about
    ``CHUNK_ELEMENTS`` scores per call).  The fused kernel applies the scale before the product and accumulates
    the softmax in float32 for half-precision inputs.  Peak memory: the gathered keys/values and mask of one
    call, plus the diagonal tile table (``B x P x Lk x block`` booleans); no ``queries x keys`` matrix.

    Args:
        q: ``[B, H, Lq, D]`` at absolute positions ``q_offset .. q_offset + Lq - 1``.
        k, v: ``[B, Hkv, Lk, D]`` and ``[B, Hkv, Lk, Dv]``; keys after position ``q_offset + Lq - 1`` are
            never attended.
        columns: bool ``[B, P, >= q_offset + Lq]``: kept key columns (by key position).
        diagonals: bool ``[B, P, >= q_offset + Lq]``: kept diagonals (by offset ``i - j``, 0 = each query itself).
            ``P`` is 1 (one pattern for every head), ``Hkv`` (per key/value head) or ``H`` (per query head).
        scale: logit scale.
        q_offset: absolute position of the first query.
        key_valid: ``[B, Lk]`` bool, False at padding keys, or ``None``.
        block: query rows per block and keys per tile (tokens).
        return_counts: also return the kept causal pairs per (sequence, query head) over valid queries.

    Returns:
        ``(out, kept)``: ``out`` ``[B, H, Lq, Dv]`` in ``q.dtype`` (a query with no kept key gives zeros);
        ``kept`` float64 ``[B, H]`` or ``None``.

    Raises:
        ValueError: inputs that do not fit (:func:`~attnpatch.attention.prefill.check_inputs`), ``P`` not in
            ``{1, Hkv, H}``, pattern tensors not bool ``[B, P, >= q_offset + Lq]``, ``block < 1``.
    """
    check_inputs(q, k, v, scale, q_offset, key_valid, value_dim=True)
    b, h, lq, d = q.shape
    hkv, dv, dev = k.shape[1], v.shape[-1], q.device
    lc = q_offset + lq
    p = columns.shape[1] if columns.dim() == 3 else -1
    for name, pat in (("columns", columns), ("diagonals", diagonals)):
        if pat.dtype != torch.bool or pat.dim() != 3 or pat.shape[0] != b or pat.shape[1] != p or pat.shape[2] < lc:
            raise ValueError(f"{name} must be bool [{b}, P, >= {lc}] with the same P for both; got {pat.dtype} {tuple(pat.shape)}")
    if p not in (1, hkv, h):
        raise ValueError(f"pattern heads P={p}: must be 1, the key/value heads ({hkv}) or the query heads ({h})")
    if block < 1:
        raise ValueError(f"block={block}: must be >= 1")
    bq = block
    pad = (-q_offset) % bq  # keys shifted right by `pad` so that query blocks start on tile boundaries
    u0 = (q_offset + pad) // bq  # the key tile of query block 0's own positions
    nb = -(-lq // bq)
    t = u0 + nb  # key tiles
    kp = t * bq

    def placed(x: torch.Tensor, fill) -> torch.Tensor:  # x [..., Lk, *rest] along dim 2 (or last for 2/3-D masks)
        dim = 2 if x.dim() == 4 else x.dim() - 1
        x = x.narrow(dim, 0, lc)
        if pad == 0 and lc == kp:
            return x.contiguous()
        shape = list(x.shape)
        shape[dim] = kp
        out = x.new_full(shape, fill)
        out.narrow(dim, pad, lc).copy_(x)
        return out

    kk_all = placed(k, 0).reshape(b * hkv * t, bq, d)
    vv_all = placed(v, 0).reshape(b * hkv * t, bq, dv)
    valid = placed(key_valid, False) if key_valid is not None else placed(torch.ones(b, lc, dtype=torch.bool, device=dev), False)
    valid_t = valid.reshape(b, t, bq)
    cols_t = (placed(columns, False).reshape(b, p, t, bq) & valid_t[:, None])  # [B, P, T, bq]

    # diagonal tile table: pat[b, p, dd, r, c] = diagonals[b, p, dd * bq + r - c] (False for negative offsets)
    diag = diagonals[..., :lc]
    dpad = torch.zeros(b, p, (bq - 1) + kp + bq, dtype=torch.bool, device=dev)
    dpad[..., bq - 1 : bq - 1 + lc] = diag
    r_ = torch.arange(bq, device=dev)
    rc = r_[:, None] - r_[None, :] + (bq - 1)  # [bq, bq] index into a window of 2 bq - 1 offsets
    pat = dpad.unfold(-1, 2 * bq - 1, bq)[:, :, :t][..., rc]  # [B, P, T, bq, bq]
    diag_t = pat.flatten(-2).any(-1)  # [B, P, T]: some kept diagonal crosses a tile at this distance

    # which key tiles each query block needs
    m_ = torch.arange(nb, device=dev)
    u_ = torch.arange(t, device=dev)
    dist = (u0 + m_)[:, None] - u_[None, :]  # [nb, T]
    qpos = torch.arange(nb * bq, device=dev)
    q_ok = (qpos < lq)[None, :] & valid[:, (pad + q_offset + qpos).clamp(max=kp - 1)]  # [B, nb*bq]
    need = (dist >= 0) & (cols_t[:, :, None, :, :].any(-1) | diag_t[:, :, dist.clamp(min=0)])  # [B, P, nb, T]
    need &= valid_t.any(-1)[:, None, None, :] & q_ok.reshape(b, nb, bq).any(-1)[:, None, :, None]

    hu = h if p == h else hkv  # attention units: per query head for per-head patterns, else per key/value head
    gu = h // hu
    need = need.expand(b, hu, nb, t) if p == 1 else need
    n_groups = b * hu * nb
    need = need.reshape(n_groups, t)
    counts = need.sum(-1)
    qg = q if nb * bq == lq else F.pad(q, (0, 0, 0, nb * bq - lq))
    qg = qg.reshape(b, hu, gu, nb, bq, d).permute(0, 1, 3, 2, 4, 5).reshape(n_groups, gu, bq, d)
    og = q.new_zeros(n_groups, gu, bq, dv)
    kept = torch.zeros(n_groups, dtype=torch.float64, device=dev) if return_counts else None
    dummy = b * p * t  # an all-False tile for the slots that pad a group to its bucket's width
    pat_flat = torch.cat([pat.reshape(b * p * t, bq, bq), pat.new_zeros(1, bq, bq)])
    cols_flat = torch.cat([cols_t.reshape(b * p * t, bq), cols_t.new_zeros(1, bq)])
    valid_flat = valid_t.reshape(b * t, bq)
    all_valid = bool(valid_t.all())  # no padding key (nor a shifted-in one) in any tile: no validity mask
    tri = r_[:, None] >= r_[None, :]  # [bq(r), bq(c)]: key at or before the query inside the diagonal tile
    q_ok_g = q_ok.reshape(b, 1, nb, bq)
    zero = torch.zeros((), dtype=q.dtype, device=dev)
    neg = torch.full((), -math.inf, dtype=q.dtype, device=dev)

    sorted_counts, perm = counts.sort()
    sc = sorted_counts.tolist()
    i = int((sorted_counts == 0).sum())
    unit = gu * bq * bq
    while i < n_groups:
        i2 = min(n_groups, i + max(1, CHUNK_ELEMENTS // (unit * sc[i])))
        while i2 > i + 1 and (i2 - i) * unit * sc[i2 - 1] > 2 * CHUNK_ELEMENTS:
            i2 = i + (i2 - i) // 2
        idx = perm[i:i2]
        n, mk = idx.numel(), sc[i2 - 1]
        # [n, mk]: each group's needed tiles in ascending order, padded with tile 0 (masked out)
        rr, cc = need.index_select(0, idx).nonzero(as_tuple=True)
        cnt = counts.index_select(0, idx)
        order = torch.zeros(n, mk, dtype=torch.long, device=dev)
        order[rr, torch.arange(rr.numel(), device=dev) - (cnt.cumsum(0) - cnt)[rr]] = cc
        slot_ok = torch.arange(mk, device=dev)[None, :] < cnt[:, None]
        g_b, g_u, g_m = idx // (hu * nb), (idx // nb) % hu, idx % nb
        g_kv, g_p = g_u * hkv // hu, g_u * p // hu
        krow = ((g_b * hkv + g_kv)[:, None] * t + order).reshape(-1)
        kk = kk_all.index_select(0, krow).reshape(n, 1, mk * bq, d)
        vv = vv_all.index_select(0, krow).reshape(n, 1, mk * bq, dv)
        dd = ((u0 + g_m)[:, None] - order).clamp(min=0)
        prow = (g_b * p + g_p)[:, None] * t
        # the per-query mask, built in the layout of the scores [n, bq (queries), mk, bq (keys of a tile)]
        m_diag = pat_flat.index_select(0, torch.where(slot_ok, prow + dd, dummy).reshape(-1))
        m_diag = m_diag.reshape(n, mk, bq, bq).transpose(1, 2)
        m_col = cols_flat.index_select(0, torch.where(slot_ok, prow + order, dummy).reshape(-1)).reshape(n, 1, mk, bq)
        keep = torch.empty(n, bq, mk, bq, dtype=torch.bool, device=dev)
        torch.bitwise_or(m_diag, m_col, out=keep)  # a kept column for every query of the block, except ...
        rd, sd = ((dd == 0) & slot_ok).nonzero(as_tuple=True)  # ... in the diagonal tile: for the queries at or after it
        if rd.numel():
            keep[rd, :, sd, :] = m_diag[rd, :, sd, :] | (m_col[rd, 0, sd][:, None, :] & tri)
        if not all_valid:
            keep &= valid_flat.index_select(0, (g_b[:, None] * t + order).reshape(-1)).reshape(n, 1, mk, bq)
        keep = keep.reshape(n, 1, bq, mk * bq)
        mask = torch.where(keep, zero, neg)  # additive: the fused kernel reads it as is
        o = F.scaled_dot_product_attention(qg.index_select(0, idx), kk, vv, attn_mask=mask, scale=scale, enable_gqa=gu > 1)
        if not masked_rows_are_zero(dev):  # rows without a kept key: zeros (the CPU kernel already gives zeros)
            o = torch.where(keep.any(-1, keepdim=True), o.nan_to_num(0.0), 0.0)
        og.index_copy_(0, idx, o)
        if kept is not None:
            rows = keep.sum(-1, dtype=torch.float64)[:, 0] * q_ok_g[g_b, 0, g_m].double()  # [n, bq]
            kept.index_copy_(0, idx, rows.sum(-1))
        i = i2
    out = og.reshape(b, hu, nb, gu, bq, dv).permute(0, 1, 3, 2, 4, 5).reshape(b, h, nb * bq, dv)
    if nb * bq != lq:
        out = out[:, :, :lq]
    if kept is not None:
        kept = kept.reshape(b, hu, nb).sum(-1).repeat_interleave(gu, dim=1)
    return out, kept


def column_diagonal_recall(
    q: torch.Tensor,
    k: torch.Tensor,
    columns: torch.Tensor,
    diagonals: torch.Tensor,
    *,
    scale: float,
    q_offset: int = 0,
    key_valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention recall of a column/diagonal pattern: the exact softmax mass its kept keys carry.

    For each query ``i`` (valid, causal), ``sum_{j kept} softmax(q_i K^T * scale)_j`` over its causal
    valid keys, with "kept" as in :func:`column_diagonal_attention`; a diagnostic that costs one dense
    ``Q K^T`` pass, in query chunks of about ``RECALL_ELEMENTS`` scores (float32).

    Args:
        q, k, columns, diagonals, scale, q_offset, key_valid: as for :func:`column_diagonal_attention`.

    Returns:
        ``(recall_sum, queries)``: float64 ``[B, H]`` sum of the per-query recall over valid queries, and
        float64 ``[B]`` their count (the mean is their ratio).
    """
    b, h, lq, _ = q.shape
    lk = q_offset + lq
    kr = k[:, :, :lk].float()
    kr = kr if kr.shape[1] == h else kr.repeat_interleave(h // kr.shape[1], dim=1)
    p = columns.shape[1]
    cols_m, diag_m = columns[..., :lk], diagonals[..., :lk]
    if p not in (1, h):
        cols_m, diag_m = cols_m.repeat_interleave(h // p, dim=1), diag_m.repeat_interleave(h // p, dim=1)
    pos = torch.arange(lk, device=q.device)
    total = torch.zeros(b, h, dtype=torch.float64, device=q.device)
    count = torch.zeros(b, dtype=torch.float64, device=q.device)
    step = max(1, RECALL_ELEMENTS // max(1, b * h * lk))
    for c0 in range(0, lq, step):
        c1 = min(lq, c0 + step)
        rows = q_offset + torch.arange(c0, c1, device=q.device)
        logits = (q[:, :, c0:c1].float() @ kr.transpose(-1, -2)) * scale  # [B, H, c, Lk]
        allowed = (pos[None, :] <= rows[:, None])[None, None]
        if key_valid is not None:
            allowed = allowed & key_valid[:, None, None, :lk]
        off = (rows[:, None] - pos[None, :]).clamp(0, lk - 1)
        keep = (cols_m[:, :, None, :] | diag_m[:, :, off]) & allowed
        lse_all = logits.masked_fill(~allowed, -math.inf).logsumexp(-1)
        lse_keep = logits.masked_fill(~keep, -math.inf).logsumexp(-1)
        r = torch.exp(lse_keep - lse_all).nan_to_num(0.0)  # [B, H, c]; rows without a valid key give 0
        qv = torch.ones(b, c1 - c0, dtype=torch.bool, device=q.device) if key_valid is None else key_valid[:, rows]
        total += (r.double() * qv[:, None, :]).sum(-1)
        count += qv.double().sum(-1)
    return total, count


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
