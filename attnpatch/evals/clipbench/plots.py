"""The PNG of ``attnpatch eval clip-benchmark``: CLIP_benchmark's headline metric against the image-tower speed-up.

From :func:`attnpatch.evals.clipbench.run_clip_benchmark`'s result, one point per setting, dense the star at 1.0
with a dashed line at its value: ``acc1`` for zero-shot classification; ``image_retrieval_recall@k`` (text→image)
and ``text_retrieval_recall@k`` (image→text) at the smallest ``k`` for retrieval, one panel each.  The speed-up is
dense's image-tower seconds over the setting's, measured in the same run.

:func:`clipbench_panels` returns what is drawn, so it can be checked without pixels.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..run.plots import Point, as_number, draw_vs_speedup, figure_title, pyplot, save_figure

__all__ = ["clipbench_panels", "plot_clip_benchmark"]


def clipbench_panels(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The panels of a clip-benchmark result: ``[{"key", "label", "points"}]``, the points
    (:class:`~attnpatch.evals.run.plots.Point`) dense first, then each setting."""
    metrics = list((result.get("dense") or {}).get("metrics") or {})
    if "acc1" in metrics:
        keys = [("acc1", "top-1 accuracy (acc1)")]
    else:
        ks = sorted(int(k.split("@")[1]) for k in metrics if k.startswith("image_retrieval_recall@"))
        if not ks:
            return []
        keys = [(f"image_retrieval_recall@{ks[0]}", f"text→image recall@{ks[0]}"),
                (f"text_retrieval_recall@{ks[0]}", f"image→text recall@{ks[0]}")]
    d = result["dense"]
    panels = []
    for key, label in keys:
        pts = [Point("dense", 1.0 if d.get("image_seconds") else None, as_number(d["metrics"].get(key)), dense=True)]
        for e in result.get("runs") or []:
            label = str(e["setting"]) + (" [exact attention]" if e.get("note") else "")
            pts.append(Point(label, as_number(e.get("speedup")), as_number((e.get("metrics") or {}).get(key))))
        panels.append({"key": key, "label": label, "points": pts})
    return panels


def plot_clip_benchmark(result: dict[str, Any], path: str | Path, title: str = "") -> Path | None:
    """Write the PNG of a clip-benchmark ``result`` to ``path`` (see the module docstring).

    Returns:
        ``path``, or ``None`` when the result holds nothing to draw (nothing is written then).
    """
    if not result or "dense" not in result:
        return None
    panels = clipbench_panels(result)
    if not panels:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(7.5 * len(panels), 5.2), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        draw_vs_speedup(ax, panel["points"], panel["label"], percent=True, title=f"{panel['label']} vs speed-up",
                        xlabel="image-tower speed-up over dense (×)")
    if title:
        fig.suptitle(figure_title(title, 90 * len(panels)), fontsize=9)
    return save_figure(fig, path)
