"""What the command modules share: option and method-spec parsing, argparse value types, output-path
checks, Ctrl-C handling of an interrupted eval, the result report and progress printing, ``--device``."""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
from typing import Any, Sequence

from ..errors import AttnpatchError

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_VISION_MODEL = "dinov2-small"
DEFAULT_CLIP_MODEL = "ViT-B-32:openai"


def _parse_options(pairs: Sequence[str]) -> dict[str, Any]:
    """``["theta=12", "dense_layers=17,18"]`` -> ``{"theta": "12", "dense_layers": "17,18"}`` (typed later by the registry)."""
    out: dict[str, Any] = {}
    for p in pairs:
        if "=" not in p:
            raise AttnpatchError(f"option {p!r}: expected NAME=VALUE (e.g. -o theta=12, or METHOD:s=32)")
        k, v = p.split("=", 1)
        k = k.strip().replace("-", "_")
        if not k:
            raise AttnpatchError(f"option {p!r}: the NAME before '=' is empty; expected NAME=VALUE (e.g. -o theta=12)")
        if k in out:
            raise AttnpatchError(f"option {k} given twice ({k}={out[k]} and {k}={v.strip()}): give each option once")
        out[k] = v.strip()
    return out


def _method_spec(spec: str, common: Sequence[str]) -> tuple[str, dict[str, Any]]:
    """``"fna:s=32,sample_layer=0"`` -> ``("fna", {"s": "32", "sample_layer": "0"})``; ``-o`` options apply to every method."""
    name, _, rest = spec.partition(":")
    own = [p for p in rest.split(",") if p.strip()] if rest else []
    return name, {**_parse_options(common), **_parse_options(own)}


def _unique_settings(specs: Sequence[str], common: Sequence[str]) -> list[tuple[str, dict[str, Any]]]:
    out = [_method_spec(m, common) for m in specs]
    seen = set()
    for m, o in out:
        key = (m, tuple(sorted(o.items())))
        if key in seen:
            raise AttnpatchError(f"--method {m} with options {o or '{}'} is given twice")
        seen.add(key)
    return out


def _int_at_least(text: str, lo: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < lo:
        raise argparse.ArgumentTypeError(f"{value} is not {what}")
    return value


class _Repeatable(argparse.Action):
    """A ``nargs="+"`` option that may also be repeated: ``--method a --method b`` keeps both
    (argparse's default keeps the last); the values replace the default, they do not extend it."""

    def __call__(self, parser, namespace, values, option_string=None):
        current = getattr(namespace, self.dest, None)
        if current is None or current is self.default:
            current = []
        setattr(namespace, self.dest, [*current, *values])


def _positive_int(text: str) -> int:
    return _int_at_least(text, 1, "a positive integer")


def _nonnegative_int(text: str) -> int:
    return _int_at_least(text, 0, "an integer >= 0")


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number in [0, 1]") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{value} is not in [0, 1]")
    return value


def _positive_seconds(text: str) -> float:
    try:
        val = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < val < float("inf"):
        raise argparse.ArgumentTypeError(f"{text}: must be a positive number of seconds")
    return val


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", s).strip("-")


def _fmt_opts(opts: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in opts.items()) if opts else ""


def _interrupted(args, stop, json_path: str | None, markdown: str | None) -> int:
    """After Ctrl-C in an eval: the finished part is in ``stop.partial`` (its JSON already written to
    ``json_path`` by the caller); write ``markdown`` to ``--markdown``, say so in one line, return 130."""
    from ..evals.report import write_text

    if stop.partial is None:
        print(f"attnpatch: interrupted (Ctrl-C) before any result was finished ({stop.done or 'nothing done'}); nothing written", file=sys.stderr)
        return 130
    wrote = [json_path] if json_path else []
    if markdown and getattr(args, "markdown", None):
        write_text(args.markdown, markdown)
        wrote.append(args.markdown)
    print(
        f"attnpatch: interrupted (Ctrl-C) after {stop.done}; wrote the finished part to {' and '.join(wrote) or 'nothing'} "
        f"(marked \"interrupted\": true)",
        file=sys.stderr,
    )
    return 130


