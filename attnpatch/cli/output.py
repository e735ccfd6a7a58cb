"""What the command modules share for output: default result paths, output-path checks, the result report
(table, JSON, Markdown, PNG), Ctrl-C handling of an interrupted eval, and progress lines."""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..errors import AttnpatchError

__all__ = [
    "slug", "fmt_opts", "report_interrupted", "json_path", "plot_file", "report", "check_outputs", "progress_line", "image_progress",
    "rank_lines", "world_note", "Plotter",
]

#: Draws a result's PNG: ``plotter(result, png_path, title)`` returns the path written, or ``None`` when the result
#: holds nothing to draw.
Plotter = Callable[[dict[str, Any], str, str], Path | None]


def slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", s).strip("-")


def fmt_opts(opts: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in opts.items()) if opts else ""


def report_interrupted(args, stop, written_json: str | None, markdown: str | None, also: Sequence[str] = ()) -> int:
    """After Ctrl-C in an eval: the finished part is in ``stop.partial`` (its JSON already written to
    ``written_json`` by the caller, and the files ``also``, e.g. its PNG); write ``markdown`` to ``--markdown``,
    say so in one line, return 130."""
    from ..evals.run.report import write_text

    if stop.partial is None:
        print(f"attnpatch: interrupted (Ctrl-C) before any result was finished ({stop.done or 'nothing done'}); nothing written", file=sys.stderr)
        return 130
    wrote = ([written_json] if written_json else []) + [str(a) for a in also]
    if markdown and getattr(args, "markdown", None):
        write_text(args.markdown, markdown)
        wrote.append(args.markdown)
    print(
        f"attnpatch: interrupted (Ctrl-C) after {stop.done}; wrote the finished part to {' and '.join(wrote) or 'nothing'} "
        f"(marked \"interrupted\": true)",
        file=sys.stderr,
    )
    return 130


def json_path(args) -> str:
    """``--json``, or the default ``<eval>_<model>_<methods>.json``."""
    return args.json or f"{slug(args.eval)}_{slug(args.model)}_{slug('+'.join(args.method))}.json"


def plot_file(args) -> str:
    """The PNG of an eval: ``--plot``, or the result JSON's path (:func:`json_path`) with ``.png``.

    Raises:
        AttnpatchError: ``--plot`` does not end in ``.png`` (one line naming it).
    """
    from ..evals.run.plots import plot_path

    return str(plot_path(json_path(args), getattr(args, "plot", None)))


def report(args, title: str, rows, columns, result: dict[str, Any], interrupted=None, plot: Plotter | None = None) -> int:
    """Print the table, write the JSON (``--json``, default ``<eval>_<model>_<methods>.json``), the PNG (with
    ``plot``: :func:`plot_file`, drawn after the JSON) and the optional Markdown.

    With ``interrupted`` (an :class:`~attnpatch.evals.run.report.EvalInterrupted`), ``result`` is the
    finished part: it is written and drawn (no table printed), and the exit status is 130."""
    from ..evals.run.report import print_table, rows_to_markdown, write_json, write_text

    path = json_path(args)
    if interrupted is not None:
        write_json(path, result)
        png = plot(result, plot_file(args), title) if plot is not None else None
        return report_interrupted(args, interrupted, path, f"### {title} (interrupted: {interrupted.done})\n\n" + rows_to_markdown(rows, columns) + "\n",
                                  also=[png] if png else [])
    print_table(rows, columns, title=title)
    for line in rank_lines(result) + timing_lines(result) + list(result.get("warnings") or []):
        print(line)
    write_json(path, result)
    print(f"wrote {path}")
    png = plot(result, plot_file(args), title) if plot is not None else None
    if png:
        print(f"wrote {png}")
    if args.markdown:
        write_text(args.markdown, f"### {title}\n\n" + rows_to_markdown(rows, columns) + "\n")
        print(f"wrote {args.markdown}")
    return 0


