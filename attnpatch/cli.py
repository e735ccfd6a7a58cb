"""Command line: ``attnpatch methods``, ``attnpatch models``, ``attnpatch eval ruler``.

Thin by design: it parses, calls the library, prints.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any, Sequence

from .errors import AttnpatchError

DEFAULT_MODEL = "smollm2-135m-instruct"


def _parse_options(pairs: Sequence[str]) -> dict[str, Any]:
    """``["theta=12", "dense_layers=17,18"]`` -> ``{"theta": "12", "dense_layers": "17,18"}`` (typed later by the registry)."""
    out: dict[str, Any] = {}
    for p in pairs:
        if "=" not in p:
            raise AttnpatchError(f"--option {p!r}: expected NAME=VALUE, e.g. -o theta=12")
        k, v = p.split("=", 1)
        out[k.strip().replace("-", "_")] = v.strip()
    return out


def _cmd_methods(args) -> int:
    from .patchers.registry import list_methods

    methods = list_methods()
    if args.json:
        print(json.dumps(methods, indent=2, default=str))
        return 0
    from rich.console import Console
    from rich.table import Table

    con = Console(width=140)
    for m in methods:
        t = Table(
            title=f"{m['name']} — {m['summary']}\n[dim]{m['source']}; model kinds: {', '.join(m['model_kinds'])}[/dim]",
            expand=True,
        )
        t.add_column("option")
        t.add_column("type")
        t.add_column("default")
        t.add_column("meaning")
        for name, o in m["options"].items():
            help_ = o["help"] + (f" (one of {', '.join(o['choices'])})" if "choices" in o else "")
            t.add_row(name, o["kind"], repr(o["default"]), help_)
        if not m["options"]:
            t.add_row("-", "-", "-", "no options")
        con.print(t)
    return 0


def _cmd_models(args) -> int:
    from .checkpoints import catalogue

    entries = catalogue()
    if args.json:
        print(json.dumps(entries, indent=2, default=str))
        return 0
    from rich.console import Console
    from rich.table import Table

    t = Table(title="offline catalogue (any local directory or Hugging Face hub id is accepted as well)")
    keys = [k for k in ("name", "architecture", "packages", "params", "prepared", "notes") if entries and k in entries[0]]
    for k in keys:
        t.add_column(k)
    for e in entries:
        t.add_row(*(", ".join(e[k]) if isinstance(e[k], (list, tuple)) else str(e[k]) for k in keys))
    Console(width=160).print(t)
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{value} is not in [0, 1]")
    return value


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", s).strip("-")


def _cmd_eval_ruler(args) -> int:
    import torch
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .checkpoints import load_causal_lm
    from .evals import ruler_tasks
    from .evals.report import RULER_COLUMNS, machine_info, print_table, rows_to_markdown, write_json
    from .evals.ruler import run_ruler
    from .patchers.registry import get_method, validate_options

    if args.threads:
        torch.set_num_threads(args.threads)
    options = _parse_options(args.option)
    if args.method != "dense" or options:
        options = validate_options(get_method(args.method), options)  # fail before loading the model
    tasks = args.tasks or ["niah_single"]
    if tasks == ["all"]:
        tasks = list(ruler_tasks.TASKS)
    model, tok = load_causal_lm(args.model)
    total = len(tasks) * len(args.lengths) * args.samples
    with Progress(
        TextColumn("[bold]ruler[/bold]"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("{task.description}"),
        transient=False,
    ) as prog:
        bar = prog.add_task("", total=total)

        def progress(msg: str) -> None:
            prog.update(bar, advance=1, description=msg)
            if not prog.console.is_terminal:  # a log file gets one plain line per sample
                done = int(prog.tasks[0].completed)
                print(f"[{done}/{total}] {msg}", file=sys.stderr, flush=True)

        path = args.json or f"ruler_{_slug(args.model)}_{_slug(args.method)}.json"
        machine = machine_info()

        def save(partial: dict[str, Any], complete: bool = False) -> None:
            write_json(path, {**partial, "model": args.model, "machine": machine, "complete": complete})

        result = run_ruler(
            model, tok, method=args.method, options=options, tasks=tasks, lengths=args.lengths,
            num_samples=args.samples, seed=args.seed, depths=args.depths, haystack=args.haystack,
            recall=not args.no_recall, recall_samples=args.recall_samples, progress=progress, on_cell=save,
        )
    save(result, complete=True)
    title = f"RULER-style eval — {args.model} — {args.method} {_fmt_opts(result['options'])}"
    print_table(result["cells"], RULER_COLUMNS, title=title)
    print(f"wrote {path}")
    if args.markdown:
        from pathlib import Path

        Path(args.markdown).write_text(f"### {title}\n\n" + rows_to_markdown(result["cells"], RULER_COLUMNS) + "\n")
        print(f"wrote {args.markdown}")
    return 0


def _fmt_opts(opts: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in opts.items()) if opts else ""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``attnpatch`` command."""
    p = argparse.ArgumentParser(prog="attnpatch", description="Training-free attention patching and its evals.")
    sub = p.add_subparsers(dest="command", required=True)

    pm = sub.add_parser("methods", help="list registered methods, their options, defaults and model kinds")
    pm.add_argument("--json", action="store_true", help="print JSON instead of tables")
    pm.set_defaults(func=_cmd_methods)

    pc = sub.add_parser("models", help="list the offline model catalogue")
    pc.add_argument("--json", action="store_true")
    pc.set_defaults(func=_cmd_models)

    pe = sub.add_parser("eval", help="run an eval, dense vs patched")
    esub = pe.add_subparsers(dest="eval", required=True)
    from .evals import ruler_tasks

    pr = esub.add_parser("ruler", help="RULER-style long-context tasks (needle-in-a-haystack and friends)")
    pr.add_argument("--model", default=DEFAULT_MODEL, help="catalogue name, local directory or hub id (default: %(default)s)")
    pr.add_argument("--method", default="anchor_attention", help="registered method, or 'dense' for a baseline-only run")
    pr.add_argument("-o", "--option", action="append", default=[], metavar="NAME=VALUE", help="method option, repeatable (e.g. -o theta=12)")
    pr.add_argument("--tasks", nargs="+", choices=list(ruler_tasks.TASKS) + ["all"], help="default: niah_single")
    pr.add_argument("--lengths", nargs="+", type=_positive_int, default=[1024, 2048, 4096], help="context lengths in model tokens")
    pr.add_argument("--samples", type=_positive_int, default=10, help="samples per (task, length) cell (default: %(default)s)")
    pr.add_argument("--seed", type=int, default=0)
    pr.add_argument("--depths", nargs="+", type=_fraction, help="needle depths in [0, 1], cycled over samples")
    pr.add_argument("--haystack", choices=["repeat", "essay"], default="repeat")
    pr.add_argument("--no-recall", action="store_true", help="skip the attention-recall measuring pass")
    pr.add_argument("--recall-samples", type=_positive_int, metavar="N", help="measure recall on the first N samples of each cell only (default: all)")
    pr.add_argument("--json", help="result JSON path, rewritten after every finished cell (default: ruler_<model>_<method>.json)")
    pr.add_argument("--markdown", help="also write the table as Markdown to this path")
    pr.add_argument("--threads", type=_positive_int, help="torch CPU threads")
    pr.set_defaults(func=_cmd_eval_ruler)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``attnpatch`` console script; returns the exit status (2 on a usage or input error)."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except AttnpatchError as exc:
        print(f"attnpatch: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
