"""Attention recall: how much exact softmax mass the kept keys carry.

A hard logit threshold (AnchorAttention's ``theta``) does not bound the pruned softmax mass;
this diagnostic measures it.  For every sparse layer and head, recall is the mean over the
prompt's (valid) queries of ``sum_{j kept} softmax(q_i K^T * scale)_j`` over causal keys —
1.0 means nothing was lost.  Layers and heads that ran dense count as 1.0.
"""

from __future__ import annotations

from typing import Any

import torch

from ..patchers.api import handle_of, record_stats
from ..patchers.state import LayerRecord

__all__ = ["attention_recall", "summarize_layers"]


def _check_worst_fraction(worst_fraction: float) -> None:
    if not 0.0 < worst_fraction <= 1.0:
        raise ValueError(f"worst_fraction={worst_fraction!r}: must be in (0, 1]")


def summarize_layers(layers: dict[int, LayerRecord], worst_fraction: float = 0.05, recall_measured: bool | None = None) -> dict[str, Any]:
    """Aggregate one forward's layer records.

    Args:
        layers: ``{layer: LayerRecord}`` of one forward call (see :func:`attnpatch.record_stats`).
        worst_fraction: share of (layer, head) pairs averaged for ``recall_worst`` (0.05 = worst 5 %).
        recall_measured: whether recall was requested for this forward; ``None`` = whether any
            layer carries one.  When requested, layers that ran dense count as 1.0.

    Returns:
        dict with ``sparsity`` (skipped fraction of all causal query-key pairs, all layers and
        heads pooled), ``recall_mean`` (mean over layers x heads), ``recall_worst`` (mean of the
        worst ``worst_fraction`` of layer-heads, at least one), ``worst_heads`` (list of
        ``[layer, head, recall]``), ``per_layer`` (list of dicts: layer, mode, sparsity,
        recall per head), and ``recall_matrix`` (``[layers, heads]`` list, batch-averaged) —
        the recall entries are ``None`` when recall was not measured, and when some layer skipped keys
        without measuring its recall (its method does not; listed in ``recall_unmeasured_layers``).

    Raises:
        ValueError: ``worst_fraction`` outside ``(0, 1]``.
    """
    _check_worst_fraction(worst_fraction)
    if not layers:
        return {"sparsity": None, "recall_mean": None, "recall_worst": None, "worst_heads": [], "per_layer": []}
    kept = sum(float(r.kept_pairs.sum()) for r in layers.values() if r.kept_pairs is not None)
    causal = sum(float(r.causal_pairs.sum()) for r in layers.values() if r.causal_pairs is not None)
    per_layer = []
    rows = []
    have_recall = any(r.recall is not None for r in layers.values()) if recall_measured is None else recall_measured
    # a layer that skipped keys but did not measure its recall: no recall figure may claim it kept everything
    unmeasured = [li for li in sorted(layers) if layers[li].recall is None
                  and layers[li].kept_pairs is not None and layers[li].causal_pairs is not None
                  and bool((layers[li].kept_pairs < layers[li].causal_pairs).any())]
    for li in sorted(layers):
        r = layers[li]
        h = r.causal_pairs.shape[1] if r.causal_pairs is not None else 0
        rec = r.recall.mean(0) if r.recall is not None else torch.ones(h, dtype=torch.float64)
        rows.append(rec)
        per_layer.append(
            {
                "layer": li,
                "mode": r.mode,
                "sparsity": None if r.sparsity is None else float(r.sparsity.mean()),
                "recall": [float(x) for x in rec] if have_recall else None,
            }
        )
    out: dict[str, Any] = {"sparsity": 1.0 - kept / causal if causal else None, "per_layer": per_layer}
    if have_recall and unmeasured:
        out.update(recall_mean=None, recall_worst=None, worst_heads=[], recall_matrix=None, recall_unmeasured_layers=unmeasured)
    elif have_recall:
        mat = torch.stack(rows)  # [layers, heads]
        flat = mat.flatten()
        n = max(1, int(round(worst_fraction * flat.numel())))
        vals, idx = torch.topk(flat, n, largest=False)
        heads = mat.shape[1]
        out.update(
            recall_mean=float(flat.mean()),
            recall_worst=float(vals.mean()),
            worst_heads=[[sorted(layers)[int(i) // heads], int(i) % heads, float(v)] for v, i in zip(vals, idx)],
            recall_matrix=mat.tolist(),
        )
    else:
        out.update(recall_mean=None, recall_worst=None, worst_heads=[], recall_matrix=None)
    return out


@torch.no_grad()
def attention_recall(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    worst_fraction: float = 0.05,
) -> dict[str, Any]:
    """Per layer and head, the exact softmax mass the patched model's kept keys carry, for one prompt.

    Runs one forward pass of the patched model with recall measurement on (each sparse layer
    additionally computes the exact log-sum-exp of its causal logits in query chunks, so the
    pass costs about a dense attention more than a plain patched pass).

    Args:
        model: a model patched with a sparse method (e.g. ``anchor_attention``).
        input_ids: ``[batch, tokens]`` prompt token ids.
        attention_mask: ``[batch, tokens]`` 1 for real tokens, 0 for (left) padding.
        worst_fraction: share of layer-heads averaged into ``recall_worst``.

    Returns:
        :func:`summarize_layers`'s dict (``sparsity``, ``recall_mean``, ``recall_worst``,
        ``worst_heads``, ``per_layer``, ``recall_matrix``).

    Raises:
        PatchStateError: ``model`` is not patched.
        ValueError: ``input_ids`` not 2-D, or ``worst_fraction`` outside ``(0, 1]``.
    """
    handle_of(model)
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids of shape {tuple(input_ids.shape)}: expected [batch, tokens]")
    _check_worst_fraction(worst_fraction)
    with record_stats(model, recall=True) as rec:
        model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    return summarize_layers(rec.forwards[0], worst_fraction, recall_measured=True)
