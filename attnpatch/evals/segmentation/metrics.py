"""Segmentation metrics from per-image counts: mIoU, per-class IoU, pixel accuracy, agreement with dense, and a
bootstrap confidence interval over images for a difference in mIoU.

Per image, :func:`image_counts` keeps ``[3, K]`` pixel counts (intersection, predicted area, labelled area, all
on non-void pixels) and the pixels where the prediction equals dense's; every metric is a sum of them, so a
resample of images is a resample of rows.  mIoU is the mean over the classes present in the labels of the
evaluated images (as mmsegmentation's ``nanmean`` over classes with a non-empty union counts a class with
predictions but no labels too: here such a class counts, with IoU 0, only if it is labelled somewhere).
"""

from __future__ import annotations

import numpy as np

from .data import VOID

__all__ = ["image_counts", "scores", "bootstrap_delta"]


def image_counts(pred: np.ndarray, labels: np.ndarray, k: int, dense: np.ndarray | None = None) -> dict[str, np.ndarray | int]:
    """Counts of one image: ``{"counts" [3, K] int64 (intersection, predicted, labelled on non-void pixels),
    "valid" (non-void pixels), "correct", "agree" (non-void pixels where ``pred == dense``; ``valid`` without dense)}``."""
    ok = labels != VOID
    p, g = pred[ok].astype(np.int64), labels[ok].astype(np.int64)
    inter = np.bincount(g[p == g], minlength=k)[:k]
    area_p = np.bincount(p, minlength=k)[:k]
    area_g = np.bincount(g, minlength=k)[:k]
    agree = int((pred[ok] == dense[ok]).sum()) if dense is not None else int(ok.sum())
    return {"counts": np.stack([inter, area_p, area_g]), "valid": int(ok.sum()), "correct": int((p == g).sum()), "agree": agree}


def _none_if_nan(v: float) -> float | None:
    return None if v != v else float(v)


def _miou(counts: np.ndarray) -> tuple[float, np.ndarray]:
    inter, area_p, area_g = counts
    union = area_p + area_g - inter
    present = area_g > 0
    iou = np.where(union > 0, inter / np.maximum(union, 1), np.nan)
    return (float(np.mean(iou[present])) if present.any() else float("nan")), iou


def scores(per_image: list[dict], classes: list[str]) -> dict:
    """mIoU (over classes labelled in these images), per-class IoU (``None`` for a class neither labelled nor
    predicted), pixel accuracy, and agreement with dense (share of non-void pixels), from :func:`image_counts` rows;
    ``None`` for a score the images cannot give (no labelled pixel)."""
    counts = np.sum([r["counts"] for r in per_image], axis=0)
    valid = sum(r["valid"] for r in per_image)
    miou, iou = _miou(counts)
    return {
        "miou": _none_if_nan(miou),
        "per_class_iou": {c: (None if np.isnan(v) else float(v)) for c, v in zip(classes, iou)},
        "pixel_accuracy": sum(r["correct"] for r in per_image) / valid if valid else None,
        "agreement": sum(r["agree"] for r in per_image) / valid if valid else None,
        "classes_present": int((counts[2] > 0).sum()),
    }


def bootstrap_delta(setting: list[dict], dense: list[dict], *, resamples: int = 1000, seed: int = 0, level: float = 0.95) -> dict:
    """The mIoU difference ``setting - dense`` with a percentile bootstrap interval over images (the same
    resample of images for both, so the interval is of the paired difference).

    Returns:
        ``{"delta", "low", "high", "level", "resamples"}`` (mIoU units, 0..1).
    """
    a = np.stack([r["counts"] for r in setting])
    b = np.stack([r["counts"] for r in dense])
    delta = _miou(a.sum(0))[0] - _miou(b.sum(0))[0]
    rng = np.random.default_rng(seed)
    n = len(setting)
    ds = np.empty(resamples)
    for i in range(resamples):
        pick = rng.integers(0, n, n)
        ds[i] = _miou(a[pick].sum(0))[0] - _miou(b[pick].sum(0))[0]
    if np.isnan(ds).all():
        return {"delta": _none_if_nan(delta), "low": None, "high": None, "level": level, "resamples": resamples}
    lo, hi = np.nanpercentile(ds, [100 * (1 - level) / 2, 100 * (1 + level) / 2])
    return {"delta": _none_if_nan(delta), "low": float(lo), "high": float(hi), "level": level, "resamples": resamples}
