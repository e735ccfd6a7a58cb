"""``attnpatch compare``: dense and several settings on one model and one eval, at matched budgets;
one table, one JSON, a Pareto plot (PNG, next to the JSON unless ``--plot``) and an optional Markdown table
(:mod:`attnpatch.evals.compare`)."""

from __future__ import annotations

from typing import Any

import contextlib
import sys

from .args import DEFAULT_CLIP_MODEL, DEFAULT_MODEL, DEFAULT_VISION_MODEL, fraction, positive_int, Repeatable, unique_settings
from .output import check_outputs, image_progress, plot_file, report, report_interrupted, slug, world_note
from .runtime import load_kwargs, open_store, other_process_exit, rank_log, scale_out_args
from .ruler import ruler_settings, ruler_task_names
from ..errors import AttnpatchError

EVAL_NAMES = ["fidelity", "knn", "linear-probe", "retrieval", "zeroshot", "clip-retrieval", "segmentation", "ruler"]


def log_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@contextlib.contextmanager
def _ruler_progress(total: int):
    """A progress bar over ``total`` samples; yields the ``progress(line)`` callback of the RULER runners."""
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("[bold]compare ruler[/bold]"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.description}")) as prog:
        bar = prog.add_task("", total=total)

        def progress(msg: str) -> None:
            prog.update(bar, advance=1, description=escape(msg))
            if not prog.console.is_terminal:
                print(f"[{int(prog.tasks[0].completed)}/{total}] {msg}", file=sys.stderr, flush=True)

        yield progress


def _run(args, family: str, settings, match, save, ranks, earlier):
    """Load the model and inputs of ``args.eval`` and run the compare; returns ``(result, title, store)``."""
    from ..evals import compare as cmp

    common = dict(settings=settings, match=match, steps=args.steps, log=log_stderr, ranks=ranks)
    quiet = not ranks.main
    # the run identity of the kept batches (--resume) beside open_store's own fields
    same = dict(match=[m.text() for m in match or []], family=family, dtype=args.dtype, backend=args.backend)
    if family == "vision":
        from .vision import load_images_and_model

        stores = []  # opened before the model loads: a --resume of another run fails at once
        images, model, preprocess = load_images_and_model(
            args, ranks, before_model=lambda images: stores.append(open_store(args, ranks, len(images), settings, **same)))
        store = stores[0]
        lei = args.layer_error_images if args.layer_error_images is not None else (32 if args.eval == "fidelity" else 0)
        title = f"compare {args.eval} — {args.model} ({args.backend}) — {images.name}, {len(images)} images"
        with image_progress(f"compare {args.eval}", len(images), quiet=quiet) as progress:
            return cmp.compare_vision(model, images, preprocess, eval=args.eval, batch_size=args.batch_size or 16,
                                      layer_error_images=lei, knn_k=args.k or 20, progress=progress, store=store, **common), title, store
    if family == "segmentation":
        from ..checkpoints import load_vision_model
        from ..evals.segmentation import load_segmentation_set, square_preprocess
        from ..evals.vision.preprocess import fit_resolution
        from ..patchers.adapters import adapter_for

        names = None if args.classnames in (None, "auto") else [c.strip() for c in args.classnames.split(",")]
        data = load_segmentation_set(args.data, train_split=args.train_split, val_split=args.val_split, limit=args.limit,
                                     image_column=args.image_column, mask_column=args.mask_column, classnames=names, void=args.void)
        model, processor = load_vision_model(args.model, backend=args.backend, log=rank_log(ranks), **load_kwargs(args, ranks))
        adapter = adapter_for(model)
        resolution = fit_resolution(args.resolution or 448, adapter.patch_size(model), what="--resolution")
        pc = adapter.preprocess_config(model, processor)
        total = len(data.train) + len(data.val)
        title = (f"compare segmentation — {args.model} ({args.backend}) — {data.name}, {len(data.val)} val / {len(data.train)} train "
                 f"images, {resolution} px, {args.readout[0]} read-out, fit {args.fit}")
        with image_progress("compare segmentation (fit, then score)", total, quiet=quiet) as bar:
            def progress(phase, done, n):
                if bar is not None:
                    bar(done if phase == "fit" else len(data.train) + done, total)

            result = cmp.compare_segmentation(
                model, data, square_preprocess(pc.mean, pc.std, resolution), readout=args.readout[0], readouts=args.readout,
                fit=args.fit, last=args.layers, max_patches=args.max_patches, k=args.k or 30, batch_size=args.batch_size or 8,
                progress=progress, **common)
        result["result"].pop("examples", None)
        return result, title, None
    if family == "clip":
        from .clip import load_clip_inputs

        data, bundle, classnames, _, templates = load_clip_inputs(args, ranks, args.eval == "zeroshot")
        extra = dict(classnames=classnames, templates=templates) if args.eval == "zeroshot" else {}
        store = open_store(args, ranks, len(data), settings, **same)
        title = f"compare {args.eval} — {args.model} — {getattr(data, 'name', args.data)}, {len(data)} images"
        with image_progress(f"compare {args.eval}", len(data), quiet=quiet) as progress:
            return cmp.compare_clip(bundle, data, eval=args.eval, batch_size=args.batch_size or 32, progress=progress, store=store,
                                    **extra, **common), title, store
    from ..checkpoints import load_causal_lm

    tasks = ruler_task_names(args)
    with ranks.main_first():  # a catalogue model is prepared once
        model, tok = load_causal_lm(args.model, log=rank_log(ranks), **load_kwargs(args, ranks))
    title = f"compare ruler — {args.model} — {', '.join(tasks)} at {', '.join(map(str, args.lengths))} tokens, {args.samples} samples per cell"
    with (_ruler_progress(len(tasks) * len(args.lengths) * args.samples) if ranks.main else contextlib.nullcontext()) as progress:
        return cmp.compare_ruler(
            model, tok, tasks=tasks, lengths=args.lengths, num_samples=args.samples, seed=args.seed, depths=args.depths,
            haystack=args.haystack, recall=not args.no_recall, recall_samples=args.recall_samples, progress=progress,
            on_cell=save, resume=earlier, **common,
        ), title, None


