"""ReLU-kernel linear attention (L2ViT's linear global attention), optionally merged with exact local softmax attention.

Source: "The Linear Attention Resurrection in Vision Transformer" (L2ViT, arXiv 2501.16182), Sec. 3, linear
global attention (LGA): with the kernel ``phi(x) = ReLU(x)``,

    O = phi(Q) (phi(K)^T V) / (phi(Q) (phi(K)^T 1) + eps)

evaluated right to left in ``O(N D Dv)`` time (``N`` tokens, head sizes ``D``, ``Dv``), never forming an
``N x N`` matrix.  L2ViT trains this kernel; applied to a pretrained softmax model it is a training-free
stand-in, so :func:`relu_linear_attention` can keep part of the attention exact (beyond the paper, whose
local attention is a separate block type, LWA):

* the ``prefix`` leading tokens (CLS, registers) attend to every key by exact softmax, and every query
  attends to them exactly;
* the other (patch) tokens are cut into consecutive windows of ``local_window`` tokens in token order (1-D
  non-overlapping windows, the last one shorter; the patch grid is not known here, so a window of a raster-order
  ViT sequence is a run of whole or partial patch rows); a patch query's *local* keys are the prefix
  tokens and its own window, attended by exact softmax; all other keys are *far*.

The two parts are merged through their normalisers.  For query ``i`` with local keys ``L_i``, far keys
``F_i``, kernel scores ``a_ij = phi(c q_i) . phi(k_j)`` (``c`` the attention scale) and the exact softmax
output over the local keys ``o_i = sum_{j in L_i} softmax_j(c q_i . k_j) v_j``:

    out_i = ((A_i + eps) o_i + sum_{j in F_i} a_ij v_j) / (A_i + eps + sum_{j in F_i} a_ij),   A_i = sum_{j in L_i} a_ij

This is the merged normaliser of the local exp-scores and the far kernel scores, with the kernel calibrated
per query so that it carries, on the local keys, the same total weight as the exp-scores there (the
calibration constant ``sum_{L_i} exp(s_ij) / A_i`` cancels).  The kernel decides how much weight goes outside
the window; exact softmax distributes it inside.  Consequences: every key local (``local_window`` at least
the number of patch tokens) gives exact softmax attention; no local key (``local_window = 0`` and no prefix)
gives the paper's formula; a row whose kernel scores are all 0 (all-negative projections) gets ``o_i``,
or 0 without local keys, never NaN: the denominator is ``phi(c q_i) . sum_j phi(k_j) + eps >= eps > 0``.
The far sums are ``phi(c q_i) (phi(K)^T V) - sum_{j in L_i} a_ij v_j``.

Pure tensor functions on ``[batch, heads, tokens, head_dim]`` tensors; keys/values may have fewer heads
(grouped-query attention).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["relu_linear_attention", "exact_pairs"]

_HALF = (torch.float16, torch.bfloat16)
# Elements of one chunk's local scores (queries x local keys, all batch items and heads) held at once.
CHUNK_ELEMENTS = 1 << 24


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, local_window: int, prefix: int, eps: float) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must be [batch, heads, tokens, head_dim]")
    b, h, n, d = q.shape
    if k.shape[0] != b or k.shape[3] != d or k.shape[2] != n:
        raise ValueError(f"k {tuple(k.shape)} does not fit q {tuple(q.shape)} (same batch, tokens and head_dim)")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v {tuple(v.shape)} must have k's batch, heads and tokens {tuple(k.shape[:3])}")
    if k.shape[1] < 1 or h % k.shape[1]:
        raise ValueError(f"query heads {h} must be a multiple of key/value heads {k.shape[1]}")
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale={scale!r}: must be a positive finite number")
    if local_window < 0 or prefix < 0:
        raise ValueError(f"local_window={local_window} and prefix={prefix} must be >= 0")
    if not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps={eps!r}: must be a positive finite number")


def exact_pairs(n: int, local_window: int, prefix: int) -> int:
    """Query-key pairs one head computes by exact softmax in :func:`relu_linear_attention` (``n`` tokens).

    The prefix rows attend to all ``n`` keys; each patch query to the prefix and to its own window.
    """
    p = min(prefix, n)
    np_ = n - p
    w = min(local_window, np_)
    if np_ == 0:
        return p * n
    if w == 0:
        return p * n + np_ * p
    full, rest = divmod(np_, w)
    return p * n + np_ * p + full * w * w + rest * rest


def relu_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    local_window: int = 0,
    prefix: int = 0,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Bidirectional ReLU-kernel linear attention merged with exact softmax over prefix and local-window keys.

    The formula, the windows and the merge are in the module docstring (L2ViT, arXiv 2501.16182, Sec. 3, LGA;
    the local merge is beyond the paper).  Time ``O(N (D Dv + (P + W) D))``, memory ``O(N (P + W))`` for the
    local scores in chunks of about :data:`CHUNK_ELEMENTS` elements, plus ``O(D Dv)`` per head for the kernel
    sums; nothing of size ``N x N``.  Kernel sums, local logits, softmax and the merge run in float32 (float64 for
    float64 inputs); the prefix rows, and every row when every key is local, run as fused attention
    (``scaled_dot_product_attention``, which accumulates in float32 for half inputs).

    Args:
        q: ``[B, H, N, D]`` queries.
        k: ``[B, Hkv, N, D]`` keys, ``H % Hkv == 0``.
        v: ``[B, Hkv, N, Dv]`` values.
        scale: attention (logit) scale, positive.
        local_window: patch tokens per local window (tokens; 0 = no window).  At least ``N - prefix``: every key is
            local and the result is exact softmax attention (to float rounding).
        prefix: leading tokens (CLS, registers) that attend and are attended by exact softmax.
        eps: the ``eps`` of the denominator (units of kernel scores ``phi(c q) . phi(k)``).

    Returns:
        ``[B, H, N, Dv]`` in ``q.dtype``.

    Raises:
        ValueError: shapes that do not fit, a scale or ``eps`` that is not positive and finite, a negative
            ``local_window`` or ``prefix``.
    """
    _check(q, k, v, scale, local_window, prefix, eps)
    b, h, n, d = q.shape
    hkv, dv = k.shape[1], v.shape[-1]
    g = h // hkv
    p = min(prefix, n)
    np_ = n - p
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.empty(b, h, n, dv, dtype=q.dtype, device=q.device)
    if p:  # prefix rows: exact softmax over every key
        out[:, :, :p] = F.scaled_dot_product_attention(q[:, :, :p], k, v, scale=scale, enable_gqa=g > 1)
    if np_ == 0:
        return out
    w = min(local_window, np_)
    qp = q[:, :, p:]
    if w == np_:  # every key is local: exact softmax (prefix and all patch tokens), no kernel part
        out[:, :, p:] = F.scaled_dot_product_attention(qp, k, v, scale=scale, enable_gqa=g > 1)
        return out
    # kernel sums over all keys, per key/value head: S = phi(K)^T V [D, Dv], z = phi(K)^T 1 [D]
    fk = torch.relu(k.to(acc))
    s_all = torch.einsum("bknd,bkne->bkde", fk, v.to(acc))
    z_all = fk.sum(2)
    fq = (torch.relu(qp.to(acc)) * scale).reshape(b, hkv, g, np_, d)  # phi(c q) = c phi(q)
    res = torch.matmul(fq, s_all[:, :, None])  # [B, Hkv, G, Np, Dv]: phi(c q) S, all keys
    den = torch.matmul(fq, z_all[:, :, None, :, None])[..., 0].add_(eps)  # phi(c q) z + eps >= eps
    if w == 0 and p == 0:  # no local key: the paper's formula
        out[:, :, p:] = (res / den[..., None]).reshape(b, h, np_, dv).to(q.dtype)
        return out
    qs = (qp.to(acc) * scale).reshape(b, hkv, g, np_, d)  # scaled queries for the local logits
    if w == 0:  # the local keys are the prefix only, the same for every patch query: one window of Np queries
        spans = [(0, 1, np_)]
    else:  # (first token, number of windows, window length): the whole windows, then the shorter last one
        full, rest = divmod(np_, w)
        spans = [(0, full, w)] + ([(full * w, 1, rest)] if rest else [])
    for t0, nw, wl in spans:
        kw_ = 0 if w == 0 else wl  # window keys of each of these windows
        per_window = b * h * wl * (p + kw_)  # local scores of one window
        if per_window <= CHUNK_ELEMENTS:  # several whole windows at a time
            step = CHUNK_ELEMENTS // per_window
            parts = [(c0, min(nw, c0 + step), 0, wl) for c0 in range(0, nw, step)]
        else:  # one window at a time, its queries in row chunks
            rows = max(1, CHUNK_ELEMENTS // (b * h * (p + kw_)))
            parts = [(c, c + 1, i0, min(wl, i0 + rows)) for c in range(nw) for i0 in range(0, wl, rows)]
        for c0, c1, i0, i1 in parts:
            m, nq = c1 - c0, i1 - i0
            k0 = p + t0 + c0 * wl  # first window key
            kl = k[:, :, k0 : k0 + m * kw_].reshape(b, hkv, m, kw_, d)
            vl = v[:, :, k0 : k0 + m * kw_].reshape(b, hkv, m, kw_, dv)
            if p:  # local keys of a window: the prefix, then the window
                kl = torch.cat([k[:, :, None, :p].expand(b, hkv, m, p, d), kl], 3)
                vl = torch.cat([v[:, :, None, :p].expand(b, hkv, m, p, dv), vl], 3)
            kl, vl = kl.to(acc)[:, :, None], vl.to(acc)[:, :, None]  # [B, Hkv, 1, m, P + W, .]
            r0 = t0 + c0 * wl + i0  # the queries: patch rows r0 .. r0 + m * nq - 1 (whole windows, or rows of one)
            r1 = r0 + m * nq
            logits = torch.matmul(qs[:, :, :, r0:r1].reshape(b, hkv, g, m, nq, d), kl.transpose(-1, -2))  # [.., m, nq, P + W]
            a = torch.matmul(fq[:, :, :, r0:r1].reshape(b, hkv, g, m, nq, d), torch.relu(kl).transpose(-1, -2))  # kernel scores
            # (A + eps) softmax(logits) - a: the local keys' weights once their kernel part is swapped for softmax
            wts = torch.softmax(logits, -1).mul_(a.sum(-1, keepdim=True).add_(eps)).sub_(a)
            res[:, :, :, r0:r1] += torch.matmul(wts, vl).reshape(b, hkv, g, r1 - r0, dv)
    out[:, :, p:] = (res / den[..., None]).reshape(b, h, np_, dv).to(q.dtype)
    return out
