"""Vertical-slash sparse attention (MInference's dynamic pattern) and the column + diagonal attention it runs on.

Source: MInference 1.0, Jiang et al., arXiv 2407.02490, Sec. 3.2 and Alg. 2 ("vertical-slash head").  For
one head, with queries at absolute positions ``i`` and keys at positions ``j <= i``:

1. estimate: the last ``last_q`` queries attend exactly, ``A = softmax(Q_last K^T c + m_causal)``
   (``c`` the attention scale);
2. score: a key column ``j`` by ``sum_r A[r, j]`` (vertical lines), a diagonal ``o = i - j`` by
   ``sum_r A[r, i_r - o]`` (slash lines);
3. keep the top ``vertical`` columns and ``slash`` diagonals: the local ones ``0 .. LOCAL_DIAGONALS - 1``
   and the top ones of the others (MInference's code forces the 100 local diagonals and also the first 30
   columns; here the columns are all chosen by their score);
4. every query attends with an exact softmax to the union of the kept columns and the kept diagonals
   that are causal for it:  ``keep(i, j) = j <= i and (col[j] or diag[i - j])`` (and ``j`` not padding).

:func:`vertical_slash_attention` does this for the whole call, or per chunk of queries, each chunk choosing
its own pattern from its own last queries.

Step 4 is :func:`~attnpatch.attention.column_diagonal.column_diagonal_attention` (its own module, which
also runs the A-shape pattern of :mod:`attnpatch.attention.streaming`), or with ``kernel="flex"`` the same kept set
through FlexAttention (:func:`~attnpatch.attention.flex_patterns.column_diagonal_flex`); ``"auto"`` picks flex on CUDA and,
on the CPU, from :data:`CPU_FLEX_MIN_KEYS`.

All functions are pure tensor functions on ``[batch, heads, tokens, head_dim]`` tensors; keys and values
may have fewer heads than queries (grouped-query attention).
"""

from __future__ import annotations

import functools
import math

import torch

from .column_diagonal import BLOCK, column_diagonal_attention, column_diagonal_recall
from .flex import choose_kernel, flex_attend
from .flex_patterns import column_diagonal_counts, column_diagonal_flex
from .prefill import check_inputs, per_sequence, per_sequence_rows, split_padding

__all__ = [
    "LOCAL_DIAGONALS",
    "vertical_slash_scores",
    "vertical_slash_pattern",
    "vertical_slash_attention",
    "vertical_slash_recall",
]

#: Diagonals ``0 .. LOCAL_DIAGONALS - 1`` (each query itself and the keys just before it) are always among the
#: kept slash lines (counted within ``slash``; the first ``slash`` of them when ``slash`` is smaller).
LOCAL_DIAGONALS = 16
#: Elements of the estimation's ``last_q x keys`` probabilities per step (chunked over key/value heads).
SELECT_ELEMENTS = 1 << 25
#: ``kernel="auto"`` on the CPU: FlexAttention from this many keys (``q_offset + Lq``) on, else the gather path;
#: ``None``: never.  ``None`` because the gather path measured faster on the CPU at every length tried, with about
#: half the causal pairs kept (``benchmarks/flex_cpu.py``, side by side; the numbers: docs/benchmarks/cpu.md); set it where
#: a CPU's FlexAttention kernel measures faster.  On CUDA ``"auto"`` is always flex.
CPU_FLEX_MIN_KEYS: int | None = None


