"""Helpers several methods share: refusing calls a method does not handle, grouped-query keys, warnings once per forward."""

from __future__ import annotations

import warnings

import torch

from ...errors import OptionError, UnsupportedModelError
from ..registry import Method
from ..state import LayerContext

__all__ = ["check_call", "repeat_kv", "say"]


def check_call(method: Method, ctx: LayerContext) -> None:
    """Refuse an attention call the method's declared capabilities exclude.

    Raises:
        OptionError: a causal call to a method without ``causal_calls``, or a bidirectional call to
            one without ``noncausal_calls``.
        UnsupportedModelError: a key-padding mask that hides some keys, for a method without ``key_padding``.
    """
    if ctx.causal and not method.causal_calls:
        raise OptionError(f"method {method.name!r} is for bidirectional (vision) attention; layer {ctx.layer} is causal")
    if not ctx.causal and not method.noncausal_calls:
        raise OptionError(f"method {method.name!r} is for causal attention; layer {ctx.layer} is bidirectional")
    if not method.key_padding and ctx.key_valid is not None and not bool(ctx.key_valid.all()):
        raise UnsupportedModelError(
            f"method {method.name!r} got an attention mask that hides some keys (padding) in layer {ctx.layer}; "
            "it supports unmasked bidirectional attention only"
        )


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
