"""The columns and rows of ``attnpatch eval segmentation``'s table: dense first, then each setting, one column group
per read-out (mIoU, its difference from dense with the bootstrap interval, agreement with dense)."""

from __future__ import annotations

from typing import Any

from ..run.report import Column

__all__ = ["segmentation_columns", "segmentation_rows"]

_NAMES = {"linear": "linear", "knn": "k-NN"}


def segmentation_columns(readouts) -> list[Column]:
    """The table's columns for ``readouts`` (``"linear"``, ``"knn"``)."""
    cols = [Column("setting", "setting"), Column("resolution", "res", "int"), Column("tokens", "N", "int")]
    for r in readouts:
        n = _NAMES.get(r, r)
        cols += [Column(f"{r}_miou", f"{n} mIoU", "pct"), Column(f"{r}_delta", f"{n} Δ mIoU [95% CI]"),
                 Column(f"{r}_pixel_accuracy", f"{n} pixel acc", "pct"), Column(f"{r}_agreement", f"{n} agree", "pct")]
    return cols + [Column("images_per_s", "img/s", "f2"), Column("speedup", "speed-up", "x")]


def _delta(d: dict[str, Any] | None) -> str | None:
    if not d or d.get("delta") is None:
        return None
    if d.get("low") is None:
        return f"{100 * d['delta']:+.2f}"
    return f"{100 * d['delta']:+.2f} [{100 * d['low']:+.2f}, {100 * d['high']:+.2f}]"


def segmentation_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Table rows of :func:`attnpatch.evals.segmentation.run_segmentation`'s result: dense first, then each setting."""
    base = {"resolution": result.get("resolution"), "tokens": result.get("tokens")}
    out = []
    for label, row, is_dense in [("dense", result["dense"], True)] + [
        (None, r, False) for r in result["runs"]
    ]:
        if label is None:
            opts = ", ".join(f"{k}={v}" for k, v in row.get("shown_options", row.get("given_options") or {}).items())
            label = row["method"] + (f" ({opts})" if opts else "") + (f" [{row['note']}]" if row.get("note") else "")
        entry = {**base, "setting": label, "images_per_s": row.get("images_per_s"), "speedup": row.get("speedup")}
        for r in result["readouts"]:
            s = row.get(r) or {}
            entry.update({f"{r}_miou": s.get("miou"), f"{r}_pixel_accuracy": s.get("pixel_accuracy"),
                          f"{r}_agreement": None if is_dense else s.get("agreement"),
                          f"{r}_delta": None if is_dense else _delta(s.get("miou_delta"))})
        out.append(entry)
    return out
