"""``attnpatch sinks``: massive-token and attention-sink diagnostic of a ViT, per layer."""

from __future__ import annotations

from .args import positive_int
from .output import check_outputs
from .vision import load_images_and_model, vision_common


def cmd_sinks(args) -> int:
    import torch

    from ..evals.run.report import write_json
    from ..evals.vision.sinks import sink_diagnostic

    if args.threads:
        torch.set_num_threads(args.threads)
    check_outputs(("--json", args.json))
    images, model, preprocess = load_images_and_model(args)
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


def add_parser(sub) -> None:
    """Register ``sinks`` on the top-level subparsers."""
    ps = sub.add_parser("sinks", help="massive-token and attention-sink diagnostic of a ViT, per layer")
    vision_common(ps)
    ps.add_argument("--images", type=positive_int, default=8, help="images to analyse (default: %(default)s)")
    ps.add_argument("--norm-ratio", type=float, default=5.0, help="massive token: norm above this many times the median")
    ps.add_argument("--mass-ratio", type=float, default=10.0, help="attention sink: above this many times the uniform share")
    ps.add_argument("--json", help="write the full report here")
    ps.set_defaults(func=cmd_sinks)
