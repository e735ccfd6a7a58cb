"""The columns of ``attnpatch eval ruler``'s table: one row per (task, length) cell of
:func:`attnpatch.evals.ruler.run_ruler`'s ``"cells"``."""

from __future__ import annotations

from ..run.report import Column

__all__ = ["RULER_COLUMNS"]

RULER_COLUMNS = [
    Column("task", "task"),
    Column("length", "length", "int"),
    Column("n", "n", "int"),
    Column("dense_acc", "dense acc", "pct"),
    Column("patched_acc", "patched acc", "pct"),
    Column("sparsity", "sparsity", "pct"),
    Column("recall_mean", "recall mean", "f3"),
    Column("recall_worst5", "recall worst5%", "f3"),
    Column("prefill_dense_s", "prefill dense", "s"),
    Column("prefill_patched_s", "prefill patched", "s"),
    Column("prefill_speedup", "speed-up", "x"),
]
