"""Exact k-nearest-neighbour search for the dense k-NN read-out: faiss's flat inner-product index against a matrix
product and ``topk`` in torch (what ``attnpatch.evals.segmentation.heads.KnnBank`` does), timed side by side.

One val image's patches (1024 at 448 px, 4096 at 896 px, width 384) against memory banks of 20000 and 100000 train
patches, k = 30, float32, both on the same L2-normalised arrays; the two are timed interleaved, median of 5, and the
neighbour sets are checked equal.

    python benchmarks/knn_search.py            # prints a Markdown table, writes benchmarks/results/segmentation/knn_search.json
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

OUT = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "segmentation" / "knn_search.json"


def main() -> int:
    import faiss

    rng = np.random.default_rng(0)
    rows = []
    for bank_n in (20_000, 100_000):
        bank = rng.standard_normal((bank_n, 384)).astype(np.float32)
        faiss.normalize_L2(bank)
        index = faiss.IndexFlatIP(384)
        index.add(bank)
        tb = torch.from_numpy(bank)
        for q_n in (1024, 4096):
            q = rng.standard_normal((q_n, 384)).astype(np.float32)
            faiss.normalize_L2(q)
            tq = torch.from_numpy(q)
            times = {"faiss": [], "torch": []}
            for _ in range(5):
                t0 = time.perf_counter()
                _, fi = index.search(q, 30)
                times["faiss"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                ti = torch.cat([(tq[i:i + 256] @ tb.T).topk(30, dim=-1).indices for i in range(0, q_n, 256)])
                times["torch"].append(time.perf_counter() - t0)
            same = float(np.mean([len(set(a) & set(b)) / 30 for a, b in zip(fi, ti.numpy())]))
            f, t = statistics.median(times["faiss"]), statistics.median(times["torch"])
            rows.append({"bank": bank_n, "queries": q_n, "faiss_s": f, "torch_s": t, "ratio": f / t, "same_neighbours": same})
            print(f"| {bank_n} | {q_n} | {f:.3f} | {t:.3f} | {f / t:.1f}x | {same:.4f} |", flush=True)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"command": "python benchmarks/knn_search.py", "threads": torch.get_num_threads(),
                               "faiss": faiss.__version__, "torch": torch.__version__, "rows": rows}, indent=1) + "\n")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
