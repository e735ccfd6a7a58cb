"""``anchor_attention``: one call of AnchorAttention (selection, recall guard, sparse attention, dense rows),
per sequence when padding differs between rows.
"""

from __future__ import annotations

import math

import torch

from ...errors import OptionError
from ..backends.dispatch import choose
from ..prefill import check_inputs, per_sequence, split_padding
from .attend import (attend_call, dense_causal_attention, dense_heads_attention, dense_rows_attention, pair_counts,
                     sparse_attend)
from .config import AnchorConfig, AnchorStats
from .guard import causal_guard, kept_mass, probe_recall
from .select import call_geometry, causal_keys, select_kept

__all__ = ["anchor_attention", "anchor_per_sequence"]


def anchor_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cfg: AnchorConfig,
    *,
    scale: float,
    q_offset: int = 0,
    key_valid: torch.Tensor | None = None,
    dense_heads: list[int] | tuple[int, ...] = (),
    return_stats: bool = False,
    compute_recall: bool = False,
) -> tuple[torch.Tensor, AnchorStats | None]:
    """AnchorAttention sparse prefill (arXiv 2505.23520, Sec. 3, Eq. 2-4), fast batched implementation.

    The kernels are :func:`attnpatch.attention.backends.dispatch.choose`'s for ``cfg.kernel`` (operations
    ``"anchor_select"`` and ``"anchor_attend"``).  Selection (anchors, pooled scores) is computed in fp32 (the
    stripe-scoring product in bfloat16 with ``select_dtype="bfloat16"``) on grouped query heads, without repeating
    keys.  Attention over kept stripes: float32 CPU tensors run the compiled kernel (``cfg.kernel``; each
    (batch, head, query block) gathers its kept keys tile by tile inside an online-softmax loop,
    K/V never repeated or copied whole); other inputs gather, per (batch, head, query block), the
    kept keys padded to the largest kept set of a bucket of blocks sorted by kept count, and run
    batched fused attention.  There is no Python loop over queries or heads (see ``sparse_attend``).
    On CUDA (``kernel="auto"`` or ``"triton"``) the selection, the attention over the kept keys (the ``dense_last``
    rows and the blocks the recall guard makes dense included) and the guard's probes run as Triton kernels
    (:mod:`.triton_select`, :mod:`.triton_attend`): the kept keys stay on the device as a bitmask, with no host
    synchronisation between selection and attention (the guard's decision and the statistics read the bitmask
    through PyTorch operations, which synchronise where they branch on a result).

    Speed and recall of the defaults and of faster settings, against causal SDPA on captured inputs:
    docs/benchmarks/cpu.md.  Heads the global recall
    guard makes dense run PyTorch's fused causal attention (one call per key/value head, K/V not repeated);
    blocks the causal guard makes dense run the compiled kernel over every causal key, or on the PyTorch path
    fused attention over the rows from the first guarded block (:func:`dense_rows_attention`).

    Args:
        q: ``[B, H, Lq, D]`` queries at absolute positions ``q_offset .. q_offset+Lq-1``.
        k, v: ``[B, Hkv, Lk, D]``, ``H % Hkv == 0``; ``Lk >= q_offset + Lq``.
        cfg: :class:`AnchorConfig`.
        scale: logit scale.
        q_offset: absolute position of the first query (``Lk - Lq`` for a prompt continued on a cache).
        key_valid: ``[B, Lk]`` bool, False at padding keys (left padding), or ``None``.
        dense_heads: query-head indices that attend densely (all causal keys).
        return_stats: also return :class:`AnchorStats` (sparsity, kept columns per block).
        compute_recall: also fill ``AnchorStats.recall`` (exact softmax mass on kept keys; costs
            one dense ``Q K^T`` pass in query chunks, never an ``Lq x Lk`` buffer).

    Returns:
        ``(out, stats)``: ``out`` is ``[B, H, Lq, D]`` in ``q.dtype``; queries with no valid key
        (padding) give zeros.  ``stats`` is ``None`` unless requested.

    Raises:
        ValueError: inputs that do not fit: ranks, batch or head dim of ``q`` and ``k``, ``v`` shaped
            unlike ``k``, ``H`` not a multiple of ``Hkv``, ``q_offset < 0`` or ``Lk < q_offset + Lq``,
            ``key_valid`` not bool ``[B, Lk]``, a scale that is not a positive finite number.
        OptionError: a ``dense_heads`` index outside ``0..H-1``.
        KernelError: ``kernel="compiled"`` for inputs it does not take or where it cannot be built;
            ``kernel="triton"`` where Triton cannot run (no Triton, float64, a CPU tensor outside the Triton
            interpreter).  Both an ``OptionError`` and a ``RuntimeError``.
    """
    check_inputs(q, k, v, scale, q_offset, key_valid)
    b, h, lq, d = q.shape
    hkv = k.shape[1]
    want_stats = return_stats or compute_recall
    split = split_padding(key_valid, q_offset, lq)
    if split is not None:
        return anchor_per_sequence(
            anchor_attention, q, k, v, cfg, split, scale=scale, q_offset=q_offset, key_valid=key_valid,
            dense_heads=dense_heads, return_stats=return_stats, compute_recall=compute_recall,
        )
    n_dense = min(cfg.dense_last, lq)
    ls = lq - n_dense  # queries that follow the sparse rule; the last n_dense attend densely
    dense_set = sorted({int(x) for x in dense_heads})
    if any(x < 0 or x >= h for x in dense_set):
        raise OptionError(f"dense_heads={dense_set}: head indices must be in 0..{h - 1}")
    geo = call_geometry(q, k, cfg.block_size, q_offset, key_valid)
    use = choose("anchor_attend", cfg.kernel, attend_call(q, geo))  # raises for a kernel that cannot run here
    triton_path = use == "triton"
    sparse_heads = [x for x in range(h) if x not in dense_set]
    if cfg.theta == math.inf or not sparse_heads or ls == 0 or lq < cfg.min_len_on(q.device):
        # every causal key is kept (or the prompt is shorter than min_len): exactly dense
        out = dense_causal_attention(q, k, v, scale=scale, q_offset=q_offset, key_valid=key_valid)
        stats = None
        if want_stats:
            causal = pair_counts(None, geo, cfg.block_size)[0].expand(b, h).clone()
            stats = AnchorStats(causal, causal.clone(), None, torch.ones_like(causal) if compute_recall else None)
        return out, stats
    g = h // hkv
    if dense_set:
        sidx = torch.tensor(sparse_heads, device=q.device)
        qh, kh, vh = q.index_select(1, sidx), k.index_select(1, sidx // g), v.index_select(1, sidx // g)
    else:
        qh, kh, vh = q, k, v
    if triton_path:  # selection into a bitmask, guard probes and attention (dense_last rows included) on the device
        from .triton_attend import attend_bits, triton_guard  # imports Triton: only where its kernels run
        from .triton_select import select_bits

        bits = select_bits(qh, kh, cfg, scale, geo)  # [B, Hs, nb, ceil(Lk / 32)] int32
        low = triton_guard(qh, kh, bits, geo, cfg, scale, ls)
        o = attend_bits(qh, kh, vh, bits, geo, cfg, scale, dense_from=ls, dense_blocks=low)
    else:
        keep = select_kept(qh, kh, cfg, scale, geo)
        low, o = _guarded_attend(qh, kh, vh, keep, geo, cfg, scale, ls, q_offset, key_valid, use)
    if dense_set:
        configured = torch.zeros(h, dtype=torch.bool, device=q.device)
        configured[dense_set] = True
        out = dense_heads_attention(q, k, v, configured, scale, q_offset, key_valid)
        out[:, sidx] = o
    else:
        out = o
    if n_dense and not triton_path:
        out[:, :, ls:] = dense_causal_attention(
            q[:, :, ls:], k, v, scale=scale, q_offset=q_offset + ls, key_valid=key_valid
        )
    if not want_stats:
        return out, None
    if triton_path:
        from .triton_attend import triton_stats

        causal = pair_counts(None, geo, cfg.block_size)[0]
        kept_s, cols, r = triton_stats(qh, kh, bits, low, geo, cfg, scale, ls, compute_recall)
    else:
        if low is not None:  # guarded blocks kept every causal key
            keep = torch.where(low[..., None], causal_keys(geo)[:, None], keep)
        causal, kept_s = pair_counts(keep, geo, cfg.block_size, dense_from=ls)
        cols = keep.sum(-1)
        r = kept_mass(qh, kh, keep, geo, cfg.block_size, scale) if compute_recall else None  # [B, Hs, Lq]
    causal = causal.expand(b, h).clone()
    kept = causal.clone()
    kept[:, sparse_heads] = kept_s
    kept_cols = torch.full((b, h, geo.nb), -1, dtype=torch.long, device=q.device)
    kept_cols[:, sparse_heads] = cols
    stats = AnchorStats(causal, kept, kept_cols)
    if compute_recall:
        r[:, :, ls:] = 1.0
        qv = geo.query_valid[:, :lq].double()
        recall = torch.ones(b, h, dtype=torch.float64, device=q.device)
        recall[:, sparse_heads] = (r * qv[:, None]).sum(-1) / qv.sum(-1).clamp(min=1)[:, None]
        stats.recall = recall
    return out, stats


def _guarded_attend(qh, kh, vh, keep, geo, cfg: AnchorConfig, scale: float, ls: int, q_offset: int, key_valid,
                    use: str):
    """The PyTorch / compiled path's recall guard and attention over the kept keys ``keep`` of the sparse heads, with
    the stripe-attention kernel ``use`` (``"compiled"`` or ``"torch"``): ``(low, o)``, ``low`` ``[B, Hs, nb]`` bool
    (the blocks the guard made dense) or ``None``."""
    low = None  # [B, Hs, nb] bool: the (sequence, head, query block) triples the recall guard makes dense
    bq = cfg.block_size
    if cfg.min_recall > 0 and cfg.guard == "global":  # heads that lose too much mass on the probe blocks
        heads_low = probe_recall(qh, kh, keep, geo, cfg, scale, ls, use=use) < cfg.min_recall  # [B, Hs]
        low = heads_low[:, :, None].expand(-1, -1, geo.nb) if bool(heads_low.any()) else None
    elif cfg.min_recall > 0:  # causal: blocks whose probes so far lost too much mass
        low = causal_guard(qh, kh, keep, geo, cfg, scale, use=use)
    if low is None:
        o = sparse_attend(qh, kh, vh, keep, geo, bq, scale, use=use)
    elif cfg.guard == "causal" and use == "compiled":
        # the compiled kernel takes a guarded block's every causal key at about the fused kernel's cost per pair
        o = sparse_attend(qh, kh, vh, torch.where(low[..., None], causal_keys(geo)[:, None], keep), geo, bq, scale,
                          use=use)
    else:
        # guarded blocks gather nothing (diagonal block only) and take the fused dense result
        o = sparse_attend(qh, kh, vh, keep.masked_fill(low[..., None], False), geo, bq, scale, use=use)
        if cfg.guard == "global":
            dense = dense_heads_attention(qh, kh, vh, low[:, :, 0].any(0), scale, q_offset, key_valid)
            o = torch.where(low[:, :, :1, None], dense, o)
        else:
            r0 = int(low.any(1).any(0).nonzero()[0]) * cfg.block_size  # first guarded query row
            if r0 < ls:  # rows from ls on attend densely anyway (dense_last)
                rows = low.repeat_interleave(cfg.block_size, -1)[:, :, r0:ls, None]
                dense = dense_rows_attention(qh, kh, vh, low.any(-1).any(0), scale, geo, r0, ls)
                o[:, :, r0:ls] = torch.where(rows, dense, o[:, :, r0:ls])
    return low, o


def anchor_per_sequence(fn, q, k, v, cfg, ranges, *, scale, q_offset, key_valid, dense_heads, return_stats, compute_recall):
    """Run ``fn`` (:func:`anchor_attention` or the reference) on each sequence with its padding stripped
    (:func:`~attnpatch.attention.prefill.per_sequence`); padded query rows get zeros."""
    b, h, lq, _ = q.shape
    extra = {"return_stats": return_stats, "compute_recall": compute_recall} if fn is anchor_attention else {}
    out, parts = per_sequence(
        lambda qi, ki, vi, **kw: fn(qi, ki, vi, cfg, scale=scale, dense_heads=dense_heads, **extra, **kw),
        q, k, v, ranges, q_offset=q_offset, key_valid=key_valid,
    )
    if fn is not anchor_attention:  # the reference returns the kept mask [1, H, Lq', Lk']
        kept = torch.zeros(b, h, lq, k.shape[2], dtype=torch.bool)
        for bi, part in enumerate(parts):
            if part is not None:
                qi0, p, km = part
                kept[bi, :, qi0 : qi0 + km.shape[2], p : p + km.shape[3]] = km[0]
        return out, kept
    parts = [None if part is None else part[2] for part in parts]
    if not (return_stats or compute_recall):
        return out, None
    zero = torch.zeros(1, h, dtype=torch.float64, device=q.device)
    causal = torch.cat([zero if st is None else st.causal_pairs for st in parts])
    kept = torch.cat([zero if st is None else st.kept_pairs for st in parts])
    recall = None
    if compute_recall:
        recall = torch.cat([torch.ones_like(zero) if st is None else st.recall for st in parts])
    nbs = [st.kept_columns.shape[-1] for st in parts if st is not None and st.kept_columns is not None]
    cols = None
    if nbs:
        cols = torch.full((b, h, max(nbs)), -1, dtype=torch.long, device=q.device)
        for bi, st in enumerate(parts):
            if st is not None and st.kept_columns is not None:
                cols[bi, :, : st.kept_columns.shape[-1]] = st.kept_columns[0]
    return out, AnchorStats(causal, kept, cols, recall)
