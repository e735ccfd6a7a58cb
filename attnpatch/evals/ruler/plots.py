"""The needle-in-a-haystack heatmap of a RULER result: accuracy over context length × needle depth.

One PNG, one row of panels per NIAH task run (``niah_*``, in the run's order): the dense accuracy, the patched
accuracy and their difference (patched − dense), each cell the mean string-match score of the samples of that
context length (columns, target tokens) and needle depth (rows, the fraction of the haystack before the target
needle, as :func:`attnpatch.evals.ruler.tasks.make_samples` places it), annotated in percent.  Accuracy is drawn
on a red-yellow-green scale fixed to [0, 100] %, the difference on a red-blue scale centred at 0 and fixed to
[-100, +100] points, so figures of different runs read alike.  A (length, depth) cell without samples (fewer
samples than depths, or an interrupted run) is grey and marked "–".  A baseline-only run (``--method dense``)
has the dense panel alone.

A run without a NIAH task (the depth only applies to those) gets the same three panels over task × context
length instead, each cell the task's accuracy at that length.

Source of the layout: the needle-in-a-haystack pressure test (G. Kamradt, 2023) and RULER (Hsieh et al. 2024,
arXiv 2404.06654); the plotting plumbing is :mod:`attnpatch.evals.run.plots`.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..run.plots import pyplot, save_figure

__all__ = ["is_niah", "niah_grids", "task_grid", "plot_niah_heatmap"]

#: The result keys drawn per cell: ``<name>_acc`` / ``<name>_score`` (the patched one only when the run patched).
_SCORES = ("dense", "patched")


def is_niah(task: str) -> bool:
    """Whether ``task`` is a needle-in-a-haystack task (its samples have a needle depth)."""
    return task.startswith("niah_")


def _patched(cells: Sequence[dict[str, Any]]) -> bool:
    return any("patched_acc" in c for c in cells)


def _grid(rows: list, cols: list[int], values: dict[tuple[Any, int], list[float]]) -> tuple[np.ndarray, np.ndarray]:
    mean = np.full((len(rows), len(cols)), np.nan)
    n = np.zeros((len(rows), len(cols)), dtype=int)
    for (r, c), xs in values.items():
        i, j = rows.index(r), cols.index(c)
        mean[i, j], n[i, j] = sum(xs) / len(xs), len(xs)
    return mean, n


def niah_grids(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Bin each NIAH task's samples of a :func:`~attnpatch.evals.ruler.run_ruler` result by context length and needle depth.

    Args:
        result: ``{"cells": [...]}``, each cell with ``task``, ``length`` and ``samples`` (``depth``,
            ``dense_score`` and, in a patched run, ``patched_score``).

    Returns:
        Per NIAH task (in the run's order): ``{"depths": [...], "lengths": [...], "dense", "patched", "diff", "n"}``:
        the distinct depths (fractions in [0, 1], ascending) and lengths (tokens, ascending), and arrays of shape
        ``(len(depths), len(lengths))``: the mean dense and patched scores (in [0, 1]; NaN where no sample
        falls), ``patched - dense``, and the sample counts.  ``patched`` and ``diff`` are ``None`` in a
        baseline-only run.
    """
    cells = [c for c in result.get("cells") or [] if is_niah(c["task"])]
    patched = _patched(cells)
    out: dict[str, dict[str, Any]] = {}
    for task in dict.fromkeys(c["task"] for c in cells):
        rows = [(c["length"], s) for c in cells if c["task"] == task for s in c.get("samples") or [] if s.get("depth") is not None]
        depths = sorted({round(float(s["depth"]), 6) for _, s in rows})
        lengths = sorted({int(length) for length, _ in rows})
        binned: dict[str, dict[tuple[float, int], list[float]]] = {"dense": {}, "patched": {}}
        for length, s in rows:
            for name in _SCORES if patched else _SCORES[:1]:
                binned[name].setdefault((round(float(s["depth"]), 6), int(length)), []).append(float(s[f"{name}_score"]))
        dense, n = _grid(depths, lengths, binned["dense"])
        grid: dict[str, Any] = {"depths": depths, "lengths": lengths, "dense": dense, "patched": None, "diff": None, "n": n}
        if patched:
            grid["patched"] = _grid(depths, lengths, binned["patched"])[0]
            grid["diff"] = grid["patched"] - dense
        out[task] = grid
    return out


def task_grid(result: dict[str, Any]) -> dict[str, Any] | None:
    """The accuracy of every task of a RULER result per context length, for a run without a NIAH task.

    Returns:
        ``{"tasks": [...], "lengths": [...], "dense", "patched", "diff", "n"}``: the tasks in the run's order, the
        lengths ascending, and arrays of shape ``(len(tasks), len(lengths))`` of the cells' ``dense_acc``,
        ``patched_acc`` (``None`` in a baseline-only run), their difference and the cells' ``n``; ``None`` when the
        result has no cell.
    """
    cells = list(result.get("cells") or [])
    if not cells:
        return None
    tasks = list(dict.fromkeys(c["task"] for c in cells))
    lengths = sorted({int(c["length"]) for c in cells})
    patched = _patched(cells)
    grid: dict[str, Any] = {"tasks": tasks, "lengths": lengths, "patched": None, "diff": None}
    for name in _SCORES if patched else _SCORES[:1]:
        values = {(c["task"], int(c["length"])): [float(c[f"{name}_acc"])] for c in cells if c.get(f"{name}_acc") is not None}
        grid[name] = _grid(tasks, lengths, values)[0]
    grid["n"] = np.zeros((len(tasks), len(lengths)), dtype=int)
    for c in cells:
        grid["n"][tasks.index(c["task"]), lengths.index(int(c["length"]))] = int(c["n"])
    if patched:
        grid["diff"] = grid["patched"] - grid["dense"]
    return grid