def _json_path(args) -> str:
    """``--json``, or the default ``<eval>_<model>_<methods>.json``."""
    return args.json or f"{_slug(args.eval)}_{_slug(args.model)}_{_slug('+'.join(args.method))}.json"


def _report(args, title: str, rows, columns, result: dict[str, Any], interrupted=None) -> int:
    """Print the table, write the JSON (``--json``, default ``<eval>_<model>_<methods>.json``) and the optional Markdown.

    With ``interrupted`` (an :class:`~attnpatch.evals.report.EvalInterrupted`), ``result`` is the
    finished part: it is written (no table printed), and the exit status is 130."""
    from ..evals.report import print_table, rows_to_markdown, write_json, write_text

    path = _json_path(args)
    if interrupted is not None:
        write_json(path, result)
        return _interrupted(args, interrupted, path, f"### {title} (interrupted: {interrupted.done})\n\n" + rows_to_markdown(rows, columns) + "\n")
    print_table(rows, columns, title=title)
    for line in rank_lines(result):
        print(line)
    write_json(path, result)
    print(f"wrote {path}")
    if args.markdown:
        write_text(args.markdown, f"### {title}\n\n" + rows_to_markdown(rows, columns) + "\n")
        print(f"wrote {args.markdown}")
    return 0


def _check_outputs(*flags: tuple[str, str | None]) -> None:
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


