"""Columns and diagonals (MInference's vertical-slash step 4; A-shape with padding inside the keys) as a FlexAttention
``mask_mod`` over :mod:`.tiles`' tile tables, run by :func:`attnpatch.attention.backends.flex.run_tiles`.

Source: MInference, arXiv 2407.02490, Sec. 3.2; FlexAttention, arXiv 2412.05496.
"""

from __future__ import annotations

import torch

from ...backends.flex import run_tiles
from .tiles import column_diagonal_tiles, scalar

__all__ = ["column_diagonal_flex"]


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
    g = column_diagonal_tiles(q, columns, diagonals, q_offset, key_valid)
    valid, cols, diag = g["valid"], g["cols"], g["diag"]
    base_t, group_t = scalar(g["base"], q.device), scalar(q.shape[1] // columns.shape[1], q.device)

    def mask_mod(bi, hi_, qi, kj):
        i = qi + base_t
        causal = kj <= i
        pi = hi_ // group_t
        return causal & valid[bi, kj] & (cols[bi, pi, kj] | diag[bi, pi, torch.where(causal, i - kj, 0)])

    return run_tiles(q, k, v, g["partial"], g["full"], mask_mod, scale=scale, **g["geometry"])
