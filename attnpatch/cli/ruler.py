"""``attnpatch eval ruler``: RULER-style long-context tasks on a causal LM, dense vs patched."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from ..errors import AttnpatchError

from .args import DEFAULT_MODEL, OneSetting, Repeatable, check_fits, fraction, method_spec, positive_int
from .output import check_outputs, fmt_opts, report_interrupted, slug, world_note
from .runtime import load_kwargs, scale_out_args


def cmd_eval_ruler(args) -> int:
    import contextlib
    import time

    import torch
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..checkpoints import check_lengths, load_causal_lm
    from ..evals.run.distributed import ranks as current_ranks
    from ..evals.run.plots import plot_path
    from ..evals.run.report import EvalInterrupted, machine_info, print_table, rows_to_markdown, write_json, write_text
    from ..evals.run.resume import resume_cells
    from ..evals.ruler.plots import plot_niah_heatmap
    from ..evals.ruler.runner import run_ruler
    from ..evals.ruler.table import RULER_COLUMNS
    from ..log import log_stderr
    from ..patchers.registry import get_method, validate_options

    t0 = time.perf_counter()
    ranks = current_ranks()

    if args.threads:
        torch.set_num_threads(args.threads)
    # fail before loading the model; a method without options (``dense``) validates to {}
    args.method, spec_options = method_spec(args.method, args.option)  # METHOD or METHOD:OPT=VALUE,... (-o applies too)
    check_fits(args.method, "causal_lm")
    options = validate_options(get_method(args.method), spec_options)
    tasks = ruler_task_names(args)
    check_lengths(args.model, args.lengths, "--lengths")  # from the model's config.json: nothing loads before it
    path = args.json or f"ruler_{slug(args.model)}_{slug(args.method)}.json"
    png = str(plot_path(path, args.plot))  # a --plot that is not a .png fails here, on every process
    kwargs = load_kwargs(args, ranks)
    key = {"model": args.model, "method": args.method, "options": options, "dtype": args.dtype, "settings": ruler_settings(args)}
    earlier = None
    if ranks.main:
        check_outputs(("--json", path), ("--plot", png), ("--markdown", args.markdown))  # before the long work, not after it
        if args.resume:
            earlier = resume_cells(path, key, [(t, n) for t in tasks for n in args.lengths], log=log_stderr)
    earlier = ranks.broadcast(earlier)
    with ranks.main_first():  # a catalogue model is prepared once
        model, tok = load_causal_lm(args.model, log=log_stderr if ranks.main else (lambda line: None), **kwargs)
    # the bar counts process 0's samples (its share of each cell in a data-parallel run)
    total = len(tasks) * len(args.lengths) * len(ranks.shard(args.samples))
    with (Progress(
        TextColumn("[bold]ruler[/bold]"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("{task.description}"),
        transient=False,
    ) if ranks.main else contextlib.nullcontext()) as prog:
        done0 = len((earlier or {}).get("cells") or []) * len(ranks.shard(args.samples))
        bar = prog.add_task("", total=total, completed=done0) if prog else None

        def progress(msg: str) -> None:
            prog.update(bar, advance=1, description=escape(msg))  # task text, not rich markup
            if not prog.console.is_terminal:  # a log file gets one plain line per sample
                done = int(prog.tasks[0].completed)
                share = f" of process 0's share ({ranks.world_size} processes)" if ranks.distributed else ""
                print(f"[{done}/{total}{share}] {msg}", file=sys.stderr, flush=True)

        machine = machine_info()

        def save(partial: dict[str, Any], complete: bool = False) -> None:
            if ranks.main:
                write_json(path, {**partial, "model": args.model, "dtype": args.dtype, "machine": machine, "complete": complete,
                                  "wall_s": time.perf_counter() - t0})

        try:
            result = run_ruler(
                model, tok, method=args.method, options=options, tasks=tasks, lengths=args.lengths,
                num_samples=args.samples, seed=args.seed, depths=args.depths, haystack=args.haystack,
                recall=not args.no_recall, recall_samples=args.recall_samples, progress=progress if prog else None, on_cell=save,
                ranks=ranks, resume=earlier,
            )
        except EvalInterrupted as stop:
            result = stop.partial
            if not ranks.main:
                return 130
            drawn = None
            if result is not None:
                save(result)  # "interrupted": true is in the partial result
                title = f"RULER-style eval — {args.model} — {args.method} {fmt_opts(result['options'])} (interrupted: {stop.done})"
                drawn = plot_niah_heatmap(result, png, title)
            return report_interrupted(args, stop, path, result and (
                f"### {title}\n\n" + rows_to_markdown(result["cells"], RULER_COLUMNS) + "\n"
            ), also=[str(drawn)] if drawn else [])
    if not ranks.main:
        return 0
    save(result, complete=True)
    title = f"RULER-style eval — {args.model} — {args.method} {fmt_opts(result['options'])}"
    title += world_note({**result, "wall_s": time.perf_counter() - t0})
    print_table(result["cells"], RULER_COLUMNS, title=title)
    note = _handback_note(result["cells"])
    if note:
        print(note)
    for line in _rank_lines(result["cells"]):
        print(line)
    print(f"wrote {path}")
    drawn = plot_niah_heatmap(result, png, title)
    if drawn:
        print(f"wrote {drawn}")
    if args.markdown:
        write_text(args.markdown, f"### {title}\n\n" + rows_to_markdown(result["cells"], RULER_COLUMNS) + "\n"
                   + (f"\n{note}\n" if note else ""))
        print(f"wrote {args.markdown}")
    return 0


def ruler_task_names(args) -> list[str]:
    """``--tasks`` of ``eval ruler`` and ``compare --eval ruler``: ``niah_single`` when not given, every task for ``all``."""
    from ..evals.ruler import tasks as ruler_tasks

    tasks = args.tasks or ["niah_single"]
    return list(ruler_tasks.TASKS) if tasks == ["all"] else tasks


def ruler_settings(args) -> dict[str, Any]:
    """The run configuration a RULER result records under ``"settings"`` (as :func:`attnpatch.evals.ruler.run_ruler`
    writes it, less ``torch_threads``): what a ``--resume`` must find equal."""
    return {"tasks": ruler_task_names(args), "lengths": args.lengths, "num_samples": args.samples, "seed": args.seed,
            "depths": args.depths, "haystack": args.haystack, "recall": not args.no_recall, "recall_samples": args.recall_samples}


def _rank_lines(cells: list[dict[str, Any]]) -> list[str]:
    """One line per process of a data-parallel run: the samples it answered and its median prefill times over them."""
    import statistics

    per: dict[int, list[dict[str, Any]]] = {}
    for c in cells:
        for r in c.get("ranks") or []:
            per.setdefault(r["rank"], []).extend(c["samples"][i] for i in r["samples"])
    out = []
    for k, rows in sorted(per.items()):
        med = [f"{name} {statistics.median(x[key] for x in rows):.2f} s" for name, key in (("dense", "prefill_dense_s"), ("patched", "prefill_patched_s"))
               if rows and key in rows[0]]
        out.append(f"process {k}: {len(rows)} samples" + (f", median prefill {', '.join(med)}" if med else ""))
    return out


def _handback_note(cells: list[dict[str, Any]]) -> str | None:
    """One line naming the cells whose patched prefills ran the model's own attention in every layer (every record mode
    ``dense:<why>``: prompts shorter than the method's minimum length, a window covering the prompt, ...), or
    ``None``."""
    from ..evals.run.report import handback_note

    return handback_note([(f"{c['task']} {c['length']}", c.get("patched_modes")) for c in cells], len(cells), "cell")


def add_parser(esub) -> None:
    """Register ``eval ruler`` on the ``eval`` subparsers."""
    from ..evals.ruler import tasks as ruler_tasks

    pr = esub.add_parser("ruler", help="RULER-style long-context tasks (needle-in-a-haystack and friends)")
    pr.add_argument("--model", default=DEFAULT_MODEL, help="catalogue name, local directory or hub id (default: %(default)s)")
    pr.add_argument("--method", action=OneSetting, default="anchor_attention", metavar="METHOD",
                    hint="several settings side by side: attnpatch compare --eval ruler",
                    help="one setting, METHOD or METHOD:OPT=VALUE,... ('dense' for a baseline-only run; several settings "
                    "side by side: compare --eval ruler)")
    pr.add_argument("-o", "--option", action="append", default=[], metavar="NAME=VALUE", help="method option, repeatable (e.g. -o theta=12)")
    pr.add_argument("--tasks", nargs="+", action=Repeatable, choices=list(ruler_tasks.TASKS) + ["all"], help="default: niah_single")
    pr.add_argument("--lengths", nargs="+", action=Repeatable, type=positive_int, default=[1024, 2048, 4096], help="context lengths in model tokens")
    pr.add_argument("--samples", type=positive_int, default=10, help="samples per (task, length) cell (default: %(default)s)")
    pr.add_argument("--seed", type=int, default=0)
    pr.add_argument("--depths", nargs="+", action=Repeatable, type=fraction, help="needle depths in [0, 1], cycled over samples")
    pr.add_argument("--haystack", choices=["repeat", "essay"], default="repeat")
    pr.add_argument("--no-recall", action="store_true", help="skip the attention-recall measuring pass")
    pr.add_argument("--recall-samples", type=positive_int, metavar="N", help="measure recall on the first N samples of each cell only (default: all)")
    pr.add_argument("--json", help="result JSON path, rewritten after every finished cell (default: ruler_<model>_<method>.json)")
    pr.add_argument("--plot", metavar="PATH", help="needle-in-a-haystack heatmap PNG: accuracy over context length x needle depth, "
                    "dense, patched and their difference (default: the --json path with .png)")
    pr.add_argument("--markdown", help="also write the table as Markdown to this path")
    pr.add_argument("--threads", type=positive_int, help="torch CPU threads")
    scale_out_args(pr)
    pr.set_defaults(func=cmd_eval_ruler)


#: Calibration prompts come from these seeds on; the held-out check uses ``eval ruler``'s seed 0 on, so the two
#: never share a prompt.
CALIBRATION_SEED = 1000
#: The tasks of the embedded calibration prompts (cycled) and of the held-out check.
NIAH_TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery")
#: The question ``eval generate --images`` asks of each image without ``--prompts``.
DEFAULT_QUESTION = "Describe this image in one sentence."


def read_prompt_files(path: str) -> list[tuple[Path, str]]:
    """``attnpatch tune``'s calibration prompts: ``(file, text)`` of each, read (and refused when unreadable or blank) before the model loads."""
    p = Path(path)
    if p.exists() and not p.is_file() and not p.is_dir():
        raise AttnpatchError(f"--prompts {path}: not a regular file or folder (a .txt file, or a folder of .txt files)")
    if p.is_file():
        files = [p]
    elif p.is_dir():
        files = sorted(f for f in p.iterdir() if f.suffix == ".txt" and f.is_file())
        if not files:
            raise AttnpatchError(f"--prompts {path}: no .txt files in this folder (one prompt per file)")
    else:
        raise AttnpatchError(f"--prompts {path}: no such file or folder (a .txt file, or a folder of .txt files, one prompt each)")
    out = []
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise AttnpatchError(f"--prompts: {f} cannot be read as UTF-8 text ({e})") from None
        if "\0" in text:
            raise AttnpatchError(f"--prompts: {f} holds NUL bytes; a calibration prompt is plain text")
        text = text.removeprefix("\ufeff")  # a UTF-8 byte-order mark is not text
        if not text.strip():
            raise AttnpatchError(f"--prompts: {f} is empty or blank; a calibration prompt needs text")
        out.append((f, text))
    return out