def _panel(fig, ax, values: np.ndarray, rows: list[str], cols: list[int], *, diff: bool, title: str, ylabel: str) -> None:
    """One heatmap panel: ``values`` (rows × cols, in [0, 1] or, with ``diff``, [-1, 1]) in percent, annotated."""
    from matplotlib import colormaps
    from matplotlib.colors import Normalize

    cmap = colormaps["RdBu" if diff else "RdYlGn"].with_extremes(bad="0.85")
    norm = Normalize(-100, 100) if diff else Normalize(0, 100)
    pct = 100 * values
    im = ax.imshow(np.ma.masked_invalid(pct), cmap=cmap, norm=norm, aspect="auto", interpolation="nearest")
    small = max(len(rows), len(cols)) > 8
    for i in range(pct.shape[0]):
        for j in range(pct.shape[1]):
            v = pct[i, j]
            if np.isnan(v):
                ax.text(j, i, "–", ha="center", va="center", fontsize=8, color="0.4")
                continue
            r, g, b, _ = cmap(norm(v))
            ink = "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.5 else "white"
            text = ("0" if round(v) == 0 else f"{v:+.0f}") if diff else f"{v:.0f}"
            ax.text(j, i, text, ha="center", va="center",
                    fontsize=7 if small else 9, color=ink)
    ax.set_xticks(range(len(cols)), [str(c) for c in cols], fontsize=8)
    ax.set_yticks(range(len(rows)), rows, fontsize=8)
    ax.set_xlabel("context length (tokens)", fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.set_title(title, fontsize=9)
    bar = fig.colorbar(im, ax=ax, fraction=0.046, pad=0.03)
    bar.set_label("patched − dense (points)" if diff else "accuracy (%)", fontsize=7)
    bar.ax.tick_params(labelsize=7)


def _counts(n: np.ndarray) -> str:
    got = n[n > 0]
    if not got.size:
        return "no samples"
    lo, hi = int(got.min()), int(got.max())
    return f"n = {lo} per cell" if lo == hi else f"n = {lo}–{hi} per cell"


def plot_niah_heatmap(result: dict[str, Any], path: str | Path, title: str = "") -> Path | None:
    """Draw the needle-in-a-haystack heatmap of a :func:`~attnpatch.evals.ruler.run_ruler` result to a PNG.

    One row of panels per NIAH task (:func:`niah_grids`): dense, patched and patched − dense, over context length
    (tokens, x) × needle depth (% of the haystack before the needle, y), colour and annotation the accuracy in
    percent (the difference in points); the run's other tasks (no needle depth) get a last row of task × context
    length (:func:`task_grid`), and a run without a NIAH task draws that alone.  An interrupted run's partial result draws its finished cells.

    Args:
        result: the result (``"cells"`` with per-sample ``depth`` and scores).
        path: the PNG to write (its folder is created).
        title: the figure's title (e.g. the table's), wrapped to the figure's width.

    Returns:
        ``path`` as a :class:`~pathlib.Path`, or ``None`` when the result has no cell to draw.
    """
    grids = niah_grids(result)
    if grids:
        rows = [(task, g, [f"{100 * d:g}%" for d in g["depths"]], "needle depth") for task, g in grids.items()]
        others = task_grid({"cells": [c for c in result.get("cells") or [] if c["task"] not in grids]})
        if others is not None:  # the tasks without a needle depth: a last row of task × length, not left out
            rows.append(("other tasks", others, list(others["tasks"]), "task"))
    else:
        g = task_grid(result)
        if g is None:
            return None
        rows = [("accuracy per task", g, list(g["tasks"]), "task")]
    patched = rows[0][1]["patched"] is not None
    ncols = 3 if patched else 1
    plt = pyplot()
    heights = [max(2.4, 0.42 * len(labels) + 1.3) for _, _, labels, _ in rows]
    width = max(4.6, 0.75 * max(len(g["lengths"]) for _, g, _, _ in rows) + 2.8)
    fig, axes = plt.subplots(len(rows), ncols, figsize=(width * ncols, sum(heights) + 0.8), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for (task, g, labels, ylabel), line in zip(rows, axes):
        counts = _counts(g["n"])
        _panel(fig, line[0], g["dense"], labels, g["lengths"], diff=False, title=f"{task}: dense ({counts})", ylabel=ylabel)
        if patched:
            _panel(fig, line[1], g["patched"], labels, g["lengths"], diff=False, title=f"{task}: patched", ylabel=ylabel)
            _panel(fig, line[2], g["diff"], labels, g["lengths"], diff=True, title=f"{task}: patched − dense", ylabel=ylabel)
    if title:
        fig.suptitle("\n".join(textwrap.wrap(title, int(14 * width * ncols))), fontsize=10)
    return save_figure(fig, path)
