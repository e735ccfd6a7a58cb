"""``attnpatch eval lm-eval`` and ``attnpatch eval clip-benchmark``: the harnesses people report with
(lm-evaluation-harness, CLIP_benchmark), run on the unpatched model and on each setting, side by side.

One module per harness (:mod:`.lmeval`, :mod:`.clipbench`); each imports its harness only when its
command runs, so the CLI works without the optional extras.
"""

from __future__ import annotations

from . import clipbench, lmeval


def add_parser(esub) -> None:
    """Register ``eval lm-eval`` and ``eval clip-benchmark`` on the ``eval`` subparsers."""
    lmeval.add_parser(esub)
    clipbench.add_parser(esub)
