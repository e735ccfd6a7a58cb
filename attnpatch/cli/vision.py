"""``attnpatch eval {fidelity,knn,linear-probe,retrieval}``: frozen ViT features, dense vs patched; ``attnpatch eval
segmentation``: semantic segmentation on frozen patch features."""

from __future__ import annotations

from .args import DEFAULT_VISION_MODEL, Repeatable, checked_settings, method_spec, nonnegative_int, positive_float, positive_int
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
    """Register the four feature evals and ``segmentation`` on the ``eval`` subparsers."""
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
    add_segmentation_parser(esub)


def examples_path(args) -> str:
    """``--examples-png``, or the result JSON's path with ``_examples.png``."""
    from pathlib import Path

    if args.examples_png:
        return args.examples_png
    p = Path(json_path(args))
    return str(p.with_name(p.stem + "_examples.png"))


def cmd_eval_segmentation(args) -> int:
    import time

    import torch

    from ..checkpoints import load_vision_model
    from ..errors import OptionError
    from ..evals.run.report import EvalInterrupted, machine_info
    from ..evals.segmentation import check_dense_methods, load_segmentation_set, run_segmentation, square_preprocess
    from ..evals.segmentation.plots import plot_examples, plot_segmentation
    from ..evals.segmentation.table import segmentation_columns, segmentation_rows
    from ..evals.vision.preprocess import fit_resolution
    from ..patchers.adapters import adapter_for

    t0 = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = checked_settings(args.method, args.option, "vision")  # fail before loading anything
    check_dense_methods([m for m, _ in settings])
    if args.head:
        from ..evals.segmentation.heads import read_head

        read_head(args.head)  # a missing, unreadable or malformed head file is refused before the model loads
    if args.head and args.fit != "unpatched":
        raise OptionError(f"--head {args.head}: a released head is the linear read-out of every setting; it needs --fit unpatched, not --fit {args.fit}")
    if args.head and "linear" not in args.readout:
        raise OptionError(f"--head {args.head}: a released head is the linear read-out; add linear to --readout")
    check_outputs(("--json", json_path(args)), ("--markdown", args.markdown), ("--plot", plot_file(args)),
                  ("--examples-png", examples_path(args)))
    classnames = [c.strip() for c in args.classnames.split(",")] if args.classnames else None
    data = load_segmentation_set(args.data, train_split=args.train_split, val_split=args.val_split, limit=args.limit,
                                 image_column=args.image_column, mask_column=args.mask_column, classnames=classnames, void=args.void)
    model, processor = load_vision_model(args.model, backend=args.backend)
    adapter = adapter_for(model)
    resolution = fit_resolution(args.resolution, adapter.patch_size(model), what="--resolution")
    pc = adapter.preprocess_config(model, processor)
    preprocess = square_preprocess(pc.mean, pc.std, resolution)
    stop = None
    with image_progress("segmentation (fit: train images, then score: val images)", len(data.train) + len(data.val)) as bar:
        def progress(phase, done, total):
            if bar is not None:
                bar(done if phase == "fit" else len(data.train) + done, len(data.train) + len(data.val))

        try:
            result = run_segmentation(
                model, data, preprocess, settings=settings, readouts=args.readout, fit=args.fit, last=args.layers,
                max_patches=args.max_patches, k=args.k, temperature=args.temperature, head=args.head, batch_size=args.batch_size,
                probe_steps=args.probe_steps, seed=args.seed, examples=args.examples, progress=progress,
            )
        except EvalInterrupted as exc:
            stop, result = exc, exc.partial
    if stop is not None and result is None:
        return report_interrupted(args, stop, None, None)
    examples = result.pop("examples", None)
    result.update(model=args.model, backend=args.backend, eval="segmentation", machine=machine_info(),
                  wall_s=time.perf_counter() - t0, preprocess={"resize": "square (aspect not kept), bicubic", "mean": list(pc.mean),
                                                           "std": list(pc.std)})
    if examples:
        result["example_ids"] = examples["ids"]
    title = (f"segmentation — {args.model} ({args.backend}) — {data.name}, {result['n_images']} val / {result['n_train']} train images, "
             f"{result['resolution']} px, fit {args.fit}")
    rows = segmentation_rows(result)
    status = report(args, title, rows, segmentation_columns(result["readouts"]), result, interrupted=stop, plot=plot_segmentation)
    if examples and stop is None and result["runs"]:
        from ..evals.run.report import setting_label

        ids = examples["ids"]
        png = plot_examples(examples, [data.val.image(i) for i in range(len(ids))], [data.val.labels(i) for i in range(len(ids))],
                            len(data.classes), result["readouts"][0], [setting_label(r["method"], r["given_options"]) for r in result["runs"]],
                            examples_path(args), title)
        if png:
            print(f"wrote {png}")
    return status