def check_outputs(*flags: tuple[str, str | None]) -> None:
    """Fail before any work when an output file cannot be written: it is a directory, it lies under
    a file, its folder (or the nearest existing folder above a missing one, which will be created)
    does not accept a new file, the file exists and cannot be written, or two outputs share a path.

    ``flags`` are ``(flag, path)`` pairs, e.g. ``("--json", "r.json")``; ``None`` paths are skipped.
    Nothing is left behind by the check.
    """
    import os
    import tempfile
    from pathlib import Path

    seen: dict[str, str] = {}
    for flag, path in flags:
        if not path:
            continue
        p = Path(path).expanduser()
        if p.is_dir():
            raise AttnpatchError(f"{flag} {path}: is a directory; give a file path")
        key = os.path.realpath(p)  # a symlink and its target are one file
        if key in seen:
            raise AttnpatchError(f"{flag} {path}: the same file as {seen[key]}; give different paths")
        seen[key] = f"{flag} {path}"
        parent = next((x for x in Path(key).parents if x.exists()), None)
        if parent is not None and not parent.is_dir():
            raise AttnpatchError(f"{flag} {path}: {parent} is a file, not a folder")
        try:
            if p.exists():
                with open(p, "a"):
                    pass
            else:
                with tempfile.NamedTemporaryFile(dir=parent, prefix=".attnpatch-write-test-"):
                    pass
        except OSError as err:
            what = f"cannot write {p}" if p.exists() else f"cannot create a file in {parent}"
            raise AttnpatchError(f"{flag} {path}: {what} ({err.strerror or err})") from None


def progress_line(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@contextlib.contextmanager
def image_progress(label: str, total: int, quiet: bool = False):
    """A progress bar over ``total`` images; yields the ``progress(done, total)`` callback the evals take
    (plain lines on stderr when the output is not a terminal; nothing with ``quiet``, e.g. on ranks other than 0)."""
    if quiet:
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from rich.markup import escape

    with Progress(TextColumn(f"[bold]{escape(label)}[/bold]"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()) as prog:
        bar = prog.add_task("", total=total)

        def progress(done: int, total: int) -> None:
            prog.update(bar, completed=done, total=total)
            if not prog.console.is_terminal:
                print(f"[{done}/{total}] images", file=sys.stderr, flush=True)

        yield progress


def timing_lines(result: dict[str, Any]) -> list[str]:
    """A warning when the machine's speed drifted during an image pass (``result["timing"]``, from
    :func:`attnpatch.evals.vision.image_pass.timing_summary`): dense's batches took longer or shorter at the end than
    at the start, so the speed-ups, measured batch by batch beside dense, carry more than their spread."""
    t = result.get("timing") or (result.get("result") or {}).get("timing") or {}
    if not t.get("drifted"):
        return []
    return [f"warning: the machine's speed drifted during the run: dense's batches took {t['dense_first_s']:.3g} s "
            f"(median, first third) and {t['dense_last_s']:.3g} s (last third), {t['drift']:.2f}x; every speed-up is "
            "timed beside dense batch by batch, but is less certain than its spread says (another job on the machine?)"]


def rank_lines(result: dict[str, Any]) -> list[str]:
    """One line per process of a data-parallel image eval: the images it encoded, its median forward time per batch
    (dense and each setting) and its wall time; nothing for a one-process run."""
    ranks = result.get("ranks") or (result.get("result") or {}).get("ranks") or []
    if len(ranks) < 2:
        return []

    def s(x):
        return "-" if x is None else f"{x:.3f} s"

    return [
        f"process {r['rank']}: {r['images']} images in {len(r['batches'])} batch(es), median per batch: dense {s(r['dense_s_median'])}, "
        f"settings {', '.join(s(x) for x in r['seconds_median'])}; wall {r['wall_s']:.1f} s"
        for r in ranks
    ]


def world_note(result: dict[str, Any]) -> str:
    """`` — 2 processes, 12.3 s`` for a data-parallel run's title (how many processes and the wall time); ``""`` for one process."""
    w = result.get("world_size") or 1
    return f" — {w} processes, {result['wall_s']:.1f} s" if w > 1 and result.get("wall_s") is not None else ""
