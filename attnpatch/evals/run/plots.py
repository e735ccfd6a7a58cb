"""What every eval's plot shares: headless matplotlib, the default PNG path next to the result JSON, saving.

Each eval draws its own figure (its module knows its result); this module only keeps the plumbing in
one place so every ``--plot PATH`` behaves the same:

* :func:`pyplot` selects matplotlib's headless ``Agg`` backend before ``pyplot`` is imported, so a plot
  never needs a display;
* :func:`plot_path` is ``--plot`` when given, else the result JSON's path with ``.png`` (next to it);
* :func:`save_figure` creates the folder, writes the PNG and closes the figure;
* :class:`Point`, :func:`setting_label`, :func:`setting_points` and :func:`draw_vs_speedup`: the panel several
  evals share, their headline metric against the speed-up over dense, one labelled point per setting, dense at
  speed-up 1.0 with a dashed line at its value (settings without a time are listed on the panel, not placed).
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import AttnpatchError

__all__ = ["pyplot", "plot_path", "check_plot_path", "save_figure", "Point", "as_number", "setting_label", "setting_points",
           "draw_vs_speedup", "setting_colour", "figure_title", "SPEEDUP_LABEL"]

#: The x axis of every metric-vs-speed-up panel.
SPEEDUP_LABEL = "speed-up over dense (×)"


def pyplot():
    """``matplotlib.pyplot`` on the headless ``Agg`` backend (set before the first pyplot import)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def check_plot_path(path: str | Path) -> Path:
    """``path`` as a :class:`~pathlib.Path` when it names a ``.png`` file.

    Raises:
        AttnpatchError: ``path`` does not end in ``.png`` (one line naming it).
    """
    p = Path(path)
    if p.suffix.lower() != ".png":
        raise AttnpatchError(f"--plot {path}: give a .png path")
    return p


def plot_path(json_path: str | Path, plot: str | Path | None = None) -> Path:
    """The PNG an eval writes: ``plot`` (``--plot``) when given, else ``json_path`` with its suffix replaced by ``.png``.

    Raises:
        AttnpatchError: ``plot`` given without a ``.png`` suffix.
    """
    if plot is not None:
        return check_plot_path(plot)
    return Path(json_path).with_suffix(".png")


def save_figure(fig: Any, path: str | Path, dpi: int = 110) -> Path:
    """Write ``fig`` as a PNG to ``path`` (creating its folder), close it and return the path."""
    plt = pyplot()
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(p, dpi=dpi)
    plt.close(fig)
    return p


@dataclass(frozen=True)
class Point:
    """One setting on a metric-vs-speed-up panel.

    Attributes:
        label: the setting as the table names it (e.g. ``"fna (s=64)"``, ``"dense"``).
        speedup: dense seconds / the setting's seconds (dense: 1.0); ``None`` when the result holds no time for it.
        value: the metric; ``None`` when the result holds none (e.g. an interrupted run's metrics on too few images).
        dense: the dense reference (drawn as a black star).
        chosen: the setting a search chose (``tune``; drawn with a red ring).
        err: a symmetric error bar on ``value`` (e.g. the standard deviation over cross-validation folds), or ``None``.
        why: why the point has no speed-up (e.g. ``"not timed: misses the target"``), for the panel's note.
    """

    label: str
    speedup: float | None
    value: float | None
    dense: bool = False
    chosen: bool = False
    err: float | None = None
    why: str | None = None


def setting_label(row: dict[str, Any]) -> str:
    """A result row's setting as the eval tables name it: ``method (opt=value, ...)``, with the options the user
    gave (``shown_options``, else ``options``), and `` [exact attention]`` when the row's ``"note"`` says every
    patched layer ran exact attention (its speed-up is then no approximation's)."""
    opts = row.get("shown_options", row.get("options")) or {}
    shown = ", ".join(f"{k}={v}" for k, v in opts.items())
    exact = str(row.get("note") or "").startswith("exact attention")  # every patched layer ran exact: say so
    return f"{row.get('method', '?')}" + (f" ({shown})" if shown else "") + (" [exact attention]" if exact else "")


