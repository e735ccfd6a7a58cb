"""Does ``attnpatch tune --target knn-agreement`` choose the same setting beside a competing process?

Runs :func:`attnpatch.evals.tune.targets.tune_knn_agreement` on dinov2-small at ``--resolution`` px, idle, then beside
the competing PyTorch process that ``attnpatch bench ... --background-load`` starts, ``--tries`` times each, and prints
each run's family winners (their speed-up ranges and FLOP ratios) and the chosen setting.  The settings compare on
the family knob's steps (the start layer: from layer 0, a quarter, half the depth).  Writes
``benchmarks/results/frontier/busy<resolution>.json`` (or ``<--name>.json``) after every run (a stopped run keeps what finished).

    python benchmarks/tune_busy.py [--method tome] [--calibration 32] [--tries 2]
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--method", default="tome")
    p.add_argument("--resolution", type=int, default=448)
    p.add_argument("--target", type=float, default=0.99)
    p.add_argument("--calibration", type=int, default=32)
    p.add_argument("--max-candidates", type=int, default=9)
    p.add_argument("--tries", type=int, default=2)
    p.add_argument("--name", default=None, help="results file stem (default: busy<resolution>)")
    args = p.parse_args(argv)

    import torch

    from attnpatch.checkpoints import load_vision_model
    from attnpatch.evals.bench import background_load
    from attnpatch.evals.run.report import machine_info
    from attnpatch.evals.tune.search import short_setting
    from attnpatch.evals.tune.targets import tune_knn_agreement
    from attnpatch.evals.vision.images import load_image_set
    from attnpatch.evals.vision.preprocess import make_preprocess
    from attnpatch.log import log_stderr

    model, processor = load_vision_model("dinov2-small")
    images = load_image_set(str(DATA / "tuxpaint-captions"))
    pre = make_preprocess(processor, args.resolution)
    order = torch.randperm(len(images), generator=torch.Generator().manual_seed(0)).tolist()
    cal = images.subset(order[:args.calibration])
    hold = images.subset(order[args.calibration:args.calibration + 2])  # the held-out check is not what is compared
    OUT.mkdir(parents=True, exist_ok=True)
    out = OUT / f"{args.name or f'busy{args.resolution}'}.json"
    runs = []
    for i in range(args.tries):
        for load_s in (None, 1800):
            t0 = time.perf_counter()
            with background_load(load_s) as load:
                r = tune_knn_agreement(model, cal, hold, pre, args.method, target=args.target,
                                       max_candidates=args.max_candidates, progress=log_stderr)
            ch = r["chosen"]
            starts = sorted({w["start"] for w in r["winners"]})
            run = {"try": i + 1, "busy": load is not None, "load": load, "seconds": time.perf_counter() - t0,
                   "chosen": "exact" if ch.get("exact") else short_setting(ch["shown"]),
                   "step": -1 if ch.get("exact") else starts.index(ch["start"]),
                   "winners": [{"setting": short_setting(w["shown"]), "agreement": w["agreement"],
                                "speedup": w["speedup"], "spread": w["spread"], "best": w["best"],
                                "flop_ratio": w["flop_ratio"]} for w in r["winners"]]}
            runs.append(run)
            out.write_text(json.dumps({"argv": sys.argv[1:], "machine": machine_info(), "runs": runs}, indent=1, default=str))
            print(f"try {run['try']} {'busy' if run['busy'] else 'idle'} ({run['seconds']:.0f} s): chosen {run['chosen']} "
                  f"(family step {run['step']})", flush=True)
            for w in run["winners"]:
                print(f"    {w['setting']}: agreement {w['agreement']:.4f}, {w['speedup']:.2f}x "
                      f"[{w['spread'][0]:.2f}-{w['spread'][1]:.2f}], best {w['best']:.2f}x, "
                      f"dense / setting FLOPs {w['flop_ratio']:.2f}", flush=True)
    idle = [r["step"] for r in runs if not r["busy"]]
    busy = [r["step"] for r in runs if r["busy"]]
    print(f"family steps: idle {idle}, busy {busy}; busy within one step of every idle run: "
          f"{all(abs(b - a) <= 1 for b in busy for a in idle)}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
