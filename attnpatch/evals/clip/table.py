"""The columns and rows of the CLIP evals' tables (``attnpatch eval zeroshot``, ``clip-retrieval``): dense, each
setting and chance."""

from __future__ import annotations

from typing import Any

from ..run.report import Column
from ..vision.table import vision_rows

__all__ = ["ZEROSHOT_COLUMNS", "CLIP_RETRIEVAL_COLUMNS", "clip_rows"]

ZEROSHOT_COLUMNS = [
    Column("setting", "setting"),
    Column("resolution", "res", "int"),
    Column("tokens", "N", "int"),
    Column("top1", "top-1", "pct"),
    Column("top5", "top-5", "pct"),
    Column("agreement", "top-1 agree", "pct"),
    Column("embed_cosine", "emb cos", "f3"),
    Column("embed_cosine_min", "emb cos min", "f3"),
    Column("images_per_s", "img/s", "f2"),
    Column("speedup", "speed-up", "x"),
]


CLIP_RETRIEVAL_COLUMNS = [
    Column("setting", "setting"),
    Column("resolution", "res", "int"),
    Column("tokens", "N", "int"),
    Column("t2i_recall@1", "T→I R@1", "pct"),
    Column("t2i_recall@5", "T→I R@5", "pct"),
    Column("t2i_recall@10", "T→I R@10", "pct"),
    Column("i2t_recall@1", "I→T R@1", "pct"),
    Column("i2t_recall@5", "I→T R@5", "pct"),
    Column("i2t_recall@10", "I→T R@10", "pct"),
    Column("embed_cosine", "emb cos", "f3"),
    Column("images_per_s", "img/s", "f2"),
    Column("speedup", "speed-up", "x"),
]


def clip_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Table rows of :func:`attnpatch.evals.clip.run_zeroshot_eval` / ``run_retrieval_eval``: dense,
    each setting, and a ``chance`` row (the expected score of a random ranking)."""
    rows = vision_rows(result)
    for row, run in zip(rows[1:], result["runs"]):
        towers = run.get("towers")
        if towers and list(towers) != ["vision"]:
            row["setting"] += f" [towers: {', '.join(towers)}]"
    if result.get("chance"):
        rows.append({"setting": "chance", **result["chance"]})
    return rows