def as_number(v: Any) -> float | None:
    """``v`` as a float when it is a number (not a bool, not NaN, e.g. CLIP_benchmark's ``acc5`` under 5 classes),
    else ``None``: a value a panel can place."""
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and v == v
    return float(v) if ok else None


def setting_points(result: dict[str, Any], key: str, err_key: str | None = None, dense_value: float | None = None) -> list[Point]:
    """Dense and each setting of an image eval's result (``{"dense": {...}, "runs": [{...}]}``) as points of metric
    ``key`` against ``"speedup"``.

    Dense comes first, at speed-up 1.0 when the result timed it (``"seconds"``), with ``result["dense"][key]`` or
    ``dense_value`` (for a metric measured against dense, e.g. a cosine to dense: 1.0).  ``err_key`` names a
    per-row error bar (e.g. ``"linear_probe_std"``).
    """
    d = result.get("dense") or {}
    timed = bool(d.get("seconds"))
    value = as_number(d.get(key)) if d.get(key) is not None else dense_value
    pts = [Point("dense", 1.0 if timed else None, value, dense=True, err=as_number(d.get(err_key)) if err_key else None)]
    for r in result.get("runs") or []:
        pts.append(Point(setting_label(r), as_number(r.get("speedup")), as_number(r.get(key)), err=as_number(r.get(err_key)) if err_key else None))
    return pts


def setting_colour(i: int) -> str:
    """The colour of the ``i``-th non-dense setting, the same in every panel of a figure (matplotlib's cycle)."""
    return f"C{i % 10}"


def figure_title(title: str, width: int = 100) -> str:
    """``title`` wrapped to lines of at most ``width`` characters (a long eval title on a figure)."""
    return "\n".join(textwrap.wrap(title, width)) if title else ""


def _label_offsets(placed: Sequence[Point]) -> dict[int, tuple[int, int]]:
    """Label offsets (points) by ``id(point)``: above right, or further up (then below) when the label of a
    point just to its left would run into it (its text's width, at the panel's spans, as the x distance; a tenth of
    the y span as the y distance)."""
    if not placed:
        return {}
    xs, ys = [p.speedup for p in placed] + [1.0], [p.value for p in placed]
    xspan = max(max(xs) - min(xs), 1e-9) * 1.45  # the panel's x limits (see draw_vs_speedup)
    yspan = max(max(ys) - min(ys), 1e-4 * max(abs(y) for y in ys), 1e-9)
    out: dict[int, tuple[int, int]] = {}
    done: list[tuple[Point, tuple[int, int]]] = []
    for p in sorted(placed, key=lambda p: (p.speedup, p.value)):
        near = {o for q, o in done
                if 0 <= p.speedup - q.speedup < (0.008 * len(q.label) + 0.03) * xspan and abs(p.value - q.value) < 0.1 * yspan}
        out[id(p)] = next((c for c in ((6, 5), (6, 15), (6, -12), (6, 25)) if c not in near), (6, 5))
        done.append((p, out[id(p)]))
    return out


