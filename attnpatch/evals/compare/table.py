"""The table and the plot of :mod:`attnpatch.evals.compare`: the rows and columns of a compare result
(:func:`compare_rows`, :func:`compare_columns`) and metric vs speed-up with its Pareto front (:func:`plot_pareto`)."""

from __future__ import annotations

import re
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..run.plots import figure_title
from ..run.report import Column

__all__ = ["compare_rows", "compare_columns", "pareto_front", "front_of", "plot_pareto", "speedup_text"]


def _fmt_value(v: Any) -> str:
    if isinstance(v, (tuple, list)):  # a per-layer schedule, as it is written: 0/0/8/8
        return "/".join(str(x) for x in v)
    return f"{v:g}" if isinstance(v, float) else str(v)


def compare_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Table rows of a compare result (dense first): the result's rows with text columns for options and match."""
    out = []
    for r in result["rows"]:
        row = dict(r)
        row["options_text"] = ", ".join(f"{k}={_fmt_value(v)}" for k, v in r.get("shown_options", {}).items())
        if r.get("note"):
            row["options_text"] += f" [{r['note']}]"
        mi = r.get("match")
        if mi is None:
            row["match_text"] = ""
        elif mi["status"] in ("matched", "closest"):
            key = mi.get("key", "")
            row["match_text"] = f"{key} {mi['reached']:.3g}" + (" (closest)" if mi["status"] == "closest" else "")
            if key == "speedup" and mi.get("run_speedup") is not None:
                row["match_text"] += f" (first batch; run {mi['run_speedup']:.2f}x)"
        elif mi["status"] == "not matched":
            row["match_text"] = "not matched"
        else:
            row["match_text"] = ""
        row["speedup_text"] = speedup_text(r)
        out.append(row)
    return out


def speedup_text(row: dict[str, Any]) -> str:
    """``"1.44x"``, with the run's own spread (the per-batch speed-ups' middle half) when measured:
    ``"1.44x [1.38-1.52]"``, and ``"(within noise)"`` when that range holds 1.00x."""
    s = row.get("speedup")
    if s is None:
        return "-"
    text = f"{s:.2f}x"
    spread = row.get("speedup_spread")
    if spread and not row.get("baseline"):
        text += f" [{spread[0]:.2f}-{spread[1]:.2f}]"
        if row.get("speedup_within_noise"):
            text += " (within noise)"
    return text


def compare_columns(result: dict[str, Any]) -> list[Column]:
    """The table columns of a compare result (metric and fidelity titled after the eval)."""
    cols = [
        Column("method", "method"), Column("options_text", "options"),
        Column("metric", result.get("metric_label", "metric"), "f3" if result.get("metric") == "cls_cosine" else "pct"),
    ]
    if result.get("fidelity") != result.get("metric"):
        cols.append(Column("fidelity", result.get("fidelity_label", "fidelity"), "f3"))
    cols += [Column("sparsity", "sparsity", "pct"), Column("knob_tokens", "landmarks")]
    if result.get("match"):
        cols.append(Column("match_text", "matched"))
    cols += [Column("seconds", "time", "s"), Column("speedup_text", "speed-up [middle half of batches]")]
    return cols


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points not dominated in (x, y), both maximised, sorted by x ascending.

    A point is dominated when another is at least as good in both and better in one.
    """
    idx = []
    for i, (x, y) in enumerate(points):
        dominated = any(
            (x2 >= x and y2 >= y) and (x2 > x or y2 > y) for j, (x2, y2) in enumerate(points) if j != i
        )
        if not dominated:
            idx.append(i)
    return sorted(idx, key=lambda i: (points[i][0], -points[i][1]))


def front_of(rows: Sequence[dict[str, Any]]) -> list[int]:
    """Indices of the compare rows on the Pareto front of (speed-up, metric), by speed-up: rows with both values that
    did not run exact attention everywhere (``"exact"``: such a row approximated nothing; dense, the baseline, counts)."""
    live = [i for i, r in enumerate(rows)
            if r.get("metric") is not None and r.get("speedup") is not None and not r.get("exact")]
    return [live[i] for i in pareto_front([(float(rows[i]["speedup"]), float(rows[i]["metric"])) for i in live])]


def plot_pareto(result: dict[str, Any], path: str | Path, title: str | None = None) -> Path:
    """Draw the eval's metric (y) against the speed-up over dense (x) as a PNG: one labelled point per
    setting, dense marked, and the Pareto front (settings not dominated in (speed-up, metric)) as a step line.

    Rows without a metric or a speed-up are left out.  A row that ran exact attention everywhere (``"exact"``) is
    drawn hollow and grey and is never on the front: it approximated nothing, so its speed-up is the run's noise.
    Returns the path written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in compare_rows(result) if r.get("metric") is not None and r.get("speedup") is not None]
    pts = [(float(r["speedup"]), float(r["metric"])) for r in rows]
    fig, ax = plt.subplots(figsize=(7, 5), dpi=120)
    try:
        front = front_of(rows)
        if front:
            fx, fy = [pts[i][0] for i in front], [pts[i][1] for i in front]
            ax.step(fx, fy, where="pre", color="tab:orange", lw=1.5, label="Pareto front", zorder=1)
            ax.plot(fx, fy, "o", ms=13, mfc="none", mec="tab:orange", mew=1.5, zorder=1)  # visible with a single front point too
        xs_, ys_ = [x for x, _ in pts], [y for _, y in pts]
        xr, yr = (max(xs_) - min(xs_)) or 1.0, (max(ys_) - min(ys_)) or 1.0
        labelled: list[tuple[float, float, tuple[int, int]]] = []
        for (x, y), r in zip(pts, rows):
            dense = bool(r.get("baseline"))
            if r.get("exact"):
                ax.scatter([x], [y], marker="o", s=40, facecolors="none", edgecolors="grey", zorder=2)
            else:
                ax.scatter([x], [y], marker="*" if dense else "o", s=140 if dense else 40,
                           color="black" if dense else "tab:blue", zorder=2)
            label = r["method"] + (f" ({r['options_text']})" if r.get("options_text") else "")
            # the table's "[exact attention: <why>]" mark, short; long labels wrapped so they stay in the panel
            label = textwrap.fill(re.sub(r"\[exact attention[^\]]*\]", "[exact]", label), 30)
            near = {o for x2, y2, o in labelled if abs(x - x2) < 0.12 * xr and abs(y - y2) < 0.06 * yr}
            offset = next((o for o in ((5, 5), (5, -11), (5, 15), (5, -21)) if o not in near), (5, 5))  # close points: stacked
            labelled.append((x, y, offset))
            ax.annotate(label, (x, y), textcoords="offset points", xytext=offset, fontsize=7)
        ax.axvline(1.0, color="grey", lw=0.6, ls="--")
        ax.set_xlabel("speed-up over dense (x)")
        ax.set_ylabel(result.get("metric_label", "metric"))
        m = result.get("match") or []
        matched = ", ".join(f"{x['key']}={x['value']:g}" for x in m)
        ax.set_title(figure_title(title or f"{result.get('eval', '')}" + (f" — matched {matched}" if matched else ""), 80), fontsize=9)
        ax.margins(x=0.3, y=0.15)  # room for the labels right of and above the points
        ax.legend(loc="best", fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(p)
    finally:
        plt.close(fig)
    return p
