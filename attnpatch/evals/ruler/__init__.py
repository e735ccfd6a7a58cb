"""RULER-style long-context eval of a causal LM, dense vs patched (entry point: :func:`run_ruler`).

Modules: :mod:`.runner` (the eval: prefill timing, greedy generation, scoring, recall), :mod:`.tasks`
(task names, sample generation and scoring), the task families :mod:`.niah`, :mod:`.tracing` and
:mod:`.aggregation`, their word lists (:mod:`.words`), the haystacks (:mod:`.haystack`) and the shared
text fitting (:mod:`.text`); the result's table columns (:mod:`.table`), needle-in-a-haystack heatmap (:mod:`.plots`)
and its accuracies in lm-evaluation-harness's results layout (:mod:`.dialect`).
"""

from __future__ import annotations

from .runner import run_ruler, run_ruler_settings
from .tasks import TASKS

__all__ = ["run_ruler", "run_ruler_settings", "TASKS"]