def causal_prompts(args, tok, prompt_files) -> tuple[list, str]:
    import torch

    from ..evals.ruler import tasks as ruler_tasks
    from ..evals.ruler.text import build_input_ids

    if prompt_files:
        out = []
        for f, text in prompt_files:
            ids = tok(text, add_special_tokens=True)["input_ids"]
            if len(ids) < 2:
                raise AttnpatchError(f"--prompts: {f} encodes to {len(ids)} token(s); a calibration prompt needs text")
            out.append(torch.tensor([ids]))
        return out, f"{len(out)} prompt file(s) from {args.prompts}"
    out = []
    for i in range(args.calibration):
        task = NIAH_TASKS[(i + 1) % len(NIAH_TASKS)]  # multikey first: the harder retrieval
        s = ruler_tasks.make_samples(task, tok, args.length, 1, seed=CALIBRATION_SEED + i)[0]
        out.append(torch.tensor([build_input_ids(tok, s)]))
    return out, f"{len(out)} embedded NIAH prompt(s) of {args.length} tokens (seeds {CALIBRATION_SEED}+)"


def cmd_eval_generate(args) -> int:
    """``attnpatch eval generate``: greedy generations dense and under each setting on the same prompts."""
    import time

    import torch

    from ..checkpoints import check_lengths, load_causal_lm
    from ..evals.generate import run_generate, text_inputs
    from ..evals.generate.table import GENERATE_COLUMNS, generate_rows, plot_generate
    from ..evals.run.report import machine_info
    from ..evals.ruler import tasks as ruler_tasks
    from ..evals.ruler.text import build_input_ids
    from .args import checked_settings, tower_settings
    from .output import json_path, plot_file, report

    t0 = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    vlm = args.images is not None
    # before loading; a VLM's settings name their towers (tower_settings)
    settings = tower_settings(args.method, args.option) if vlm else checked_settings(args.method, args.option, "causal_lm")
    files = read_prompt_files(args.prompts) if args.prompts else None
    if files is None and not vlm:
        check_lengths(args.model, [args.length], "--length")
    check_outputs(("--json", json_path(args)), ("--plot", plot_file(args)), ("--markdown", args.markdown))
    if vlm:
        from ..checkpoints import load_vlm
        from ..evals.generate import image_inputs, load_images

        images = load_images(args.images, args.samples)  # a bad folder fails before the model loads
        model, processor = load_vlm(args.model)
        tok = processor.tokenizer
        prompts = [t for _, t in files] if files else [DEFAULT_QUESTION]
        inputs = image_inputs(processor, [im for _, im in images], prompts, [n for n, _ in images])
        source = f"{len(inputs)} image(s) from {args.images}, " + (f"{len(prompts)} prompt file(s)" if files else repr(DEFAULT_QUESTION))
    elif files is not None:
        model, tok = load_causal_lm(args.model)
        inputs = text_inputs(tok, [t for _, t in files], [str(f) for f, _ in files])
        source = f"{len(inputs)} prompt file(s) from {args.prompts}"
    else:
        from ..evals.generate import GenerationInput

        model, tok = load_causal_lm(args.model)
        inputs = []
        for i in range(args.samples):
            task = NIAH_TASKS[i % len(NIAH_TASKS)]
            s = ruler_tasks.make_samples(task, tok, args.length, 1, seed=args.seed + i)[0]
            ids = torch.tensor([build_input_ids(tok, s)])
            inputs.append(GenerationInput(f"{task} seed {args.seed + i}", {"input_ids": ids, "attention_mask": torch.ones_like(ids)}))
        source = f"{len(inputs)} NIAH prompt(s) of {args.length} tokens (seeds {args.seed}+)"
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    result = run_generate(model, inputs, settings=settings, max_new_tokens=args.max_new_tokens, pad_token_id=pad,
                          decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
                          progress=lambda d, t: print(f"[{d}/{t}] prompts", file=sys.stderr, flush=True))
    result.update(model=args.model, source=source, machine=machine_info(), wall_s=time.perf_counter() - t0)
    title = f"generation agreement — {args.model} — {source}, {args.max_new_tokens} new tokens, greedy"
    return report(args, title, generate_rows(result), GENERATE_COLUMNS, result, plot=plot_generate)


