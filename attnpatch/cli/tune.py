"""``attnpatch tune``: the cheapest setting of a method that meets an accuracy target on calibration data,
written as a JSON config for ``patch(model, method, config=PATH)`` / ``-o config=PATH``, with a held-out check."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import AttnpatchError
from .args import OneSetting, check_fits, fraction, nonnegative_int, parse_options, positive_float, positive_int
from .output import check_outputs, progress_line, slug
from .ruler import NIAH_TASKS, causal_prompts, read_prompt_files

def _kind(model: str, kind: str) -> str:
    from ..checkpoints import catalogue_entry

    if kind != "auto":
        return kind
    try:
        return catalogue_entry(model).kind
    except AttnpatchError:
        if not Path(model).is_dir():
            if "/" in model or Path(model).exists():
                raise AttnpatchError(f"--model {model}: no such folder (a catalogue name or a model folder)") from None
            raise AttnpatchError(f"--model {model!r} is not in the catalogue; say --kind vision or --kind causal_lm") from None
        return "vision" if (Path(model) / "preprocessor_config.json").is_file() else "causal_lm"


def _fmt(v: Any, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def _rows_table(result: dict[str, Any]) -> list[dict[str, Any]]:
    from ..evals.tune import short_options

    rows = []
    for r in result["rows"]:
        row = {"setting": "exact (unpatched)" if r.get("exact") else short_options(r["options"])}
        if result["kind"] == "causal_lm":
            row.update(dense_heads=r["dense_heads"], recall_mean=_fmt(r["recall_mean"]), recall_worst=_fmt(r["recall_worst"]))
        else:
            row.update(cls_cos=_fmt(r["cls_cos"], ".5f"), cls_cos_min=_fmt(r["cls_cos_min"], ".5f"))
        seconds = _fmt(r["seconds"], ".2f")
        if r["seconds"] is None and r.get("note"):
            seconds = "- (all heads dense)" if r["note"].startswith("every head dense") else "- (ran exact)"
        row.update(meets="yes" if r["meets"] else "no", seconds=seconds,
                   speedup="-" if r["speedup"] is None else f"{r['speedup']:.2f}x",
                   chosen="<-" if r is result["chosen"] else "")
        rows.append(row)
    return rows


def _print_rows(rows: list[dict[str, Any]], title: str) -> str:
    from ..evals.run.report import Column, print_table, rows_to_markdown

    columns = [Column(k, k.replace("_", " ")) for k in rows[0]]
    print_table(rows, columns, title=title)
    return rows_to_markdown(rows, columns)


def _holdout_causal(args, model, tok, method: str, options: dict[str, Any]) -> dict[str, Any]:
    from ..evals.ruler.runner import run_ruler_settings

    res = run_ruler_settings(
        model, tok, settings=[(method, options)], tasks=list(NIAH_TASKS), lengths=[args.length], num_samples=args.holdout,
        seed=0, recall=False, progress=progress_line,
    )
    cells = [{"task": c["task"], "length": c["length"], "samples": c["n"], "dense": c["dense_acc"], "tuned": c["patched_acc"],
              "per_sample": [(r["dense_score"], r["patched_score"]) for r in c["samples"]],
              "prefill_speedup": c["prefill_speedup"]} for c in res["runs"][0]["cells"]]
    return {"seed": 0, "samples": args.holdout, "tasks": list(NIAH_TASKS), "length": args.length, "cells": cells}


def _holdout_vision(args, model, images, preprocess, hold, method: str, options: dict[str, Any]) -> dict[str, Any]:
    from ..evals.vision.runner import run_feature_eval

    res = run_feature_eval(model, images.subset(hold), preprocess, settings=[(method, options)], tasks=("knn", "fidelity"),
                           batch_size=args.batch_size, layer_error_images=0)
    run = res["runs"][0]
    return {"images": len(hold), "dense": res["dense"], "tuned": {k: v for k, v in run.items() if not isinstance(v, list)}}


def _cmd_tune(args) -> int:
    import torch

    from ..evals.run.report import machine_info, write_json, write_text
    from ..evals.run.plots import plot_path
    from ..evals.tune import short_options, tunable_methods, tune_causal, tune_vision
    from ..evals.tune.plots import plot_tune
    from ..patchers.api import model_geometry
    from ..patchers.registry import get_method, validate_options, write_config

    if args.threads:
        torch.set_num_threads(args.threads)
    kind = args.resolved_kind
    method = args.method or ("fna" if kind == "vision" else "anchor_attention")
    check_fits(method, kind)
    if args.target is not None:
        return _cmd_tune_agreement(args, kind, method)
    if args.option:
        raise AttnpatchError(f"-o {args.option[0]}: fixed options go with --target (the agreement search); without it, "
                             "give --candidate settings")
    meth = get_method(method)
    if meth.tune_space is None and not args.candidate:
        raise AttnpatchError(f"method {method!r} has no tuning space; give --candidate settings, or tune one of: "
                             f"{', '.join(tunable_methods())}")
    candidates = None
    if args.candidate:
        for c in args.candidate:
            if not any(part.strip() for part in c.split(",")):
                raise AttnpatchError(f"--candidate {c!r}: empty; give NAME=VALUE,... (e.g. theta=6,pool_stride=8)")
        candidates = [parse_options([p for p in c.split(",") if p.strip()]) for c in args.candidate]
        for c in candidates:
            validate_options(meth, c)  # fail before loading the model
    vision = kind == "vision"
    wrong = ([f for f, v in (("--length", args.length_given), ("--prompts", args.prompts), ("--target-recall", args.target_recall),
                             ("--target-worst", args.target_worst)) if v is not None] if vision else
             [f for f, v in (("--data", args.data), ("--resolution", args.resolution), ("--target-cos", args.target_cos)) if v is not None])
    if wrong and vision:
        raise AttnpatchError(f"{', '.join(wrong)}: apply to LLMs only; a ViT is tuned on images (--data, --resolution, --target-cos)")
    if wrong:
        raise AttnpatchError(f"{', '.join(wrong)}: apply to ViTs only; an LLM is tuned on prompts "
                             "(--length, --prompts, --target-recall, --target-worst)")
    if args.prompts and args.calibration_given is not None:
        raise AttnpatchError(f"--calibration {args.calibration_given}: with --prompts every prompt file is a calibration "
                             "prompt; drop one of the two")
    prompt_files = read_prompt_files(args.prompts) if args.prompts else None  # before loading the model
    for flag, v in (("--out", args.out), ("--json", args.json), ("--markdown", args.markdown), ("--plot", args.plot)):
        if v is not None and not v.strip():
            raise AttnpatchError(f"{flag} '': empty; give a file path")
    out = args.out or f"tuned_{slug(args.model)}_{method}.json"
    report = args.json or f"tune_{slug(args.model)}_{method}.json"
    png = str(plot_path(report, args.plot))
    outputs = (("--out", out), ("--json", report), ("--markdown", args.markdown), ("--plot", png))
    check_outputs(*outputs)
    _check_not_inputs(args, prompt_files, outputs)
    machine = machine_info()
    if not vision:
        from ..checkpoints import check_lengths, load_causal_lm

        check_lengths(args.model, [args.length], "--length")  # from the model's config.json: nothing loads before it
        model, tok = load_causal_lm(args.model)
        if args.holdout:  # the held-out prompts are built now, so that a length too short for a task fails before the search
            from ..evals.ruler import tasks as ruler_tasks

            for task in NIAH_TASKS:
                ruler_tasks.make_samples(task, tok, args.length, 1, seed=0)
        prompts, source = causal_prompts(args, tok, prompt_files)
        result = tune_causal(
            model, prompts, method, target_mean=args.target_recall if args.target_recall is not None else 0.95,
            target_worst=args.target_worst if args.target_worst is not None else 0.8, candidates=candidates,
            repeats=args.repeats, progress=progress_line,
        )
        what = f"{result['tokens']} tokens, {source}"
    else:
        from ..checkpoints import load_vision_model
        from ..evals.vision.preprocess import fit_resolution, make_preprocess
        from ..evals.vision.images import load_image_set
        from ..evals.vision.runner import patch_size
        from ..log import log_stderr

        images = load_image_set(args.data)
        if len(images) < args.calibration + (0 if args.holdout == 0 else 2):
            raise AttnpatchError(f"--data: {len(images)} images; --calibration {args.calibration} needs that many, and the "
                                 "held-out k-NN check at least two more (or --holdout 0)")
        model, processor = load_vision_model(args.model, backend=args.backend)
        resolution = fit_resolution(args.resolution, patch_size(model), log=log_stderr, what="--resolution")
        preprocess = make_preprocess(processor, resolution)
        order = torch.randperm(len(images), generator=torch.Generator().manual_seed(0)).tolist()
        cal, hold = order[: args.calibration], order[args.calibration:]
        hold = hold if args.holdout is None else hold[: args.holdout]
        pixels = preprocess([images[i][0] for i in cal])
        result = tune_vision(model, pixels, method, target_cos=args.target_cos if args.target_cos is not None else 0.98,
                             candidates=candidates, repeats=args.repeats, batch_size=args.batch_size, progress=progress_line)
        source = f"{len(cal)} images of {images.name} (seeded order, seed 0)"
        what = f"{result['resolution']} px, {result['tokens']} tokens, {source}"
    chosen = result["chosen"]
    if chosen.get("exact_at_tokens"):
        _stderr_line(f"note: {method}'s exact setting {short_options(chosen['options'])} is exact at {chosen['exact_at_tokens']} "
                     "tokens only; the config records it, and on other input sizes it approximates")
    for w in result["warnings"]:
        _stderr_line(f"warning: {w}")
    geometry = model_geometry(model)
    tuned_for = {"model": args.model, "kind": kind, "tokens": result["tokens"], "calibration": source, "target": result["target"],
                 "exact": bool(chosen.get("exact")), "measured": {k: chosen[k] for k in chosen if k not in ("options", "exact")},
                 "machine": {k: machine.get(k) for k in ("cpu", "cpu_capability", "torch_threads", "torch") if k in machine}}
    if vision:
        tuned_for["resolution"] = result["resolution"]
    write_config(out, method, chosen["options"], geometry, tuned_for=tuned_for)
    result.update(model=args.model, calibration=source, config=str(out), machine=machine)
    write_json(report, result)  # the search is kept before the held-out check starts
    title = f"tune — {args.model} — {method} — {what}"
    drawn = plot_tune(result, png, title)  # the search's plot, kept too before the held-out check
    md = _print_rows(_rows_table(result), title)
    print(f"chosen: {'exact (unpatched): no setting met the target faster' if chosen.get('exact') else short_options(chosen['options'])}"
          f" ({chosen['speedup']:.2f}x on the calibration input); wrote {out}  (use: -o config={out})")
    if args.holdout != 0:
        if vision:
            result["holdout"] = _holdout_vision(args, model, images, preprocess, hold, method, {"config": str(out)})
            h = result["holdout"]
            d, t = h["dense"], h["tuned"]
            line = (f"held-out ({h['images']} images): k-NN top-1 dense {_pct(d.get('knn_top1'))}, tuned {_pct(t.get('knn_top1'))}; "
                    f"k-NN agreement {_pct(t.get('knn_agreement'))}; CLS cos mean {_fmt(t.get('cls_cosine'), '.4f')}, "
                    f"min {_fmt(t.get('cls_cosine_min'), '.4f')}; speed {_fmt(t.get('speedup'), '.2f')}x")
        else:
            result["holdout"] = _holdout_causal(args, model, tok, method, {"config": str(out)})
            parts = [f"{c['task']} dense {_pct(c['dense'])} tuned {_pct(c['tuned'])} (prefill {_fmt(c['prefill_speedup'], '.2f')}x)"
                     for c in result["holdout"]["cells"]]
            line = f"held-out ({args.holdout} sample(s) per task at {args.length} tokens, seeds 0+): " + "; ".join(parts)
        print(line)
        md += "\n\n" + line + "\n"
        write_json(report, result)
    print(f"wrote {report}")
    if drawn:
        print(f"wrote {drawn}")
    if args.markdown:
        write_text(args.markdown, f"### {title}\n\n{md}")
        print(f"wrote {args.markdown}")
    return 0


def _cmd_tune_agreement(args, kind: str, method: str) -> int:
    """``--target knn-agreement=X`` / ``seg-agreement=X``: :func:`attnpatch.evals.tune.search.tune_knn_agreement` on a
    seeded split of the image set, :func:`~attnpatch.evals.tune.search.tune_seg_agreement` on a seeded split of a
    segmentation set's val images (calibration, then the disjoint held-out rest); the chosen setting written as a config."""
    import torch

    from ..evals.run.report import machine_info, write_json, write_text
    from ..evals.tune.search import agreement_line, agreement_tables, parse_target, searchable_methods
    from ..evals.tune.targets import tune_knn_agreement, tune_ruler_agreement, tune_seg_agreement
    from ..patchers.api import model_geometry
    from ..patchers.registry import get_method, write_config

    key, target = parse_target(args.target)
    other = [f for f, v in (("--target-cos", args.target_cos), ("--target-recall", args.target_recall),
                            ("--target-worst", args.target_worst), ("--prompts", args.prompts)) if v is not None]
    if other:
        raise AttnpatchError(f"{', '.join(other)}: not with --target {args.target} (the agreement search has its own "
                             "target; drop one of the two)")
    causal = key == "ruler-agreement"
    if (kind == "causal_lm") != causal:
        raise AttnpatchError(f"--target {args.target}: fits a {'causal LM' if causal else 'ViT'}; this model is a "
                             f"{kind.replace('_', ' ')} (ViT: knn-agreement, seg-agreement; causal LM: ruler-agreement)")
    if not causal and method not in searchable_methods():
        raise AttnpatchError(f"--target {args.target}: method {method!r} has no per-layer knob to search; searchable: "
                             f"{', '.join(searchable_methods())}")
    if args.candidate:
        raise AttnpatchError("--candidate: the agreement search builds its candidates (per-layer families of the method's "
                             "knob); give fixed options with -o NAME=VALUE instead")
    given = parse_options(args.option or [])
    from ..evals.tune.search import check_given
    from ..patchers.registry import validate_options

    check_given(method, given, per_layer=not causal)  # before loading
    for flag, v in (("--out", args.out), ("--json", args.json), ("--markdown", args.markdown)):
        if v is not None and not v.strip():
            raise AttnpatchError(f"{flag} '': empty; give a file path")
    out = args.out or f"tuned_{slug(args.model)}_{method}.json"
    report = args.json or f"tune_{slug(args.model)}_{method}.json"
    check_outputs(("--out", out), ("--json", report), ("--markdown", args.markdown))
    _check_not_inputs(args, None, (("--out", out), ("--json", report), ("--markdown", args.markdown)))
    from ..checkpoints import load_vision_model
    from ..evals.vision.images import load_image_set
    from ..evals.vision.preprocess import fit_resolution, make_preprocess
    from ..evals.vision.runner import patch_size
    from ..log import log_stderr

    if causal:
        from ..checkpoints import check_lengths, load_causal_lm

        check_lengths(args.model, [args.length], "--length")
        model, tok = load_causal_lm(args.model)
        n_cal = args.calibration_given if args.calibration_given is not None else 2
        result = tune_ruler_agreement(model, tok, method, target=target, given=given, tasks=NIAH_TASKS, length=args.length,
                                      calibration=n_cal, held_out=2 if args.holdout is None else args.holdout,
                                      max_candidates=args.max_candidates, repeats=max(args.repeats, 3),
                                      max_minutes=args.max_minutes, progress=progress_line)
        source = (f"{n_cal} NIAH sample(s) per task at {args.length} tokens (seeds 1000+); held-out: "
                  f"{result['held_out'] // len(NIAH_TASKS)} per task (seeds 0+)")
    elif key == "seg-agreement":
        from ..evals.segmentation import load_segmentation_set, square_preprocess
        from ..patchers.adapters import adapter_for

        from ..evals.segmentation.data import detect_layout

        if args.data is None or detect_layout(args.data) == "datasets":
            raise AttnpatchError(f"--data {args.data}: --target seg-agreement reads a VOC or ADE20k segmentation folder "
                                 "(JPEGImages/ + SegmentationClass/, or ADEChallengeData2016/); for a datasets dataset "
                                 "with image and mask columns, use attnpatch eval segmentation")
        data = load_segmentation_set(args.data)  # every file checked before the model loads
        n_val = len(data.val)
        n_cal = args.calibration_given if args.calibration_given is not None else n_val // 2
        if n_cal < 1 or n_val - n_cal < 1:
            raise AttnpatchError(f"--data: {n_val} val images; the calibration share ({n_cal}) and the held-out rest "
                                 f"({n_val - n_cal}) need at least one image each")
        model, processor = load_vision_model(args.model, backend=args.backend)
        adapter = adapter_for(model)
        pc = adapter.preprocess_config(model, processor)
        resolution = fit_resolution(args.resolution or 448, adapter.patch_size(model), what="--resolution")
        result = tune_seg_agreement(model, data, square_preprocess(pc.mean, pc.std, resolution), method, target=target,
                                    given=given, calibration=n_cal, split_seed=args.split_seed, batch_size=args.batch_size,
                                    max_candidates=args.max_candidates, repeats=max(args.repeats, 3),
                                    max_minutes=args.max_minutes, progress=progress_line)
        source = (f"{n_cal} of the {n_val} val images of {data.name} (seeded split, seed {args.split_seed}; the linear "
                  f"read-out fitted once on its {len(data.train)} train images, unpatched); held-out: the other {n_val - n_cal}")
    else:
        images = load_image_set(args.data)
        n_cal = args.calibration_given if args.calibration_given is not None else len(images) // 2
        if n_cal < 2 or len(images) - n_cal < 2:
            raise AttnpatchError(f"--data: {len(images)} images; the calibration split ({n_cal}) and the held-out rest "
                                 f"({len(images) - n_cal}) need at least 2 images each")
        model, processor = load_vision_model(args.model, backend=args.backend)
        resolution = fit_resolution(args.resolution, patch_size(model), log=log_stderr, what="--resolution")
        preprocess = make_preprocess(processor, resolution)
        order = torch.randperm(len(images), generator=torch.Generator().manual_seed(args.split_seed)).tolist()
        cal, hold = images.subset(order[:n_cal]), images.subset(order[n_cal:])
        result = tune_knn_agreement(model, cal, hold, preprocess, method, target=target, given=given,
                                    batch_size=args.batch_size, max_candidates=args.max_candidates,
                                    repeats=max(args.repeats, 3), max_minutes=args.max_minutes, progress=progress_line)
        source = f"{n_cal} of {len(images)} images of {images.name} (seeded split, seed {args.split_seed}); held-out: the other {len(hold)}"
    chosen = result["chosen"]
    meth = get_method(method)
    options = chosen["options"] if not chosen.get("exact") else validate_options(meth, meth.exact_everywhere() or {})
    machine = machine_info()
    write_config(out, method, options, model_geometry(model), tuned_for={
        "model": args.model, "kind": kind, "target": {key: target}, "resolution": result.get("resolution"),
        "tokens": result["tokens"], "calibration": source, "exact": bool(chosen.get("exact")),
        "measured": {"agreement": chosen["agreement"], "speedup": chosen["speedup"], "spread": chosen["spread"]},
        "held_out": result["held_out_result"]})
    result.update(model=args.model, target_key=key, calibration_source=source, config=str(out), machine=machine)
    write_json(report, result)
    size = f"{result['resolution']} px, " if result.get("resolution") else ""
    title = f"tune {key} >= {target:g} — {args.model} — {method} — {size}{result['tokens']} tokens, {source}"
    rows, wins = agreement_tables(result)
    md = _print_rows(rows, title)
    if wins:
        md += "\n\n" + _print_rows(wins, "each family's cheapest setting that meets the target, timed beside dense")
    line = agreement_line(result, key)
    if result.get("stopped"):
        line = f"search stopped {result['stopped']} (--max-minutes); each family kept its best so far\n" + line
    print(line)
    print(f"wrote {out}  (use: -o config={out})")
    print(f"wrote {report}")
    if args.markdown:
        write_text(args.markdown, f"### {title}\n\n{md}\n\n{line}\n")
        print(f"wrote {args.markdown}")
    return 0


