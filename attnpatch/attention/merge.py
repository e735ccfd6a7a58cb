"""Token merging (ToMe, Bolya et al., arXiv 2210.09461): bipartite soft matching and proportional attention.

Pure functions on batch-first tensors; no model knowledge.  ToMe merges ``r`` tokens per transformer
block, between the attention and the MLP branch (Sec. 3): the tokens are split by position parity
into two sets ``A`` and ``B``; each token of ``A`` is matched to its most similar token of ``B``
(cosine similarity of the attention keys averaged over heads); the ``r`` best-matched ``A`` tokens
are averaged into their ``B`` partners, weighted by the number of input tokens each one already
stands for (its *size*).  Attention then adds ``log(size)`` to every key's logit ("proportional
attention", Eq. 1), so that a merged token counts as the tokens it replaced.

The leading ``prefix`` tokens (CLS and register tokens) are never merged and never merged into; they
keep their positions at the front.  Parity is taken on absolute positions, so with one class token
the sets are ToMe's own (``A`` = even positions with the class token left out, ``B`` = odd ones).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["bipartite_merge", "merge_plan", "apply_merge", "merge_destinations", "unmerge", "proportional_attention"]


def merge_plan(metric: torch.Tensor, r: int, prefix: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Which tokens bipartite soft matching merges (ToMe, arXiv 2210.09461, Sec. 3, "Bipartite Soft Matching").

    Args:
        metric: ``[B, N, C]`` token features the similarity is measured on (ToMe: the layer's keys
            averaged over heads).
        r: tokens to merge away (at most ``(N - prefix) // 2`` are; ``r <= 0`` merges nothing).
        prefix: leading tokens never merged and never merged into (CLS + registers).

    Returns:
        ``(unmerged [B, |A| - r], src [B, r], dst [B, r])``: indices into set ``A`` of the ``A``
        tokens that stay (ascending), of the ``A`` tokens merged away, and indices into set ``B`` of
        the partner each merged token joins; ``None`` when nothing is merged.  ``A`` and ``B`` are
        the non-prefix tokens at even and odd absolute positions.
    """
    n = metric.shape[1]
    rest = n - prefix
    r = min(int(r), rest // 2)
    if r <= 0:
        return None
    m = metric[:, prefix:].float()
    m = m / m.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    off = prefix % 2  # set A = absolute even positions
    a, b = m[:, off::2], m[:, 1 - off::2]
    scores = a @ b.transpose(1, 2)  # [B, |A|, |B|] cosine similarity
    node_max, node_idx = scores.max(dim=-1)
    order = node_max.argsort(dim=-1, descending=True, stable=True)
    src = order[:, :r]
    unmerged = order[:, r:].sort(dim=-1).values
    dst = node_idx.gather(1, src)
    return unmerged, src, dst


def apply_merge(
    x: torch.Tensor, size: torch.Tensor, plan: tuple[torch.Tensor, torch.Tensor, torch.Tensor], prefix: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Size-weighted average of merged tokens (ToMe's ``merge_wavg``).

    Args:
        x: ``[B, N, C]`` tokens (the residual stream).
        size: ``[B, N]`` input tokens each token stands for (float).
        plan: :func:`merge_plan`'s output on the same ``N`` tokens.
        prefix: leading tokens kept as they are.

    Returns:
        ``(x' [B, N - r, C], size' [B, N - r])``: the prefix, the unmerged ``A`` tokens in position
        order, then every ``B`` token (each the size-weighted mean of itself and the tokens merged
        into it), in ``x``'s dtype; sizes in float32.
    """
    unmerged, src, dst = plan
    c = x.shape[-1]
    off = prefix % 2
    w = size[:, prefix:].float()
    xs = x[:, prefix:].float() * w[..., None]
    xa, xb = xs[:, off::2], xs[:, 1 - off::2]
    wa, wb = w[:, off::2], w[:, 1 - off::2]
    keep = xa.gather(1, unmerged[..., None].expand(-1, -1, c))
    keep_w = wa.gather(1, unmerged)
    xb = xb.scatter_reduce(1, dst[..., None].expand(-1, -1, c), xa.gather(1, src[..., None].expand(-1, -1, c)), reduce="sum")
    wb = wb.scatter_reduce(1, dst, wa.gather(1, src), reduce="sum")
    rest = torch.cat([keep, xb], dim=1) / torch.cat([keep_w, wb], dim=1)[..., None]
    out = torch.cat([x[:, :prefix], rest.to(x.dtype)], dim=1)
    return out, torch.cat([size[:, :prefix].float(), keep_w, wb], dim=1)


def merge_destinations(plan: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, n: int, prefix: int = 0) -> torch.Tensor | None:
    """Where each of ``n`` tokens goes in :func:`apply_merge`'s output: the source map of one merge step.

    ToMe's ``trace_source`` keeps a ``[B, N', N0]`` one-hot matrix of which input tokens each output
    token holds; since every token joins exactly one output token, an index per token says the same.

    Args:
        plan: :func:`merge_plan`'s output on the same ``n`` tokens (``None``: nothing merged).
        n: tokens before the merge; prefix: protected leading tokens (as given to :func:`merge_plan`).

    Returns:
        ``[B, n]`` int64, the output position of each token (a merged ``A`` token: its ``B`` partner's),
        or ``None`` when ``plan`` is ``None``.  Composed over blocks (``dest.gather(1, source)``) it maps every
        input token to the output token it was merged into.
    """
    if plan is None:
        return None
    unmerged, src, dst = plan
    b, device = unmerged.shape[0], unmerged.device
    off = prefix % 2
    rest = n - prefix
    n_a, n_b = (rest - off + 1) // 2, (rest - (1 - off) + 1) // 2
    keep = unmerged.shape[1]
    a_dest = torch.empty(b, n_a, dtype=torch.long, device=device)
    a_dest.scatter_(1, unmerged, prefix + torch.arange(keep, device=device).expand(b, keep))
    a_dest.scatter_(1, src, prefix + keep + dst)
    b_dest = (prefix + keep + torch.arange(n_b, device=device)).expand(b, n_b)
    out = torch.empty(b, n, dtype=torch.long, device=device)
    out[:, :prefix] = torch.arange(prefix, device=device)
    out[:, prefix + off::2] = a_dest
    out[:, prefix + 1 - off::2] = b_dest
    return out


def unmerge(tokens: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """Read merged tokens back out at every input position (tomesd's unmerge as a gather).

    Args:
        tokens: ``[B, N', C]`` outputs of merged tokens.
        source: ``[B, N0]`` int64, the position in ``tokens`` of the token each input token was merged into
            (composed :func:`merge_destinations`).

    Returns:
        ``[B, N0, C]``: input token ``i`` reads ``tokens[source[i]]``.
    """
    return tokens.gather(1, source[..., None].expand(-1, -1, tokens.shape[-1]))


def bipartite_merge(
    x: torch.Tensor, size: torch.Tensor, metric: torch.Tensor, r: int, prefix: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """One ToMe merge step: :func:`merge_plan` on ``metric``, then :func:`apply_merge` on ``x``.

    Args:
        x: ``[B, N, C]``; size: ``[B, N]``; metric: ``[B, N, Cm]``; r: tokens to merge; prefix: protected leading tokens.

    Returns:
        ``(x' [B, N', C], size' [B, N'])`` with ``N' = N - min(r, (N - prefix) // 2)``.
    """
    plan = merge_plan(metric, r, prefix)
    if plan is None:
        return x, size.float()
    return apply_merge(x, size, plan, prefix)


def proportional_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, size: torch.Tensor | None, *, scale: float
) -> torch.Tensor:
    """Softmax attention with ``log(size)`` added to every key's logit (ToMe, Sec. 3, Eq. 1).

    Args:
        q: ``[B, H, N, D]``; k, v: ``[B, H, N, D]``.
        size: ``[B, N]`` input tokens each key stands for, or ``None`` (all 1: plain attention).
        scale: logit scale.

    Returns:
        ``[B, H, N, Dv]`` in ``q``'s dtype; ``softmax(q k^T * scale + log(size)) v``.
    """
    if size is None:
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    # the log in float32 at least (half inputs), in float64 for float64 inputs
    bias = size.to(torch.promote_types(q.dtype, torch.float32)).log()[:, None, None, :].to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
