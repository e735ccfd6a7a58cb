"""``attnpatch eval {zeroshot,clip-retrieval}``: CLIP zero-shot classification and image<->text retrieval,
dense vs patched image tower."""

from __future__ import annotations

from .args import DEFAULT_CLIP_MODEL, method_spec, positive_int, Repeatable
from .output import check_outputs, image_progress, json_path, plot_file, report, report_interrupted, world_note
from .runtime import open_store, other_process_exit, rank_log, resolve_device, scale_out_args


def cmd_eval_clip(args) -> int:
    import time

    import torch

    from ..evals import clip as clip_eval
    from ..evals.clip.table import CLIP_RETRIEVAL_COLUMNS, ZEROSHOT_COLUMNS, clip_rows
    from ..evals.run.distributed import ranks as current_ranks
    from ..evals.run.report import EvalInterrupted, machine_info
    from ..patchers.registry import get_method, validate_options

    t0 = time.perf_counter()
    ranks = current_ranks()

    if args.threads:
        torch.set_num_threads(args.threads)
    zeroshot = args.eval in ("zeroshot", "clip-zeroshot")
    settings = []
    for spec in args.method:
        method, opts = method_spec(spec, args.option)  # METHOD or METHOD:OPT=VALUE,..., as the other evals
        validate_options(get_method(method), opts)  # fail before loading anything
        settings.append((method, opts))
    if ranks.main:
        check_outputs(("--json", json_path(args)), ("--markdown", args.markdown), ("--plot", plot_file(args)))
    data, bundle, classnames, names_source, templates = load_clip_inputs(args, ranks, zeroshot)
    towers = args.towers
    store = open_store(args, ranks, len(data), settings, split=args.split, towers=towers)
    stop = None
    with image_progress(args.eval, len(data), quiet=not ranks.main) as progress:
        common = dict(settings=settings, towers=towers, batch_size=args.batch_size, text_batch_size=args.text_batch_size, progress=progress,
                      ranks=ranks, store=store)
        try:
            if zeroshot:
                result = clip_eval.run_zeroshot_eval(bundle, data, classnames, templates, ks=(1, 5), **common)
            else:
                result = clip_eval.run_retrieval_eval(bundle, data, ks=tuple(args.ks), **common)
        except EvalInterrupted as exc:
            stop, result = exc, exc.partial
    if not ranks.main:
        return other_process_exit(store, stop)
    if stop is not None and result is None:
        return report_interrupted(args, stop, None, None)
    result.update(
        model=args.model, model_kind=bundle.kind, random_init=bundle.random_init, data=args.data or "default",
        split=getattr(data, "split", None), machine=machine_info(), wall_s=time.perf_counter() - t0,
    )
    if zeroshot:
        result.update(classnames=names_source)
    columns = ZEROSHOT_COLUMNS if zeroshot else CLIP_RETRIEVAL_COLUMNS
    if not zeroshot:
        from ..evals.run.report import Column

        keep = [c for c in columns if "@" not in c.key]
        recall = [Column(f"{d}_recall@{k}", f"{'T→I' if d == 't2i' else 'I→T'} R@{k}", "pct") for d in ("t2i", "i2t") for k in result["ks"]]
        columns = keep[:3] + recall + keep[3:]
    rows = clip_rows(result)
    what = (
        f"{result['n_images']} images, {result['n_classes']} classes ({names_source} names) x {result['n_templates']} templates"
        if zeroshot else f"{result['n_images']} images, {result['n_texts']} captions"
    )
    title = f"{args.eval} — {args.model}{' (random weights)' if bundle.random_init else ''} — {getattr(data, 'name', args.data)}, {what}, {result['resolution']} px"
    title += world_note(result)
    from ..evals.clip.plots import plot_clip_eval

    status = report(args, title, rows, columns, result, interrupted=stop, plot=plot_clip_eval)
    if stop is None:
        store.remove()
    return status


