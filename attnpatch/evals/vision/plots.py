"""The PNG of a frozen-feature eval (``attnpatch eval fidelity|knn|linear-probe|retrieval``).

:func:`plot_feature_eval` draws, from :func:`attnpatch.evals.vision.run_feature_eval`'s result:

* ``knn``, ``linear-probe``, ``retrieval``: the eval's headline metric (:data:`HEADLINE`) against the speed-up over
  dense, one point per setting, dense at 1.0 with a dashed line at its value (the linear probe with the standard
  deviation over its folds as error bars);
* ``fidelity``: two panels, (a) the final-CLS cosine to dense against the speed-up, (b) per layer the relative
  Frobenius error of the attention output (``layer_error_teacher``, solid, and ``layer_error_free``, dashed), one
  colour per setting.

:func:`headline_points` and :func:`layer_error_curves` return what is drawn, so it can be checked without pixels.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..run.plots import Point, draw_vs_speedup, figure_title, pyplot, save_figure, setting_colour, setting_label, setting_points

__all__ = ["HEADLINE", "headline_points", "layer_error_curves", "plot_feature_eval"]

#: task -> (result key of the headline metric, axis label, in percent, key of its error bar or None)
HEADLINE: dict[str, tuple[str, str, bool, str | None]] = {
    "fidelity": ("cls_cosine", "final-CLS cosine to dense (mean over images)", False, None),
    "knn": ("knn_top1", "k-NN top-1 accuracy", True, None),
    "linear_probe": ("linear_probe", "linear-probe accuracy (mean ± std over folds)", True, "linear_probe_std"),
    "retrieval": ("map_at_r", "image retrieval mAP@R", False, None),
}


def _task(result: dict[str, Any]) -> str:
    """The result's eval as a :data:`HEADLINE` key: ``result["eval"]`` (CLI name) or its ``tasks``."""
    name = str(result.get("eval") or "").replace("-", "_")
    if name in HEADLINE:
        return name
    tasks = result.get("tasks") or []
    return "fidelity" if "fidelity" in tasks else next((t for t in tasks if t in HEADLINE), "knn")


def headline_points(result: dict[str, Any], task: str | None = None) -> list[Point]:
    """Dense and each setting of ``result`` as (speed-up, headline metric) points of ``task`` (default: the result's).

    Fidelity's cosine is measured against dense, so dense's value is 1.0 by definition.
    """
    task = task or _task(result)
    key, _, _, err = HEADLINE[task]
    return setting_points(result, key, err_key=err, dense_value=1.0 if task == "fidelity" else None)


def layer_error_curves(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One entry per setting of a fidelity result: ``{"label", "teacher": [error per layer], "free": [error or None
    per layer], "index"}`` (``index``: the setting's place among the runs, its colour).  A setting without per-layer
    errors (a token-merging method, or ``--layer-error-images 0``) has empty lists."""
    return [{"label": setting_label(r), "teacher": list(r.get("layer_error_teacher") or []),
             "free": list(r.get("layer_error_free") or []), "index": i} for i, r in enumerate(result.get("runs") or [])]


def _draw_layer_errors(ax, curves: list[dict[str, Any]]) -> None:
    missing = []
    positive = []
    for c in curves:
        if not c["teacher"]:
            missing.append(c["label"])
            continue
        colour = setting_colour(c["index"])
        ax.plot(range(len(c["teacher"])), c["teacher"], "o-", color=colour, ms=3, lw=1.2, label=f"{c['label']} teacher-forced")
        free = [(i, e) for i, e in enumerate(c["free"]) if e is not None]
        if free:
            ax.plot([i for i, _ in free], [e for _, e in free], "s--", color=colour, ms=3, lw=1.0, alpha=0.8,
                    label=f"{c['label']} free-running")
        positive += [e for e in c["teacher"] + [e for _, e in free] if e > 0]
    if positive and max(positive) / min(positive) > 100:
        ax.set_yscale("log")  # errors over several decades; an exact layer (error 0) is then not drawn
        ax.text(0.99, 0.01, "log scale: exact layers (error 0) not drawn", transform=ax.transAxes, fontsize=7, ha="right",
                va="bottom", color="0.3")
    if missing:
        ax.text(0.01, 0.99, "no per-layer errors: " + ", ".join(missing) + "\n(a token-merging method, or --layer-error-images 0)",
                transform=ax.transAxes, fontsize=7, ha="left", va="top", color="0.25",
                bbox=dict(boxstyle="round", fc="white", ec="0.8", alpha=0.9))
    ax.set_xlabel("layer")
    ax.set_ylabel("relative error of the attention output\n‖H_patched − H_exact‖_F / ‖H_exact‖_F")
    ax.set_title("(b) per-layer error (solid: teacher-forced, dashed: free-running)", fontsize=9)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="best", fontsize=6)
    ax.xaxis.get_major_locator().set_params(integer=True)


def plot_feature_eval(result: dict[str, Any], path: str | Path, title: str = "") -> Path | None:
    """Write the PNG of a frozen-feature eval result to ``path`` (see the module docstring).

    Args:
        result: :func:`attnpatch.evals.vision.run_feature_eval`'s result, with ``"eval"`` (the CLI name) or ``"tasks"``;
            a partial result of an interrupted run is drawn as it is.
        path: the ``.png`` file to write (its folder is created).
        title: the figure's title (e.g. the table's title).

    Returns:
        ``path``, or ``None`` when the result holds no setting to draw (nothing is written then).
    """
    if not result or "dense" not in result:
        return None
    plt = pyplot()
    task = _task(result)
    key, ylabel, percent, _ = HEADLINE[task]
    pts = headline_points(result, task)
    if task == "fidelity":
        fig, (a, b) = plt.subplots(1, 2, figsize=(13, 5.2))
        draw_vs_speedup(a, pts, ylabel, percent=percent, reference_label="dense (1.0 by definition)",
                        title="(a) fidelity vs speed-up")
        _draw_layer_errors(b, layer_error_curves(result))
    else:
        fig, a = plt.subplots(figsize=(7.5, 5.2))
        draw_vs_speedup(a, pts, ylabel, percent=percent, title=f"{ylabel.split(' (')[0]} vs speed-up")
    if title:
        fig.suptitle(figure_title(title, 120 if task == "fidelity" else 90), fontsize=9)
    return save_figure(fig, path)
