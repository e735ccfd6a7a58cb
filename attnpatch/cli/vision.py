"""``attnpatch eval {fidelity,knn,linear-probe,retrieval}``: frozen ViT features, dense vs patched."""

from __future__ import annotations

from .args import DEFAULT_VISION_MODEL, method_spec, positive_int, Repeatable
from .output import check_outputs, image_progress, json_path, plot_file, report, report_interrupted, world_note
from .runtime import load_kwargs, open_store, other_process_exit, rank_log, scale_out_args

VISION_EVALS = {"fidelity": "fidelity", "knn": "knn", "linear-probe": "linear_probe", "retrieval": "retrieval"}


def load_images_and_model(args, ranks=None, before_model=None):
    """The image set, the model (``--dtype``, ``--device-map`` ... where the command has them) and the preprocessing;
    ``before_model(images)`` runs in between (e.g. the ``--resume`` check, before a long model load)."""
    from ..checkpoints import load_vision_model
    from ..evals.run.distributed import Ranks
    from ..evals.vision.preprocess import fit_resolution, make_preprocess
    from ..evals.vision.images import load_image_set
    from ..evals.vision.runner import patch_size

    ranks = ranks or Ranks()
    kwargs = load_kwargs(args, ranks) if hasattr(args, "dtype") else {}
    with ranks.main_first():  # a dataset cache is prepared once
        images = load_image_set(args.data, limit=args.limit, log=rank_log(ranks))
    if before_model is not None:
        before_model(images)
    with ranks.main_first():  # a catalogue model is prepared once
        model, processor = load_vision_model(args.model, backend=args.backend, log=rank_log(ranks), **kwargs)
    resolution = fit_resolution(args.resolution, patch_size(model), log=rank_log(ranks), what="--resolution")
    return images, model, make_preprocess(processor, resolution)


def cmd_eval_vision(args) -> int:
    import time

    import torch

    from ..evals.run.distributed import ranks as current_ranks
    from ..evals.run.report import EvalInterrupted, machine_info
    from ..evals.vision.runner import run_feature_eval
    from ..evals.vision.table import VISION_COLUMNS, vision_rows
    from ..patchers.registry import get_method, validate_options

    t0 = time.perf_counter()
    ranks = current_ranks()

    if args.threads:
        torch.set_num_threads(args.threads)
    task = VISION_EVALS[args.eval]
    tasks = ["fidelity", "knn"] if task == "fidelity" else [task]
    settings = []
    for spec in args.method:
        method, opts = method_spec(spec, args.option)
        validate_options(get_method(method), opts)  # fail before loading anything
        settings.append((method, opts))
    if ranks.main:
        check_outputs(("--json", json_path(args)), ("--markdown", args.markdown), ("--plot", plot_file(args)))
    stores = []  # opened before the model loads: a --resume of another run fails at once
    images, model, preprocess = load_images_and_model(args, ranks, before_model=lambda images: stores.append(open_store(
        args, ranks, len(images), settings, backend=args.backend, dtype=args.dtype, layer_error_images=args.layer_error_images)))
    store = stores[0]
    stop = None
    with image_progress(args.eval, len(images), quiet=not ranks.main) as progress:
        try:
            result = run_feature_eval(
                model, images, preprocess, settings=settings, tasks=tasks, batch_size=args.batch_size,
                layer_error_images=args.layer_error_images, knn_k=args.k, progress=progress, ranks=ranks, store=store,
                probe_max_iter=getattr(args, "max_iter", 1000),
            )
        except EvalInterrupted as exc:
            stop, result = exc, exc.partial
    if not ranks.main:
        return other_process_exit(store, stop)
    if stop is not None and result is None:
        return report_interrupted(args, stop, None, None)
    result.update(model=args.model, backend=args.backend, data=args.data or "default", eval=args.eval, machine=machine_info(),
                  dtype=args.dtype, wall_s=time.perf_counter() - t0)
    rows = vision_rows(result)
    title = f"{args.eval} — {args.model} ({args.backend}) — {images.name}, {result['n_images']} images, {result['resolution']} px"
    title += world_note(result)
    from ..evals.vision.plots import plot_feature_eval

    status = report(args, title, rows, VISION_COLUMNS, result, interrupted=stop, plot=plot_feature_eval)
    if stop is None:
        store.remove()
    return status


def vision_common(q) -> None:
    """The ViT options shared by the feature evals and ``sinks``: model, backend, data, resolution, limit, threads."""
    q.add_argument("--model", default=DEFAULT_VISION_MODEL, help="catalogue name, local directory or hub id (default: %(default)s)")
    q.add_argument("--backend", choices=["hf", "timm"], default="hf", help="model implementation (default: %(default)s)")
    q.add_argument("--data", help="imagefolder directory or hub dataset id (default: the embedded image set)")
    q.add_argument("--resolution", type=positive_int, help="input size in pixels (square; position embeddings interpolated)")
    q.add_argument("--limit", type=positive_int, help="use at most this many images")
    q.add_argument("--threads", type=positive_int, help="torch CPU threads")


def add_parser(esub) -> None:
    """Register the four feature evals on the ``eval`` subparsers."""
    for name, task in VISION_EVALS.items():
        pv = esub.add_parser(name, help=f"{task.replace('_', ' ')} on frozen ViT features, dense vs patched")
        vision_common(pv)
        pv.add_argument(
            "--method", nargs="+", action=Repeatable, default=["fna"], metavar="METHOD[:NAME=VALUE,...]",
            help="registered method(s), each compared with dense in the same run; options per method after a colon "
            "(e.g. fna:s=32 fna:s=128,sample_layer=0 sink_mask); -o options apply to every method",
        )
        pv.add_argument("-o", "--option", action="append", default=[], metavar="NAME=VALUE", help="method option, repeatable (e.g. -o s=64; a METHOD:NAME=VALUE in --method wins over it)")
        pv.add_argument("--batch-size", type=positive_int, default=16)
        pv.add_argument("--layer-error-images", type=int, default=32, help="images on which per-layer errors are measured (fidelity)")
        pv.add_argument("--k", type=positive_int, default=20, help="k-NN neighbours (default: %(default)s)")
        if task == "linear_probe":
            pv.add_argument("--max-iter", type=positive_int, default=1000,
                            help="L-BFGS iteration limit of the logistic regression per fold (default: %(default)s); a setting "
                            "that hits it is marked \"linear_probe_converged\": false in the JSON, with a warning")
        pv.add_argument("--json", help="result JSON path (default: <eval>_<model>_<method>.json)")
        pv.add_argument("--markdown", help="also write the table as Markdown to this path")
        pv.add_argument("--plot", metavar="PATH", help="PNG path (default: next to the JSON, <json stem>.png)")
        scale_out_args(pv)
        pv.set_defaults(func=cmd_eval_vision)