def add_generate_parser(esub) -> None:
    """Register ``eval generate`` on the ``eval`` subparsers."""
    p = esub.add_parser("generate", help="greedy generations dense vs patched: token agreement, first divergence, exact "
                        "match, time to first token, decode speed")
    p.add_argument("--model", default=DEFAULT_MODEL, help="catalogue name, local directory or hub id (default: %(default)s)")
    p.add_argument("--method", nargs="+", action=Repeatable, required=True, metavar="METHOD[:NAME=VALUE,...]",
                   help="settings compared with dense (e.g. anchor_attention:preset=accurate)")
    p.add_argument("-o", "--option", action="append", default=[], metavar="NAME=VALUE", help="option for every method")
    p.add_argument("--prompts", help="a .txt file or a folder of .txt files, one prompt each (default: NIAH prompts of --length "
                   "tokens; with --images one question, asked of each image)")
    p.add_argument("--images", metavar="DIR", help="a VLM run: the first --samples images of this imagefolder, one input each "
                   "(--model a saved VLM and its processor); a --method may then name its towers: "
                   "vision=fna+text=anchor_attention:preset=accurate")
    p.add_argument("--length", type=positive_int, default=4096, help="tokens of the default NIAH prompts (default: %(default)s)")
    p.add_argument("--samples", type=positive_int, default=4, help="default NIAH prompts, the four NIAH tasks cycled; with --images, "
                   "the images (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=positive_int, default=32, help="greedy generation budget per prompt (default: %(default)s)")
    p.add_argument("--json", help="result JSON (default: generate_<model>_<methods>.json)")
    p.add_argument("--plot", metavar="PATH", help="agreement vs time-to-first-token speed-up PNG (default: next to the JSON)")
    p.add_argument("--markdown", help="also write the table as Markdown here")
    p.add_argument("--threads", type=positive_int, help="torch CPU threads")
    p.set_defaults(func=cmd_eval_generate)
