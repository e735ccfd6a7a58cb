"""L2ViT's claim, measured: how concentrated ReLU-kernel linear attention is next to softmax, per layer.

L2ViT (arXiv 2501.16182) argues that linear attention spreads its weight too evenly (high entropy)
and pairs it with local attention for that reason.  On the same ``q, k`` of every layer of an
unpatched ViT (captured through ``record_stats(probe=...)`` under the exact ``dense`` patch), this
prints per layer the mean row entropy, in nats, of

* softmax attention ``softmax(q k^T * scale)`` (what the model computes), and
* the ReLU kernel's attention weights ``relu(q) relu(k)^T / sum`` (what ``relu_linear`` computes
  far from the local window), rows with no positive mass left out,

each also as a fraction of ``log N`` (1 = uniform over all keys), and the share of rows whose 90 %
of mass lies on fewer than 5 % of the keys.  The accuracy lost is what ``attnpatch compare`` prints
for ``relu_linear`` on the same model (docs/claims.md).

    python benchmarks/claims_attention_entropy.py --model dinov2-small --data ../shared/data/imagenet-det-200x5 \
        --resolution 448 --images 16 --json benchmarks/results/cpu/claims_l2vit_entropy.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import torch


def _row_stats(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(entropy [rows], concentrated [rows] bool)`` of row-stochastic weights ``w`` ``[rows, N]``."""
    ent = -(w * w.clamp_min(1e-30).log()).sum(-1)
    top = w.sort(dim=-1, descending=True).values.cumsum(-1)
    need = (top < 0.9).sum(-1) + 1  # keys holding 90 % of the mass
    return ent, need < 0.05 * w.shape[-1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="dinov2-small")
    ap.add_argument("--data", default=None, help="imagefolder (default: the embedded image set)")
    ap.add_argument("--resolution", type=int, default=448)
    ap.add_argument("--images", type=int, default=16)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from attnpatch import patched, record_stats
    from attnpatch.checkpoints import load_vision_model
    from attnpatch.evals.vision.images import load_image_set
    from attnpatch.evals.vision.preprocess import make_preprocess
    from attnpatch.evals.vision.runner import encode

    model, processor = load_vision_model(args.model)
    model.eval()
    images = load_image_set(args.data, limit=args.images)
    pre = make_preprocess(processor, args.resolution)
    acc: dict[int, dict[str, list]] = {}

    def probe(ctx, q, k, v):
        b, h, n, d = q.shape
        qf, kf = q.float(), k.float()
        soft = torch.softmax(qf @ kf.transpose(-1, -2) * ctx.scale, dim=-1).reshape(-1, n)
        rel = torch.relu(qf) @ torch.relu(kf).transpose(-1, -2)
        mass = rel.sum(-1, keepdim=True)
        ok = (mass > 0).reshape(-1)
        lin = (rel / mass.clamp_min(1e-30)).reshape(-1, n)[ok]
        a = acc.setdefault(ctx.layer, {"soft": [], "lin": [], "soft_c": [], "lin_c": [], "n": n, "dead": []})
        for key, w in (("soft", soft), ("lin", lin)):
            e, c = _row_stats(w)
            a[key].append(e.mean().item())
            a[key + "_c"].append(c.float().mean().item())
        a["dead"].append(1.0 - ok.float().mean().item())

    done = 0
    batch = []
    for img, _ in images:
        batch.append(img)
        if len(batch) == 4 or done + len(batch) == len(images):
            x = pre(batch)
            with patched(model, "dense"), record_stats(model, probe=probe), torch.no_grad():
                encode(model, x)
            done += len(batch)
            batch = []
    rows = []
    for li in sorted(acc):
        a = acc[li]
        logn = math.log(a["n"])
        rows.append(dict(
            layer=li, tokens=a["n"],
            softmax_entropy=float(np.mean(a["soft"])), relu_entropy=float(np.mean(a["lin"])),
            softmax_entropy_frac=float(np.mean(a["soft"]) / logn), relu_entropy_frac=float(np.mean(a["lin"]) / logn),
            softmax_concentrated=float(np.mean(a["soft_c"])), relu_concentrated=float(np.mean(a["lin_c"])),
            relu_rows_without_mass=float(np.mean(a["dead"])),
        ))
    print(f"attention entropy per layer — {args.model}, {done} images, {args.resolution} px, N = {rows[0]['tokens']} "
          f"(log N = {math.log(rows[0]['tokens']):.2f} nats)")
    print("| layer | softmax H (nats) | ReLU-kernel H (nats) | softmax H / log N | ReLU H / log N | softmax rows 90 % on < 5 % keys | ReLU rows 90 % on < 5 % keys |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['layer']} | {r['softmax_entropy']:.2f} | {r['relu_entropy']:.2f} | {r['softmax_entropy_frac']:.2f} | "
              f"{r['relu_entropy_frac']:.2f} | {r['softmax_concentrated']:.0%} | {r['relu_concentrated']:.0%} |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"model": args.model, "resolution": args.resolution, "images": done, "layers": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
