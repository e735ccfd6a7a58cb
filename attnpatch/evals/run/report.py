"""Shared reporting: JSON files, Markdown tables and terminal tables of eval results.

The table plumbing lives here (:class:`Column`, :func:`rows_to_markdown`, :func:`print_table`); each eval's own
columns and rows live in its package (``evals/ruler/table.py``, ``evals/vision/table.py``, ``evals/clip/table.py``,
``evals/bench/table.py``, ``evals/lmeval/table.py``, ``evals/compare/table.py``), which import this module, never
the reverse.
"""

from __future__ import annotations

import json
import math
import os
import platform
from pathlib import Path
from typing import Any, Sequence

import torch

from ...patchers.break_even import resolved_break_evens

__all__ = [
    "Column", "rows_to_markdown", "print_table", "write_json", "write_text", "machine_info", "EvalInterrupted", "handback_note",
    "UNPATCHED", "setting_label", "exact_modes",
]


class EvalInterrupted(KeyboardInterrupt):
    """Ctrl-C (a ``KeyboardInterrupt``) during an eval, carrying what was finished before it.

    It is a ``KeyboardInterrupt``, so a caller that does not look for it stops as on any Ctrl-C.

    Attributes:
        partial: the eval's result over the finished part (same layout as its normal return value,
            with ``"interrupted": True``), or ``None`` when nothing was finished.
        done: a short description of what was finished (e.g. ``"2/6 cells"``, ``"48/1000 images"``).
    """

    def __init__(self, partial: dict[str, Any] | None, done: str = ""):
        super().__init__(done)
        self.partial = partial
        self.done = done


class Column:
    """One table column: ``key`` in the row dict, ``title``, and a format (``"pct"``, ``"f3"``, ``"f2"``, ``"s"``,
    ``"ms"`` (seconds shown in ms), ``"mib"`` (bytes shown in MiB), ``"x"``, ``"int"``, ``"str"``)."""

    def __init__(self, key: str, title: str, fmt: str = "str"):
        self.key, self.title, self.fmt = key, title, fmt

    def render(self, value: Any) -> str:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "-"
        if self.fmt == "pct":
            return f"{100 * value:.1f}%"
        if self.fmt == "f3":
            return f"{value:.3f}"
        if self.fmt == "f2":
            return f"{value:.2f}"
        if self.fmt == "s":
            return f"{value:.2f}s"
        if self.fmt == "x":
            return f"{value:.2f}x"
        if self.fmt == "int":
            return f"{int(round(value))}"
        if self.fmt == "ms":
            ms = 1e3 * value
            return f"{ms:.1f}ms" if ms >= 10 else f"{ms:.3g}ms"
        if self.fmt == "mib":
            return f"{value / 2**20:.1f}MiB"
        return str(value)


def _present(columns: Sequence[Column], rows: Sequence[dict[str, Any]]) -> list[Column]:
    return [c for c in columns if any(c.key in r for r in rows)]


def rows_to_markdown(rows: Sequence[dict[str, Any]], columns: Sequence[Column]) -> str:
    """A GitHub Markdown table of ``rows`` (columns absent from every row are dropped)."""
    cols = _present(columns, rows)
    lines = ["| " + " | ".join(c.title for c in cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(c.render(r.get(c.key)) for c in cols) + " |")
    return "\n".join(lines)


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[Column], title: str | None = None) -> None:
    """Print ``rows`` as a rich table on stdout.

    Every text (title, column titles, cells) is printed literally: rich markup such as
    ``[exact attention: s >= N tokens]`` in a setting label is escaped, not interpreted.
    """
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    cols = _present(columns, rows)
    table = Table(title=escape(title) if title is not None else None)
    for c in cols:
        table.add_column(escape(c.title), justify="left" if c.fmt == "str" else "right")
    for r in rows:
        table.add_row(*(escape(c.render(r.get(c.key))) for c in cols))
    Console(width=max(120, 14 * len(cols))).print(table)