def _progress_line(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@contextlib.contextmanager
def _image_progress(label: str, total: int, quiet: bool = False):
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


def _world_note(result: dict[str, Any]) -> str:
    """`` — 2 processes, 12.3 s`` for a data-parallel run's title (how many processes and the wall time); ``""`` for one process."""
    w = result.get("world_size") or 1
    return f" — {w} processes, {result['wall_s']:.1f} s" if w > 1 and result.get("wall_s") is not None else ""


def _device(name: str) -> str:
    """``--device``: ``auto`` resolved (cuda if available, else cpu), and a clear error for a device this
    machine cannot use (allowed: cpu, cuda, cuda:N)."""
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        raise AttnpatchError(f"--device {name!r}: not a device name (allowed: auto, cpu, cuda, cuda:N)") from None
    if dev.type == "cpu":
        return name
    if dev.type != "cuda":
        raise AttnpatchError(f"--device {name!r}: only cpu and cuda are supported")
    if not torch.cuda.is_available():
        raise AttnpatchError(f"--device {name!r}: CUDA is not available on this machine (allowed here: cpu)")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise AttnpatchError(f"--device {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return name


def scale_out_args(q, *, device: bool = True, big: bool = True) -> None:
    """The options of every eval for long and big runs: ``--resume``, and with ``big`` (transformers models)
    ``--dtype``, ``--device-map``, ``--max-memory`` (and ``--device`` where the command has none yet).
    Data-parallel runs need no option: launched by ``torchrun`` or ``accelerate launch``, each process takes its share."""
    q.add_argument("--resume", action="store_true", help="continue a run that stopped: its finished cells or batches are read "
                   "back (from --json, or the <json>.parts folder of an image eval) and the run goes on with the same inputs")
    if not big:
        return
    if device:
        q.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: auto = cuda if available; "
                       "under a multi-process launch cuda:<local rank>)")
    q.add_argument("--dtype", choices=DTYPES, default="float32", help="weights and activations (default: %(default)s)")
    q.add_argument("--device-map", choices=["auto", "balanced", "sequential"],
                   help="spread a model that does not fit one device over the GPUs, CPU memory and disk (accelerate's "
                   "big-model loading; each attention module runs where its weights are); not with several processes")
    q.add_argument("--max-memory", metavar="DEVICE=SIZE,...", help="with --device-map: memory per device, e.g. 0=20GiB,1=20GiB,cpu=64GiB")


DTYPES = ("float32", "bfloat16", "float16")


def rank_log(ranks):
    """The one-line log of this process: stderr on process 0, nothing on the others (process 0 says it)."""
    from ..fetch import _stderr

    return _stderr if ranks.main else (lambda line: None)


def open_store(args, ranks, n_images: int, settings, **extra):
    """The kept batches of an image eval (``<json>.parts``, ``--resume``); its run identity is the eval, model, data,
    image count, resolution, batch size, the settings after validation (written otherwise, the same run) and ``extra``.

    Raises:
        AttnpatchError: ``--resume`` of a folder another run wrote (the differing field named).
    """
    from ..evals.resume import BatchStore, same_path
    from ..fetch import _stderr
    from ..patchers.registry import get_method, validate_options

    key = dict(
        eval=args.eval, model=same_path(args.model), data=same_path(args.data) or "default", n_images=n_images,
        resolution=args.resolution, batch_size=args.batch_size,
        settings=[(m, validate_options(get_method(m), dict(o))) for m, o in settings], **extra,
    )
    return BatchStore(_json_path(args) + ".parts", key, ranks=ranks, resume=args.resume, log=_stderr)


def other_process_exit(store, stop) -> int:
    """The exit of a process other than 0 after an image eval: process 0 reports; when the run finished, wait for it to
    be done with the kept batches (:meth:`~attnpatch.evals.resume.BatchStore.remove`)."""
    if stop is None:
        store.remove()
    return 130 if stop is not None else 0


def _max_memory(text: str | None) -> dict | None:
    """``"0=20GiB,cpu=64GiB"`` -> ``{0: "20GiB", "cpu": "64GiB"}`` (accelerate's ``max_memory``)."""
    if not text:
        return None
    import torch
    from accelerate.utils import convert_file_size_to_int

    out: dict = {}
    for part in text.split(","):
        dev, sep, size = part.partition("=")
        dev, size = dev.strip(), size.strip()
        if not sep or not dev or not size:
            raise AttnpatchError(f"--max-memory {text!r}: expected DEVICE=SIZE,... (e.g. 0=20GiB,cpu=64GiB; devices: GPU index, cpu, disk)")
        if not (dev.isdigit() or dev in ("cpu", "disk")):
            raise AttnpatchError(f"--max-memory: device {dev!r} is not a GPU index, cpu or disk")
        key = int(dev) if dev.isdigit() else dev
        if key in out:
            raise AttnpatchError(f"--max-memory: device {dev} is given twice ({out[key]} and {size}); give each device once")
        if isinstance(key, int) and key >= torch.cuda.device_count():
            raise AttnpatchError(f"--max-memory: GPU {key} does not exist on this machine ({torch.cuda.device_count()} CUDA device(s))")
        value = int(size) if size.isdigit() else size  # bytes, or a size with its unit
        try:
            if convert_file_size_to_int(value) <= 0:
                raise ValueError
        except (ValueError, TypeError):
            raise AttnpatchError(f"--max-memory: size {size!r} of {dev} is not a positive size (e.g. 512MB, 20GiB, or bytes: 1000000)") from None
        out[key] = value
    return out


def load_kwargs(args, ranks) -> dict[str, Any]:
    """The loader keywords (``dtype``, ``device``, ``device_map``, ``max_memory``) of ``args``, checked before loading.

    Raises:
        AttnpatchError: ``--max-memory`` without ``--device-map`` or malformed; ``--device-map`` in a
            multi-process run (each process would spread its model over every device).
    """
    import torch

    if args.max_memory and not args.device_map:
        raise AttnpatchError("--max-memory applies with --device-map only (e.g. --device-map auto --max-memory 0=20GiB,cpu=64GiB)")
    if args.device_map and ranks.distributed:
        exc = AttnpatchError(
            f"--device-map {args.device_map} with {ranks.world_size} processes: each process would spread its model over "
            "every device; run one process with --device-map, or several without it (one device each)"
        )
        exc.quiet = not ranks.main  # every process finds it: process 0 says it
        raise exc
    out: dict[str, Any] = {"dtype": getattr(torch, args.dtype)}
    if args.device_map:
        out.update(device_map=args.device_map, max_memory=_max_memory(args.max_memory))
    else:
        out["device"] = ranks.device(_device(getattr(args, "device", "cpu")))
    return out