def load_clip_inputs(args, ranks, zeroshot: bool):
    """The data, the CLIP bundle and, for zero-shot, the class names, their source and the templates of ``args``
    (``eval zeroshot|clip-retrieval`` and ``compare``); process 0 loads first (a dataset cache or a checkpoint download
    happens once). Returns ``(data, bundle, classnames, names_source, templates)``, the last three ``None`` for retrieval."""
    from ..clip_models import load_clip
    from ..evals import clip as clip_eval

    classnames = names_source = templates = None
    if zeroshot and args.templates != "auto":
        templates = clip_eval.resolve_templates(args.templates)  # fail early on a bad name
    with ranks.main_first():
        if zeroshot:
            from ..evals.vision.images import load_image_set

            data = load_image_set(args.data, split=args.split or "train", limit=args.limit, log=rank_log(ranks))
            classnames, names_source = clip_eval.resolve_classnames(args.classnames, data)
            if templates is None:
                templates = clip_eval.resolve_templates("openai" if names_source == "imagenet1k" else "photo")
        else:
            data = clip_eval.load_caption_set(args.data, split=args.split, caption_column=args.caption_column, limit=args.limit,
                                          log=rank_log(ranks))
        bundle = load_clip(args.model, device=ranks.device(resolve_device(args.device)), resolution=args.resolution,
                           resolution_flag="--resolution", log=rank_log(ranks))
    return data, bundle, classnames, names_source, templates


def clip_common(q) -> None:
    """The options shared by both CLIP evals."""
    q.add_argument(
        "--model", default=DEFAULT_CLIP_MODEL,
        help="open_clip ARCH:TAG (e.g. ViT-B-32:openai, ViT-L-14:openai), ARCH:random (random weights, offline), "
        "hf-hub:ORG/REPO, a Hugging Face id (e.g. openai/clip-vit-base-patch32) or a local directory (default: %(default)s)",
    )
    q.add_argument("--method", nargs="+", action=Repeatable, default=["fna"], help="registered method(s), each METHOD or METHOD:OPT=VALUE,...; each is compared with dense in the same run")
    q.add_argument("-o", "--option", action="append", default=[], metavar="NAME=VALUE", help="method option, repeatable (e.g. -o s=64)")
    q.add_argument("--towers", nargs="+", action=Repeatable, metavar="TOWER", help="towers the patch routes: vision (default), text, or all (text takes only 'dense')")
    q.add_argument("--split", help="dataset split (default: train for a directory; zeroshot: train, clip-retrieval hub ids: test)")
    q.add_argument("--limit", type=positive_int, help="use at most this many images")
    q.add_argument("--resolution", type=positive_int, help="input size in pixels (square; position embeddings resampled)")
    q.add_argument("--batch-size", type=positive_int, default=32, help="images per forward call (default: %(default)s)")
    q.add_argument("--text-batch-size", type=positive_int, default=256, help="texts per forward call (default: %(default)s)")
    q.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: auto = cuda if available; under a "
                   "multi-process launch cuda:<local rank>)")
    q.add_argument("--threads", type=positive_int, help="torch CPU threads")
    q.add_argument("--json", help="result JSON path (default: <eval>_<model>_<method>.json)")
    q.add_argument("--markdown", help="also write the table as Markdown to this path")
    q.add_argument("--plot", metavar="PATH", help="PNG path (default: next to the JSON, <json stem>.png)")
    scale_out_args(q, device=False, big=False)


def add_parser(esub) -> None:
    """Register ``eval zeroshot`` and ``eval clip-retrieval`` on the ``eval`` subparsers."""
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
    pz.set_defaults(func=cmd_eval_clip)

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
    pt.add_argument("--ks", nargs="+", action=Repeatable, type=positive_int, default=[1, 5, 10], help="recall cut-offs (default: 1 5 10)")
    pt.set_defaults(func=cmd_eval_clip)