def _ruler_key(args, settings, match) -> dict:
    """The fields of a compare ruler JSON a ``--resume`` must find equal."""
    return {
        "model": args.model, "eval": "ruler", "match": [{"key": m.key, "value": m.value} for m in match or []] or None,
        "given": [[m, o] for m, o in settings], "dtype": args.dtype, "result": {"settings": ruler_settings(args)},
    }


def _cmd_compare(args) -> int:
    import time

    import torch

    from ..evals import compare as cmp
    from ..evals.run.distributed import ranks as current_ranks
    from ..evals.run.report import EvalInterrupted, machine_info, write_json
    from ..evals.run.resume import resume_cells

    t0 = time.perf_counter()
    ranks = current_ranks()

    if args.threads:
        torch.set_num_threads(args.threads)
    # everything checked before any model loads
    match = cmp.parse_matches(args.match, args.eval)
    settings = unique_settings(args.method, args.option)
    cmp.check_settings(settings, args.eval)
    family = cmp.EVALS[args.eval][0]
    if args.model is None:
        args.model = {"vision": DEFAULT_VISION_MODEL, "segmentation": DEFAULT_VISION_MODEL, "clip": DEFAULT_CLIP_MODEL, "ruler": DEFAULT_MODEL}[family]
    if family == "segmentation" and not args.data:
        from ..errors import OptionError

        raise OptionError("compare --eval segmentation needs --data (a VOC or ADE20k folder)")
    if args.eval == "clip-retrieval" and not args.data:
        from ..errors import OptionError

        raise OptionError("compare --eval clip-retrieval needs --data (an imagefolder with captions or a hub dataset id)")
    if family == "ruler":
        from ..checkpoints import check_lengths

        check_lengths(args.model, args.lengths, "--lengths")  # from the model's config.json: nothing loads before it
    args.json = args.json or f"compare_{slug(args.eval)}_{slug(args.model)}.json"
    if family == "clip" and (args.device_map or args.dtype != "float32"):
        raise AttnpatchError("compare: --device-map and --dtype apply to the transformers models (ruler and the ViT evals); "
                             "a CLIP model loads in float32 on --device")
    earlier = None
    if ranks.main:
        check_outputs(("--json", args.json), ("--markdown", args.markdown), ("--plot", plot_file(args)))
        if args.resume and family == "ruler":
            plan = [(t, n) for t in ruler_task_names(args) for n in args.lengths]
            earlier = resume_cells(args.json, _ruler_key(args, settings, match), plan, log=log_stderr)
    earlier = ranks.broadcast(earlier)
    machine = machine_info()

    def save(partial) -> None:  # RULER: the JSON rewritten after every finished cell
        if ranks.main:
            write_json(args.json, {**partial, "model": args.model, "machine": machine, "given": [[m, o] for m, o in settings],
                                   "dtype": args.dtype, "wall_s": time.perf_counter() - t0})

    stop = store = None
    try:
        result, title, store = _run(args, family, settings, match, save, ranks, earlier)
    except EvalInterrupted as exc:
        stop, result, title = exc, exc.partial, f"compare {args.eval} — {args.model}"
    if not ranks.main:
        return other_process_exit(store, stop) if store is not None else (130 if stop is not None else 0)
    if stop is not None and result is None:
        return report_interrupted(args, stop, None, None)
    result.update(model=args.model, machine=machine, complete=stop is None, given=[[m, _typed(m, o)] for m, o in settings], dtype=args.dtype,
                  wall_s=time.perf_counter() - t0, world_size=ranks.world_size)
    title += world_note(result)
    if match:
        title += f" — matched {', '.join(m.text() for m in match)}"
    rc = report(args, title, cmp.compare_rows(result), cmp.compare_columns(result), result, interrupted=stop, plot=_plot)
    if stop is None and store is not None:
        store.remove()
    return rc


