"""Sink diagnostic: per layer, token-norm statistics, massive tokens and attention sinks of a ViT.

Answers "does this model have massive tokens, and from which layer?" and "which tokens soak up
attention?" for a batch of images, with the model's exact attention (it is routed through the
``dense`` method only to observe ``q, k`` and each block's input).  Definitions in
:mod:`attnpatch.attention.sinks`.
"""

from __future__ import annotations

from typing import Any

import torch

from ...attention.sinks import attention_received, token_norm_stats
from ...patchers.api import patched, record_stats

__all__ = ["sink_diagnostic"]


@torch.no_grad()
def sink_diagnostic(
    model: torch.nn.Module, pixel_values: torch.Tensor, *, norm_ratio: float = 5.0, mass_ratio: float = 10.0, top: int = 3
) -> dict[str, Any]:
    """Per-layer massive-token and attention-sink report of a ViT on a batch of images.

    Args:
        model: an unpatched ViT encoder (Hugging Face DINOv2-style or timm ``VisionTransformer``).
        pixel_values: ``[B, 3, H, W]``.
        norm_ratio: a massive token's block-input L2 norm exceeds ``norm_ratio x`` the image's median.
        mass_ratio: an attention sink receives more than ``mass_ratio x`` the uniform share ``1/N``.
        top: how many top attention receivers to list per layer.

    Returns:
        ``{"tokens": N, "prefix_tokens", "first_massive_layer" (or None), "layers": [{"layer",
        "norm_median" (mean over images), "norm_max_over_median" (max over images),
        "argmax_token" (per image), "massive" (per image: token indices), "sinks" (per image:
        token indices receiving > mass_ratio/N), "top_received" (per image: [(token, share x N)]),
        "cls_received_x_uniform" (mean over images)}]}``.
    """
    from .runner import encode

    layers: list[dict[str, Any]] = []
    n_tokens: list[int] = []

    def probe(ctx, q, k, v):
        entry: dict[str, Any] = {"layer": ctx.layer}
        if ctx.residual is not None:
            st = token_norm_stats(ctx.residual)
            norms = st["norms"]
            entry.update(
                norm_median=float(st["median"].mean()),
                norm_max_over_median=float(st["max_over_median"].max()),
                argmax_token=st["argmax"].tolist(),
                massive=[torch.nonzero(r > norm_ratio * m).flatten().tolist() for r, m in zip(norms, st["median"])],
            )
        kk = k if k.shape[1] == q.shape[1] else k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        recv = attention_received(q, kk, scale=ctx.scale)  # [B, N]
        n = recv.shape[-1]
        n_tokens[:] = [n]
        vals, idx = recv.topk(min(top, n), dim=-1)
        entry.update(
            sinks=[torch.nonzero(r > mass_ratio / n).flatten().tolist() for r in recv],
            top_received=[[(int(i), round(float(v) * n, 2)) for i, v in zip(ii, vv)] for ii, vv in zip(idx, vals)],
            cls_received_x_uniform=float(recv[:, 0].mean() * n),
        )
        layers.append(entry)

    with patched(model, "dense"), record_stats(model, probe=probe):
        encode(model, pixel_values)
        tokens = n_tokens[0] if n_tokens else None
    first = next((e["layer"] for e in layers if any(e.get("massive") or [])), None)
    return {
        "tokens": tokens,
        "first_massive_layer": first,
        "norm_ratio": norm_ratio,
        "mass_ratio": mass_ratio,
        "layers": layers,
    }
