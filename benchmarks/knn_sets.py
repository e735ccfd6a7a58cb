"""Is dense k-NN meaningful on a shared image set?  The unpatched dinov2-small's leave-one-out k-NN top-1
(:func:`attnpatch.evals.vision.metrics.knn_classify`, as ``eval knn``) on a set's whole image list and on the halves
of the frontier's seeded 50/50 split (seed 0), for several ``k``, on the final CLS token and on the mean patch token.

    python benchmarks/knn_sets.py [--data tuxpaint-captions] [--resolution 448]

Prints a Markdown table and writes ``benchmarks/results/frontier/knn_sets_<data>_<resolution>.md``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
OUT = ROOT / "benchmarks" / "results" / "frontier"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="tuxpaint-captions")
    p.add_argument("--resolution", type=int, default=448)
    p.add_argument("--ks", type=int, nargs="+", default=[5, 10, 20])
    args = p.parse_args(argv)

    import torch

    from attnpatch.checkpoints import load_vision_model
    from attnpatch.evals.vision.images import load_image_set
    from attnpatch.evals.vision.metrics import knn_classify
    from attnpatch.evals.vision.preprocess import make_preprocess
    from attnpatch.evals.vision.runner import encode

    model, processor = load_vision_model("dinov2-small")
    images = load_image_set(str(DATA / args.data))
    pre = make_preprocess(processor, args.resolution)
    cls, mean = [], []
    with torch.no_grad():
        for i in range(0, len(images), 8):
            c, m = encode(model, pre([images[j][0] for j in range(i, min(len(images), i + 8))]))
            cls.append(c)
            mean.append(m)
    feats = {"CLS": torch.cat(cls).numpy(), "mean patch": torch.cat(mean).numpy()}
    labels = images.labels
    n = len(images)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()
    splits = {f"all {n}": list(range(n)), f"calibration half ({n // 2})": order[:n // 2],
              f"held-out half ({n - n // 2})": order[n // 2:]}
    head = "| feature | images | " + " | ".join(f"k = {k}" for k in args.ks) + " |"
    lines = [head, "|" + "---|" * (2 + len(args.ks))]
    for fname, f in feats.items():
        for sname, idx in splits.items():
            tops = [knn_classify(f[idx], labels[idx], k=k)["top1"] for k in args.ks]
            lines.append(f"| {fname} | {sname} | " + " | ".join(f"{100 * t:.1f}%" for t in tops) + " |")
    title = (f"dense k-NN top-1 (leave-one-out), dinov2-small, {args.data} ({n} images, {images.num_classes} classes), "
             f"{args.resolution} px")
    table = f"{title}\n\n" + "\n".join(lines)
    print(table)
    OUT.mkdir(parents=True, exist_ok=True)
    out = OUT / f"knn_sets_{args.data}_{args.resolution}.md"
    out.write_text(table + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
