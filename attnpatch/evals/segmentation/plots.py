"""The PNGs of ``attnpatch eval segmentation``.

* :func:`plot_segmentation`: per read-out, mIoU against the feature-extraction speed-up over dense (dense at 1.0,
  each setting a point; the bootstrap interval of each difference from dense is in the table and the JSON).
* :func:`plot_examples`: a few val images side by side: image, ground truth, dense prediction, and each setting's
  prediction (one row per image, one read-out).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..run.plots import Point, draw_vs_speedup, figure_title, pyplot, save_figure, setting_label

__all__ = ["miou_points", "plot_segmentation", "plot_examples", "colourise"]

_LABEL = {"linear": "linear-probe mIoU", "knn": "dense k-NN mIoU"}


def miou_points(result: dict[str, Any], readout: str) -> list[Point]:
    """Dense and each setting as (speed-up, mIoU) points of ``readout``."""
    d = result["dense"]
    pts = [Point("dense", 1.0 if d.get("seconds") else None, d[readout]["miou"], dense=True)]
    for r in result["runs"]:
        pts.append(Point(setting_label(r), r.get("speedup"), r[readout]["miou"]))
    return pts


def plot_segmentation(result: dict[str, Any], path: str | Path, title: str = "") -> Path | None:
    """One panel per read-out: mIoU against the speed-up over dense; returns the path, or ``None`` with no runs."""
    if not result.get("runs"):
        return None
    plt = pyplot()
    readouts = result["readouts"]
    fig, axes = plt.subplots(1, len(readouts), figsize=(6.5 * len(readouts), 4.8), squeeze=False)
    for ax, r in zip(axes[0], readouts):
        draw_vs_speedup(ax, miou_points(result, r), _LABEL.get(r, r), percent=True, title=_LABEL.get(r, r))
    fig.suptitle(figure_title(title))
    fig.tight_layout()
    return save_figure(fig, path)


def colourise(labels: np.ndarray, k: int) -> np.ndarray:
    """``[H, W, 3]`` uint8 of a class map (VOC's palette for the first classes; void white)."""
    pal = np.zeros((max(k, 1), 3), np.uint8)
    for i in range(len(pal)):
        c, j = i, 0
        while c:
            for ch in range(3):
                pal[i, ch] |= ((c >> ch) & 1) << (7 - j)
            c >>= 3
            j += 1
    out = np.full(labels.shape + (3,), 255, np.uint8)
    ok = (labels >= 0) & (labels < k)
    out[ok] = pal[labels[ok]]
    return out


def plot_examples(examples: dict[str, Any], images: list, labels: list[np.ndarray], k: int, readout: str,
                  run_labels: list[str], path: str | Path, title: str = "") -> Path | None:
    """Rows of image, ground truth, dense prediction and each setting's prediction of ``readout``; ``None`` without examples."""
    ids = examples.get("ids") or []
    if not ids:
        return None
    plt = pyplot()
    cols = 3 + len(run_labels)
    fig, axes = plt.subplots(len(ids), cols, figsize=(2.2 * cols, 2.3 * len(ids)), squeeze=False)
    for i, name in enumerate(ids):
        panels = [(np.asarray(images[i]), name), (colourise(labels[i], k), "ground truth"),
                  (colourise(examples["dense"][readout][i], k), "dense")]
        panels += [(colourise(run[readout][i], k), lab) for run, lab in zip(examples["runs"], run_labels)]
        for ax, (img, t) in zip(axes[i], panels):
            ax.imshow(img)
            ax.set_title(t, fontsize=7)
            ax.axis("off")
    fig.suptitle(figure_title(title + f" ({readout} read-out)"), fontsize=9)
    fig.tight_layout()
    return save_figure(fig, path)
