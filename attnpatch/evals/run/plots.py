"""What every eval's plot shares: headless matplotlib, the default PNG path next to the result JSON, saving.

Each eval draws its own figure (its module knows its result); this module only keeps the plumbing in
one place so every ``--plot PATH`` behaves the same:

* :func:`pyplot` selects matplotlib's headless ``Agg`` backend before ``pyplot`` is imported, so a plot
  never needs a display;
* :func:`plot_path` is ``--plot`` when given, else the result JSON's path with ``.png`` (next to it);
* :func:`save_figure` creates the folder, writes the PNG and closes the figure.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...errors import AttnpatchError

__all__ = ["pyplot", "plot_path", "check_plot_path", "save_figure"]


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
