"""How a method says it is benchmarked on one attention layer (``attnpatch bench attention``).

A method may declare a hook ``bench_hook(config, q, k, v, inputs) -> BenchCase``; the bench
(:func:`attnpatch.evals.bench.bench_attention`) times what the :class:`BenchCase` holds against
SDPA on the same inputs and knows nothing else about the method.  A method without a hook gets
:func:`default_bench`: its forward on a synthetic one-layer :class:`~attnpatch.patchers.state.LayerContext`,
with SDPA wherever the forward hands back to exact attention (returns ``None``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F

from .state import ForwardState, LayerContext

__all__ = ["BenchCase", "BenchInputs", "default_bench", "sdpa"]


@dataclass(frozen=True)
class BenchInputs:
    """What a bench hook knows besides ``q`` ``[B, H, N, D]`` and ``k, v`` ``[B, Hkv, N, D]``.

    Attributes:
        scale: attention scale.
        causal: causal (LLM prefill, queries and keys from position 0) or bidirectional (ViT) attention.
        reuse_layers: layers that reuse one per-forward computation (FNA's landmark sampling), for amortised times.
        prefix_tokens: leading special tokens (CLS + registers; 1 for a ViT, 0 causal).
    """

    scale: float
    causal: bool
    reuse_layers: int = 6
    prefix_tokens: int = 1


@dataclass
class BenchCase:
    """One method's layer, as the bench measures it.

    Attributes:
        call: the whole layer as a model runs it; its peak memory is measured, and it is timed
            unless ``seconds`` derives the layer's time from the parts.
        parts: extra timed parts by name (e.g. ``{"fps": ..., "nystrom": ...}``), each reported as
            ``<name>_seconds`` (median).
        seconds: the layer's time from the parts' times (e.g. an amortised time), instead of timing ``call``.
        extra: more row fields from ``(part_seconds, sdpa_seconds)`` (e.g. speed-ups of the parts).
        stats: untimed statistics of one call (sparsity, recall), run when the bench asks for them.
        note: a remark on the row (e.g. why the layer ran dense).
        exponents: parts whose time-vs-N scaling exponent is reported (as ``"<label> [<part>]"``).
        plot: parts drawn beside the layer's time in the time plot, with their legend text.
    """

    call: Callable[[], Any]
    parts: dict[str, Callable[[], Any]] = field(default_factory=dict)
    seconds: Callable[[dict[str, float]], float] | None = None
    extra: Callable[[dict[str, float], float], dict[str, Any]] | None = None
    stats: Callable[[], dict[str, Any]] | None = None
    note: str | None = None
    exponents: tuple[str, ...] = ()
    plot: dict[str, str] = field(default_factory=dict)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool) -> torch.Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` (causal with ``is_causal=True``; grouped-query keys as they are)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def default_bench(forward: Callable[..., Any], config: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  inputs: BenchInputs) -> BenchCase:
    """The bench of a method that declares no hook: ``forward(config, q, k, v, ctx)`` on layer 0 of a
    one-layer model, a fresh per-forward state per call, SDPA where the forward returns ``None``.

    The layer context carries the keys (heads concatenated, ``[B, N, Hkv * D]``) as stand-ins for the
    attention input and the block input, which one attention layer on its own does not have. One
    untimed call first says what the layer does at this length: a forward that hands back to exact
    attention (a ``"dense:<why>"`` record) gets the note ``"ran dense: <why>"``.
    """
    b, _, n, _ = q.shape
    feats = k.transpose(1, 2).reshape(b, n, -1)

    def run():
        ctx = LayerContext(
            layer=0, num_layers=1, scale=inputs.scale, causal=inputs.causal,
            prefix_tokens=0 if inputs.causal else inputs.prefix_tokens, state=ForwardState(), hidden=feats, residual=feats,
        )
        out, rec = forward(config, q, k, v, ctx)
        return (sdpa(q, k, v, scale=inputs.scale, causal=inputs.causal) if out is None else out), rec

    _, rec = run()
    mode = getattr(rec, "mode", "")
    note = f"ran dense: {mode.split(':', 1)[1]}" if mode.startswith("dense:") else None
    return BenchCase(call=lambda: run()[0], note=note)
