"""Plots of :func:`~attnpatch.evals.bench.bench_attention`'s result."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["plot_attention"]


def plot_attention(result: dict[str, Any], path: str | Path, title: str = "") -> list[Path]:
    """Two PNGs from :func:`bench_attention`'s result: time vs N (log-log) and speed-up over SDPA vs N.

    Returns the written paths (``<stem>_time.png``, ``<stem>_speedup.png``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = result["rows"]
    labels = list(dict.fromkeys(r["method"] for r in rows))
    exps = result.get("exponents", {})
    series = result.get("plot_series", {})

    colour = {lab: f"C{i}" for i, lab in enumerate(labels)}  # one colour per method in both plots

    def save(fig, ax, ylabel: str, default_title: str, suffix: str) -> Path:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("N (tokens)")
        ax.set_ylabel(ylabel)
        ax.set_title(title or default_title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        p = path.with_name(path.stem + suffix)
        fig.savefig(p, dpi=110)
        plt.close(fig)
        return p

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for lab in labels:
        sel = [r for r in rows if r["method"] == lab]
        e = exps.get(lab)
        ax.plot([r["N"] for r in sel], [r["seconds"] for r in sel], "o-", color=colour[lab], label=f"{lab} (slope {e:.2f})" if e else lab)
        for part, legend in series.get(lab, {}).items():  # the parts the method's bench asks to draw
            e2 = exps.get(f"{lab} [{part}]")
            ax.plot([r["N"] for r in sel], [r[f"{part}_seconds"] for r in sel], "x--", color=colour[lab],
                    label=f"{legend} (slope {e2:.2f})" if e2 else legend)
    ax.set_yscale("log")
    out = [save(fig, ax, "seconds (median)", "attention time vs N", "_time.png")]
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for lab in labels:
        if lab != "sdpa":
            sel = [r for r in rows if r["method"] == lab]
            ax.plot([r["N"] for r in sel], [r["speedup"] for r in sel], "o-", color=colour[lab], label=lab)
    ax.axhline(1.0, color="k", lw=0.8)
    out.append(save(fig, ax, "speed-up over SDPA (x)", "speed-up vs N", "_speedup.png"))
    return out
