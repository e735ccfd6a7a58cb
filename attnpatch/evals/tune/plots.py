"""The PNG of ``attnpatch tune``: each candidate's score against its speed-up over the exact model, the target as a
line, the chosen setting marked.

From :func:`attnpatch.evals.tune.tune_vision` / :func:`~attnpatch.evals.tune.tune_causal`'s result: a ViT search has
one panel (the final-CLS cosine to the unpatched model), a causal-LM search two (mean attention recall, and the mean
of the worst ``worst_fraction``), each with its target as a dashed line.  The exact setting is the reference at
speed-up 1.0 (a star); a candidate that was not timed (it misses the target, or every layer ran exact attention, or
every head ended dense) is listed on the panel with its score instead of being placed.

:func:`tune_panels` returns what is drawn, so it can be checked without pixels.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..run.plots import Point, draw_vs_speedup, figure_title, pyplot, save_figure

__all__ = ["tune_panels", "plot_tune"]


def _why(row: dict[str, Any]) -> str | None:
    if row.get("speedup") is not None:
        return None
    note = row.get("note") or ""
    if note.startswith("every head dense"):
        return "not timed: every head dense"
    if note.startswith("every layer ran exact"):
        return "not timed: ran exact attention"
    return "not timed: misses the target" if not row.get("meets") else "not timed"


def tune_panels(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The panels of a tune result: ``[{"key", "label", "target", "points"}]``, one per target (``cls_cos`` for a ViT;
    ``recall_mean`` and ``recall_worst`` for a causal LM).  ``points`` has one
    :class:`~attnpatch.evals.run.plots.Point` per row of the search, in its order (the exact setting last, ``dense``,
    at speed-up 1.0), the chosen row ``chosen``."""
    from . import short_options

    target = result.get("target") or {}
    if result.get("kind") == "causal_lm":
        worst = 100 * float(target.get("worst_fraction", 0.05))
        keys = [("recall_mean", "mean attention recall"), ("recall_worst", f"attention recall, mean of the worst {worst:g} %")]
    else:
        keys = [("cls_cos", "final-CLS cosine to the unpatched model (mean)")]
    chosen = result.get("chosen")
    panels = []
    for key, label in keys:
        pts = []
        for r in result.get("rows") or []:
            name = "exact (unpatched)" if r.get("exact") else short_options(r.get("options") or {})
            pts.append(Point(name, r.get("speedup"), r.get(key), dense=bool(r.get("exact")),
                             chosen=chosen is not None and r == chosen, why=_why(r)))
        panels.append({"key": key, "label": label, "target": target.get(key), "points": pts})
    return panels


def plot_tune(result: dict[str, Any], path: str | Path, title: str = "") -> Path | None:
    """Write the PNG of a tune result to ``path`` (see the module docstring).

    Returns:
        ``path``, or ``None`` when the result holds no rows (nothing is written then).
    """
    if not result or not result.get("rows"):
        return None
    plt = pyplot()
    panels = tune_panels(result)
    fig, axes = plt.subplots(1, len(panels), figsize=(7.5 * len(panels), 5.4), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        t = panel["target"]
        draw_vs_speedup(ax, panel["points"], panel["label"], reference=t, reference_label=None if t is None else f"target ≥ {t:g}",
                        title=f"{panel['label']} vs speed-up", xlabel="speed-up over the unpatched model (×)")
    if title:
        fig.suptitle(figure_title(title, 90 * len(panels)), fontsize=9)
    return save_figure(fig, path)
