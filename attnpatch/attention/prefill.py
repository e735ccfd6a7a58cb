"""What every causal-prefill method shares: the input checks of one attention call, and running a padded
batch one sequence at a time with its padding stripped (so each sequence is computed exactly as if alone).

Tensors follow ``[batch, heads, tokens, head_dim]``; keys and values may have fewer heads than queries
(grouped-query attention).  No model knowledge.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

__all__ = ["check_inputs", "split_padding", "per_sequence", "per_sequence_rows"]


def check_inputs(q, k, v, scale: float, q_offset: int, key_valid, *, value_dim: bool = False) -> None:
    """Check the shapes of one causal attention call; ``v=None`` checks ``q`` and ``k`` alone.

    Args:
        q: ``[B, H, Lq, D]``; k: ``[B, Hkv, Lk, D]``; v: ``[B, Hkv, Lk, Dv]`` or ``None``.
        scale: the logit scale; q_offset: absolute position of the first query (tokens);
        key_valid: ``[B, Lk]`` bool or ``None``.
        value_dim: whether ``Dv`` may differ from ``D`` (``False``: ``v`` must have the shape of ``k``).

    Raises:
        ValueError: naming the first thing that does not fit: ranks, batch, head dim, ``H % Hkv``,
            ``v`` shaped unlike ``k``, queries beyond the keys, a negative ``q_offset``, ``key_valid``
            not ``[B, Lk]`` bool, a logit scale that is not a positive finite number.
    """
    if q.dim() != 4 or k.dim() != 4 or (v is not None and v.dim() != 4):
        got = f"q {tuple(q.shape)}, k {tuple(k.shape)}" + ("" if v is None else f", v {tuple(v.shape)}")
        raise ValueError(f"{got}: must be [batch, heads, tokens, head_dim]")
    b, h, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k {tuple(k.shape)} does not fit q {tuple(q.shape)} (batch and head_dim must match)")
    if v is not None and (v.shape[:3] != k.shape[:3] if value_dim else v.shape != k.shape):
        what = "[batch, kv heads, keys] of k" if value_dim else "the shape of k"
        raise ValueError(f"v {tuple(v.shape)} must have {what} {tuple(k.shape)}")
    if hkv < 1 or h % hkv:
        raise ValueError(f"query heads {h} not a multiple of key/value heads {hkv}")
    if q_offset < 0 or q_offset + lq > lk:
        raise ValueError(
            f"q_offset={q_offset}: the {lq} queries sit at positions q_offset..q_offset+{lq - 1}, which must lie "
            f"within the {lk} keys (0 <= q_offset <= {lk - lq})"
        )
    if key_valid is not None and (key_valid.dtype != torch.bool or tuple(key_valid.shape) != (b, lk)):
        raise ValueError(f"key_valid {key_valid.dtype} {tuple(key_valid.shape)}: must be bool [batch, keys] = [{b}, {lk}]")
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale={scale!r}: the logit scale must be a positive finite number (usually head_dim ** -0.5)")


def split_padding(key_valid: torch.Tensor | None, q_offset: int, lq: int) -> list[tuple[int, int]] | None:
    """``(first, end)`` valid key range of each sequence when some sequence has padding before its first or
    after its last real token (up to the last query), else ``None``.

    Keys after the last query (``>= q_offset + lq``) are empty cache slots or future tokens, not padding.
    A sequence with no valid key gets ``(0, 0)``.
    """
    if key_valid is None:
        return None
    lk = key_valid.shape[1]
    any_valid = key_valid.any(1)
    first = torch.where(any_valid, torch.argmax(key_valid.to(torch.int8), dim=1), 0)
    end = torch.where(any_valid, lk - torch.argmax(key_valid.flip(1).to(torch.int8), dim=1), 0).clamp(max=q_offset + lq)
    if bool((first == 0).all()) and bool((end == q_offset + lq).all()):
        return None
    return [(int(a), int(e)) for a, e in zip(first, end)]


def per_sequence(
    call: Callable[..., tuple[torch.Tensor, Any]],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ranges: list[tuple[int, int]],
    *,
    q_offset: int,
    key_valid: torch.Tensor,
) -> tuple[torch.Tensor, list[tuple[int, int, Any] | None]]:
    """Run ``call`` on each sequence alone, its padding stripped (``ranges`` from :func:`split_padding`).

    ``call(q_i, k_i, v_i, q_offset=..., key_valid=...) -> (out_i, extra_i)`` gets the sequence's real
    queries and its keys ``first..end`` (``key_valid`` ``None`` when all of them are valid, else the
    mask of the holes inside).

    Returns:
        ``(out, parts)``: ``out`` ``[B, H, Lq, Dv]`` (zeros on query rows outside the sequence's real
        tokens; ``q``'s dtype), ``parts[i]`` ``(qi0, first, extra_i)`` for sequence
        ``i`` (its first query row, its first key) or ``None`` when it has no real query.
    """
    b, h, lq, _ = q.shape
    out = torch.zeros(b, h, lq, v.shape[-1], dtype=q.dtype, device=q.device)
    parts: list[tuple[int, int, Any] | None] = []
    for bi, (first, end) in enumerate(ranges):
        qi0 = min(lq, max(0, first - q_offset))
        qi1 = max(qi0, min(lq, end - q_offset))
        if qi1 <= qi0:
            parts.append(None)
            continue
        kv = key_valid[bi : bi + 1, first:end]
        o, extra = call(
            q[bi : bi + 1, :, qi0:qi1], k[bi : bi + 1, :, first:end], v[bi : bi + 1, :, first:end],
            q_offset=q_offset + qi0 - first, key_valid=None if bool(kv.all()) else kv,
        )
        out[bi : bi + 1, :, qi0:qi1] = o
        parts.append((qi0, first, extra))
    return out, parts


def per_sequence_rows(parts: list, b: int, h: int, device, fill: float = 0.0) -> torch.Tensor:
    """``[B, H]`` float64 from :func:`per_sequence`'s ``parts`` whose extras are ``[1, H]`` per-sequence rows
    (kept-pair counts, recall); ``fill`` for sequences without a real query."""
    out = torch.full((b, h), fill, dtype=torch.float64, device=device)
    for bi, part in enumerate(parts):
        if part is not None:
            out[bi] = part[2][0]
    return out
