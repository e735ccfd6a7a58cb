"""``attnpatch eval clip-benchmark``: CLIP_benchmark's zero-shot classification / retrieval on a patched CLIP,
dense and each setting side by side; one CLIP_benchmark result file per setting, our table and JSON."""

from __future__ import annotations

import argparse

from ..args import positive_int, Repeatable
from ..output import check_outputs, json_path, plot_file, report, slug


def setting_file(args, label: str) -> str:
    """The CLIP_benchmark-format file of one setting: the ``--json`` path with ``.<setting>`` before ``.json``."""
    base = json_path(args)
    stem = base[:-5] if base.endswith(".json") else base
    return f"{stem}.{slug(label.replace(' (', '_').replace(', ', '_').replace('=', '-').rstrip(')'))}.json"


def cmd_eval_clip_benchmark(args) -> int:
    import time

    from ...evals import clipbench as cb
    from ...evals.run.distributed import ranks as current_ranks
    from ...evals.run.report import Column, EvalInterrupted, machine_info, write_json
    from ...errors import AttnpatchError

    version = cb.require_clip_benchmark()  # before anything loads
    t0 = time.perf_counter()
    import torch

    from ...clip_models import load_clip
    from ...patchers.registry import get_method, validate_options
    from ..args import unique_settings
    from ..runtime import resolve_device

    if current_ranks().distributed:
        raise AttnpatchError("eval clip-benchmark runs in one process (CLIP_benchmark's evaluate is not sharded); start it without torchrun / accelerate launch")
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = unique_settings(args.method, args.option)  # a setting given twice would share a row name and a result file
    for method, opts in settings:
        validate_options(get_method(method), opts)  # fail before loading anything
    check_outputs(("--json", json_path(args)), ("--markdown", args.markdown), ("--plot", plot_file(args)))
    bundle = load_clip(args.model, device=resolve_device(args.device), resolution=args.resolution, resolution_flag="--resolution")
    data = cb.load_bench_data(args.dataset, task=args.task, root=args.dataset_root, split=args.split, preprocess=bundle.preprocess,
                              classnames=args.classnames, templates=args.templates, language=args.language,
                              caption_column=args.caption_column, limit=args.limit)
    arch, _, tag = args.model.rpartition(":") if bundle.kind == "open_clip" and ":" in args.model and not args.model.startswith("hf-hub:") else (args.model, "", args.model)
    files: list[str] = []

    def write_setting(entry):
        path = setting_file(args, entry["setting"])
        write_json(path, cb.upstream_result(entry, dataset=args.dataset, model=arch, pretrained=tag, task=data.task, language=args.language,
                                            amp=args.amp))
        entry["file"] = path
        files.append(path)

    stop = None
    try:
        result = cb.run_clip_benchmark(bundle, data, settings=settings, towers=args.towers, amp=args.amp, ks=args.ks,
                                       batch_size=args.batch_size, on_setting=write_setting)
    except EvalInterrupted as exc:
        stop, result = exc, exc.partial
        if result is None:
            from ..output import report_interrupted

            return report_interrupted(args, stop, None, None)
    try:
        tokens = bundle.vision_tokens()
    except AttnpatchError:
        tokens = None
    result.update(harness=f"clip_benchmark {version}", model=args.model, model_kind=bundle.kind, random_init=bundle.random_init,
                  language=args.language, resolution=bundle.resolution, tokens=tokens, machine=machine_info(),
                  wall_s=time.perf_counter() - t0)
    if data.task == "zeroshot_classification":
        result["classnames"] = data.classnames_source
    keys = list(result["dense"]["metrics"])
    short = {"acc1": "acc1", "acc5": "acc5", "mean_per_class_recall": "mean/class recall"}

    def title_of(k):
        return short.get(k) or k.replace("image_retrieval_recall@", "T→I R@").replace("text_retrieval_recall@", "I→T R@")

    columns = ([Column("setting", "setting")] + [Column(k, title_of(k), "pct") for k in keys]
               + [Column(f"Δ{k}", f"Δ {title_of(k)}", "pct") for k in keys]
               + [Column("agreement", "top-1 agree", "pct"), Column("images_per_s", "img/s", "f2"), Column("speedup", "speed-up", "x")])
    rows = [{**e, **e["metrics"], **{f"Δ{k}": v for k, v in (e.get("diff") or {}).items()},
             "setting": e["setting"] + (f" [{e['note']}]" if e.get("note") else "")} for e in [result["dense"], *result["runs"]]]
    what = (f"{result['n_images']} images, {result.get('n_classes')} classes x {result.get('n_templates')} templates"
            if data.task == "zeroshot_classification" else f"{result['n_images']} images, {result.get('n_texts')} captions")
    title = (f"clip-benchmark {data.task} — {args.model}{' (random weights)' if bundle.random_init else ''} — {args.dataset}, {what}, "
             f"{bundle.resolution} px, amp {'on' if args.amp else 'off'}")
    from ...evals.clipbench.plots import plot_clip_benchmark

    status = report(args, title, rows, columns, result, interrupted=stop, plot=plot_clip_benchmark)
    if stop is None:
        for f in files:
            print(f"wrote {f}")
    return status


