"""``attnpatch bench {attention,capture,model}``: speed and memory, patched vs exact, measured side by side."""

from __future__ import annotations

from typing import Any, Sequence

from ..errors import AttnpatchError
from .args import DEFAULT_MODEL, DEFAULT_VISION_MODEL, check_fits, nonnegative_int, positive_int, positive_seconds, Repeatable, unique_settings
from .output import check_outputs, progress_line
from .runtime import resolve_device

_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16"}


_BACKGROUND_LOAD_HELP = (
    "run the bench beside a competing PyTorch process (a = tanh(a @ a) on 512x512 float32, default torch threads), "
    "as a data-loader worker or a second job would; it is started by the bench, killed when the bench ends or fails, "
    "and stops by itself after MAX_SECONDS (default: 900)"
)


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


def _bench_out(args, title: str, rows, columns, result: dict[str, Any], footer: str = "") -> None:
    """Print a bench table (and ``footer``) and write ``--json`` / ``--markdown`` when asked."""
    from ..evals.run.report import print_table, rows_to_markdown, write_json

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


def _check_max_positions(model, lengths: Sequence[int], flag: str) -> None:
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    too_long = [n for n in lengths if limit and n > limit]
    if too_long:
        raise AttnpatchError(f"{flag} {too_long}: the model's max_position_embeddings is {limit} tokens")


