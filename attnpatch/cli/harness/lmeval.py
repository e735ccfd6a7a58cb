"""``attnpatch eval lm-eval``: lm-evaluation-harness tasks on a causal LM, unpatched and patched with each setting,
side by side (:func:`attnpatch.evals.lmeval.run_lm_eval`)."""

from __future__ import annotations

import argparse
import sys

from ..args import DEFAULT_MODEL, Repeatable, check_fits, nonnegative_int, positive_int, unique_settings
from ..output import check_outputs, fmt_opts, report_interrupted, slug, world_note
from ..runtime import DTYPES, load_kwargs, rank_log


def _limit(text: str) -> int | float:
    """lm-eval's ``--limit``: a document count per task, or a fraction of them below 1."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text}: must be a positive count (or a fraction below 1)")
    if value >= 1:
        if value != int(value):
            raise argparse.ArgumentTypeError(f"{text}: a count of documents is a whole number (a fraction is below 1)")
        return int(value)
    return value


def cmd_eval_lm_eval(args) -> int:
    import time

    import torch

    from ...evals import lmeval
    from ...evals.run.distributed import ranks as current_ranks
    from ...patchers.registry import get_method, validate_options

    t0 = time.perf_counter()
    ranks = current_ranks()
    lmeval.require_lm_eval()  # one line, before anything loads
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = unique_settings(args.method, args.option)
    for method, opts in settings:
        check_fits(method, "causal_lm")  # lm-eval loads a causal LM: a vision method fails before loading
        validate_options(get_method(method), opts)  # a bad method or option fails before loading
    user_meta = lmeval.parse_metadata(args.metadata)
    if "max_seq_lengths" in user_meta:  # RULER's context lengths, against the model's config.json: nothing loads before it
        from ...checkpoints import check_lengths

        check_lengths(args.model, user_meta["max_seq_lengths"], "--metadata max_seq_lengths")
    path = args.json or f"lm-eval_{slug(args.model)}_{slug('+'.join(args.method))}.json"
    kwargs = load_kwargs(args, ranks)
    from ...evals.run.plots import plot_path

    png = plot_path(path, args.plot)
    if ranks.main:
        check_outputs(("--json", path), ("--markdown", args.markdown), ("--plot", str(png)))
    # the checks that need lm-eval's task index come last (the index is read from its copy on disk, or built once)
    rank_log(ranks)(f"checking task names ({', '.join(args.tasks)}) against lm-eval's task index ...")
    manager = lmeval.task_manager(user_meta)
    lmeval.check_tasks(manager, args.tasks)
    lmeval.check_metadata(manager, args.tasks, user_meta)
    from ...checkpoints import load_causal_lm

    with ranks.main_first():  # a catalogue model is prepared once
        model, tok = load_causal_lm(args.model, log=rank_log(ranks), **kwargs)
    chat = "on" if args.apply_chat_template else "off"
    header = (f"lm-eval — {args.model} — {', '.join(args.tasks)}"
              + (f" — metadata {fmt_opts(user_meta)}" if user_meta else "")
              + f" — limit {args.limit if args.limit is not None else 'none (all documents)'} — chat template {chat}")
    if ranks.main:
        print(header, flush=True)
    machine = _machine()

    def document(result) -> dict:
        return {"eval": "lm-eval", "model": args.model, "dtype": args.dtype, **_slim(result), "machine": machine,
                "packages": lmeval.installed_packages(), "wall_s": time.perf_counter() - t0}

    def save(partial, complete=False) -> None:
        from ...evals.run.report import write_json

        files = {}
        for entry in [partial["dense"], *partial["runs"]]:
            files[entry["label"]] = str(lmeval.write_results(path, entry["label"], entry["results"]))
        write_json(path, {**document(partial), "lm_eval_files": files, "complete": complete})

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    from ...evals.lmeval.plots import plot_lm_eval
    from ...evals.run.report import EvalInterrupted, print_table, rows_to_markdown, write_text

    try:
        result = lmeval.run_lm_eval(
            model, tok, tasks=args.tasks, settings=settings, metadata=user_meta, limit=args.limit,
            apply_chat_template=args.apply_chat_template, fewshot_as_multiturn=args.fewshot_as_multiturn, gen_kwargs=args.gen_kwargs,
            recall_samples=args.recall_samples, ranks=ranks, progress=progress if ranks.main else None,
            on_setting=save if ranks.main else None,
        )
    except EvalInterrupted as stop:
        if not ranks.main:
            return 130
        if stop.partial is not None:
            save(stop.partial)
            drawn = plot_lm_eval(stop.partial["rows"], png, title=header)
            if drawn:
                print(f"wrote {drawn}", file=sys.stderr)
        return report_interrupted(args, stop, path, stop.partial and (
            f"### {header} (interrupted: {stop.done})\n\n" + rows_to_markdown(stop.partial["rows"], lmeval.LMEVAL_COLUMNS) + "\n"))
    if not ranks.main:
        return 0
    save(result, complete=True)
    title = header + world_note({**result, "wall_s": time.perf_counter() - t0})
    print_table(result["rows"], lmeval.LMEVAL_COLUMNS, title=title)
    note = lmeval.handback_note(result["rows"])
    if note:
        print(note)
    if result["differing_tasks"]:
        print(f"warning: the settings did not answer the same prompts in {', '.join(result['differing_tasks'])} (lm-eval's "
              "prompt hashes differ): their rows show no Δ")
    print(f"wrote {path} and lm-eval's results of each setting next to it")
    drawn = plot_lm_eval(result["rows"], png, title=title)
    if drawn:
        print(f"wrote {drawn}")
    if args.markdown:
        write_text(args.markdown, f"### {title}\n\n" + rows_to_markdown(result["rows"], lmeval.LMEVAL_COLUMNS) + "\n"
                   + (f"\n{note}\n" if note else ""))
        print(f"wrote {args.markdown}")
    return 0


def _machine() -> dict:
    from ...evals.run.report import machine_info

    return machine_info()


def _slim(result: dict) -> dict:
    """Our JSON: the run without lm-eval's result dicts (they go to their own files), its scores kept."""
    def entry(e):
        if e is None:
            return None
        res = e["results"]
        return {**{k: v for k, v in e.items() if k != "results"},
                "lm_eval": {k: res.get(k) for k in ("results", "groups", "group_subtasks", "versions", "n-shot", "n-samples", "higher_is_better")}}

    return {**result, "dense": entry(result.get("dense")), "runs": [entry(r) for r in result.get("runs") or []]}


