"""Peak memory of ``eval segmentation`` against the size of the train set: it must stay flat.

Each run, in its own process, fits both read-outs (linear probe and dense k-NN, ``max_patches`` capped) on ``N``
synthetic train images and scores 16 val images through a random 1-layer ViT of dinov2-small's width (384, 6 heads
of 64) at 448 px (32 x 32 patches of 14 px + CLS = 1025 tokens, dinov2-small's token count there), and reports its
peak resident set size (``ru_maxrss``).  The images are made on the fly (noise and one square of one of 9 classes),
so the set itself takes no memory.

    python benchmarks/segmentation_memory.py                      # N = 2000 and 20000, writes the JSON below
    python benchmarks/segmentation_memory.py --sizes 200 400      # a quick look

Writes ``benchmarks/results/segmentation/memory.json``; docs/benchmarks/segmentation.md shows it.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "segmentation" / "memory.json"
RES, CLASSES = 448, 9


def _split(name: str, n: int, seed: int):
    import numpy as np
    from PIL import Image

    from attnpatch.evals.segmentation.data import SegmentationSplit

    def labels(i):
        rng = np.random.default_rng([seed, i])
        lab = np.zeros((RES, RES), np.int16)
        y, x = rng.integers(0, RES // 2, 2)
        lab[y:y + RES // 2, x:x + RES // 2] = 1 + i % (CLASSES - 1)
        return lab

    def image(i):
        lab = labels(i)
        arr = np.empty((RES, RES, 3), np.uint8)
        arr[...] = (lab[..., None] * 25).astype(np.uint8)
        return Image.fromarray(arr)

    return SegmentationSplit(name, [f"{name}_{i}" for i in range(n)], [(RES, RES)] * n, image, labels)


def one(n: int, max_patches: int) -> dict:
    """Fit and score once on ``n`` train images (in this process); returns the figures."""
    import torch
    from transformers import Dinov2Config, Dinov2Model

    from attnpatch.evals.segmentation import run_segmentation, square_preprocess
    from attnpatch.evals.segmentation.data import SegmentationSet

    torch.manual_seed(0)
    model = Dinov2Model(Dinov2Config(hidden_size=384, num_hidden_layers=1, num_attention_heads=6, patch_size=14, image_size=518)).eval()
    data = SegmentationSet("synthetic", "voc", _split("train", n, 0), _split("val", 16, 1), [f"c{i}" for i in range(CLASSES)], 255)
    t0 = time.perf_counter()
    r = run_segmentation(model, data, square_preprocess((0.5,) * 3, (0.25,) * 3, RES), settings=[], max_patches=max_patches,
                         batch_size=16, probe_steps=200, resamples=10, examples=0)
    from attnpatch.patchers.adapters import adapter_for

    tokens = adapter_for(model).token_count(model, RES)
    return {"train_images": n, "val_images": 16, "tokens": tokens, "max_patches": max_patches, "patches": r["patches"]["dense"],
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "seconds": time.perf_counter() - t0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[2000, 20000])
    ap.add_argument("--max-patches", type=int, default=100_000)
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--output", default=str(OUT))
    a = ap.parse_args()
    if a.one is not None:
        print(json.dumps(one(a.one, a.max_patches)))
        return 0
    rows = []
    for n in a.sizes:
        out = subprocess.run([sys.executable, __file__, "--one", str(n), "--max-patches", str(a.max_patches)], capture_output=True,
                             text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"{n:>6} train images: peak RSS {rows[-1]['peak_rss_mib']:.0f} MiB, {rows[-1]['patches']} patches kept, "
              f"{rows[-1]['seconds']:.0f} s", flush=True)
    lo, hi = min(r["peak_rss_mib"] for r in rows), max(r["peak_rss_mib"] for r in rows)
    result = {"command": "python benchmarks/segmentation_memory.py " + " ".join(sys.argv[1:]), "rows": rows,
              "spread": hi / lo - 1}
    print(f"largest / smallest peak RSS: {hi / lo:.3f}")
    Path(a.output).parent.mkdir(parents=True, exist_ok=True)
    Path(a.output).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {a.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
