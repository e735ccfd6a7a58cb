"""``attnpatch methods`` and ``attnpatch models``: what is registered, what is in the catalogue."""

from __future__ import annotations

import json


def cmd_methods(args) -> int:
    from ..patchers.method_table import methods_markdown
    from ..patchers.registry import list_methods

    if args.markdown:
        print(methods_markdown(), end="")
        return 0
    methods = list_methods()
    if args.json:
        print(json.dumps(methods, indent=2, default=str))
        return 0
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    con = Console(width=140)
    for m in methods:
        t = Table(
            title=(
                f"{escape(m['name'])} — {escape(m['summary'])}\n[dim]{escape(m['source'])}; model kinds: "
                f"{escape('any (exact)' if m['exact'] else ', '.join(m['model_kinds']))}; model features supported: "
                f"{escape(', '.join(m['supports']) or 'none (sliding windows, soft-capping and other layer types are refused)')}; "
                f"{'keeps autograd' if m['exact'] else 'inference only'}; {escape(m['exactness'])}; "
                f"config=PATH loads a saved JSON config[/dim]"
            ),
            expand=True,
        )
        t.add_column("option")
        t.add_column("type")
        t.add_column("default")
        t.add_column("meaning")
        for name, o in m["options"].items():
            help_ = o["help"] + (f" (one of {', '.join(o['choices'])})" if "choices" in o else "") + (f"; {o['range']}" if "range" in o else "")
            t.add_row(escape(name), escape(str(o["kind"])), escape(repr(o["default"])), escape(help_))
        if not m["options"]:
            t.add_row("-", "-", "-", "no options")
        for pname, p in m["presets"].items():
            values = ", ".join(f"{k}={v!r}" for k, v in p["options"].items())
            t.add_row(escape(f"preset={pname}"), "preset", "-", escape(f"{p['text']} ({values})"))
        con.print(t)
    return 0


def cmd_models(args) -> int:
    from ..checkpoints import catalogue

    entries = catalogue()
    if args.json:
        print(json.dumps(entries, indent=2, default=str))
        return 0
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    t = Table(title="offline catalogue (any local directory or Hugging Face hub id is accepted as well)")
    keys = [k for k in ("name", "kind", "architecture", "packages", "params", "prepared", "notes") if entries and k in entries[0]]
    for k in keys:
        t.add_column(k)
    for e in entries:
        t.add_row(*(escape(", ".join(e[k]) if isinstance(e[k], (list, tuple)) else str(e[k])) for k in keys))
    Console(width=160).print(t)
    return 0


def add_parser(sub) -> None:
    """Register ``methods`` and ``models`` on the top-level subparsers."""
    pm = sub.add_parser("methods", help="list registered methods, their options, defaults, presets and model kinds")
    pm.add_argument("--json", action="store_true", help="print JSON instead of tables")
    pm.add_argument("--markdown", action="store_true", help="print the method table of docs/methods.md (Markdown, generated from the registry)")
    pm.set_defaults(func=cmd_methods)

    pc = sub.add_parser("models", help="list the offline model catalogue")
    pc.add_argument("--json", action="store_true")
    pc.set_defaults(func=cmd_models)
