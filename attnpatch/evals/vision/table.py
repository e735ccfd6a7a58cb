"""The columns and rows of the frozen-feature evals' table (``attnpatch eval fidelity``, ``knn``, ``linear-probe``,
``retrieval``): dense first, then each setting of :func:`attnpatch.evals.vision.run_feature_eval`'s result."""

from __future__ import annotations

from typing import Any

from ..run.report import Column

__all__ = ["VISION_COLUMNS", "vision_rows"]

VISION_COLUMNS = [
    Column("setting", "setting"),
    Column("resolution", "res", "int"),
    Column("tokens", "N", "int"),
    Column("knn_top1", "k-NN top-1", "pct"),
    Column("linear_probe", "lin. probe", "pct"),
    Column("map_at_r", "mAP@R", "f3"),
    Column("recall_at_1", "R@1", "pct"),
    Column("cls_cosine", "CLS cos", "f3"),
    Column("patch_cosine", "patch cos", "f3"),
    Column("knn_agreement", "k-NN agree", "pct"),
    Column("mean_layer_error_teacher", "layer err (teacher)", "f3"),
    Column("mean_layer_error_free", "layer err (free)", "f3"),
    Column("images_per_s", "img/s", "f2"),
    Column("speedup", "speed-up", "x"),
]


def vision_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Table rows of :func:`attnpatch.evals.vision.run_feature_eval`'s result: dense first, then each setting."""
    base = {"resolution": result.get("resolution"), "tokens": result.get("tokens")}
    rows = [{"setting": "dense", **base, **result["dense"]}]
    for r in result["runs"]:
        opts = ", ".join(f"{k}={v}" for k, v in r.get("shown_options", r["options"]).items())
        label = f"{r['method']}" + (f" ({opts})" if opts else "") + (f" [{r['note']}]" if r.get("note") else "")
        rows.append({**base, **r, "setting": label})
    return rows