def draw_vs_speedup(
    ax: Any,
    points: Sequence[Point],
    ylabel: str,
    *,
    percent: bool = False,
    reference: float | None = None,
    reference_label: str | None = None,
    lines: Sequence[tuple[float, str]] = (),
    title: str | None = None,
    xlabel: str = SPEEDUP_LABEL,
) -> list[Point]:
    """Draw ``points`` on ``ax``: metric (y) against the speed-up over dense (x), one labelled point per setting.

    Dense is a black star at speed-up 1.0 and, unless ``reference`` is given, its value is the dashed horizontal
    line (``reference``/``reference_label`` replace it, e.g. a search's target); ``lines`` are more dotted horizontal
    lines ``(y, label)`` (e.g. chance).  A dotted vertical line marks speed-up 1.0.  A point without a speed-up or
    without a value is not placed: the panel lists it in a note (and says when nothing was timed at all).
    ``percent`` shows the y axis in percent of 1.0; ``xlabel`` names the x axis (default :data:`SPEEDUP_LABEL`).

    Returns:
        The points placed (with both a speed-up and a value), in the order given.
    """
    from matplotlib.ticker import PercentFormatter

    placed = [p for p in points if p.speedup is not None and p.value is not None]
    dense = next((p for p in points if p.dense), None)
    ref, ref_label = reference, reference_label
    if ref is None and dense is not None and dense.value is not None:
        ref, ref_label = dense.value, reference_label or "dense"
    if ref is not None:
        ax.axhline(ref, color="black", lw=0.9, ls="--", label=ref_label, zorder=1)
    for i, (y, label) in enumerate(lines):
        ax.axhline(y, color=f"0.{4 + 2 * (i % 3)}", lw=0.9, ls=":", label=label, zorder=1)
    ax.axvline(1.0, color="grey", lw=0.6, ls=":", zorder=0)
    offsets = _label_offsets(placed)
    colour = 0
    for p in points:
        c = "black" if p.dense else setting_colour(colour)
        colour += 0 if p.dense else 1
        if p not in placed:
            continue
        if p.err is not None:
            ax.errorbar([p.speedup], [p.value], yerr=[p.err], fmt="none", ecolor=c, elinewidth=1, capsize=3, zorder=2)
        ax.scatter([p.speedup], [p.value], marker="*" if p.dense else "o", s=160 if p.dense else 45, color=c, zorder=3,
                   edgecolors="white", linewidths=0.5, clip_on=False)  # whole on an axis limit (0 % or 100 %)
        if p.chosen:
            ax.scatter([p.speedup], [p.value], marker="o", s=260, facecolors="none", edgecolors="tab:red", linewidths=1.8,
                       zorder=4, label="chosen")
        ax.annotate(p.label + ("  (chosen)" if p.chosen else ""), (p.speedup, p.value), textcoords="offset points",
                    xytext=offsets.get(id(p), (6, 5)), fontsize=7, color=c)
    notes = []
    if not any(p.speedup is not None for p in points):
        notes.append("no timing in this result: nothing to place on the speed-up axis")
    for p in points:
        if p.value is None:
            notes.append(f"{p.label}: no value")
        elif p.speedup is None:
            shown = f"{100 * p.value:.1f}%" if percent else f"{p.value:.4g}"
            notes.append(f"{p.label}: {p.why or 'not timed'} ({shown})")
    if len(notes) > 8:
        notes = notes[:7] + [f"... and {len(notes) - 7} more"]
    if notes:
        ax.text(0.01, 0.01, "\n".join(notes), transform=ax.transAxes, fontsize=7, va="bottom", ha="left", color="0.25",
                bbox=dict(boxstyle="round", fc="white", ec="0.8", alpha=0.9), zorder=5)
    if placed:
        xs = [p.speedup for p in placed] + [1.0]
        lo, hi = min(xs), max(xs)
        pad = max(0.05, 0.15 * (hi - lo))
        ax.set_xlim(lo - pad, hi + 2.5 * pad)  # room on the right for the labels
    ys = [p.value for p in placed] + [y for y in [ref, *(y for y, _ in lines)] if y is not None]
    ys += [p.value + sgn * p.err for p in placed if p.err is not None for sgn in (-1, 1)]
    if ys:
        lo, hi = min(ys), max(ys)
        span = 0.02 if percent else max(0.01 * max(abs(lo), abs(hi)), 1e-9)  # equal values: a readable axis around them
        if hi - lo < span:
            mid = (lo + hi) / 2
            lo, hi = mid - span / 2, mid + span / 2
        margin = 0.08 * (hi - lo)  # every point and line inside the frame, none on its edge
        ax.set_ylim(lo - margin, hi + margin)
    if percent:  # a fraction: the axis stays within [0, 1]
        lo, hi = ax.get_ylim()
        ax.set_ylim(max(lo, 0.0), min(hi, 1.0))
        ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    else:
        ax.ticklabel_format(axis="y", style="plain", useOffset=False)  # values as they are, no "+1" offset above the axis
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="best", fontsize=7)
    return placed