def _typed(method: str, options: dict[str, Any]) -> dict[str, Any]:
    """The options given on the command line, each parsed to its option's type (``"64"`` -> ``64``)."""
    from ..patchers.registry import get_method, validate_options

    full = validate_options(get_method(method), dict(options))
    return {k: full.get(k, v) for k, v in options.items()}


def _plot(result, path: str, title: str):
    """The Pareto plot of a compare result (:func:`attnpatch.evals.compare.plot_pareto`), or ``None`` when no row
    has both a metric and a speed-up yet (an interrupted run)."""
    from ..evals import compare as cmp

    if not any(r.get("metric") is not None and r.get("speedup") is not None for r in result.get("rows") or []):
        return None
    return cmp.plot_pareto(result, path, title=title)


def add_parser(sub) -> None:
    """Register ``compare`` on the top-level subparsers."""
    from ..evals.ruler import tasks as ruler_tasks
    from ..evals.compare import MATCH_KEYS

    p = sub.add_parser(
        "compare", help="dense and several settings on one model and one eval, at matched budgets: one table, one Pareto plot",
        description="Run dense and every --method setting on the same inputs in one process (interleaved), optionally with "
        "each method's knob matched to one budget (--match), and print one table.",
    )
    p.add_argument("--eval", required=True, choices=EVAL_NAMES, help="the eval (vision: fidelity, knn, linear-probe, retrieval, segmentation; CLIP: zeroshot, clip-retrieval; causal LM: ruler)")
    p.add_argument("--model", help=f"catalogue name, local directory or hub id (default: {DEFAULT_VISION_MODEL} for vision evals, {DEFAULT_CLIP_MODEL} for CLIP, {DEFAULT_MODEL} for ruler)")
    p.add_argument(
        "--method", nargs="+", action=Repeatable, required=True, metavar="METHOD[:NAME=VALUE,...]",
        help="registered method(s), each with its own options after a colon (e.g. fna:s=64 a_shape block_topk:block_size=32)",
    )
    p.add_argument("-o", "--option", action="append", default=[], metavar="NAME=VALUE", help="option for every method (a METHOD:NAME=VALUE wins over it)")
    p.add_argument(
        "--match", metavar="KEY=VALUE", nargs="+",
        help="put every method with a knob at one budget, calibrated on the first batch / sample; with several, each method "
        "follows the first its knob can (e.g. --match tokens=64 speedup=1.4: landmark methods at s = m = 64, the others at "
        "1.4x): "
        + "; ".join(f"{k} ({v})" for k, v in MATCH_KEYS.items()),
    )
    p.add_argument("--steps", type=positive_int, default=10, help="bisection steps per method for --match (default: %(default)s)")
    p.add_argument("--json", help="result JSON path (default: compare_<eval>_<model>.json)")
    p.add_argument("--markdown", help="also write the table as Markdown to this path")
    p.add_argument("--plot", metavar="PATH", help="PNG path of the Pareto plot, metric vs speed-up (default: next to the JSON, "
                   "<json stem>.png)")
    p.add_argument("--threads", type=positive_int, help="torch CPU threads")
    scale_out_args(p, device=False)
    g = p.add_argument_group("vision and CLIP evals")
    g.add_argument("--data", help="imagefolder directory or hub dataset id (default: the embedded image set; clip-retrieval: required)")
    g.add_argument("--resolution", type=positive_int, help="input size in pixels (square; position embeddings interpolated)")
    g.add_argument("--limit", type=positive_int, help="use at most this many images")
    g.add_argument("--batch-size", type=positive_int, help="images per forward call (default: 16 vision, 32 CLIP)")
    g.add_argument("--backend", choices=["hf", "timm"], default="hf", help="ViT implementation (default: %(default)s)")
    g.add_argument("--k", type=positive_int, help="k-NN neighbours (default: 20; segmentation's dense k-NN: 30)")
    g.add_argument("--layer-error-images", type=int, help="per-layer errors on the first N images (default: 32 for fidelity, else 0)")
    g.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: auto = cuda if available; under a multi-process "
                   "launch cuda:<local rank>)")
    g.add_argument("--split", help="CLIP: dataset split")
    g.add_argument("--classnames", default="auto", help="zeroshot: auto, imagenet1k, dataset or a file (default: %(default)s); "
                   "segmentation of a datasets dataset: the class names, comma-separated")
    g.add_argument("--templates", default="auto", help="zeroshot: openai, openai-7, photo or a file (default: %(default)s)")
    g.add_argument("--caption-column", help="clip-retrieval: caption column")
    s = p.add_argument_group("segmentation")
    s.add_argument("--readout", nargs="+", choices=["linear", "knn"], default=["linear"],
                   help="read-outs; the first gives the compare's metric (mIoU) and fidelity (agreement with dense) (default: linear)")
    s.add_argument("--fit", choices=["unpatched", "per-setting"], default="unpatched", help="read-outs fitted on the unpatched model's train features (default) "
                   "or on each setting's own")
    s.add_argument("--layers", type=positive_int, default=1, help="last blocks whose patch tokens are concatenated (default: 1)")
    s.add_argument("--max-patches", type=positive_int, default=100_000, help="train patches for the probe and the k-NN bank")
    s.add_argument("--train-split", help="train split name")
    s.add_argument("--val-split", help="val split name")
    s.add_argument("--image-column", default="image", help="datasets layout: the image column (default: %(default)s)")
    s.add_argument("--mask-column", default="annotation", help="datasets layout: the mask column (default: %(default)s)")
    s.add_argument("--void", type=int, default=255, help="datasets layout: the ignored mask value (default: %(default)s)")
    r = p.add_argument_group("ruler")
    r.add_argument("--tasks", nargs="+", action=Repeatable, choices=list(ruler_tasks.TASKS) + ["all"], help="default: niah_single")
    r.add_argument("--lengths", nargs="+", action=Repeatable, type=positive_int, default=[1024], help="context lengths in model tokens (default: 1024)")
    r.add_argument("--samples", type=positive_int, default=10, help="samples per (task, length) cell (default: %(default)s)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--depths", nargs="+", action=Repeatable, type=fraction, help="needle depths in [0, 1], cycled over samples")
    r.add_argument("--haystack", choices=["repeat", "essay"], default="repeat")
    r.add_argument("--no-recall", action="store_true", help="skip the attention-recall measuring pass (no fidelity column)")
    r.add_argument("--recall-samples", type=positive_int, metavar="N", help="measure recall on the first N samples of each cell only")
    p.set_defaults(func=_cmd_compare)