def machine_info() -> dict[str, Any]:
    """CPU model, PyTorch's CPU vector capability (``AVX512``, ``AVX2``, ...), logical cores, torch threads,
    torch and transformers versions, Python version."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import transformers

    return {
        "cpu": cpu,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def write_json(path: str | os.PathLike, result: dict[str, Any]) -> Path:
    """Write ``result`` as indented JSON (creating parent folders); returns the path.

    The file is written under a temporary name next to it and renamed into place, so an
    interrupted write never leaves a half-written file (an earlier version stays whole).  A run's result (a dict
    with ``"machine"``) also records under ``"break_even"`` every break-even length this process resolved
    (:func:`attnpatch.patchers.break_even.resolved_break_evens`: value, where it came from, and for what).
    """
    if isinstance(result, dict) and "machine" in result:
        result = {**result, "break_even": resolved_break_evens()}
    return write_text(path, json.dumps(result, indent=2, default=_jsonable))


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` atomically (temporary file + rename, parent folders created); returns the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.partial-{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, p)
    finally:
        tmp.unlink(missing_ok=True)
    return p


def _jsonable(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.tolist()
    if isinstance(x, Path):
        return str(x)
    if isinstance(x, float) and math.isinf(x):
        return "inf" if x > 0 else "-inf"
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


#: The unpatched row's name in the side-by-side evals' tables and file names.
UNPATCHED = "dense"


def setting_label(method: str | None, options: dict[str, Any]) -> str:
    """``dense`` (unpatched), ``fna``, ``fna (s=8, sample_layer=0)``: how the side-by-side evals (``eval lm-eval``,
    ``eval clip-benchmark``) name a setting in tables and file names, with the options as given; the ``dense``
    method (the model's own attention routed through the patch) is ``dense-routed``, apart from the unpatched row."""
    if method is None:
        return UNPATCHED
    opts = ", ".join(f"{k}={v}" for k, v in options.items())
    label = f"{method} ({opts})" if opts else method
    return f"{label}-routed" if label == UNPATCHED else label  # a setting never takes the unpatched row's name


#: Why a patched layer ran the model's own attention, by record mode (``dense:<why>``).
_DENSE_WHY = {
    "dense:short": "the prompt is below the method's minimum length, e.g. anchor_attention's min_len",
    "dense:window>=N": "the local window covers the whole prompt, e.g. a_shape's window",
    "dense:vertical>=N": "every key column is kept (vertical_slash's vertical >= N)",
    "dense:slash>=N": "every diagonal is kept (vertical_slash's slash >= N)",
    "dense:theta=inf": "theta = inf keeps every key",
    "dense:layer": "dense_layers",
    "dense:s>=N": "every token is a landmark (s >= N)",
    "dense:no-sinks": "no sink token was found, so sink_mask masked nothing",
    "dense:r=0": "r = 0: nothing merged (tome)",
    "dense:schedule": "the per-layer schedule leaves the layer exact (0)",
}


def exact_modes(modes: Sequence[str] | str | None) -> list[str]:
    """The record modes of ``modes`` (a list, or the tables' comma-joined text) when every one is a ``dense:<why>``
    mode other than decoding, i.e. the patch ran the model's own attention in every layer; else ``[]``."""
    if isinstance(modes, str):
        modes = [m.strip() for m in modes.split(",")]
    ms = sorted({m for m in modes or [] if m and m != "dense:decode"})
    return ms if ms and all(m.startswith("dense:") for m in ms) else []


def handback_note(entries: Sequence[tuple[str, Sequence[str] | str | None]], total: int, unit: str) -> str | None:
    """The note under a long-context table naming where the patch ran the model's own attention in every layer (every
    record mode ``dense:<why>``: a prompt below the method's minimum length, a window that covers the whole prompt,
    ...), or ``None`` when nowhere.

    Args:
        entries: ``(name, record modes)`` of each patched table entry (e.g. ``("niah_single 1024",
            ["dense:short"])``); the modes as a list or comma-joined.
        total: how many patched entries the table has (all of them handed back: "every <unit>").
        unit: what an entry is called (``"cell"``, ``"row"``).
    """
    back = [(name, exact_modes(modes)) for name, modes in entries]
    back = [(name, ms) for name, ms in back if ms]
    if not back:
        return None
    which = f"every {unit}" if len(back) == total else ", ".join(name for name, _ in back)
    modes = sorted({m for _, ms in back for m in ms})
    why = "; ".join(f"{m}: {_DENSE_WHY.get(m, m.removeprefix('dense:'))}" for m in modes)
    return (f"note: in {which} the patch ran the model's own attention in every layer (record mode {why}); the "
            "patched answers there are the unpatched model's")