def add_parser(esub) -> None:
    """Register ``eval clip-benchmark`` on the ``eval`` subparsers."""
    from ..args import DEFAULT_CLIP_MODEL

    p = esub.add_parser(
        "clip-benchmark", help="CLIP_benchmark's zero-shot classification / retrieval (its own code), dense vs each setting",
    )
    p.add_argument("--model", default=DEFAULT_CLIP_MODEL, help="as eval zeroshot: ARCH:TAG, ARCH:random, hf-hub:ORG/REPO, a Hugging "
                   "Face id or a local directory (default: %(default)s)")
    p.add_argument("--dataset", required=True, help="a CLIP_benchmark dataset name (cifar10, imagenet1k, mscoco_captions, flickr30k, "
                   "wds/..., built from --dataset-root) or a local folder (labelled imagefolder, or one with a caption column)")
    p.add_argument("--dataset-root", default="root", help="CLIP_benchmark's dataset root; {dataset} and {dataset_cleaned} are filled "
                   "in (default: %(default)s)")
    p.add_argument("--task", default="auto", choices=["auto", "zeroshot_classification", "zeroshot_retrieval"],
                   help="auto: CLIP_benchmark's default task of the name; for a folder, retrieval when it has captions")
    p.add_argument("--method", nargs="+", action=Repeatable, default=["fna"], help="registered method(s), each METHOD or "
                   "METHOD:OPT=VALUE,...; each is run after dense on the same loaded model")
    p.add_argument("-o", "--option", action="append", default=[], metavar="NAME=VALUE", help="method option, repeatable (e.g. -o s=64)")
    p.add_argument("--towers", nargs="+", action=Repeatable, metavar="TOWER", help="towers the patch routes: vision (default), text, or all")
    p.add_argument("--amp", action=argparse.BooleanOptionalAction, default=False,
                   help="CLIP_benchmark's autocast (bfloat16 on a CPU, float16 on CUDA); its own CLI defaults to on, this command "
                   "to off (float32, as eval zeroshot / clip-retrieval) (default: off)")
    p.add_argument("--split", help="split (default: test for a CLIP_benchmark name, train for a folder)")
    p.add_argument("--language", default="en", help="CLIP_benchmark's language of class names and templates (default: %(default)s)")
    p.add_argument("--classnames", default="auto", help="a folder's class names, as eval zeroshot (a CLIP_benchmark set brings its own)")
    p.add_argument("--templates", default="auto", help="as eval zeroshot; auto: a CLIP_benchmark set's own, for a folder as eval zeroshot")
    p.add_argument("--caption-column", help="a captioned folder's caption column (default: as eval clip-retrieval)")
    p.add_argument("--ks", nargs="+", action=Repeatable, type=positive_int, default=[1, 5, 10], help="retrieval recall cut-offs (default: 1 5 10)")
    p.add_argument("--limit", type=positive_int, help="use the first N images")
    p.add_argument("--resolution", type=positive_int, help="input size in pixels (square; position embeddings resampled)")
    p.add_argument("--batch-size", type=positive_int, default=32, help="images per batch (default: %(default)s)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: auto = cuda if available)")
    p.add_argument("--threads", type=positive_int, help="torch CPU threads")
    p.add_argument("--json", help="our side-by-side JSON (default: clip-benchmark_<model>_<method>.json); each setting's "
                   "CLIP_benchmark result goes next to it as <json stem>.<setting>.json")
    p.add_argument("--markdown", help="also write the table as Markdown to this path")
    p.add_argument("--plot", metavar="PATH.png", help="PNG of the headline metric against the image-tower speed-up per "
                   "setting (default: next to the JSON, <json stem>.png)")
    p.set_defaults(func=cmd_eval_clip_benchmark)
