"""Command line: ``attnpatch methods``, ``models``, ``eval ruler``, ``eval generate``, ``eval {fidelity,knn,linear-probe,retrieval}``,
``eval {zeroshot,clip-retrieval}`` (CLIP), ``eval segmentation``,
``eval {lm-eval,clip-benchmark}`` (the harnesses), ``sinks``, ``bench {attention,capture,model}``, ``compare``, ``tune``.

Thin by design: it parses, calls the library, prints. One module per command group, each command's
parser next to its handler (every module's ``add_parser`` registers its commands and sets
``func``); :mod:`.args` (option parsing, argparse types), :mod:`.output` (result report, output checks,
progress lines) and :mod:`.runtime` (device, scale-out options, loader keywords) hold what they share.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from ..errors import AttnpatchError
from ..patchers.break_even import begin_run
from . import bench, clip, compare, harness, methods, ruler, sinks, tune, vision

# The handlers and shared helpers stay importable (and patchable) as ``attnpatch.cli.<name>``; a patch
# here does not reach the command modules, which import them directly.
from .args import DEFAULT_CLIP_MODEL, DEFAULT_MODEL, DEFAULT_VISION_MODEL, Parser, method_spec, parse_options, Repeatable  # noqa: F401
from .bench import cmd_bench_attention, cmd_bench_capture, cmd_bench_model  # noqa: F401
from .clip import cmd_eval_clip  # noqa: F401
from .methods import cmd_methods, cmd_models  # noqa: F401
from .output import check_outputs, slug  # noqa: F401
from .ruler import cmd_eval_generate, cmd_eval_ruler  # noqa: F401
from .runtime import resolve_device  # noqa: F401
from .sinks import cmd_sinks  # noqa: F401
from .vision import VISION_EVALS, cmd_eval_vision  # noqa: F401

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``attnpatch`` command."""
    p = Parser(prog="attnpatch", description="Training-free attention patching and its evals.")
    sub = p.add_subparsers(dest="command", required=True)
    methods.add_parser(sub)  # methods, models
    pe = sub.add_parser("eval", help="run an eval, dense vs patched")
    esub = pe.add_subparsers(dest="eval", required=True)
    ruler.add_parser(esub)
    ruler.add_generate_parser(esub)  # generate: greedy generations, dense vs patched
    vision.add_parser(esub)  # fidelity, knn, linear-probe, retrieval, segmentation
    clip.add_parser(esub)  # zeroshot, clip-retrieval
    harness.add_parser(esub)  # lm-eval, clip-benchmark
    bench.add_parser(sub)  # bench attention, capture, model
    sinks.add_parser(sub)
    compare.add_parser(sub)  # compare: dense + several settings at matched budgets
    tune.add_parser(sub)  # tune: the cheapest setting that meets a target, as a config
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``attnpatch`` console script; returns the exit status (2 on a usage or input error)."""
    args = build_parser().parse_args(argv)
    begin_run()  # the result JSON lists the break-even lengths this command resolved
    try:
        return args.func(args)
    except AttnpatchError as exc:
        if not getattr(exc, "quiet", False):  # a data-parallel run's common error is printed by process 0 alone
            print(f"attnpatch: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C outside an eval's own handling (loading, writing): one line, no traceback
        print("attnpatch: interrupted (Ctrl-C); nothing more written", file=sys.stderr)
        return 130