def _check_not_inputs(args, prompt_files, outputs) -> None:
    """Refuse an output path that is one of the run's inputs: a calibration prompt, a file in the model's folder,
    a file in the image set's folder."""
    import os

    inputs = [os.path.realpath(f) for f, _ in (prompt_files or [])]
    folders = [os.path.realpath(d) for d in (args.model, args.data) if d and Path(d).is_dir()]
    for flag, path in outputs:
        if not path:
            continue
        real = os.path.realpath(Path(path).expanduser())
        if real in inputs:
            raise AttnpatchError(f"{flag} {path}: is a calibration prompt (--prompts); give another path")
        for d in folders:
            if real.startswith(d + os.sep):
                raise AttnpatchError(f"{flag} {path}: lies inside the input folder {d}; write it elsewhere")


def _stderr_line(msg: str) -> None:
    import sys

    print(msg, file=sys.stderr)


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def add_parser(sub) -> None:
    """Register ``tune``."""
    p = sub.add_parser("tune", help="find the cheapest setting of a method that meets an accuracy target; write it as a config")
    p.add_argument("--model", default="smollm2-135m-instruct", help="catalogue name or local directory (default: %(default)s)")
    p.add_argument("--kind", choices=["auto", "vision", "causal_lm"], default="auto", help="auto: from the catalogue")
    p.add_argument("--backend", choices=["hf", "timm"], default="hf", help="ViT implementation (default: %(default)s)")
    p.add_argument("--method", action=OneSetting, metavar="METHOD", hint="tune one method per run",
                   help="method to tune (default: anchor_attention for an LLM, fna for a ViT)")
    p.add_argument("--candidate", action="append", metavar="NAME=VALUE,...",
                   help="a setting to try instead of the method's tuning space, repeatable (e.g. theta=6,pool_stride=8)")
    p.add_argument("--length", type=positive_int, default=None,
                   help="LLM: length in tokens of the embedded calibration prompts and of the held-out NIAH check (default: 4096)")
    p.add_argument("--prompts", help="LLM: a .txt file or a folder of .txt files, one calibration prompt each (default: embedded NIAH prompts)")
    p.add_argument("--target-recall", type=fraction, default=None, help="LLM: mean attention recall to reach (default: 0.95)")
    p.add_argument("--target-worst", type=fraction, default=None, help="LLM: mean recall of the worst 5%% (prompt, layer, head) (default: 0.8)")
    p.add_argument("--data", help="ViT: imagefolder or hub dataset (default: the embedded image set)")
    p.add_argument("--resolution", type=positive_int, help="ViT: input size in pixels (default: the model's)")
    p.add_argument("--target-cos", type=float, default=None, help="ViT: mean final-CLS cosine to the unpatched model (default: 0.98)")
    p.add_argument("--batch-size", type=positive_int, default=8, help="ViT: images per forward (default: %(default)s)")
    p.add_argument("--calibration", type=positive_int, default=None, help="prompts (default 2) or images (default 8) to tune on")
    p.add_argument("--holdout", type=nonnegative_int, default=None,
                   help="held-out check: NIAH samples per task (default 2) or images (default: the rest of the set); 0 = none")
    p.add_argument("--repeats", type=positive_int, default=2, help="timed forwards per candidate (median; default: %(default)s)")
    p.add_argument("--out", help="the tuned config (default: tuned_<model>_<method>.json)")
    p.add_argument("--json", help="the search and held-out result (default: tune_<model>_<method>.json)")
    p.add_argument("--markdown", help="also write the tables as Markdown here")
    p.add_argument("--plot", metavar="PATH", help="PNG path (default: next to the JSON, <json stem>.png): each candidate's "
                   "score vs speed-up, the target, the chosen one")
    p.add_argument("--target", metavar="KEY=X", action=OneSetting, hint="tune for one target per run",
                   help="tune on downstream agreement: ViT knn-agreement=X (k-NN top-1 agreement with the unpatched "
                   "model; --data an image set) or seg-agreement=X (segmentation prediction agreement, linear read-out; "
                   "--data a VOC / ADE20k segmentation set); causal LM ruler-agreement=X (share of RULER samples scored "
                   "as dense scores them); on a seeded calibration split, reported on the held-out rest; the method's "
                   "knob searched per layer (ViT) or on every layer (causal LM)")
    p.add_argument("-o", "--option", action="append", default=[], metavar="NAME=VALUE",
                   help="with --target: an option every candidate keeps (e.g. -o s=64 for tome+fna)")
    p.add_argument("--max-candidates", type=positive_int, default=24,
                   help="with --target: settings measured for agreement at most (default: %(default)s)")
    p.add_argument("--max-minutes", type=positive_float, default=45,
                   help="with --target: after the dense pass and the first round, no setting starts whose measurement "
                   "would end past this many minutes, and one running then is dropped (default: %(default)s; the "
                   "winners' timing and the held-out check follow)")
    p.add_argument("--split-seed", type=nonnegative_int, default=0, help="with --target: seed of the calibration / held-out split")
    p.add_argument("--threads", type=positive_int, help="torch CPU threads")
    p.set_defaults(func=_run)


def _run(args) -> int:
    args.length_given, args.calibration_given = args.length, args.calibration
    if args.length is None:
        args.length = 4096
    args.resolved_kind = _kind(args.model, args.kind)
    vision = args.resolved_kind == "vision"
    if args.calibration is None:
        args.calibration = 8 if vision else 2
    if args.holdout is None and not vision:
        args.holdout = 2  # a ViT's held-out check takes every image not used for calibration
    if vision and args.holdout == 1:
        raise AttnpatchError("--holdout 1: the held-out k-NN check needs at least 2 images (or --holdout 0 for none)")
    if args.target_cos is not None and not -1.0 <= args.target_cos <= 1.0:
        raise AttnpatchError(f"--target-cos {args.target_cos}: must be a cosine in [-1, 1]")
    return _cmd_tune(args)

