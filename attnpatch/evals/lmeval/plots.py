"""The PNG of ``attnpatch eval lm-eval``: lm-eval's score against the prefill speed-up over dense, per task and metric.

One panel per (task, metric) row group of the table (:func:`attnpatch.evals.lmeval.table.score_rows`; for a RULER
task the metric is the context length): dense is the star at 1.0 with a dashed line at its score, each setting a
point at its median prefill speed-up (the same requests, timed with the device synchronised).  A setting with no
prefill time (e.g. a loglikelihood-only task) is listed in the panel's note instead of placed.

:func:`lmeval_panels` returns what is drawn, so it can be checked without pixels.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

from ..run.plots import Point, as_number, draw_vs_speedup, figure_title, pyplot, save_figure

__all__ = ["lmeval_panels", "plot_lm_eval"]


def lmeval_panels(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The panels of an lm-eval result's table rows: ``[{"task", "metric", "points"}]`` in table order, the points
    (:class:`~attnpatch.evals.run.plots.Point`) dense first (speed-up 1.0 when dense was timed) and then one per
    setting (its ``speedup`` and ``score``)."""
    panels: dict[tuple[str, str], dict[str, Any]] = {}
    for r in rows:
        key = (str(r["task"]), str(r["metric"]))
        if key not in panels:
            timed = bool(r.get("prefill_dense_s"))
            panels[key] = {"task": key[0], "metric": key[1],
                           "points": [Point("dense", 1.0 if timed else None, as_number(r.get("dense")), dense=True)]}
        if "score" in r:  # a setting's row (a run without settings has one unpatched row, without "score")
            why = None if as_number(r.get("speedup")) is not None else "no prefill timed"
            panels[key]["points"].append(Point(str(r["setting"]), as_number(r.get("speedup")), as_number(r.get("score")), why=why))
    return list(panels.values())


def plot_lm_eval(rows: Sequence[dict[str, Any]], path: str | Path, title: str = "") -> Path | None:
    """Write the PNG of an lm-eval result's table ``rows`` to ``path`` (see the module docstring).

    Returns:
        ``path``, or ``None`` when there is no row to draw (nothing is written then).
    """
    panels = lmeval_panels(rows)
    if not panels:
        return None
    plt = pyplot()
    cols = min(len(panels), 3)
    nrows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(6.5 * cols, 4.8 * nrows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        metric = f"{panel['metric']} tokens" if panel["metric"].isdigit() else panel["metric"]
        values = [p.value for p in panel["points"] if p.value is not None]
        fraction = bool(values) and all(0.0 <= v <= 1.0 for v in values)  # accuracy-like scores: shown in percent
        draw_vs_speedup(ax, panel["points"], "lm-eval score", percent=fraction, title=f"{panel['task']}, {metric}",
                        xlabel="prefill speed-up over dense (×)")
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    if title:
        fig.suptitle(figure_title(title, 80 * cols), fontsize=9)
    return save_figure(fig, path)
