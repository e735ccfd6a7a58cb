"""The PNG of a CLIP eval (``attnpatch eval zeroshot|clip-retrieval``).

:func:`plot_clip_eval` draws, from :func:`attnpatch.evals.clip.run_zeroshot_eval` /
:func:`~attnpatch.evals.clip.run_retrieval_eval`'s result, the headline metric against the speed-up over dense,
one point per setting, dense at 1.0 with a dashed line at its value and chance (the expected score of a random
ranking, the result's ``"chance"``) as a dotted line:

* ``zeroshot``: top-1 accuracy;
* ``clip-retrieval``: two panels, text→image and image→text recall at the smallest cut-off of ``"ks"``.

:func:`clip_panels` returns what is drawn, so it can be checked without pixels.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..run.plots import Point, draw_vs_speedup, figure_title, pyplot, save_figure, setting_points

__all__ = ["clip_panels", "plot_clip_eval"]


def _is_retrieval(result: dict[str, Any]) -> bool:
    return any(str(k).startswith("t2i_recall@") for k in result.get("dense") or {})


def clip_panels(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The panels of a CLIP result: ``[{"key", "label", "points" (:class:`~attnpatch.evals.run.plots.Point`, dense
    first), "chance" (or None)}]``: one (top-1) for zero-shot, two (text→image and image→text recall@k, k the
    smallest cut-off) for retrieval."""
    if _is_retrieval(result):
        k = min(result.get("ks") or [int(str(k).split("@")[1]) for k in result["dense"] if str(k).startswith("t2i_recall@")])
        keys = [(f"t2i_recall@{k}", f"text→image recall@{k}"), (f"i2t_recall@{k}", f"image→text recall@{k}")]
    else:
        keys = [("top1", "zero-shot top-1 accuracy")]
    chance = result.get("chance") or {}
    return [{"key": key, "label": label, "points": setting_points(result, key), "chance": chance.get(key)} for key, label in keys]


def _towers_note(result: dict[str, Any], pts: list[Point]) -> list[Point]:
    """Points relabelled with the towers a setting routes when it is not the image tower alone (as the table does)."""
    out = [pts[0]]
    for p, run in zip(pts[1:], result.get("runs") or []):
        towers = run.get("towers")
        label = p.label + (f" [towers: {', '.join(towers)}]" if towers and list(towers) != ["vision"] else "")
        out.append(Point(label, p.speedup, p.value, p.dense, p.chosen, p.err, p.why))
    return out


def plot_clip_eval(result: dict[str, Any], path: str | Path, title: str = "") -> Path | None:
    """Write the PNG of a CLIP eval result to ``path`` (see the module docstring).

    Args:
        result: a CLIP runner's result (a partial result of an interrupted run is drawn as it is).
        path: the ``.png`` file to write (its folder is created).
        title: the figure's title (e.g. the table's title).

    Returns:
        ``path``, or ``None`` when the result holds nothing to draw (nothing is written then).
    """
    if not result or "dense" not in result:
        return None
    plt = pyplot()
    panels = clip_panels(result)
    fig, axes = plt.subplots(1, len(panels), figsize=(7.5 * len(panels), 5.2), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        lines = [(panel["chance"], "chance")] if panel["chance"] is not None else []
        draw_vs_speedup(ax, _towers_note(result, panel["points"]), panel["label"], percent=True, lines=lines,
                        title=f"{panel['label']} vs speed-up")
    if title:
        fig.suptitle(figure_title(title, 90 * len(panels)), fontsize=9)
    return save_figure(fig, path)
