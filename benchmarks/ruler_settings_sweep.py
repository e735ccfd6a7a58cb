"""Compare several AnchorAttention settings against one dense run on the same RULER prompts.

Each prompt is answered once densely and once per setting (greedy), so every setting sees the
same prompts and the same dense reference.  Prints one line per (task, length, setting):
accuracy dense vs patched, samples where the patched answer scored below / above dense, and
the mean attention sparsity of the patched prefill.

    python benchmarks/ruler_settings_sweep.py --model smollm2-135m-instruct \
        --tasks niah_multikey niah_multivalue niah_multiquery --lengths 2048 4096 --samples 10 \
        --setting default '{}' --setting stride4 '{"pool_stride": 4}'
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from attnpatch import patch, record_stats, unpatch
from attnpatch.checkpoints import load_causal_lm
from attnpatch.evals.ruler import tasks as ruler_tasks
from attnpatch.evals.recall import summarize_layers
from attnpatch.evals.ruler.runner import generate_greedy
from attnpatch.evals.ruler.text import build_input_ids


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tasks", nargs="+", default=["niah_multikey", "niah_multivalue", "niah_multiquery"])
    ap.add_argument("--lengths", nargs="+", type=int, default=[2048, 4096])
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--setting", nargs=2, action="append", metavar=("NAME", "JSON_OPTIONS"), required=True)
    ap.add_argument("--json", default=None, help="write per-sample results here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = [(name, json.loads(opts)) for name, opts in args.setting]
    model, tok = load_causal_lm(args.model)
    rows = []
    for task in args.tasks:
        for length in args.lengths:
            samples = ruler_tasks.make_samples(task, tok, length, args.samples, seed=args.seed)
            cell = {name: [] for name, _ in settings}
            dense_scores = []
            for i, s in enumerate(samples):
                ids = build_input_ids(tok, s)
                text_d, _ = generate_greedy(model, tok, ids, s.max_new_tokens)
                sd = ruler_tasks.score(task, text_d, s.answers)
                dense_scores.append(sd)
                for name, opts in settings:
                    patch(model, "anchor_attention", **opts)
                    try:
                        with record_stats(model) as rec:
                            text_p, _ = generate_greedy(model, tok, ids, s.max_new_tokens)
                    finally:
                        unpatch(model)
                    sp = ruler_tasks.score(task, text_p, s.answers)
                    spars = summarize_layers(rec.forwards[0]).get("sparsity") if rec.forwards else None
                    cell[name].append((sp, spars))
                    rows.append({"task": task, "length": length, "sample": i, "setting": name, "dense": sd,
                                 "patched": sp, "sparsity": spars, "dense_pred": text_d, "patched_pred": text_p})
                print(f"  {task} {length} sample {i}: dense {sd:.2f} " +
                      " ".join(f"{n}={cell[n][-1][0]:.2f}" for n, _ in settings), file=sys.stderr, flush=True)
            n = len(samples)
            for name, _ in settings:
                ps = [p for p, _ in cell[name]]
                below = sum(p < d for p, d in zip(ps, dense_scores))
                above = sum(p > d for p, d in zip(ps, dense_scores))
                sp = [x for _, x in cell[name] if x is not None]
                print(f"{task:16s} {length:5d} {name:12s} dense {100*sum(dense_scores)/n:5.1f}% "
                      f"patched {100*sum(ps)/n:5.1f}% below {below} above {above} "
                      f"sparsity {100*sum(sp)/max(len(sp),1):4.1f}%", flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