def add_parser(esub) -> None:
    """Register ``eval lm-eval`` on the ``eval`` subparsers."""
    p = esub.add_parser(
        "lm-eval", help="lm-evaluation-harness tasks (RULER, LongBench, ...), unpatched and each setting side by side",
        description="Runs lm-evaluation-harness (pip install 'attnpatch[lm-eval]') through its own Hugging Face model "
        "class on the loaded model, unpatched and patched with each --method, and prints the scores side by side "
        "with prefill times, sparsity and recall.",
    )
    p.add_argument("--model", default=DEFAULT_MODEL, help="catalogue name, local directory or hub id (default: %(default)s)")
    p.add_argument("--tasks", nargs="+", action=Repeatable, required=True, metavar="TASK",
                   help="lm-eval task, group or tag names, e.g. niah_single_1 ruler_vt ruler longbench (offline, with no "
                   "download: niah_single_1, niah_multikey_2, niah_multikey_3, ruler_vt, ruler_cwe, ruler_fwe; the essay "
                   "haystacks, the ruler group, the QA tasks and LongBench need the Hugging Face hub)")
    p.add_argument("--method", nargs="+", action=Repeatable, default=["anchor_attention"], metavar="SPEC",
                   help="registered method(s), each METHOD or METHOD:OPT=VALUE,...; each is run after the unpatched model "
                   "(default: anchor_attention)")
    p.add_argument("-o", "--option", action="append", default=[], metavar="NAME=VALUE", help="method option for every --method, repeatable")
    p.add_argument("--metadata", nargs="+", action="extend", metavar="ARG",
                   help="lm-eval's --metadata: key=value items (values parsed as Python literals) or a JSON object, e.g. "
                   "'max_seq_lengths=[4096,8192]' (RULER's context lengths, default [4096]); tokenizer and pretrained "
                   "default to the model's tokenizer folder (or hub id); a key no chosen task reads is an error")
    p.add_argument("--limit", type=_limit,
                   help="documents per task (lm-eval's --limit; below 1: a fraction). Without it every document runs: "
                   "RULER generates 500 per length, hours on a CPU. With several lengths the first documents are "
                   "those of the first length")
    p.add_argument("--apply-chat-template", action="store_true",
                   help="format prompts with the tokenizer's chat template (lm-eval's --apply_chat_template; default off, as in lm-eval)")
    p.add_argument("--fewshot-as-multiturn", action="store_true",
                   help="few-shot examples as a multi-turn chat (lm-eval's --fewshot_as_multiturn; with --apply-chat-template)")
    p.add_argument("--gen-kwargs", metavar="KEY=VALUE,...", help="lm-eval's --gen_kwargs, e.g. max_gen_toks=32")
    p.add_argument("--recall-samples", type=nonnegative_int, default=0, metavar="N",
                   help="measure attention recall of the patched prefill on the first N documents of each task (one extra "
                   "forward each; default 0 = off)")
    p.add_argument("--json", help="result JSON (default: lm-eval_<model>_<methods>.json); lm-eval's own result JSON of each "
                   "setting is written next to it as <stem>.<setting>.lm-eval.json")
    p.add_argument("--markdown", help="also write the table as Markdown to this path")
    p.add_argument("--plot", metavar="PATH.png", help="PNG of each task's score against the prefill speed-up per setting "
                   "(default: next to the JSON, <json stem>.png)")
    p.add_argument("--threads", type=positive_int, help="torch CPU threads")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: auto = cuda if available; under a "
                   "multi-process launch cuda:<local rank>)")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="weights and activations (default: %(default)s)")
    p.add_argument("--device-map", choices=["auto", "balanced", "sequential"],
                   help="spread a model that does not fit one device over the GPUs, CPU memory and disk; not with several processes")
    p.add_argument("--max-memory", metavar="DEVICE=SIZE,...", help="with --device-map: memory per device, e.g. 0=20GiB,cpu=64GiB")
    p.set_defaults(func=cmd_eval_lm_eval)