def cmd_bench_attention(args) -> int:
    import torch

    from ..evals.bench import DEFAULT_LENGTHS, background_load, bench_attention, load_qkv, plot_attention
    from ..evals.bench.table import BENCH_ATTENTION_COLUMNS
    from ..evals.run.report import machine_info

    if args.threads:
        torch.set_num_threads(args.threads)
    args.device = resolve_device(args.device)
    check_outputs(("--json", args.json), ("--markdown", args.markdown), ("--plot", args.plot))
    if args.plot and not args.plot.lower().endswith(".png"):
        raise AttnpatchError(f"--plot {args.plot}: give a .png path (it writes <stem>_time.png and <stem>_speedup.png)")
    causal = args.mode == "causal"
    if causal and args.reuse_layers is not None:
        raise AttnpatchError("--reuse-layers: only FNA (--mode noncausal) amortises a landmark sampling over layers")
    methods = unique_settings(args.method or (["anchor_attention"] if causal else ["fna"]), args.option)
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
            progress_line(f"background load: competing PyTorch process started (pid {load['pid']}, {load['threads']} threads)")
        result = bench_attention(
            methods, lengths=lengths or DEFAULT_LENGTHS, causal=causal, batch=args.batch or 1, heads=args.heads or 6,
            kv_heads=args.kv_heads, head_dim=args.head_dim or 64, dtype=getattr(torch, _DTYPES[args.dtype]), device=args.device,
            repeats=args.repeats, warmup=args.warmup, reuse_layers=args.reuse_layers or 6, qkv=qkv, memory=not args.no_memory,
            progress=progress_line,
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


def cmd_bench_capture(args) -> int:
    import torch

    from ..checkpoints import load_causal_lm
    from ..evals.bench import capture_qkv, prefill_ids

    if args.threads:
        torch.set_num_threads(args.threads)
    args.device = resolve_device(args.device)
    check_outputs(("--output", args.output))
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


def cmd_bench_model(args) -> int:
    import torch

    from ..checkpoints import catalogue_entry, load_causal_lm, load_vision_model
    from ..evals.bench import background_load, bench_causal_lm, bench_vision_model
    from ..evals.bench.table import BENCH_LM_COLUMNS, BENCH_VISION_COLUMNS
    from ..evals.run.report import machine_info
    from ..patchers.registry import get_method, validate_options

    if args.threads:
        torch.set_num_threads(args.threads)
    args.device = resolve_device(args.device)
    check_outputs(("--json", args.json), ("--markdown", args.markdown))
    kind = args.kind
    if kind == "auto":
        from pathlib import Path

        try:
            kind = catalogue_entry(args.model).kind
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
    settings = unique_settings(args.method or (["fna"] if vision else ["anchor_attention"]), args.option)
    for name, opts in settings:
        check_fits(name, kind)
        validate_options(get_method(name), opts)  # fail before loading anything
    if vision:
        images = None
        if args.data:
            from ..evals.vision.images import load_image_set

            data = load_image_set(args.data, limit=args.batch or 1)
            images = [data[i][0] for i in range(len(data))]
        model, processor = load_vision_model(args.model, backend=args.backend, device=args.device)
        with background_load(args.background_load) as load:
            result = bench_vision_model(
                model, processor, settings, resolutions=args.resolutions or [224, 448, 896], batch=args.batch or 1,
                repeats=args.repeats, warmup=args.warmup, device=args.device, images=images, progress=progress_line,
            )
        columns, what = BENCH_VISION_COLUMNS, f"batch {args.batch or 1}"
    else:
        model, tok = load_causal_lm(args.model, device=args.device)
        lengths = args.lengths or [1024, 2048, 4096, 8192]
        _check_max_positions(model, lengths, "--lengths")
        with background_load(args.background_load) as load:
            result = bench_causal_lm(
                model, tok, settings, lengths=lengths, repeats=args.repeats, warmup=args.warmup, device=args.device,
                progress=progress_line,
            )
        columns, what = BENCH_LM_COLUMNS, "prefill, batch 1"
    result["config"]["background_load"] = load
    result.update(model=args.model, kind=kind, machine=machine_info())
    m = result["machine"]
    where = m["cuda"] if str(args.device).startswith("cuda") else f"{m['cpu']}, {m['torch_threads']} torch threads"
    title = f"bench model — {args.model} ({what}) on {where}, median of {args.repeats}" + (", under background load" if load else "")
    _bench_out(args, title, result["rows"], columns, result, footer=_load_note(load))
    return 0


def add_parser(sub) -> None:
    """Register ``bench`` and its three commands on the top-level subparsers."""
    pb = sub.add_parser("bench", help="speed and memory benchmarks, patched vs exact, measured side by side")
    bsub = pb.add_subparsers(dest="bench", required=True)
    ba = bsub.add_parser("attention", help="one attention layer: time, peak memory and ratio to SDPA per method and N")
    ba.add_argument("--mode", choices=["noncausal", "causal"], default="noncausal", help="ViT (noncausal, fna) or LLM prefill (causal, anchor_attention) (default: %(default)s)")
    ba.add_argument("--method", nargs="+", action=Repeatable, metavar="METHOD[:NAME=VALUE,...]", help="registered method(s) that fit --mode (causal: methods for causal LMs; noncausal: methods for ViTs), with options (default: fna / anchor_attention)")
    ba.add_argument("-o", "--option", action="append", default=[], metavar="NAME=VALUE", help="option applied to every method, repeatable (a METHOD:NAME=VALUE in --method wins over it)")
    ba.add_argument("--lengths", nargs="+", action=Repeatable, type=positive_int, help="sequence lengths N in tokens (default: 256 512 ... 16384; with --qkv, up to the captured length)")
    ba.add_argument("--batch", type=positive_int, help="random inputs: batch size (default: 1)")
    ba.add_argument("--heads", type=positive_int, help="random inputs: query heads (default: 6, DINOv2-S)")
    ba.add_argument("--kv-heads", type=positive_int, help="random inputs: key/value heads (GQA; default: = heads)")
    ba.add_argument("--head-dim", type=positive_int, help="random inputs: head dimension (default: 64)")
    ba.add_argument("--dtype", choices=sorted(_DTYPES), default="float32", help="dtype of q/k/v (default: %(default)s)")
    ba.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: %(default)s)")
    ba.add_argument("--repeats", type=positive_int, default=5, help="timed calls per cell; the median is reported (default: %(default)s)")
    ba.add_argument("--warmup", type=nonnegative_int, default=1, help="untimed calls before them (default: %(default)s)")
    ba.add_argument("--reuse-layers", type=positive_int, help="FNA: layers sharing one FPS sampling, for the amortised time (default: 6, DINOv2-S)")
    ba.add_argument("--qkv", help="captured q/k/v file (attnpatch bench capture) instead of random inputs")
    ba.add_argument("--layer", type=int, help="which captured layer (default: the first in the file)")
    ba.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    ba.add_argument("--threads", type=positive_int, help="torch CPU threads")
    ba.add_argument("--background-load", type=positive_seconds, nargs="?", const=900.0, metavar="MAX_SECONDS", help=_BACKGROUND_LOAD_HELP)
    ba.add_argument("--json", help="write the result here")
    ba.add_argument("--markdown", help="write the table as Markdown here")
    ba.add_argument("--plot", metavar="PATH.png", help="write <PATH>_time.png (log-log) and <PATH>_speedup.png")
    ba.set_defaults(func=cmd_bench_attention)

    bc = bsub.add_parser("capture", help="save a causal LM's q/k/v at some layers on a natural-prose prompt (input of bench attention --qkv)")
    bc.add_argument("--model", default=DEFAULT_MODEL, help="catalogue name, local directory or hub id (default: %(default)s)")
    bc.add_argument("--length", type=positive_int, default=8192, help="prompt length in tokens (default: %(default)s)")
    bc.add_argument("--layers", nargs="+", action=Repeatable, type=int, required=True, help="attention-layer indices, 0-based")
    bc.add_argument("--output", "-O", required=True, help="file to write (torch.save)")
    bc.add_argument("--device", default="cpu", help="where the model runs: cpu, cuda or cuda:N (default: %(default)s)")
    bc.add_argument("--threads", type=positive_int, help="torch CPU threads")
    bc.set_defaults(func=cmd_bench_capture)

    bm = bsub.add_parser("model", help="end to end: ViT images/s vs resolution or LLM prefill latency vs length, unpatched vs patched")
    bm.add_argument("--model", default=DEFAULT_VISION_MODEL, help="catalogue name, local directory or hub id (default: %(default)s)")
    bm.add_argument("--kind", choices=["auto", "vision", "causal_lm"], default="auto", help="auto: from the catalogue")
    bm.add_argument("--backend", choices=["hf", "timm"], default="hf", help="ViT implementation (default: %(default)s)")
    bm.add_argument("--method", nargs="+", action=Repeatable, metavar="METHOD[:NAME=VALUE,...]", help="settings (default: fna for a ViT, anchor_attention for an LLM)")
    bm.add_argument("-o", "--option", action="append", default=[], metavar="NAME=VALUE", help="option applied to every method, repeatable (a METHOD:NAME=VALUE in --method wins over it)")
    bm.add_argument("--resolutions", nargs="+", action=Repeatable, type=positive_int, help="ViT input sizes in pixels (default: 224 448 896)")
    bm.add_argument("--lengths", nargs="+", action=Repeatable, type=positive_int, help="LLM prompt lengths in tokens (default: 1024 2048 4096 8192)")
    bm.add_argument("--batch", type=positive_int, help="ViT: images per forward (default: 1)")
    bm.add_argument("--data", help="imagefolder or hub dataset the ViT batch is drawn from (default: the embedded image set)")
    bm.add_argument("--repeats", type=positive_int, default=3, help="timed forwards per cell; the median is reported (default: %(default)s)")
    bm.add_argument("--warmup", type=nonnegative_int, default=1, help="untimed forwards before them (default: %(default)s)")
    bm.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: %(default)s)")
    bm.add_argument("--threads", type=positive_int, help="torch CPU threads")
    bm.add_argument("--background-load", type=positive_seconds, nargs="?", const=900.0, metavar="MAX_SECONDS", help=_BACKGROUND_LOAD_HELP)
    bm.add_argument("--json", help="write the result here")
    bm.add_argument("--markdown", help="write the table as Markdown here")
    bm.set_defaults(func=cmd_bench_model)
