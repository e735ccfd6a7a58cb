"""The speed / agreement frontier of dinov2-small: ``tome``, ``fna`` and ``tome+fna`` each tuned to one downstream
agreement target (``attnpatch tune --target``'s search, :mod:`attnpatch.evals.tune.targets`), side by side, on the
same seeded calibration / held-out split, and what each tuned setting gives on the held-out split.

Parts (one per run; each writes ``benchmarks/results/frontier/<part>.json``, or ``<--name>.json``, and prints a Markdown
table):

* ``knn448``: k-NN top-1 agreement >= ``--target`` (default 0.99) on tuxpaint-captions by category, 448 px;
* ``knn896``: the same at 896 px (the images are upsampled: their long side is at most 448 px);
* ``seg896``: segmentation prediction agreement on tuxpaint-seg at 896 px (linear read-out fitted once on the
  unpatched model's train images, or a seeded ``--train N`` of them; the val images, or a seeded ``--val N`` of them,
  split into ``--calibration`` searched on and the rest held out), where the bar is "within 1 mIoU".

Each method's search, its held-out check, and the wall time are recorded.  The speed-ups of the held-out rows are
those of ``eval knn`` / ``eval segmentation`` (every batch, dense and the setting back to back), so the three methods'
rows compare at the same target.

    python benchmarks/frontier.py --part knn448 [--calibration N] [--held-out N] [--max-candidates M]
        [--given tome+fna:s=256] [--train N --val N (seg)] [--name STEM]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
OUT = ROOT / "benchmarks" / "results" / "frontier"
PARTS = {"knn448": ("tuxpaint-captions", 448), "knn896": ("tuxpaint-captions", 896), "seg896": ("tuxpaint-seg", 896)}


def _row(method: str, res: dict, seconds: float, seg: bool) -> dict:
    from attnpatch.evals.tune.search import short_setting

    ch, h = res["chosen"], res["held_out_result"] or {}
    row = {"method": method, "chosen": "exact (unpatched)" if ch.get("exact") else short_setting(ch["shown"]),
           "calibration agreement": f"{ch['agreement']:.4f}", "calibration speed-up": f"{ch['speedup']:.2f}x",
           "held-out agreement": "-" if not h else f"{h['agreement' if seg else 'knn_agreement']:.4f}",
           "held-out speed-up": "-" if not h or h.get("speedup") is None else f"{h['speedup']:.2f}x",
           "settings measured": len(res["measured"]), "minutes": f"{seconds / 60:.1f}"}
    if seg and h:
        d = h["miou_delta"]["delta"]
        row["held-out mIoU (dense)"] = f"{100 * h['miou']:.1f}% ({100 * h['dense_miou']:.1f}%), {100 * d:+.2f}"
    elif h:
        row["held-out k-NN top-1 (dense)"] = f"{100 * h['knn_top1']:.1f}% ({100 * h['dense_knn_top1']:.1f}%)"
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=sorted(PARTS), required=True)
    p.add_argument("--methods", nargs="+", default=["tome", "fna", "tome+fna"])
    p.add_argument("--target", type=float, default=0.99)
    p.add_argument("--calibration", type=int, default=None, help="calibration images (default: half)")
    p.add_argument("--held-out", type=int, default=None, help="held-out images (default: the rest)")
    p.add_argument("--max-candidates", type=int, default=18)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--train", type=int, default=None, help="seg: train images the read-out is fitted on (default: all)")
    p.add_argument("--val", type=int, default=None,
                   help="seg: val images used (a seeded subset; default: all); --calibration of them searched on")
    p.add_argument("--given", action="append", default=[], metavar="METHOD:NAME=VALUE,...",
                   help="options every candidate of METHOD keeps (e.g. tome+fna:s=256)")
    p.add_argument("--name", default=None, help="file stem of the results (default: the part)")
    args = p.parse_args(argv)
    from attnpatch.cli.args import parse_options

    given = {}
    for g in args.given:
        m, _, opts = g.partition(":")
        given[m] = parse_options(opts.split(","))

    def label(m: str) -> str:
        return m + (f" ({', '.join(f'{k}={v}' for k, v in given[m].items())})" if given.get(m) else "")

    import torch

    from attnpatch.checkpoints import load_vision_model
    from attnpatch.evals.run.report import machine_info, rows_to_markdown, Column
    from attnpatch.evals.tune.targets import tune_knn_agreement, tune_seg_agreement
    from attnpatch.log import log_stderr

    name, res_px = PARTS[args.part]
    seg = args.part.startswith("seg")
    OUT.mkdir(parents=True, exist_ok=True)
    out = OUT / f"{args.name or args.part}.json"

    def save() -> None:  # after every method: a stopped run keeps the methods it finished
        out.write_text(json.dumps({"part": args.part, "data": name, "resolution": res_px, "target": args.target,
                                   "argv": sys.argv[1:], "machine": machine_info(), "rows": rows, "runs": runs,
                                   "wall_s": time.perf_counter() - t_all}, indent=1, default=str))

    model, processor = load_vision_model("dinov2-small")
    rows, runs = [], {}
    t_all = time.perf_counter()
    if seg:
        from attnpatch.evals.segmentation import fit_readouts, load_segmentation_set, square_preprocess
        from attnpatch.patchers.adapters import adapter_for

        import dataclasses

        data = load_segmentation_set(str(DATA / name))
        pick = lambda n, k: torch.randperm(n, generator=torch.Generator().manual_seed(1)).tolist()[:k]  # noqa: E731
        if args.train:
            data = dataclasses.replace(data, train=data.train.subset(sorted(pick(len(data.train), args.train))))
        if args.val:
            data = dataclasses.replace(data, val=data.val.subset(sorted(pick(len(data.val), args.val))))
        pc = adapter_for(model).preprocess_config(model, processor)
        pre = square_preprocess(pc.mean, pc.std, res_px)
        t0 = time.perf_counter()
        fitted = fit_readouts(model, data, pre, readouts=("linear",), batch_size=args.batch_size)
        log_stderr(f"linear read-out fitted on {len(data.train)} train images in {time.perf_counter() - t0:.0f} s")
        for m in args.methods:
            t0 = time.perf_counter()
            r = tune_seg_agreement(model, data, pre, m, target=args.target, calibration=args.calibration,
                                   given=given.get(m), batch_size=args.batch_size, max_candidates=args.max_candidates, fitted=fitted,
                                   progress=log_stderr)
            runs[m] = r
            rows.append(_row(label(m), r, time.perf_counter() - t0, True))
            save()
    else:
        from attnpatch.evals.vision.images import load_image_set
        from attnpatch.evals.vision.preprocess import make_preprocess

        images = load_image_set(str(DATA / name))
        pre = make_preprocess(processor, res_px)
        order = torch.randperm(len(images), generator=torch.Generator().manual_seed(0)).tolist()
        n_cal = args.calibration or len(images) // 2
        hold = order[n_cal:] if args.held_out is None else order[n_cal:n_cal + args.held_out]
        cal, held = images.subset(order[:n_cal]), images.subset(hold)
        for m in args.methods:
            t0 = time.perf_counter()
            r = tune_knn_agreement(model, cal, held, pre, m, target=args.target, given=given.get(m),
                                   batch_size=args.batch_size, max_candidates=args.max_candidates, progress=log_stderr)
            runs[m] = r
            rows.append(_row(label(m), r, time.perf_counter() - t0, False))
            save()
            print(rows[-1], flush=True)
    columns = [Column(k, k) for k in rows[0]]
    table = rows_to_markdown(rows, columns)
    print(table)
    save()
    out.with_suffix(".md").write_text(table + "\n")
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
