"""The progress-log type that loaders and evals take, and its default, which prints to stderr."""

from __future__ import annotations

import sys
from collections.abc import Callable

__all__ = ["Log", "log_stderr"]

#: A progress log: called with one line of text (no trailing newline).
Log = Callable[[str], None]


def log_stderr(msg: str) -> None:
    """Print one progress line to stderr, prefixed ``[attnpatch]`` and flushed at once."""
    print(f"[attnpatch] {msg}", file=sys.stderr, flush=True)
