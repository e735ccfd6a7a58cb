"""The method table of docs/methods.md, generated from the registry (:func:`methods_markdown`)."""

from __future__ import annotations

import math
from typing import Any

from .contract import MODEL_KINDS
from .registry import METHODS

__all__ = ["methods_markdown"]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _value(v: Any) -> str:
    if isinstance(v, float) and math.isinf(v):
        return "inf" if v > 0 else "-inf"
    if isinstance(v, tuple):
        return "()" if not v else repr(v)
    return repr(v) if isinstance(v, str) else str(v)


def methods_markdown() -> str:
    """The method table of docs/methods.md, generated from the registry (one row per method, sorted by name).

    Columns: method, model kinds, what it does (with its source), exactness, options with defaults (and
    the allowed values of string options).  ``attnpatch methods --markdown`` prints it; a test keeps the
    copy in docs/methods.md (between ``<!-- methods:begin -->`` and ``<!-- methods:end -->``) equal to it.
    """
    lines = [
        "| method | model kinds | what it does | exact? | options (default) |",
        "|---|---|---|---|---|",
    ]
    for name in sorted(METHODS):
        m = METHODS[name]
        kinds = "any" if m.exact else ", ".join(MODEL_KINDS.get(k, k) for k in sorted(m.model_kinds))
        text = (m.details or m.summary).rstrip()
        what = f"{text}{'' if text.endswith('.') else '.'} Source: {m.source}."
        opts = ", ".join(
            f"`{o.name}={_value(o.default)}`" + (f" ({'/'.join(o.choices)})" if o.choices else "") for o in m.options.values()
        ) or "none"
        if m.presets:
            opts += "; presets: " + ", ".join(f"`{p}`" for p in m.presets)
        lines.append(f"| `{name}` | {_cell(kinds)} | {_cell(what)} | {_cell(m.exactness())} | {_cell(opts)} |")
    return "\n".join(lines) + "\n"
