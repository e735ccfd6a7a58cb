"""Speed and memory benchmarks: one attention layer (``bench attention``) and whole models (``bench model``).

Modules: :mod:`.timing` (peak memory, scaling exponents, a competing process),
:mod:`.capture` (captured ``q, k, v``), :mod:`.layer` (one attention layer, any registered method
through its bench hook), :mod:`.models` (whole ViTs and causal LMs), :mod:`.plots`, :mod:`.table` (the tables'
columns).  Every name is
importable from this package, as ``from attnpatch.evals.bench import bench_attention``.
"""

from __future__ import annotations

from typing import Any

from .capture import capture_qkv, load_qkv
from .layer import DEFAULT_LENGTHS, bench_attention, layer_config
from .models import bench_causal_lm, bench_vision_model, prefill_ids
from .plots import plot_attention
from ...timing import time_call
from .timing import BACKGROUND_LOAD_LIMIT_S, background_load, peak_extra_bytes, scaling_exponent

__all__ = [
    "ATTENTION_METHODS",
    "DEFAULT_LENGTHS",
    "time_call",
    "peak_extra_bytes",
    "scaling_exponent",
    "capture_qkv",
    "load_qkv",
    "bench_attention",
    "layer_config",
    "bench_vision_model",
    "bench_causal_lm",
    "prefill_ids",
    "plot_attention",
    "background_load",
    "BACKGROUND_LOAD_LIMIT_S",
]


def __getattr__(name: str) -> Any:
    # ATTENTION_METHODS: the methods bench attention measures = every registered method (read when asked,
    # so that a method registered later is listed too)
    if name == "ATTENTION_METHODS":
        from ...patchers.registry import METHODS

        return tuple(sorted(METHODS))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
