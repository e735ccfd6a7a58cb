"""Compare dense and several patched settings on one model and one eval, at matched budgets.

:func:`compare_vision` (frozen ViT features: ``fidelity``, ``knn``, ``linear-probe``, ``retrieval``),
:func:`compare_clip` (``zeroshot``, ``clip-retrieval``), :func:`compare_segmentation` (``segmentation``: mIoU, agreement
with dense) and :func:`compare_ruler` (causal LMs) run
dense and every setting on the same inputs in one process, interleaved, through the existing
runners (:func:`attnpatch.evals.vision.run_feature_eval`, the CLIP runners,
:func:`attnpatch.evals.ruler.run_ruler_settings`), and return one row per setting plus dense:
the eval's main metric, a fidelity to dense, the sparsity, the time and the speed-up.

Budget matching (:class:`Match`, ``attnpatch compare --match``) turns each method's main knob
(:attr:`attnpatch.patchers.registry.Method.knob`) before the run, on the first batch of images
(vision, CLIP) or the first sample of the first cell (RULER):

* ``sparsity=X``: bisection on the knob position ``t`` in ``[0, 1]`` until the measured sparsity
  ``1 - sum(kept_pairs) / sum(causal_pairs)`` over every routed layer and head (one recorded
  forward, :func:`attnpatch.record_stats`) is within ``tol`` of ``X``;
* ``flops=X``: the same on the kept fraction ``1 - sparsity``;
* ``tokens=S``: the knob's token-count option (``Knob.tokens``: landmarks ``s``, anchors ``m``) set to ``S``;
* ``speedup=X``: bisection on the measured speed-up over dense (median of timed forwards).

A method without a knob (or, for ``tokens``, whose knob counts no tokens) runs as given and its
row says ``not matched``.  Nothing here names a method: everything goes through the registry.
:func:`plot_pareto` draws metric vs speed-up with the Pareto front.

The package: :mod:`.matching` (the evals, the budgets and their matching), :mod:`.runs` (the three
runs) and :mod:`.table` (the table rows and columns, and the Pareto plot).
"""

from __future__ import annotations

from .matching import EVALS, MATCH_KEYS, Match, check_settings, eval_kind, match_settings, parse_match, parse_matches
from .runs import compare_clip, compare_ruler, compare_segmentation, compare_vision
from .table import compare_columns, compare_rows, pareto_front, plot_pareto

__all__ = [
    "EVALS", "MATCH_KEYS", "Match", "parse_match", "parse_matches", "eval_kind", "check_settings", "match_settings", "compare_vision",
    "compare_clip", "compare_ruler", "compare_segmentation", "compare_rows", "compare_columns", "pareto_front", "plot_pareto",
]