def add_segmentation_parser(esub) -> None:
    """Register ``eval segmentation`` on the ``eval`` subparsers."""
    from ..evals.segmentation import FITS, READOUTS

    p = esub.add_parser("segmentation", help="semantic segmentation (linear probe, dense k-NN) on frozen patch features, dense vs patched")
    p.add_argument("--data", required=True, help="a Pascal VOC folder, an ADE20k folder (ADEChallengeData2016) or a datasets dataset "
                   "with an image and a mask column")
    p.add_argument("--model", default=DEFAULT_VISION_MODEL, help="catalogue name, local directory or hub id (default: %(default)s)")
    p.add_argument("--backend", choices=["hf", "timm"], default="hf", help="model implementation (default: %(default)s)")
    p.add_argument("--method", nargs="+", action=Repeatable, default=["fna"], metavar="METHOD[:NAME=VALUE,...]",
                   help="registered method(s), each compared with dense in the same run (e.g. fna fna:s=64,min_tokens=0 tome:r=48)")
    p.add_argument("-o", "--option", action="append", default=[], metavar="NAME=VALUE", help="method option for every method, repeatable")
    p.add_argument("--readout", nargs="+", choices=READOUTS, default=list(READOUTS),
                   help="linear: BatchNorm + 1x1 linear head (DINOv2's linear protocol); knn: training-free dense k-NN "
                   "(Hummingbird) (default: both)")
    p.add_argument("--fit", choices=FITS, default="unpatched", help="fit the read-outs on the unpatched model's train features and apply "
                   "them to every setting (unpatched, default), or fit each setting on its own (per-setting)")
    p.add_argument("--layers", type=positive_int, default=1, help="last blocks whose patch tokens are concatenated (DINOv2: 1 or 4; default 1)")
    p.add_argument("--max-patches", type=positive_int, default=100_000,
                   help="train patches kept for the probe and the k-NN memory bank (default: %(default)s)")
    p.add_argument("--k", type=positive_int, default=30, help="k-NN neighbours (default: %(default)s)")
    p.add_argument("--temperature", type=positive_float, default=0.02, help="softmax temperature of the k-NN vote (default: %(default)s)")
    p.add_argument("--head", metavar="FILE", help="a released DINOv2 linear head (decode_head.bn.*, decode_head.conv_seg.*) used "
                   "instead of training the probe")
    p.add_argument("--probe-steps", type=positive_int, default=2000,
                   help="AdamW steps of the linear probe, batches of 1024 sampled patches (default: %(default)s)")
    p.add_argument("--resolution", type=positive_int, default=448, help="square input side in pixels (default: %(default)s)")
    p.add_argument("--limit", type=positive_int, help="use at most this many images per split")
    p.add_argument("--train-split", help="train split name (default: train / training)")
    p.add_argument("--val-split", help="val split name (default: val / validation)")
    p.add_argument("--image-column", default="image", help="datasets layout: the image column (default: %(default)s)")
    p.add_argument("--mask-column", default="annotation", help="datasets layout: the mask column (default: %(default)s)")
    p.add_argument("--classnames", help="datasets layout: class names, comma-separated, index = mask value")
    p.add_argument("--void", type=int, default=255, help="datasets layout: the ignored mask value (default: %(default)s)")
    p.add_argument("--batch-size", type=positive_int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--examples", type=nonnegative_int, default=4, help="val images drawn side by side in the examples PNG (default: %(default)s)")
    p.add_argument("--threads", type=positive_int, help="torch CPU threads")
    p.add_argument("--json", help="result JSON path (default: segmentation_<model>_<method>.json)")
    p.add_argument("--markdown", help="also write the table as Markdown to this path")
    p.add_argument("--plot", metavar="PATH", help="PNG path of mIoU vs speed-up (default: next to the JSON)")
    p.add_argument("--examples-png", metavar="PATH", help="PNG of image / ground truth / dense / patched predictions "
                   "(default: <json stem>_examples.png)")
    p.set_defaults(func=cmd_eval_segmentation)
