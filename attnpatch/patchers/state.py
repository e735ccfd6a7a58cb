"""Per-forward state and per-layer records shared by the patch, the adapters and the methods."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["LayerRecord", "ForwardState"]


@dataclass
class LayerRecord:
    """What one patched attention layer did in one forward call.

    Attributes:
        layer: layer index.
        mode: ``"sparse"``, or why it ran dense: ``"dense:decode"`` (one query),
            ``"dense:short"`` (prompt shorter than ``min_len``), ``"dense:layer"`` (in
            ``dense_layers``), ``"dense"`` (the dense method).
        queries: query tokens in this call.
        keys: key tokens in this call.
        causal_pairs: ``[batch, heads]`` causal query-key pairs among valid tokens.
        kept_pairs: ``[batch, heads]`` pairs computed.
        recall: ``[batch, heads]`` mean exact softmax mass on kept keys, or ``None``.
        kept_columns: ``[batch, heads, blocks]`` stripes kept per query block (-1 for dense heads), or ``None``.
    """

    layer: int
    mode: str
    queries: int
    keys: int
    causal_pairs: torch.Tensor | None = None
    kept_pairs: torch.Tensor | None = None
    recall: torch.Tensor | None = None
    kept_columns: torch.Tensor | None = None

    @property
    def sparsity(self) -> torch.Tensor | None:
        """``[batch, heads]`` skipped fraction of causal query-key pairs (0 for dense)."""
        if self.causal_pairs is None:
            return None
        return 1.0 - self.kept_pairs / self.causal_pairs.clamp(min=1)


@dataclass
class ForwardState:
    """Per-forward state shared by the layers of one model call.

    Attributes:
        record: whether layers store a :class:`LayerRecord`.
        recall: whether sparse layers also measure attention recall (costs a dense ``Q K^T`` pass).
        layers: the records, by layer index.
        shared: free slot for state one layer computes and later layers reuse.
    """

    record: bool = False
    recall: bool = False
    layers: dict[int, LayerRecord] = field(default_factory=dict)
    shared: dict[str, Any] = field(default_factory=dict)
