"""Exact (non-causal) softmax attention with optional key masking after the softmax (sink masking).

:func:`exact_attention`: what the landmark methods (FNA, sink masking, Nyströmformer, AnchorFormer) run on calls or
layers they leave exact; :func:`repeat_kv`: grouped-query keys and values repeated to the query heads, for the
methods whose math takes as many key heads as query heads.  Pure tensor functions on
``[batch, heads, tokens, head_dim]`` tensors.
"""

from __future__ import annotations

import torch

__all__ = ["exact_attention", "repeat_kv"]


def repeat_kv(k: torch.Tensor, heads: int) -> torch.Tensor:
    """``[B, Hkv, N, D]`` keys (or values) repeated to ``heads`` heads (grouped-query attention: query head ``h`` reads
    key/value head ``h // (heads / Hkv)``); ``k`` itself when ``Hkv == heads``."""
    return k if k.shape[1] == heads else k.repeat_interleave(heads // k.shape[1], dim=1)


def exact_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    key_keep: torch.Tensor | None = None,
    renormalize: bool = False,
    chunk: int = 1024,
    key_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact (non-causal) softmax attention, optionally with some keys' probabilities zeroed.

    Without ``key_keep`` this is ``torch.nn.functional.scaled_dot_product_attention``.  With it,
    the attention probabilities into masked keys are set to zero after the softmax (sink
    masking, FNA arXiv 2507.16018 Sec. 4: "multiply the softmax output by the mask"), and rows
    are optionally renormalised to sum to one.  Both are one fused SDPA call, no ``N x N``
    buffer: ``softmax(Q K^T c) diag(keep) V = softmax(Q K^T c) (keep * V)`` (the masked keys
    stay in the softmax's normaliser and their values are zeroed), and the renormalised form is
    SDPA with ``-inf`` on the masked keys.  SDPA scales before the product and accumulates in
    float32 for half-precision inputs, so float16 stays finite where the unpatched model does
    (the earlier explicit ``(q @ k^T) * scale`` overflowed float16 on sharp attention).

    Args:
        q, k, v: ``[B, H, N, D]``.
        scale: attention scale.
        key_keep: ``[B, N]`` bool or ``None``.
        renormalize: renormalise rows after masking.
        chunk: unused (the masked path used to run in query chunks of this size); kept so that
            callers passing it keep working.
        key_bias: ``[B, N]`` float or ``None``: added to every query's logit of each key (ToMe's
            proportional attention passes ``log(size)``, arXiv 2210.09461 Eq. 1).

    Returns:
        ``[B, H, N, D]`` in ``q``'s dtype.
    """
    sdpa = torch.nn.functional.scaled_dot_product_attention
    mask = None if key_bias is None else key_bias.to(q.dtype)[:, None, None, :]
    if key_keep is None:
        return sdpa(q, k, v, attn_mask=mask, scale=scale)
    if renormalize:
        bias = torch.zeros(key_keep.shape, dtype=q.dtype, device=q.device).masked_fill(~key_keep, float("-inf"))
        return sdpa(q, k, v, attn_mask=bias[:, None, None, :] + (0 if mask is None else mask), scale=scale)
    return sdpa(q, k, v * key_keep[:, None, :, None].to(v.dtype), attn_mask=mask, scale=scale)
