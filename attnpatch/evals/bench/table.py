"""The columns of the benchmarks' tables: ``attnpatch bench attention`` (one attention layer per method and length)
and ``attnpatch bench model`` (a ViT per resolution, a causal LM's prefill per length)."""

from __future__ import annotations

from ..run.report import Column

__all__ = ["BENCH_ATTENTION_COLUMNS", "BENCH_VISION_COLUMNS", "BENCH_LM_COLUMNS"]

BENCH_ATTENTION_COLUMNS = [
    Column("N", "N", "int"),
    Column("method", "method"),
    Column("seconds", "time", "ms"),
    Column("speedup", "vs SDPA", "x"),
    Column("fps_seconds", "FPS", "ms"),
    Column("nystrom_seconds", "Nyström", "ms"),
    Column("speedup_incl", "vs SDPA (1 FPS/layer)", "x"),
    Column("speedup_nystrom", "vs SDPA (Nyström only)", "x"),
    Column("select_seconds", "selection", "ms"),
    Column("sparsity", "sparsity", "pct"),
    Column("recall", "recall mean", "f3"),
    Column("peak_bytes", "peak extra mem", "mib"),
    Column("nxn_bytes", "N×N scores", "mib"),
    Column("note", "note"),
]

BENCH_VISION_COLUMNS = [
    Column("resolution", "res", "int"),
    Column("tokens", "N", "int"),
    Column("setting", "setting"),
    Column("seconds", "s/forward", "s"),
    Column("images_per_s", "img/s", "f2"),
    Column("speedup", "vs unpatched", "x"),
    Column("attention_share", "attention share", "pct"),
    Column("note", "note"),
]

BENCH_LM_COLUMNS = [
    Column("length", "tokens", "int"),
    Column("setting", "setting"),
    Column("seconds", "prefill", "s"),
    Column("tokens_per_s", "tok/s", "f2"),
    Column("speedup", "vs unpatched", "x"),
    Column("attention_share", "attention share", "pct"),
    Column("sparsity", "sparsity", "pct"),
]
