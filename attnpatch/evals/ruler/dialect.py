"""RULER results in lm-evaluation-harness's dialect: task names and per-length metric keys as lm-eval writes them.

lm-eval (0.4.13, ``lm_eval/tasks/ruler/``) scores each RULER sample with ``string_match_all`` (the score of
:func:`attnpatch.evals.ruler.tasks.score`) under a metric named by the sample's context length, sets its
default length ``"4096"`` to ``-1`` on samples of another length, and aggregates each length metric as the
mean over the samples that are not ``-1`` (``-1`` when there are none).  Its results file then holds, per task::

    "results": {"niah_single_1": {"name": "niah_single_1", "alias": "niah_single_1", "sample_len": 6,
                                  "4096,none": -1, "4096_stderr,none": "N/A",
                                  "1024,none": 0.67, "1024_stderr,none": 0.33, ...}}

plus ``"group_subtasks"``, ``"configs"``, ``"versions"``, ``"n-shot"``, ``"higher_is_better"`` and ``"n-samples"``.
The lengths of lm-eval's own metric list (4096 ... 131072) carry no standard error (``"N/A"``); any other
length falls back to lm-eval's ``mean`` aggregation, whose standard error is the sample standard deviation
over the square root of the count (``"N/A"`` for one sample).  :func:`lm_eval_block` writes exactly that
from a RULER result's cells.

Task names (:func:`lm_eval_task_name`): a task of ours takes lm-eval's name where its generator matches
lm-eval's in haystack kind, key and value types and the numbers of needles, keys, values and queries:

=====================  ==========  ===================
ours                   haystack    lm-eval
=====================  ==========  ===================
``niah_single``        repeat      ``niah_single_1``
``niah_single``        essay       ``niah_single_2``
``niah_multikey``      essay       ``niah_multikey_1``
``niah_multivalue``    essay       ``niah_multivalue``
``niah_multiquery``    essay       ``niah_multiquery``
``variable_tracking``  repeat      ``ruler_vt``
``common_words``       (any)       ``ruler_cwe``
``frequent_words``     (any)       ``ruler_fwe``
=====================  ==========  ===================

Every other pair keeps our task name with the haystack appended (e.g. ``niah_multikey_repeat``), so it
never takes the name of an lm-eval task it differs from.  lm-eval's ``niah_single_3`` and
``niah_multikey_3`` (UUID values) and ``niah_multikey_2`` (a haystack of distractor needles) have no
counterpart here.

Source: lm-evaluation-harness 0.4.13, ``lm_eval/tasks/ruler/common_utils.py`` (``process_results``,
``aggregate_metrics``), ``niah_utils.py``, ``vt_utils.py``, ``cwe_utils.py``, ``fwe_utils.py`` and
``lm_eval/evaluator_utils.py`` (the results layout).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from .tasks import MAX_NEW_TOKENS

__all__ = ["LM_EVAL_NAMES", "LM_EVAL_DEFAULT_LENGTHS", "LM_EVAL_METRIC_LENGTHS", "lm_eval_task_name", "lm_eval_block",
           "lm_eval_results"]

#: ``(our task, haystack)`` -> lm-eval's task name, where the two generators correspond (``None``: any haystack).
LM_EVAL_NAMES: dict[tuple[str, str | None], str] = {
    ("niah_single", "repeat"): "niah_single_1",
    ("niah_single", "essay"): "niah_single_2",
    ("niah_multikey", "essay"): "niah_multikey_1",
    ("niah_multivalue", "essay"): "niah_multivalue",
    ("niah_multiquery", "essay"): "niah_multiquery",
    ("variable_tracking", "repeat"): "ruler_vt",
    ("common_words", None): "ruler_cwe",
    ("frequent_words", None): "ruler_fwe",
}

#: lm-eval's ``DEFAULT_SEQ_LENGTHS``: lengths every sample writes (``-1`` when the sample is of another length).
LM_EVAL_DEFAULT_LENGTHS: tuple[int, ...] = (4096,)

#: The lengths of lm-eval's RULER ``metric_list`` (aggregated with ``aggregate_metrics``, no standard error).
LM_EVAL_METRIC_LENGTHS: tuple[int, ...] = (4096, 8192, 16384, 32768, 65536, 131072)


def lm_eval_task_name(task: str, haystack: str) -> str:
    """lm-eval's name of our RULER ``task`` run on ``haystack`` (see the module's table), else ``<task>_<haystack>``."""
    return LM_EVAL_NAMES.get((task, haystack)) or LM_EVAL_NAMES.get((task, None)) or f"{task}_{haystack}"


def _scores(cell: dict[str, Any], key: str) -> list[float]:
    """The per-sample scores of ``cell`` under ``key`` (``"dense_score"``/``"patched_score"``)."""
    rows = cell.get("samples")
    if rows:
        return [float(r[key]) for r in rows]
    acc = cell.get(key.replace("_score", "_acc"))  # a cell without its samples: its mean, n times
    return [float(acc)] * int(cell.get("n") or 0) if acc is not None else []


def _stderr(xs: list[float], length: int) -> float | str:
    if length in LM_EVAL_METRIC_LENGTHS or len(xs) < 2:
        return "N/A"
    mu = sum(xs) / len(xs)
    return math.sqrt(sum((x - mu) ** 2 for x in xs) / (len(xs) - 1)) / math.sqrt(len(xs))


def lm_eval_block(cells: Sequence[dict[str, Any]], key: str, haystack: str) -> dict[str, Any]:
    """One row (dense or a patched setting) of a RULER result as lm-eval's results dict.

    Args:
        cells: the result's cells (``task``, ``length``, ``samples`` with per-sample scores).
        key: the per-sample score to report, ``"dense_score"`` or ``"patched_score"`` (in [0, 1]).
        haystack: the run's haystack (it picks the lm-eval task name, :func:`lm_eval_task_name`).

    Returns:
        ``{"results", "group_subtasks", "configs", "versions", "n-shot", "higher_is_better", "n-samples"}`` as
        lm-eval writes them: ``results[name]["<length>,none"]`` is the mean score over the samples of that
        context length (tokens), ``-1`` for lm-eval's default length 4096 when it was not run;
        ``"<length>_stderr,none"`` as lm-eval computes it (module docstring).  Tasks and lengths keep the run's order.
    """
    per_task: dict[str, dict[int, list[float]]] = {}
    ours: dict[str, str] = {}
    for c in cells:
        name = lm_eval_task_name(c["task"], haystack)
        ours[name] = c["task"]
        per_task.setdefault(name, {}).setdefault(int(c["length"]), []).extend(_scores(c, key))
    results: dict[str, Any] = {}
    for name, by_len in per_task.items():
        row: dict[str, Any] = {"name": name, "alias": name, "sample_len": sum(len(v) for v in by_len.values())}
        for length in list(LM_EVAL_DEFAULT_LENGTHS) + [n for n in by_len if n not in LM_EVAL_DEFAULT_LENGTHS]:
            xs = by_len.get(length) or []
            row[f"{length},none"] = sum(xs) / len(xs) if xs else -1
            row[f"{length}_stderr,none"] = _stderr(xs, length)
        results[name] = row
    return {
        "results": results,
        "group_subtasks": {name: [] for name in results},
        "configs": {
            name: {"task": name, "output_type": "generate_until", "metadata": {"version": 1.0, "max_seq_lengths": list(by_len)},
                   "generation_kwargs": {"do_sample": False, "temperature": 0.0, "max_gen_toks": MAX_NEW_TOKENS[ours[name]], "until": []},
                   "attnpatch": {"task": ours[name], "haystack": haystack, "score": key}}
            for name, by_len in per_task.items()
        },
        "versions": {name: 1.0 for name in results},
        "n-shot": {name: 0 for name in results},
        "higher_is_better": {name: {str(n): True for n in LM_EVAL_METRIC_LENGTHS} for name in results},
        "n-samples": {name: {"original": r["sample_len"], "effective": r["sample_len"]} for name, r in results.items()},
    }


def lm_eval_results(dense_cells: Sequence[dict[str, Any]], run_cells: Sequence[Sequence[dict[str, Any]]], haystack: str,
                    one_setting: bool = True) -> dict[str, Any]:
    """The ``"lm_eval"`` entry of a RULER result: ``{"dense": block}`` plus the patched settings' blocks.

    With ``one_setting`` (a :func:`~attnpatch.evals.ruler.run_ruler` result) the setting's block is ``"patched"``
    (absent in a baseline-only run, ``run_cells`` empty); otherwise (:func:`~attnpatch.evals.ruler.run_ruler_settings`)
    the settings' blocks are the list ``"runs"``, in the order of the result's ``"runs"``.  Each block is
    :func:`lm_eval_block`'s, over ``dense_cells`` (``"dense_score"``) or one setting's cells (``"patched_score"``).
    """
    out: dict[str, Any] = {"dense": lm_eval_block(dense_cells, "dense_score", haystack)}
    blocks = [lm_eval_block(cells, "patched_score", haystack) for cells in run_cells]
    if not one_setting:
        out["runs"] = blocks
    elif blocks:
        out["patched"] = blocks[0]
    return out
