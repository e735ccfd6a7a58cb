"""Command line: ``attnpatch methods``, ``models``, ``eval ruler``, ``eval {fidelity,knn,linear-probe,retrieval}``,
``eval {zeroshot,clip-retrieval}`` (CLIP), ``sinks``, ``bench {attention,capture,model}``.

Thin by design: it parses, calls the library, prints.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
from typing import Any, Sequence

from .errors import AttnpatchError

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_VISION_MODEL = "dinov2-small"
VISION_EVALS = {"fidelity": "fidelity", "knn": "knn", "linear-probe": "linear_probe", "retrieval": "retrieval"}
DEFAULT_CLIP_MODEL = "ViT-B-32:openai"


def _parse_options(pairs: Sequence[str]) -> dict[str, Any]:
    """``["theta=12", "dense_layers=17,18"]`` -> ``{"theta": "12", "dense_layers": "17,18"}`` (typed later by the registry)."""
    out: dict[str, Any] = {}
    for p in pairs:
        if "=" not in p:
            raise AttnpatchError(f"option {p!r}: expected NAME=VALUE (e.g. -o theta=12, or METHOD:s=32)")
        k, v = p.split("=", 1)
        k = k.strip().replace("-", "_")
        if k in out:
            raise AttnpatchError(f"option {k} given twice ({k}={out[k]} and {k}={v.strip()}): give each option once")
        out[k] = v.strip()
    return out


def _cmd_methods(args) -> int:
    from .patchers.registry import list_methods, methods_markdown

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
                f"{'keeps autograd' if m['exact'] else 'inference only'}; {escape(m['exactness'])}[/dim]"
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
        con.print(t)
    return 0


def _cmd_models(args) -> int:
    from .checkpoints import catalogue

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
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{value} is not in [0, 1]")
    return value


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", s).strip("-")


def _cmd_eval_ruler(args) -> int:
    import torch
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .checkpoints import load_causal_lm
    from .evals import ruler_tasks
    from .evals.report import RULER_COLUMNS, EvalInterrupted, machine_info, print_table, rows_to_markdown, write_json, write_text
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
    path = args.json or f"ruler_{_slug(args.model)}_{_slug(args.method)}.json"
    _check_outputs(("--json", path), ("--markdown", args.markdown))  # before the long work, not after it
    model, tok = load_causal_lm(args.model)
    total = len(tasks) * len(args.lengths) * args.samples
    with Progress(
        TextColumn("[bold]ruler[/bold]"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("{task.description}"),
        transient=False,
    ) as prog:
        bar = prog.add_task("", total=total)

        def progress(msg: str) -> None:
            prog.update(bar, advance=1, description=escape(msg))  # task text, not rich markup
            if not prog.console.is_terminal:  # a log file gets one plain line per sample
                done = int(prog.tasks[0].completed)
                print(f"[{done}/{total}] {msg}", file=sys.stderr, flush=True)

        machine = machine_info()

        def save(partial: dict[str, Any], complete: bool = False) -> None:
            write_json(path, {**partial, "model": args.model, "machine": machine, "complete": complete})

        try:
            result = run_ruler(
                model, tok, method=args.method, options=options, tasks=tasks, lengths=args.lengths,
                num_samples=args.samples, seed=args.seed, depths=args.depths, haystack=args.haystack,
                recall=not args.no_recall, recall_samples=args.recall_samples, progress=progress, on_cell=save,
            )
        except EvalInterrupted as stop:
            result = stop.partial
            if result is not None:
                save(result)  # "interrupted": true is in the partial result
            return _interrupted(args, stop, path, result and (
                f"### RULER-style eval — {args.model} — {args.method} {_fmt_opts(result['options'])} (interrupted: {stop.done})\n\n"
                + rows_to_markdown(result["cells"], RULER_COLUMNS) + "\n"
            ))
    save(result, complete=True)
    title = f"RULER-style eval — {args.model} — {args.method} {_fmt_opts(result['options'])}"
    print_table(result["cells"], RULER_COLUMNS, title=title)
    print(f"wrote {path}")
    if args.markdown:
        write_text(args.markdown, f"### {title}\n\n" + rows_to_markdown(result["cells"], RULER_COLUMNS) + "\n")
        print(f"wrote {args.markdown}")
    return 0


def _interrupted(args, stop, json_path: str | None, markdown: str | None) -> int:
    """After Ctrl-C in an eval: the finished part is in ``stop.partial`` (its JSON already written to
    ``json_path`` by the caller); write ``markdown`` to ``--markdown``, say so in one line, return 130."""
    from .evals.report import write_text

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
    from .evals.report import print_table, rows_to_markdown, write_json, write_text

    path = _json_path(args)
    if interrupted is not None:
        write_json(path, result)
        return _interrupted(args, interrupted, path, f"### {title} (interrupted: {interrupted.done})\n\n" + rows_to_markdown(rows, columns) + "\n")
    print_table(rows, columns, title=title)
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
        key = os.path.abspath(p)
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


def _method_spec(spec: str, common: Sequence[str]) -> tuple[str, dict[str, Any]]:
    """``"fna:s=32,sample_layer=0"`` -> ``("fna", {"s": "32", "sample_layer": "0"})``; ``-o`` options apply to every method."""
    name, _, rest = spec.partition(":")
    own = [p for p in rest.split(",") if p.strip()] if rest else []
    return name, {**_parse_options(common), **_parse_options(own)}


def _load_images_and_model(args):
    from .checkpoints import load_vision_model
    from .evals.images import fit_resolution, load_image_set, make_preprocess
    from .evals.vision import patch_size
    from .fetch import _stderr

    images = load_image_set(args.data, limit=args.limit)
    model, processor = load_vision_model(args.model, backend=args.backend)
    resolution = fit_resolution(args.resolution, patch_size(model), log=_stderr, what="--resolution")
    return images, model, make_preprocess(processor, resolution)


def _cmd_eval_vision(args) -> int:
    import torch

    from .evals.report import VISION_COLUMNS, EvalInterrupted, machine_info, vision_rows
    from .evals.vision import run_feature_eval
    from .patchers.registry import get_method, validate_options

    if args.threads:
        torch.set_num_threads(args.threads)
    task = VISION_EVALS[args.eval]
    tasks = ["fidelity", "knn"] if task == "fidelity" else [task]
    settings = []
    for spec in args.method:
        method, opts = _method_spec(spec, args.option)
        validate_options(get_method(method), opts)  # fail before loading anything
        settings.append((method, opts))
    _check_outputs(("--json", _json_path(args)), ("--markdown", args.markdown))
    images, model, preprocess = _load_images_and_model(args)
    stop = None
    with _image_progress(args.eval, len(images)) as progress:
        try:
            result = run_feature_eval(
                model, images, preprocess, settings=settings, tasks=tasks, batch_size=args.batch_size,
                layer_error_images=args.layer_error_images, knn_k=args.k, progress=progress,
            )
        except EvalInterrupted as exc:
            stop, result = exc, exc.partial
    if stop is not None and result is None:
        return _interrupted(args, stop, None, None)
    result.update(model=args.model, backend=args.backend, data=args.data or "default", eval=args.eval, machine=machine_info())
    rows = vision_rows(result)
    title = f"{args.eval} — {args.model} ({args.backend}) — {images.name}, {result['n_images']} images, {result['resolution']} px"
    return _report(args, title, rows, VISION_COLUMNS, result, interrupted=stop)


def _cmd_sinks(args) -> int:
    import torch

    from .evals.report import write_json
    from .evals.sink_diagnostic import sink_diagnostic

    if args.threads:
        torch.set_num_threads(args.threads)
    _check_outputs(("--json", args.json))
    images, model, preprocess = _load_images_and_model(args)
    x = preprocess([images[i][0] for i in range(min(args.images, len(images)))])
    rep = sink_diagnostic(model, x, norm_ratio=args.norm_ratio, mass_ratio=args.mass_ratio)
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    t = Table(title=escape(f"sink diagnostic — {args.model} — {x.shape[0]} images, {x.shape[-1]} px, N={rep['tokens']} tokens"))
    for c in ("layer", "median norm", "max/median norm", "images w/ massive", "massive tokens (img 0)", "CLS recv x uniform", "top receivers (img 0: token, x uniform)"):
        t.add_column(c)
    for e in rep["layers"]:
        t.add_row(
            str(e["layer"]), f"{e.get('norm_median', float('nan')):.2f}", f"{e.get('norm_max_over_median', float('nan')):.2f}",
            str(sum(bool(m) for m in e.get("massive", []))), escape(str(e.get("massive", [[]])[0][:8])),
            f"{e['cls_received_x_uniform']:.1f}", escape(str(e["top_received"][0])),
        )
    Console(width=160).print(t)
    first = rep["first_massive_layer"]
    print(f"first layer with a massive token (norm > {args.norm_ratio} x median): {first if first is not None else 'none'}")
    if args.json:
        write_json(args.json, rep)
        print(f"wrote {args.json}")
    return 0


@contextlib.contextmanager
def _image_progress(label: str, total: int):
    """A progress bar over ``total`` images; yields the ``progress(done, total)`` callback the evals take
    (plain lines on stderr when the output is not a terminal)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from rich.markup import escape

    with Progress(TextColumn(f"[bold]{escape(label)}[/bold]"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()) as prog:
        bar = prog.add_task("", total=total)

        def progress(done: int, total: int) -> None:
            prog.update(bar, completed=done)
            if not prog.console.is_terminal:
                print(f"[{done}/{total}] images", file=sys.stderr, flush=True)

        yield progress


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


def _cmd_eval_clip(args) -> int:
    import torch

    from .clip_models import load_clip
    from .evals import clip as clip_eval
    from .evals.report import CLIP_RETRIEVAL_COLUMNS, ZEROSHOT_COLUMNS, EvalInterrupted, clip_rows, machine_info
    from .patchers.registry import get_method, validate_options

    if args.threads:
        torch.set_num_threads(args.threads)
    zeroshot = args.eval in ("zeroshot", "clip-zeroshot")
    settings = []
    for method in args.method:
        opts = _parse_options(args.option)
        validate_options(get_method(method), opts)  # fail before loading anything
        settings.append((method, opts))
    _check_outputs(("--json", _json_path(args)), ("--markdown", args.markdown))
    templates = None
    if zeroshot and args.templates != "auto":
        templates = clip_eval.resolve_templates(args.templates)  # fail early on a bad name
    if zeroshot:
        from .evals.images import load_image_set

        data = load_image_set(args.data, split=args.split or "train", limit=args.limit)
        classnames, names_source = clip_eval.resolve_classnames(args.classnames, data)
        if templates is None:
            templates = clip_eval.resolve_templates("openai" if names_source == "imagenet1k" else "photo")
    else:
        data = clip_eval.load_caption_set(args.data, split=args.split, caption_column=args.caption_column, limit=args.limit)
    bundle = load_clip(args.model, device=_device(args.device), resolution=args.resolution, resolution_flag="--resolution")
    towers = args.towers
    stop = None
    with _image_progress(args.eval, len(data)) as progress:
        common = dict(settings=settings, towers=towers, batch_size=args.batch_size, text_batch_size=args.text_batch_size, progress=progress)
        try:
            if zeroshot:
                result = clip_eval.run_zeroshot_eval(bundle, data, classnames, templates, ks=(1, 5), **common)
            else:
                result = clip_eval.run_retrieval_eval(bundle, data, ks=tuple(args.ks), **common)
        except EvalInterrupted as exc:
            stop, result = exc, exc.partial
    if stop is not None and result is None:
        return _interrupted(args, stop, None, None)
    result.update(
        model=args.model, model_kind=bundle.kind, random_init=bundle.random_init, data=args.data or "default",
        split=getattr(data, "split", None), machine=machine_info(),
    )
    if zeroshot:
        result.update(classnames=names_source)
    columns = ZEROSHOT_COLUMNS if zeroshot else CLIP_RETRIEVAL_COLUMNS
    if not zeroshot:
        from .evals.report import Column

        keep = [c for c in columns if "@" not in c.key]
        recall = [Column(f"{d}_recall@{k}", f"{'T→I' if d == 't2i' else 'I→T'} R@{k}", "pct") for d in ("t2i", "i2t") for k in result["ks"]]
        columns = keep[:3] + recall + keep[3:]
    rows = clip_rows(result)
    what = (
        f"{result['n_images']} images, {result['n_classes']} classes ({names_source} names) x {result['n_templates']} templates"
        if zeroshot else f"{result['n_images']} images, {result['n_texts']} captions"
    )
    title = f"{args.eval} — {args.model}{' (random weights)' if bundle.random_init else ''} — {getattr(data, 'name', args.data)}, {what}, {result['resolution']} px"
    return _report(args, title, rows, columns, result, interrupted=stop)


def _bench_out(args, title: str, rows, columns, result: dict[str, Any], footer: str = "") -> None:
    """Print a bench table (and ``footer``) and write ``--json`` / ``--markdown`` when asked."""
    from .evals.report import print_table, rows_to_markdown, write_json

    print_table(rows, columns, title=title)
    if footer:
        print(footer)
    if args.json:
        write_json(args.json, result)
        print(f"wrote {args.json}")
    if args.markdown:
        from pathlib import Path

        Path(args.markdown).write_text(f"### {title}\n\n" + rows_to_markdown(rows, columns) + "\n" + (f"\n{footer}\n" if footer else ""))
        print(f"wrote {args.markdown}")


def _check_out_paths(**paths: str | None) -> None:
    """Fail before any work when an output path cannot be written (a directory, or under a file)."""
    from pathlib import Path

    for flag, path in paths.items():
        if not path:
            continue
        p = Path(path)
        if p.is_dir():
            raise AttnpatchError(f"--{flag.replace('_', '-')} {path}: is a directory; give a file path")
        parent = next((x for x in p.parents if x.exists()), None)
        if parent is not None and not parent.is_dir():
            raise AttnpatchError(f"--{flag.replace('_', '-')} {path}: {parent} is a file, not a folder")


def _progress_line(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _unique_settings(specs: Sequence[str], common: Sequence[str]) -> list[tuple[str, dict[str, Any]]]:
    out = [_method_spec(m, common) for m in specs]
    seen = set()
    for m, o in out:
        key = (m, tuple(sorted(o.items())))
        if key in seen:
            raise AttnpatchError(f"--method {m} with options {o or '{}'} is given twice")
        seen.add(key)
    return out


_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16"}


_BACKGROUND_LOAD_HELP = (
    "run the bench beside a competing PyTorch process (a = tanh(a @ a) on 512x512 float32, default torch threads), "
    "as a data-loader worker or a second job would; it is started by the bench, killed when the bench ends or fails, "
    "and stops by itself after MAX_SECONDS (default: 900)"
)


def _positive_seconds(text: str) -> float:
    try:
        val = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < val < float("inf"):
        raise argparse.ArgumentTypeError(f"{text}: must be a positive number of seconds")
    return val


def _load_note(load: dict[str, Any] | None) -> str:
    """The line a bench prints about ``--background-load`` (empty without it)."""
    if not load:
        return ""
    note = (f"Ran under background load: a second PyTorch process (pid {load['pid']}, {load['threads']} torch threads) "
            f"looping a = tanh(a @ a) on {load['size']}x{load['size']} float32 for the whole bench ({load['seconds']:.0f} s).")
    if not load["alive_at_end"]:
        note += (f" WARNING: it was gone before the bench ended (its {load['limit_s']:.0f} s limit, --background-load "
                 "MAX_SECONDS, or it died), so part of the bench ran without it.")
    return note


def _cmd_bench_attention(args) -> int:
    import torch

    from .evals.bench import DEFAULT_LENGTHS, background_load, bench_attention, load_qkv, plot_attention
    from .evals.report import BENCH_ATTENTION_COLUMNS, machine_info

    if args.threads:
        torch.set_num_threads(args.threads)
    args.device = _device(args.device)
    _check_out_paths(json=args.json, markdown=args.markdown, plot=args.plot)
    if args.plot and not args.plot.lower().endswith(".png"):
        raise AttnpatchError(f"--plot {args.plot}: give a .png path (it writes <stem>_time.png and <stem>_speedup.png)")
    causal = args.mode == "causal"
    if causal and args.reuse_layers is not None:
        raise AttnpatchError("--reuse-layers: only FNA (--mode noncausal) amortises a landmark sampling over layers")
    methods = _unique_settings(args.method or (["anchor_attention"] if causal else ["fna"]), args.option)
    qkv, layer = (None, None)
    shape = {"--batch": args.batch, "--heads": args.heads, "--kv-heads": args.kv_heads, "--head-dim": args.head_dim}
    lengths = args.lengths
    if args.qkv:
        given = [k for k, v in shape.items() if v is not None]
        if given:
            raise AttnpatchError(f"{', '.join(given)}: the shape comes from the captured inputs (--qkv); drop them")
        qkv, layer = load_qkv(args.qkv, args.layer)
        if lengths is None:  # the default lengths, up to the capture's length
            cap = qkv["q"].shape[2]
            lengths = [n for n in DEFAULT_LENGTHS if n < cap] + [cap]
    elif args.layer is not None:
        raise AttnpatchError("--layer needs --qkv (captured inputs)")
    with background_load(args.background_load) as load:
        if load:
            _progress_line(f"background load: competing PyTorch process started (pid {load['pid']}, {load['threads']} threads)")
        result = bench_attention(
            methods, lengths=lengths or DEFAULT_LENGTHS, causal=causal, batch=args.batch or 1, heads=args.heads or 6,
            kv_heads=args.kv_heads, head_dim=args.head_dim or 64, dtype=getattr(torch, _DTYPES[args.dtype]), device=args.device,
            repeats=args.repeats, warmup=args.warmup, reuse_layers=args.reuse_layers or 6, qkv=qkv, memory=not args.no_memory,
            progress=_progress_line,
        )
    result["config"]["background_load"] = load
    result["machine"] = machine_info()
    if args.qkv:
        result["config"].update(qkv=args.qkv, layer=layer)
    cfg = result["config"]
    src = f"captured {args.qkv} layer {layer}" if args.qkv else "random q/k/v"
    title = (f"bench attention — {cfg['mode']}, B={cfg['batch']} H={cfg['heads']} Hkv={cfg['kv_heads']} D={cfg['head_dim']}, "
             f"{cfg['dtype']} on {cfg['device']}, {src}, median of {cfg['repeats']}" + (", under background load" if load else ""))
    notes = [_load_note(load)] if load else []
    if any("reuse_layers" in r for r in result["rows"]):  # a method amortised a per-forward part over layers
        notes.append(f"FNA time = Nyström + FPS / {cfg['reuse_layers']} (one sampling reused by {cfg['reuse_layers']} layers; "
                     "--reuse-layers); 'vs SDPA (1 FPS/layer)' counts a whole FPS.")
    exps = [f"{k}: {v:.2f}" for k, v in result["exponents"].items() if v is not None]
    if exps:
        notes.append("Scaling exponents (time ~ N^slope): " + ", ".join(exps))
    _bench_out(args, title, result["rows"], BENCH_ATTENTION_COLUMNS, result, footer="\n".join(notes))
    if args.plot:
        for p in plot_attention(result, args.plot, title=f"{cfg['mode']} attention, {src}"):
            print(f"wrote {p}")
    return 0


def _cmd_bench_capture(args) -> int:
    import torch

    from .checkpoints import load_causal_lm
    from .evals.bench import capture_qkv, prefill_ids

    if args.threads:
        torch.set_num_threads(args.threads)
    args.device = _device(args.device)
    _check_out_paths(output=args.output)
    model, tok = load_causal_lm(args.model, device=args.device)
    _check_max_positions(model, [args.length], "--length")
    ids = prefill_ids(tok, args.length).to(args.device)
    got = capture_qkv(model, ids, args.layers)
    got = {layer: {x: (e[x].cpu() if x != "scale" else e[x]) for x in e} for layer, e in got.items()}
    torch.save(got, args.output)
    for layer, e in sorted(got.items()):
        print(f"layer {layer}: q {tuple(e['q'].shape)}, k {tuple(e['k'].shape)}, v {tuple(e['v'].shape)}, scale {e['scale']:.4f}")
    print(f"wrote {args.output}")
    return 0


def _check_max_positions(model, lengths: Sequence[int], flag: str) -> None:
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    too_long = [n for n in lengths if limit and n > limit]
    if too_long:
        raise AttnpatchError(f"{flag} {too_long}: the model's max_position_embeddings is {limit} tokens")


def _cmd_bench_model(args) -> int:
    import torch

    from .checkpoints import _entry, load_causal_lm, load_vision_model
    from .evals.bench import background_load, bench_causal_lm, bench_vision_model
    from .evals.report import BENCH_LM_COLUMNS, BENCH_VISION_COLUMNS, machine_info
    from .patchers.registry import get_method, validate_options

    if args.threads:
        torch.set_num_threads(args.threads)
    args.device = _device(args.device)
    _check_out_paths(json=args.json, markdown=args.markdown)
    kind = args.kind
    if kind == "auto":
        from pathlib import Path

        try:
            kind = _entry(args.model).kind
        except AttnpatchError:
            if not Path(args.model).is_dir():
                raise AttnpatchError(f"--model {args.model!r} is not in the catalogue; say --kind vision or --kind causal_lm") from None
            kind = "vision" if (Path(args.model) / "preprocessor_config.json").is_file() else "causal_lm"
    vision = kind == "vision"
    if vision and args.lengths:
        raise AttnpatchError("--lengths: a ViT is measured at --resolutions")
    if not vision:
        given = [f for f, v in (("--resolutions", args.resolutions), ("--data", args.data), ("--batch", args.batch)) if v]
        given += ["--backend"] if args.backend != "hf" else []
        if given:
            raise AttnpatchError(f"{', '.join(given)}: apply to ViTs only; an LLM is measured at --lengths, batch 1")
    settings = _unique_settings(args.method or (["fna"] if vision else ["anchor_attention"]), args.option)
    for name, opts in settings:
        method = get_method(name)
        if not method.fits(kind):
            raise AttnpatchError(f"method {name!r} does not fit a {kind.replace('_', ' ')} model (it fits: {', '.join(sorted(method.model_kinds))})")
        validate_options(method, opts)  # fail before loading anything
    if vision:
        images = None
        if args.data:
            from .evals.images import load_image_set

            data = load_image_set(args.data, limit=args.batch or 1)
            images = [data[i][0] for i in range(len(data))]
        model, processor = load_vision_model(args.model, backend=args.backend, device=args.device)
        with background_load(args.background_load) as load:
            result = bench_vision_model(
                model, processor, settings, resolutions=args.resolutions or [224, 448, 896], batch=args.batch or 1,
                repeats=args.repeats, warmup=args.warmup, device=args.device, images=images, progress=_progress_line,
            )
        columns, what = BENCH_VISION_COLUMNS, f"batch {args.batch or 1}"
    else:
        model, tok = load_causal_lm(args.model, device=args.device)
        lengths = args.lengths or [1024, 2048, 4096, 8192]
        _check_max_positions(model, lengths, "--lengths")
        with background_load(args.background_load) as load:
            result = bench_causal_lm(
                model, tok, settings, lengths=lengths, repeats=args.repeats, warmup=args.warmup, device=args.device,
                progress=_progress_line,
            )
        columns, what = BENCH_LM_COLUMNS, "prefill, batch 1"
    result["config"]["background_load"] = load
    result.update(model=args.model, kind=kind, machine=machine_info())
    m = result["machine"]
    where = m["cuda"] if str(args.device).startswith("cuda") else f"{m['cpu']}, {m['torch_threads']} torch threads"
    title = f"bench model — {args.model} ({what}) on {where}, median of {args.repeats}" + (", under background load" if load else "")
    _bench_out(args, title, result["rows"], columns, result, footer=_load_note(load))
    return 0


def _fmt_opts(opts: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in opts.items()) if opts else ""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``attnpatch`` command."""
    p = argparse.ArgumentParser(prog="attnpatch", description="Training-free attention patching and its evals.")
    sub = p.add_subparsers(dest="command", required=True)

    pm = sub.add_parser("methods", help="list registered methods, their options, defaults and model kinds")
    pm.add_argument("--json", action="store_true", help="print JSON instead of tables")
    pm.add_argument("--markdown", action="store_true", help="print the README's method table (Markdown, generated from the registry)")
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
    pr.add_argument("--tasks", nargs="+", action=_Repeatable, choices=list(ruler_tasks.TASKS) + ["all"], help="default: niah_single")
    pr.add_argument("--lengths", nargs="+", action=_Repeatable, type=_positive_int, default=[1024, 2048, 4096], help="context lengths in model tokens")
    pr.add_argument("--samples", type=_positive_int, default=10, help="samples per (task, length) cell (default: %(default)s)")
    pr.add_argument("--seed", type=int, default=0)
    pr.add_argument("--depths", nargs="+", action=_Repeatable, type=_fraction, help="needle depths in [0, 1], cycled over samples")
    pr.add_argument("--haystack", choices=["repeat", "essay"], default="repeat")
    pr.add_argument("--no-recall", action="store_true", help="skip the attention-recall measuring pass")
    pr.add_argument("--recall-samples", type=_positive_int, metavar="N", help="measure recall on the first N samples of each cell only (default: all)")
    pr.add_argument("--json", help="result JSON path, rewritten after every finished cell (default: ruler_<model>_<method>.json)")
    pr.add_argument("--markdown", help="also write the table as Markdown to this path")
    pr.add_argument("--threads", type=_positive_int, help="torch CPU threads")
    pr.set_defaults(func=_cmd_eval_ruler)

    def vision_common(q, method_default: str | None = "fna"):
        q.add_argument("--model", default=DEFAULT_VISION_MODEL, help="catalogue name, local directory or hub id (default: %(default)s)")
        q.add_argument("--backend", choices=["hf", "timm"], default="hf", help="model implementation (default: %(default)s)")
        q.add_argument("--data", help="imagefolder directory or hub dataset id (default: the embedded image set)")
        q.add_argument("--resolution", type=_positive_int, help="input size in pixels (square; position embeddings interpolated)")
        q.add_argument("--limit", type=_positive_int, help="use at most this many images")
        q.add_argument("--threads", type=_positive_int, help="torch CPU threads")

    for name, task in VISION_EVALS.items():
        pv = esub.add_parser(name, help=f"{task.replace('_', ' ')} on frozen ViT features, dense vs patched")
        vision_common(pv)
        pv.add_argument(
            "--method", nargs="+", action=_Repeatable, default=["fna"], metavar="METHOD[:NAME=VALUE,...]",
            help="registered method(s), each compared with dense in the same run; options per method after a colon "
            "(e.g. fna:s=32 fna:s=128,sample_layer=0 sink_mask); -o options apply to every method",
        )
        pv.add_argument("-o", "--option", action="append", default=[], metavar="NAME=VALUE", help="method option, repeatable (e.g. -o s=64)")
        pv.add_argument("--batch-size", type=_positive_int, default=16)
        pv.add_argument("--layer-error-images", type=int, default=32, help="images on which per-layer errors are measured (fidelity)")
        pv.add_argument("--k", type=_positive_int, default=20, help="k-NN neighbours (default: %(default)s)")
        pv.add_argument("--json", help="result JSON path (default: <eval>_<model>_<method>.json)")
        pv.add_argument("--markdown", help="also write the table as Markdown to this path")
        pv.set_defaults(func=_cmd_eval_vision)

    def clip_common(q) -> None:
        q.add_argument(
            "--model", default=DEFAULT_CLIP_MODEL,
            help="open_clip ARCH:TAG (e.g. ViT-B-32:openai, ViT-L-14:openai), ARCH:random (random weights, offline), "
            "hf-hub:ORG/REPO, a Hugging Face id (e.g. openai/clip-vit-base-patch32) or a local directory (default: %(default)s)",
        )
        q.add_argument("--method", nargs="+", action=_Repeatable, default=["fna"], help="registered method(s); each is compared with dense in the same run")
        q.add_argument("-o", "--option", action="append", default=[], metavar="NAME=VALUE", help="method option, repeatable (e.g. -o s=64)")
        q.add_argument("--towers", nargs="+", action=_Repeatable, metavar="TOWER", help="towers the patch routes: vision (default), text, or all (text takes only 'dense')")
        q.add_argument("--split", help="dataset split (default: train for a directory; zeroshot: train, clip-retrieval hub ids: test)")
        q.add_argument("--limit", type=_positive_int, help="use at most this many images")
        q.add_argument("--resolution", type=_positive_int, help="input size in pixels (square; position embeddings resampled)")
        q.add_argument("--batch-size", type=_positive_int, default=32, help="images per forward call (default: %(default)s)")
        q.add_argument("--text-batch-size", type=_positive_int, default=256, help="texts per forward call (default: %(default)s)")
        q.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: auto = cuda if available)")
        q.add_argument("--threads", type=_positive_int, help="torch CPU threads")
        q.add_argument("--json", help="result JSON path (default: <eval>_<model>_<method>.json)")
        q.add_argument("--markdown", help="also write the table as Markdown to this path")

    pz = esub.add_parser(
        "zeroshot", aliases=["clip-zeroshot"], help="CLIP zero-shot classification (top-1/top-5), dense vs patched image tower",
    )
    clip_common(pz)
    pz.add_argument("--data", help="labelled imagefolder directory or hub dataset id (default: the embedded image set)")
    pz.add_argument(
        "--classnames", default="auto",
        help="auto (ImageNet-1k CLIP names when the set is ImageNet-1k in torchvision order, else the set's own), "
        "imagenet1k, dataset, or a file (JSON list / one name per line) (default: %(default)s)",
    )
    pz.add_argument(
        "--templates", default="auto",
        help="openai (CLIP's 80 prompts), openai-7, photo ('a photo of a {}.'), or a file with one template per line; "
        "auto = openai for ImageNet names, photo otherwise (default: %(default)s)",
    )
    pz.set_defaults(func=_cmd_eval_clip)

    pt = esub.add_parser(
        "clip-retrieval", aliases=["image-text-retrieval"],
        help="CLIP image<->text retrieval recall@k (CLIP_benchmark definition), dense vs patched image tower",
    )
    clip_common(pt)
    pt.add_argument(
        "--data", required=True,
        help="imagefolder directory with a caption column (e.g. ../shared/data/tuxpaint-captions) or a hub dataset id "
        "(e.g. clip-benchmark/wds_flickr30k, clip-benchmark/wds_mscoco_captions)",
    )
    pt.add_argument("--caption-column", help="caption column (default: the first of caption, captions, sentences, txt, text, raw)")
    pt.add_argument("--ks", nargs="+", action=_Repeatable, type=_positive_int, default=[1, 5, 10], help="recall cut-offs (default: 1 5 10)")
    pt.set_defaults(func=_cmd_eval_clip)

    pb = sub.add_parser("bench", help="speed and memory benchmarks, patched vs exact, measured side by side")
    bsub = pb.add_subparsers(dest="bench", required=True)
    ba = bsub.add_parser("attention", help="one attention layer: time, peak memory and ratio to SDPA per method and N")
    ba.add_argument("--mode", choices=["noncausal", "causal"], default="noncausal", help="ViT (noncausal, fna) or LLM prefill (causal, anchor_attention) (default: %(default)s)")
    ba.add_argument("--method", nargs="+", action=_Repeatable, metavar="METHOD[:NAME=VALUE,...]", help="registered method(s) that fit --mode (causal: methods for causal LMs; noncausal: methods for ViTs), with options (default: fna / anchor_attention)")
    ba.add_argument("-o", "--option", action="append", default=[], metavar="NAME=VALUE", help="option applied to every method, repeatable")
    ba.add_argument("--lengths", nargs="+", action=_Repeatable, type=_positive_int, help="sequence lengths N in tokens (default: 256 512 ... 16384; with --qkv, up to the captured length)")
    ba.add_argument("--batch", type=_positive_int, help="random inputs: batch size (default: 1)")
    ba.add_argument("--heads", type=_positive_int, help="random inputs: query heads (default: 6, DINOv2-S)")
    ba.add_argument("--kv-heads", type=_positive_int, help="random inputs: key/value heads (GQA; default: = heads)")
    ba.add_argument("--head-dim", type=_positive_int, help="random inputs: head dimension (default: 64)")
    ba.add_argument("--dtype", choices=sorted(_DTYPES), default="float32", help="dtype of q/k/v (default: %(default)s)")
    ba.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: %(default)s)")
    ba.add_argument("--repeats", type=_positive_int, default=5, help="timed calls per cell; the median is reported (default: %(default)s)")
    ba.add_argument("--warmup", type=_nonnegative_int, default=1, help="untimed calls before them (default: %(default)s)")
    ba.add_argument("--reuse-layers", type=_positive_int, help="FNA: layers sharing one FPS sampling, for the amortised time (default: 6, DINOv2-S)")
    ba.add_argument("--qkv", help="captured q/k/v file (attnpatch bench capture) instead of random inputs")
    ba.add_argument("--layer", type=int, help="which captured layer (default: the first in the file)")
    ba.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    ba.add_argument("--threads", type=_positive_int, help="torch CPU threads")
    ba.add_argument("--background-load", type=_positive_seconds, nargs="?", const=900.0, metavar="MAX_SECONDS", help=_BACKGROUND_LOAD_HELP)
    ba.add_argument("--json", help="write the result here")
    ba.add_argument("--markdown", help="write the table as Markdown here")
    ba.add_argument("--plot", metavar="PATH.png", help="write <PATH>_time.png (log-log) and <PATH>_speedup.png")
    ba.set_defaults(func=_cmd_bench_attention)

    bc = bsub.add_parser("capture", help="save a causal LM's q/k/v at some layers on a natural-prose prompt (input of bench attention --qkv)")
    bc.add_argument("--model", default=DEFAULT_MODEL, help="catalogue name, local directory or hub id (default: %(default)s)")
    bc.add_argument("--length", type=_positive_int, default=8192, help="prompt length in tokens (default: %(default)s)")
    bc.add_argument("--layers", nargs="+", action=_Repeatable, type=int, required=True, help="attention-layer indices, 0-based")
    bc.add_argument("--output", "-O", required=True, help="file to write (torch.save)")
    bc.add_argument("--device", default="cpu", help="where the model runs: cpu, cuda or cuda:N (default: %(default)s)")
    bc.add_argument("--threads", type=_positive_int, help="torch CPU threads")
    bc.set_defaults(func=_cmd_bench_capture)

    bm = bsub.add_parser("model", help="end to end: ViT images/s vs resolution or LLM prefill latency vs length, unpatched vs patched")
    bm.add_argument("--model", default=DEFAULT_VISION_MODEL, help="catalogue name, local directory or hub id (default: %(default)s)")
    bm.add_argument("--kind", choices=["auto", "vision", "causal_lm"], default="auto", help="auto: from the catalogue")
    bm.add_argument("--backend", choices=["hf", "timm"], default="hf", help="ViT implementation (default: %(default)s)")
    bm.add_argument("--method", nargs="+", action=_Repeatable, metavar="METHOD[:NAME=VALUE,...]", help="settings (default: fna for a ViT, anchor_attention for an LLM)")
    bm.add_argument("-o", "--option", action="append", default=[], metavar="NAME=VALUE", help="option applied to every method, repeatable")
    bm.add_argument("--resolutions", nargs="+", action=_Repeatable, type=_positive_int, help="ViT input sizes in pixels (default: 224 448 896)")
    bm.add_argument("--lengths", nargs="+", action=_Repeatable, type=_positive_int, help="LLM prompt lengths in tokens (default: 1024 2048 4096 8192)")
    bm.add_argument("--batch", type=_positive_int, help="ViT: images per forward (default: 1)")
    bm.add_argument("--data", help="imagefolder or hub dataset the ViT batch is drawn from (default: the embedded image set)")
    bm.add_argument("--repeats", type=_positive_int, default=3, help="timed forwards per cell; the median is reported (default: %(default)s)")
    bm.add_argument("--warmup", type=_nonnegative_int, default=1, help="untimed forwards before them (default: %(default)s)")
    bm.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: %(default)s)")
    bm.add_argument("--threads", type=_positive_int, help="torch CPU threads")
    bm.add_argument("--background-load", type=_positive_seconds, nargs="?", const=900.0, metavar="MAX_SECONDS", help=_BACKGROUND_LOAD_HELP)
    bm.add_argument("--json", help="write the result here")
    bm.add_argument("--markdown", help="write the table as Markdown here")
    bm.set_defaults(func=_cmd_bench_model)

    ps = sub.add_parser("sinks", help="massive-token and attention-sink diagnostic of a ViT, per layer")
    vision_common(ps)
    ps.add_argument("--images", type=_positive_int, default=8, help="images to analyse (default: %(default)s)")
    ps.add_argument("--norm-ratio", type=float, default=5.0, help="massive token: norm above this many times the median")
    ps.add_argument("--mass-ratio", type=float, default=10.0, help="attention sink: above this many times the uniform share")
    ps.add_argument("--json", help="write the full report here")
    ps.set_defaults(func=_cmd_sinks)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``attnpatch`` console script; returns the exit status (2 on a usage or input error)."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except AttnpatchError as exc:
        print(f"attnpatch: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C outside an eval's own handling (loading, writing): one line, no traceback
        print("attnpatch: interrupted (Ctrl-C); nothing more written", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