def vertical_slash_scores(
    q_last: torch.Tensor,
    k: torch.Tensor,
    *,
    scale: float,
    q_start: int,
    key_valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Column and diagonal scores of the estimation queries (MInference, arXiv 2407.02490, Alg. 2, lines 1-4).

    ``A = softmax(Q_last K^T c)`` over the causal, valid keys (float32), rows of padding queries
    zeroed; ``vertical[j] = sum_r A[r, j]``; ``slash[o] = sum_r A[r, i_r - o]`` (``i_r = q_start + r``).
    Memory: ``A`` for as many key/value heads at a time as fit ``SELECT_ELEMENTS``.

    Args:
        q_last: ``[B, H, n, D]``, the queries at positions ``q_start .. q_start + n - 1``.
        k: ``[B, Hkv, Lc, D]`` with ``Lc = q_start + n`` (the keys up to the last query).
        scale: logit scale.
        q_start: absolute position of ``q_last``'s first row.
        key_valid: ``[B, Lc]`` bool or ``None``.

    Returns:
        ``(vertical, slash)``, float32 ``[B, H, Lc]`` each (``slash`` indexed by offset ``0 .. Lc - 1``).

    Raises:
        ValueError: ``Lc != q_start + n``.
    """
    b, h, n, d = q_last.shape
    hkv, lc = k.shape[1], k.shape[2]
    if lc != q_start + n:
        raise ValueError(f"k has {lc} keys; the estimation queries end at position {q_start + n - 1}, so it needs {q_start + n}")
    g = h // hkv
    dev = q_last.device
    pos = q_start + torch.arange(n, device=dev)
    allowed = torch.arange(lc, device=dev)[None, :] <= pos[:, None]  # [n, Lc]
    allowed = allowed[None, None] if key_valid is None else allowed[None, None] & key_valid[:, None, None, :]
    q_ok = torch.ones(b, n, device=dev) if key_valid is None else key_valid[:, pos].float()  # [B, n]
    vertical = torch.empty(b, hkv, g, lc, dtype=torch.float32, device=dev)
    slash = torch.empty(b, hkv, g, lc, dtype=torch.float32, device=dev)
    qf = q_last.reshape(b, hkv, g * n, d)
    wd = lc + n - 1  # shifted rows: A[r, j] goes to column n - 1 - r + j, whose sum over r is offset Lc - 1 - column
    step = max(1, SELECT_ELEMENTS // max(1, b * g * n * lc))
    for h0 in range(0, hkv, step):
        h1 = min(hkv, h0 + step)
        logits = (qf[:, h0:h1].float() * scale) @ k[:, h0:h1].float().transpose(-1, -2)  # [B, hc, g*n, Lc]
        logits = logits.reshape(b, h1 - h0, g, n, lc).masked_fill_(~allowed[:, :, None], -math.inf)
        a = torch.softmax(logits, dim=-1).nan_to_num_(0.0).mul_(q_ok[:, None, None, :, None])
        del logits
        vertical[:, h0:h1] = a.sum(-2)
        rows = b * (h1 - h0) * g
        buf = a.new_zeros(rows, n, wd)
        buf.as_strided((rows, n, lc), (n * wd, wd - 1, 1), n - 1).copy_(a.reshape(rows, n, lc))
        slash[:, h0:h1] = buf.sum(-2)[:, :lc].flip(-1).reshape(b, h1 - h0, g, lc)
    return vertical.reshape(b, h, lc), slash.reshape(b, h, lc)


def vertical_slash_pattern(
    q_last: torch.Tensor,
    k: torch.Tensor,
    *,
    vertical: int,
    slash: int,
    scale: float,
    q_start: int,
    key_valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept columns and diagonals of each head (MInference, arXiv 2407.02490, Alg. 2, lines 2-5).

    The top ``min(vertical, Lc)`` columns by :func:`vertical_slash_scores` among the valid keys, and
    ``min(slash, Lc)`` diagonals: the local ones ``0 .. min(slash, LOCAL_DIAGONALS) - 1``, then the top ones of
    the others.

    Args:
        q_last, k, scale, q_start, key_valid: as for :func:`vertical_slash_scores`.
        vertical: kept columns per head (clamped to the keys that exist).
        slash: kept diagonals per head (clamped likewise).

    Returns:
        ``(columns, diagonals)``: bool ``[B, H, Lc]`` each, for :func:`column_diagonal_attention`.

    Raises:
        ValueError: ``vertical < 0``, ``slash < 0``, or the shapes of :func:`vertical_slash_scores`.
    """
    if vertical < 0 or slash < 0:
        raise ValueError(f"vertical={vertical}, slash={slash}: counts must be >= 0")
    col, dia = vertical_slash_scores(q_last, k, scale=scale, q_start=q_start, key_valid=key_valid)
    lc = col.shape[-1]
    if key_valid is not None:
        col.masked_fill_(~key_valid[:, None, :], -math.inf)
    columns = torch.zeros_like(col, dtype=torch.bool)
    diagonals = torch.zeros_like(dia, dtype=torch.bool)
    local = min(slash, LOCAL_DIAGONALS, lc)  # forced: diagonals 0, 1, ... in this order when slash is smaller
    diagonals[..., :local] = True
    dia[..., :local] = -math.inf
    for score, kept, count in ((col, columns, min(vertical, lc)), (dia, diagonals, min(slash, lc) - local)):
        if count == lc:
            kept.copy_(score > -math.inf)
        elif count > 0:
            top = score.topk(count, dim=-1)
            kept.scatter_(-1, top.indices, top.values > -math.inf)
    return columns, diagonals


def vertical_slash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    vertical: int,
    slash: int,
    last_q: int,
    scale: float,
    q_offset: int = 0,
    key_valid: torch.Tensor | None = None,
    chunk: int | None = None,
    block: int = BLOCK,
    return_counts: bool = False,
    kernel: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """MInference's vertical-slash sparse prefill (arXiv 2407.02490, Sec. 3.2, Alg. 2), per head.

    Per chunk of ``chunk`` queries (the whole call when ``None``): the chunk's last ``min(last_q, chunk
    length)`` queries score the key columns and diagonals up to the chunk's last position
    (:func:`vertical_slash_pattern`), and every query of the chunk attends exactly to the kept columns and
    diagonals (:func:`column_diagonal_attention`).  A query's output therefore depends on the tokens up to
    the end of its chunk (with ``chunk=None``: on the whole call).  Sequences with padding before their
    first or after their last real token are computed one at a time with the padding stripped, as they
    would be alone; their padding queries give zeros.  Counts are clamped to the keys that exist:
    ``vertical >= Lc`` or ``slash >= Lc`` keeps every causal key (exact attention).

    Args:
        q: ``[B, H, Lq, D]`` at absolute positions ``q_offset .. q_offset + Lq - 1``.
        k, v: ``[B, Hkv, Lk, D]``, ``[B, Hkv, Lk, Dv]``, ``Lk >= q_offset + Lq``.
        vertical, slash: kept columns and diagonals per head (counts, >= 0).
        last_q: estimation queries per chunk (tokens, >= 1).
        scale: logit scale.
        q_offset: absolute position of the first query (a prompt continued on a cache).
        key_valid: ``[B, Lk]`` bool, False at padding keys, or ``None``.
        chunk: queries per selection chunk (tokens, >= 1) or ``None`` (one chunk: MInference).
        block: query rows per block / keys per tile of the gather path (tokens).
        return_counts: also return the kept causal pairs per (sequence, head) over valid queries.
        kernel: how step 4 runs: ``"gather"`` (:func:`column_diagonal_attention`), ``"flex"`` (the same kept set as
            a ``BlockMask`` run by FlexAttention, :func:`~attnpatch.attention.flex_patterns.column_diagonal_flex`) or
            ``"auto"`` (flex on CUDA; on the CPU from :data:`CPU_FLEX_MIN_KEYS` keys).

    Returns:
        ``(out, kept)``: ``out`` ``[B, H, Lq, Dv]`` in ``q.dtype``; ``kept`` float64 ``[B, H]`` or ``None``.

    Raises:
        ValueError: inputs that do not fit (:func:`~attnpatch.attention.prefill.check_inputs`); ``vertical`` or ``slash`` < 0,
            ``last_q`` or ``chunk`` < 1, an unknown ``kernel``.
        OptionError: ``kernel="flex"`` for inputs FlexAttention does not take (e.g. float64).
        RuntimeError: ``kernel="flex"`` where ``torch.compile`` fails.
    """
    check_inputs(q, k, v, scale, q_offset, key_valid, value_dim=True)
    if vertical < 0 or slash < 0 or last_q < 1 or (chunk is not None and chunk < 1):
        raise ValueError(f"vertical={vertical}, slash={slash} must be >= 0 and last_q={last_q}, chunk={chunk} >= 1")
    b, h, lq, _ = q.shape
    kw = dict(vertical=vertical, slash=slash, last_q=last_q, scale=scale, chunk=chunk, block=block, return_counts=return_counts,
              kernel=kernel)
    use = choose_kernel(kernel, q, q_offset + lq, CPU_FLEX_MIN_KEYS)
    split = split_padding(key_valid, q_offset, lq)
    if split is not None:
        out, parts = per_sequence(functools.partial(vertical_slash_attention, **kw), q, k, v, split, q_offset=q_offset, key_valid=key_valid)
        return out, (per_sequence_rows(parts, b, h, q.device) if return_counts else None)
    step = lq if chunk is None else chunk
    outs, kept = [], None
    for c0 in range(0, lq, step):
        c1 = min(lq, c0 + step)
        lc = q_offset + c1
        n = min(last_q, c1 - c0)
        kv = None if key_valid is None else key_valid[:, :lc]
        cols, diags = vertical_slash_pattern(
            q[:, :, c1 - n : c1], k[:, :, :lc], vertical=vertical, slash=slash, scale=scale, q_start=lc - n, key_valid=kv,
        )
        if use == "flex":
            o = flex_attend(
                lambda: column_diagonal_flex(q[:, :, c0:c1], k, v, cols, diags, scale=scale, q_offset=q_offset + c0,
                                             key_valid=key_valid),
                lambda: column_diagonal_attention(q[:, :, c0:c1], k, v, cols, diags, scale=scale, q_offset=q_offset + c0,
                                                  key_valid=key_valid, block=block)[0],
                strict=kernel == "flex")
            kc = None if not return_counts else column_diagonal_counts(
                cols, diags, heads=h, lq=c1 - c0, q_offset=q_offset + c0, key_valid=key_valid)
        else:
            o, kc = column_diagonal_attention(
                q[:, :, c0:c1], k, v, cols, diags, scale=scale, q_offset=q_offset + c0, key_valid=key_valid,
                block=block, return_counts=return_counts,
            )
        outs.append(o)
        if kc is not None:
            kept = kc if kept is None else kept + kc
    return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)), kept


