"""The table and the plot of :mod:`attnpatch.evals.generate`: one row per setting (dense first), and token agreement /
exact match against the time-to-first-token speed-up."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..run.plots import figure_title, pyplot, save_figure
from ..run.report import Column

__all__ = ["generate_rows", "GENERATE_COLUMNS", "plot_generate"]

GENERATE_COLUMNS = [
    Column("setting", "setting"), Column("token_agreement", "token agreement", "pct"),
    Column("exact_match", "exact match", "pct"), Column("first_divergence", "first divergence (per prompt)"),
    Column("ttft_s_median", "TTFT (median)", "s"), Column("ttft_speedup", "TTFT speed-up", "x"),
    Column("decode_tokens_per_s_median", "decode tok/s"), Column("modes", "prefill ran"),
]


def _setting(run: dict[str, Any]) -> str:
    """``method (options)``; a per-tower setting ``vision=fna (s=32) + text=anchor_attention``."""
    def one(name: str, given: dict[str, Any]) -> str:
        opts = ", ".join(f"{k}={v}" for k, v in given.items())
        return name + (f" ({opts})" if opts else "")

    per = run.get("per_tower")
    if per:
        return " + ".join(f"{t}={one(m, run['shown_options'].get(t, {}))}" for t, m in per.items())
    return one(run["method"], run["shown_options"])


def generate_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Dense's row, then one per setting (options as given; ``-`` where a prompt never diverged)."""
    d = result["dense"]
    rows = [{"setting": "dense", "token_agreement": 1.0, "exact_match": 1.0, "first_divergence": "-",
             "ttft_s_median": d["ttft_s_median"], "ttft_speedup": 1.0,
             "decode_tokens_per_s_median": _tps(d["decode_tokens_per_s_median"]), "modes": "-"}]
    for r in result["runs"]:
        rows.append({"setting": _setting(r), "token_agreement": r["token_agreement"],
                     "exact_match": r["exact_match"],
                     "first_divergence": ", ".join("-" if x is None else str(x) for x in r["first_divergence"]),
                     "ttft_s_median": r["ttft_s_median"], "ttft_speedup": r["ttft_speedup"],
                     "decode_tokens_per_s_median": _tps(r["decode_tokens_per_s_median"]), "modes": ", ".join(r["modes"])})
    return rows


def _tps(x) -> str:
    return "-" if x is None else f"{x:.1f}"


def plot_generate(result: dict[str, Any], path: str | Path, title: str = "") -> Path | None:
    """Token agreement and exact match (y) against the time-to-first-token speed-up (x), one point per setting, dense
    a star at (1, 1); ``None`` when there is no setting."""
    if not result["runs"]:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    try:
        ax.scatter([1.0], [1.0], marker="*", s=140, color="black", label="dense", zorder=3)
        for r in result["runs"]:
            x = r["ttft_speedup"] or 0.0
            ax.scatter([x], [r["token_agreement"]], color="tab:blue", zorder=2)
            ax.scatter([x], [r["exact_match"]], marker="x", color="tab:orange", zorder=2)
            ax.annotate(r["method"], (x, r["token_agreement"]), textcoords="offset points", xytext=(5, 5), fontsize=7)
        ax.scatter([], [], color="tab:blue", label="token agreement")
        ax.scatter([], [], marker="x", color="tab:orange", label="exact match")
        ax.set_xlabel("time to first token: speed-up over dense (x)")
        ax.set_ylabel("agreement with dense's greedy generation")
        ax.set_ylim(-0.05, 1.05)
        ax.axvline(1.0, color="grey", lw=0.6, ls="--")
        ax.legend(loc="lower left", fontsize=8)
        ax.grid(alpha=0.3)
        ax.set_title(figure_title(title or "generation agreement", 80), fontsize=9)
        return save_figure(fig, path)
    finally:
        plt.close(fig)
