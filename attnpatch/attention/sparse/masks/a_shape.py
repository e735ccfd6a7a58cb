"""A-shape (attention sinks + a sliding window) as a FlexAttention ``mask_mod`` of arithmetic only, over :mod:`.tiles`'
tile tables, run by :func:`attnpatch.attention.backends.flex.run_tiles`.

Sources: StreamingLLM, arXiv 2309.17453, Sec. 3.2; attention-gym's ``sink_attn.py`` and ``sliding_window.py``.
"""

from __future__ import annotations

import torch

from ...backends.flex import run_tiles
from .tiles import column_diagonal_tiles, scalar

__all__ = ["a_shape_flex"]


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
    g = column_diagonal_tiles(q, columns, diagonals, q_offset, None)
    s_t, base_t = scalar(g["geometry"]["s"], dev), scalar(g["base"], dev)
    init_t, window_t = scalar(init_tokens, dev), scalar(window, dev)

    def mask_mod(bi, hi, qi, kj):
        i = qi + base_t
        j = kj - s_t
        return (kj <= i) & (j >= 0) & ((j < init_t) | (i - kj < window_t))

    return run_tiles(q, k, v, g["partial"], g["full"], mask_mod, scale=scale, **g["geometry"])
