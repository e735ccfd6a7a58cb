"""A-shape (StreamingLLM) attention: each query attends to the initial tokens and a local window of keys.

Sources: StreamingLLM, Xiao et al., "Efficient Streaming Language Models with Attention Sinks", arXiv
2309.17453, Sec. 3.2 (attention sinks: the initial tokens plus a rolling window); MInference 1.0, Jiang et
al., arXiv 2407.02490, Sec. 3.2, the "A-shape" static pattern.  For a query at absolute position ``i``:

    keep(i, j) = j <= i  and  key_valid[j]  and  (rank(j) < init_tokens  or  i - j < window)

with ``rank(j)`` the number of valid keys before ``j`` (so the initial tokens are counted from each
sequence's first non-padding token), followed by an exact softmax over the kept keys.  Unlike StreamingLLM's
cache, nothing is evicted and positions are not re-assigned: the rotary positions are the model's own, as in
MInference's A-shape prefill.  The window counts positions: padding inside it is skipped, not replaced.

Computation (:func:`a_shape_attention`): blocks of ``A_BLOCK`` queries; a block attends, in one fused
``scaled_dot_product_attention`` call with several blocks and all heads, to the initial keys followed by the
``window + A_BLOCK - 1`` keys ending at its last query, under a per-query mask that is the same for every block
away from the start and the end of the prompt (so it is built once); the blocks whose window reaches back to
the initial tokens, and the last block, get their own mask (the first ones simply attend to the keys up to
their last query).  About ``init_tokens + window + A_BLOCK`` keys per query, never a ``queries x keys``
matrix.  The fused kernel applies the scale before the product and accumulates the softmax in float32 for
half-precision inputs.  Padding before a sequence's first or after its last real token is stripped (the
sequence runs alone); a sequence with padding between its real tokens runs as column + diagonal attention
(:func:`attnpatch.attention.column_diagonal.column_diagonal_attention`), the initial tokens as columns and the
diagonals ``0 .. window - 1``.

``kernel="flex"`` runs the same kept set through FlexAttention (a ``BlockMask`` of 128-token tiles and a
``mask_mod``, one compiled kernel per length bucket: :func:`attnpatch.attention.flex_patterns.a_shape_flex`, or
:func:`attnpatch.attention.flex_patterns.column_diagonal_flex` with those columns and diagonals for padding inside the
keys); ``"auto"`` picks it on CUDA and, on the CPU, from :data:`CPU_FLEX_MIN_KEYS`.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from .prefill import check_inputs, per_sequence, per_sequence_rows, split_padding
from .column_diagonal import column_diagonal_attention, column_diagonal_recall
from .flex import choose_kernel, flex_attend
from .flex_patterns import a_shape_flex, column_diagonal_counts, column_diagonal_flex

__all__ = ["a_shape_attention", "a_shape_pattern", "a_shape_kept_pairs", "a_shape_recall", "A_BLOCK"]

#: Queries per block of the A-shape path without inner padding.
A_BLOCK = 256
#: Score elements (query rows x keys, all heads) per fused attention call.
CHUNK_ELEMENTS = 1 << 24
#: ``kernel="auto"`` on the CPU: FlexAttention from this many keys (``q_offset + Lq``) on, else the gather path;
#: ``None``: never.  ``None`` because the gather path measured faster on the CPU at every length tried, with about
#: half the causal pairs kept (``benchmarks/flex_cpu.py``, side by side; the numbers: docs/benchmarks/cpu.md); set it where
#: a CPU's FlexAttention kernel measures faster.  On CUDA ``"auto"`` is always flex.
CPU_FLEX_MIN_KEYS: int | None = None


def a_shape_pattern(key_valid: torch.Tensor | None, *, batch: int, keys: int, init_tokens: int, window: int,
                    device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """The A-shape pattern as kept columns and diagonals.

    Args:
        key_valid: ``[B, >= keys]`` bool or ``None``.
        batch, keys: ``B`` and the number of key positions ``Lc`` described.
        init_tokens: initial valid keys kept as columns (tokens, >= 0).
        window: diagonals ``0 .. window - 1`` kept (tokens, >= 1).
        device: where to build them when ``key_valid`` is ``None``.

    Returns:
        ``(columns [B, 1, Lc], diagonals [B, 1, Lc])`` bool, for :func:`column_diagonal_attention`.

    Raises:
        ValueError: ``init_tokens < 0`` or ``window < 1``.
    """
    if init_tokens < 0 or window < 1:
        raise ValueError(f"init_tokens={init_tokens} must be >= 0 and window={window} >= 1")
    if key_valid is None:
        columns = (torch.arange(keys, device=device) < init_tokens).expand(batch, keys)
    else:
        kv = key_valid[:, :keys]
        columns = kv & (kv.to(torch.int64).cumsum(-1) <= init_tokens)
        device = key_valid.device
    diagonals = (torch.arange(keys, device=device) < window).expand(batch, keys)
    return columns[:, None], diagonals[:, None]


def a_shape_kept_pairs(lq: int, *, q_offset: int, init_tokens: int, window: int) -> int:
    """Kept causal pairs of one sequence without padding: ``sum_i min(I, i + 1) + max(0, i + 1 - max(I, i - W + 1))``
    over the query positions ``i = q_offset .. q_offset + Lq - 1``."""
    i = torch.arange(q_offset, q_offset + lq, dtype=torch.int64)
    init = i.clamp(max=init_tokens - 1) + 1 if init_tokens > 0 else torch.zeros_like(i)
    band = (i + 1 - torch.maximum(torch.full_like(i, init_tokens), i - window + 1)).clamp(min=0)
    return int((init + band).sum())


def a_shape_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    init_tokens: int,
    window: int,
    scale: float,
    q_offset: int = 0,
    key_valid: torch.Tensor | None = None,
    block: int = A_BLOCK,
    return_counts: bool = False,
    kernel: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A-shape attention: exact softmax over the initial tokens and the local window (module docstring).

    With ``window >= q_offset + Lq`` every causal key is kept: exact causal attention, computed through the
    same blocked code (each block against the keys up to its last query).  Sequences with padding before
    their first or after their last real token run one at a time with the padding stripped, as they would
    alone; their padding queries give zeros.

    Args:
        q: ``[B, H, Lq, D]`` at absolute positions ``q_offset .. q_offset + Lq - 1``.
        k, v: ``[B, Hkv, Lk, D]`` and ``[B, Hkv, Lk, Dv]``, ``H % Hkv == 0``, ``Lk >= q_offset + Lq``.
        init_tokens: initial keys every query keeps, counted from the sequence's first valid key (tokens, >= 0).
        window: keys ending at each query, itself included (tokens, >= 1).
        scale: logit scale.
        q_offset: absolute position of the first query (a prompt continued on a cache).
        key_valid: ``[B, Lk]`` bool, False at padding keys, or ``None``.
        block: queries per block (tokens, >= 1); changes float rounding only.
        return_counts: also return the kept causal pairs per (sequence, head) over valid queries.
        kernel: ``"gather"`` (the blocked PyTorch path above), ``"flex"`` (the same kept set as a ``BlockMask`` run
            by FlexAttention, :func:`~attnpatch.attention.flex_patterns.column_diagonal_flex`) or ``"auto"`` (flex on CUDA;
            on the CPU from :data:`CPU_FLEX_MIN_KEYS` keys; see :func:`~attnpatch.attention.flex.choose_kernel`).

    Returns:
        ``(out, kept)``: ``out`` ``[B, H, Lq, Dv]`` in ``q.dtype`` (a query with no valid key, e.g. at a
        padding position, gives zeros); ``kept`` float64 ``[B, H]`` or ``None``.

    Raises:
        ValueError: inputs that do not fit (see :func:`~attnpatch.attention.prefill.check_inputs`),
            ``init_tokens < 0``, ``window < 1``, ``block < 1``, an unknown ``kernel``.
        OptionError: ``kernel="flex"`` for inputs FlexAttention does not take (e.g. float64).
        RuntimeError: ``kernel="flex"`` where ``torch.compile`` fails.
    """
    check_inputs(q, k, v, scale, q_offset, key_valid, value_dim=True)
    if init_tokens < 0 or window < 1 or block < 1:
        raise ValueError(f"init_tokens={init_tokens} must be >= 0, window={window} and block={block} >= 1")
    b, h, lq, _ = q.shape
    kw = dict(init_tokens=init_tokens, window=window, scale=scale, block=block, return_counts=return_counts)
    use = choose_kernel(kernel, q, q_offset + lq, CPU_FLEX_MIN_KEYS)
    split = split_padding(key_valid, q_offset, lq)
    if split is not None:
        out, parts = per_sequence(functools.partial(a_shape_attention, kernel=kernel, **kw), q, k, v, split,
                                  q_offset=q_offset, key_valid=key_valid)
        return out, (per_sequence_rows(parts, b, h, q.device) if return_counts else None)
    if use == "flex":
        inner = key_valid is not None and not bool(key_valid[:, : q_offset + lq].all())  # padding inside the keys
        columns, diagonals = a_shape_pattern(key_valid if inner else None, batch=b, keys=q_offset + lq,
                                             init_tokens=init_tokens, window=window, device=q.device)

        def run_flex() -> torch.Tensor:
            if inner:  # the initial tokens counted over valid keys: table lookups
                return column_diagonal_flex(q, k, v, columns, diagonals, scale=scale, q_offset=q_offset, key_valid=key_valid)
            return a_shape_flex(q, k, v, init_tokens=init_tokens, window=window, scale=scale, q_offset=q_offset)

        out = flex_attend(
            run_flex, lambda: a_shape_attention(q, k, v, q_offset=q_offset, key_valid=key_valid, kernel="gather", **kw)[0],
            strict=kernel == "flex")
        kept = None
        if return_counts and inner:
            kept = column_diagonal_counts(columns, diagonals, heads=h, lq=lq, q_offset=q_offset, key_valid=key_valid)
        elif return_counts:
            n = a_shape_kept_pairs(lq, q_offset=q_offset, init_tokens=init_tokens, window=window)
            kept = torch.full((b, h), float(n), dtype=torch.float64, device=q.device)
        return out, kept
    if key_valid is not None and not bool(key_valid[:, : q_offset + lq].all()):  # padding inside the keys
        columns, diagonals = a_shape_pattern(key_valid, batch=b, keys=q_offset + lq, init_tokens=init_tokens, window=window)
        return column_diagonal_attention(q, k, v, columns, diagonals, scale=scale, q_offset=q_offset, key_valid=key_valid,
                                         return_counts=return_counts)
    out = _a_shape_blocks(q, k, v, init_tokens, window, scale, q_offset, block)
    kept = None
    if return_counts:
        n = a_shape_kept_pairs(lq, q_offset=q_offset, init_tokens=init_tokens, window=window)
        kept = torch.full((b, h), float(n), dtype=torch.float64, device=q.device)
    return out, kept


