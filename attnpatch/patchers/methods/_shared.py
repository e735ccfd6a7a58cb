"""Helpers several methods share: grouped-query keys, warnings once per forward."""

from __future__ import annotations

import warnings

import torch

from ..state import LayerContext

__all__ = ["repeat_kv", "say"]


def repeat_kv(k: torch.Tensor, heads: int) -> torch.Tensor:
    """``[B, Hkv, N, D]`` keys (or values) repeated to ``heads`` heads (grouped-query attention); unchanged when ``Hkv == heads``."""
    return k if k.shape[1] == heads else k.repeat_interleave(heads // k.shape[1], dim=1)


def say(ctx: LayerContext, message: str) -> None:
    """Warn (``UserWarning``, prefixed ``attnpatch:``) once per forward call."""
    if ctx.state is not None:
        said = ctx.state.shared.setdefault("_said", set())
        if message in said:
            return
        said.add(message)
    warnings.warn(f"attnpatch: {message}", UserWarning, stacklevel=4)
