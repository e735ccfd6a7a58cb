"""``dense``: the model's own exact attention, routed through the patch (a baseline and an overhead check)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...options import options_of
from ..contract import Method
from ..registry import register_method
from ..state import LayerContext, LayerRecord

__all__ = ["DenseConfig", "dense_forward", "DENSE"]


@dataclass(frozen=True)
class DenseConfig:
    """The ``dense`` baseline has no options: exact attention through the patch machinery."""


def dense_forward(cfg: DenseConfig, q, k, v, ctx: LayerContext):
    """The ``dense`` baseline: always the model's exact attention."""
    return None, LayerRecord(ctx.layer, "dense", q.shape[2], k.shape[2])


def _config(options: dict[str, Any]) -> DenseConfig:
    return DenseConfig()


DENSE = register_method(
    Method(
        name="dense",
        summary="exact attention routed through the patch (a baseline and an overhead check)",
        source="softmax attention (Vaswani et al. 2017, Eq. 1)",
        options=options_of(DenseConfig),
        model_kinds=frozenset({"causal_lm", "vision"}),
        make_config=_config,
        forward=dense_forward,
        exact=True,
        details=(
            "The model's own attention implementation routed through the patch (baseline and overhead check; "
            "bit for bit the unpatched model); keeps autograd."
        ),
    )
)