def vertical_slash_recall(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    vertical: int,
    slash: int,
    last_q: int,
    scale: float,
    q_offset: int = 0,
    key_valid: torch.Tensor | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """Attention recall of :func:`vertical_slash_attention` with the same arguments: per ``[B, H]``, the mean over
    valid queries of the exact softmax mass on the keys it keeps (the same per-chunk patterns, the same
    per-sequence handling of padding); one dense ``Q K^T`` pass more.

    Returns:
        float64 ``[B, H]``.
    """
    b, h, lq, _ = q.shape
    split = split_padding(key_valid, q_offset, lq)
    if split is not None:
        kw = dict(vertical=vertical, slash=slash, last_q=last_q, scale=scale, chunk=chunk)

        def one(qi, ki, vi, *, q_offset, key_valid):
            return torch.zeros_like(qi), vertical_slash_recall(qi, ki, q_offset=q_offset, key_valid=key_valid, **kw)

        _, parts = per_sequence(one, q, k, k, split, q_offset=q_offset, key_valid=key_valid)
        return per_sequence_rows(parts, b, h, q.device, fill=1.0)
    step = lq if chunk is None else chunk
    total = torch.zeros(b, h, dtype=torch.float64, device=q.device)
    count = torch.zeros(b, dtype=torch.float64, device=q.device)
    for c0 in range(0, lq, step):
        c1 = min(lq, c0 + step)
        lc = q_offset + c1
        n = min(last_q, c1 - c0)
        kv = None if key_valid is None else key_valid[:, :lc]
        cols, diags = vertical_slash_pattern(
            q[:, :, c1 - n : c1], k[:, :, :lc], vertical=vertical, slash=slash, scale=scale, q_start=lc - n, key_valid=kv,
        )
        t, c = column_diagonal_recall(q[:, :, c0:c1], k, cols, diags, scale=scale, q_offset=q_offset + c0, key_valid=key_valid)
        total += t
        count += c
    return total / count.clamp(min=1)[:, None]
