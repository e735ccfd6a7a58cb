"""Sink tokens: massive-activation tokens and attention sinks, and their detection.

Two kinds of "sink" are detected, per image:

* **massive tokens** (Sun et al. 2024, "Massive Activations in Large Language Models"; in ViTs
  Darcet et al. 2024, "Vision Transformers Need Registers"): tokens whose residual-stream
  hidden state has an L2 norm above ``ratio x`` the median token norm of that image at a layer.
* **attention sinks** (Xiao et al. 2024, "Efficient Streaming Language Models with Attention
  Sinks"): tokens that receive far more attention than a uniform share: the mean over heads
  and queries of the softmax probability into key ``j`` exceeds ``ratio / N``.  This catches
  a CLS sink that has no massive norm.

Sink masking (FNA, arXiv 2507.16018, Sec. 4) sets the attention probabilities into detected
sink tokens to zero in the last layers; see :func:`attnpatch.attention.exact.exact_attention`
and :func:`attnpatch.attention.nystrom.nystrom_attention` (``key_keep``).
"""

from __future__ import annotations

import torch

__all__ = ["token_norm_stats", "massive_tokens", "attention_received", "attention_sinks"]


def token_norm_stats(hidden: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-image token-norm statistics of a residual stream.

    Args:
        hidden: ``[B, N, C]`` hidden states (a block's input).

    Returns:
        ``{"norms": [B, N], "median": [B], "max": [B], "argmax": [B] (token index),
        "max_over_median": [B]}`` (float32; norms are L2 norms in the hidden units).
    """
    norms = hidden.float().norm(dim=-1)
    med = norms.median(dim=-1).values
    mx, arg = norms.max(dim=-1)
    return {"norms": norms, "median": med, "max": mx, "argmax": arg, "max_over_median": mx / med.clamp(min=1e-12)}


def massive_tokens(hidden: torch.Tensor, ratio: float) -> torch.Tensor:
    """``[B, N]`` bool: tokens whose hidden-state L2 norm exceeds ``ratio x`` the image's median token norm.

    Args:
        hidden: ``[B, N, C]`` residual-stream hidden states.
        ratio: threshold (dimensionless, > 1).
    """
    norms = hidden.float().norm(dim=-1)
    return norms > ratio * norms.median(dim=-1, keepdim=True).values


def attention_received(q: torch.Tensor, k: torch.Tensor, *, scale: float, chunk: int = 1024) -> torch.Tensor:
    """``[B, N]``: mean over heads and queries of the softmax attention probability into each key.

    Uniform attention gives ``1 / N`` everywhere; the values of one image sum to 1.

    Args:
        q, k: ``[B, H, N, D]`` (non-causal).
        scale: attention scale.
        chunk: queries per chunk (bounds the ``[B, H, chunk, N]`` buffer).
    """
    b, h, n, _ = q.shape
    acc = torch.zeros(b, k.shape[2], dtype=torch.float32, device=q.device)
    for i in range(0, n, chunk):
        p = torch.softmax((q[:, :, i : i + chunk].float() @ k.float().transpose(-1, -2)) * scale, dim=-1)
        acc += p.sum(dim=(1, 2))
    return acc / (h * n)


def attention_sinks(q: torch.Tensor, k: torch.Tensor, *, scale: float, ratio: float) -> torch.Tensor:
    """``[B, N]`` bool: keys receiving more than ``ratio x`` the uniform share ``1 / N`` of attention.

    Args:
        q, k: ``[B, H, N, D]``.
        scale: attention scale.
        ratio: threshold in multiples of the uniform share (> 1).
    """
    recv = attention_received(q, k, scale=scale)
    return recv > ratio / recv.shape[-1]