def _a_shape_blocks(q, k, v, init_tokens: int, window: int, scale: float, q_offset: int, bq: int) -> torch.Tensor:
    """A-shape attention without padding: blocks of ``bq`` queries, all heads in one call (module docstring)."""
    b, h, lq, d = q.shape
    hkv, dv, dev = k.shape[1], v.shape[-1], q.device
    lc = q_offset + lq
    win, init = min(window, lc), min(init_tokens, lc)
    nb = -(-lq // bq)
    width = init + win + bq - 1  # key slots of a block: the initial keys, then the window of its first to last query
    bh, bkv = b * h, b * hkv
    # [tokens, batch * heads, dim] layouts: a block of queries and a set of keys are then views or one gather
    qt = F.pad(q, (0, 0, 0, nb * bq - lq)).permute(2, 0, 1, 3).reshape(nb, bq, bh, d).transpose(1, 2)  # [nb, bh, bq, d]
    kt = k[:, :, :lc].permute(2, 0, 1, 3).reshape(lc, bkv, d)
    vt = v[:, :, :lc].permute(2, 0, 1, 3).reshape(lc, bkv, dv)
    out = q.new_empty(nb, bh, bq, dv)
    zero = torch.zeros((), dtype=q.dtype, device=dev)
    neg = torch.full((), -math.inf, dtype=q.dtype, device=dev)
    r = torch.arange(bq, device=dev)

    def first_pos(m: int) -> int:
        return q_offset + m * bq

    def kind(m: int) -> str:
        end = min(lc, first_pos(m) + bq)  # keys after the block's last query are never needed
        if end <= width:
            return "prefix"  # the keys up to the block's last query: no more than a block's slots
        if first_pos(m) - win + 1 >= init and first_pos(m) + bq <= lc:
            return "interior"  # the same mask as every other interior block
        return "edge"

    def slots(m0: int, m1: int) -> torch.Tensor:  # [nbc, width] absolute key position of each slot (may be out of range)
        c = torch.arange(width, device=dev)
        p0 = q_offset + torch.arange(m0, m1, device=dev) * bq
        return torch.where(c[None, :] < init, c[None, :], p0[:, None] - win + 1 + (c[None, :] - init))

    def keep_mask(m0: int, m1: int, j: torch.Tensor, band: bool) -> torch.Tensor:  # [nbc, 1, bq, L] additive
        i = (q_offset + torch.arange(m0, m1, device=dev) * bq)[:, None] + r[None, :]  # [nbc, bq]
        jj = j[:, None, :]  # [nbc or 1, 1, L]
        near = (i[:, :, None] - jj) < win
        if band:  # initial slots keep their key; window slots keep keys after the initial ones
            c = torch.arange(j.shape[-1], device=dev)
            is_init = (c < init)[None, None, :]
            keep = (jj >= 0) & (jj < lc) & (jj <= i[:, :, None]) & torch.where(is_init, True, near & (jj >= init))
        else:
            keep = (jj <= i[:, :, None]) & ((jj < init) | near)
        return torch.where(keep, zero, neg)[:, None]

    m = 0
    while m < nb:
        kd = kind(m)
        m1 = m + 1
        while m1 < nb and kind(m1) == kd:
            cols = min(lc, first_pos(m1) + bq) if kd == "prefix" else width
            if (m1 + 1 - m) * bh * bq * cols > CHUNK_ELEMENTS:
                break
            m1 += 1
        qq = qt[m:m1]
        if kd == "prefix":
            e = min(lc, first_pos(m1 - 1) + bq)
            kk = kt[:e].transpose(0, 1)[None].expand(m1 - m, bkv, e, d)
            vv = vt[:e].transpose(0, 1)[None].expand(m1 - m, bkv, e, dv)
            mask = keep_mask(m, m1, torch.arange(e, device=dev)[None], band=False)
        else:
            j = slots(m, m1)
            rows = j.clamp(0, lc - 1).reshape(-1)
            kk = kt.index_select(0, rows).reshape(m1 - m, width, bkv, d).transpose(1, 2)
            vv = vt.index_select(0, rows).reshape(m1 - m, width, bkv, dv).transpose(1, 2)
            mask = keep_mask(m, m + 1, j[:1], band=True) if kd == "interior" else keep_mask(m, m1, j, band=True)
        out[m:m1] = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=scale, enable_gqa=h != hkv)
        m = m1
    return out.transpose(0, 1).reshape(b, h, nb * bq, dv)[:, :, :lq].contiguous() if nb * bq != lq else \
        out.transpose(0, 1).reshape(b, h, lq, dv)


def a_shape_recall(
    q: torch.Tensor, k: torch.Tensor, *, init_tokens: int, window: int, scale: float, q_offset: int = 0,
    key_valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention recall of :func:`a_shape_attention` with the same arguments: per ``[B, H]``, the mean over valid
    queries of the exact softmax mass on the initial tokens and the window (one dense ``Q K^T`` pass more).

    Returns:
        float64 ``[B, H]``.
    """
    b, _, lq, _ = q.shape
    cols, diags = a_shape_pattern(key_valid, batch=b, keys=q_offset + lq, init_tokens=init_tokens, window=window, device=q.device)
    total, count = column_diagonal_recall(q, k, cols, diags, scale=scale, q_offset=q_offset, key_valid=key_valid)
    return total / count.clamp(min=1)[:, None]
