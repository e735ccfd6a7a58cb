"""Farthest-point sampling on the CPU, side by side in one run: the compiled kernel, the PyTorch loop (both exact
squared differences) and the ``|x|^2 + |c|^2 - 2 x.c`` loop they replaced (kept here as the baseline only: it breaks
the tie rule on copies of tokens).

    python benchmarks/fps_cpu.py --threads 2

Prints one line per shape: median milliseconds of each over ``--repeats`` interleaved calls (one warm-up each), and
whether the three give the same indices on these random inputs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attnpatch.attention.landmarks import farthest_point_sampling  # noqa: E402


def fps_gemv(x: torch.Tensor, s: int, prefix: int = 1) -> torch.Tensor:
    """The loop before 2026-12-04: distances ``|x_i|^2 + |x_c|^2 - 2 x_i.x_c`` by one ``baddbmm`` per landmark."""
    x = x.float()
    b, n, d = x.shape
    sq = (x * x).sum(-1)
    xt = x.transpose(1, 2)
    dist = torch.full((b, n), float("inf"))
    first = max(prefix, 1)
    picks = [torch.arange(first).expand(b, first)]
    for j in range(first):
        torch.minimum(dist, torch.baddbmm((sq + sq[:, j : j + 1])[:, None, :], x[:, j : j + 1], xt, alpha=-2.0)[:, 0],
                      out=dist)
    dist[:, :first] = -1.0
    for _ in range(first, s):
        nxt = dist.argmax(-1, keepdim=True)
        picks.append(nxt)
        c = x.gather(1, nxt[:, :, None].expand(b, 1, d))
        torch.minimum(dist, torch.baddbmm((sq + sq.gather(1, nxt))[:, None, :], c, xt, alpha=-2.0)[:, 0], out=dist)
        dist.scatter_(1, nxt, -1.0)
    return torch.cat(picks, 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--s", type=int, default=64)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    calls = {"compiled": lambda x: farthest_point_sampling(x, args.s, 1, kernel="compiled"),
             "torch loop": lambda x: farthest_point_sampling(x, args.s, 1, kernel="torch"),
             "old gemv loop": lambda x: fps_gemv(x, args.s, 1)}
    print(f"farthest-point sampling, s={args.s}, float32, {torch.get_num_threads()} threads; median ms of {args.repeats}")
    for b, n, d in ((1, 1025, 384), (4, 1025, 384), (1, 4097, 384), (1, 16385, 384)):
        x = torch.randn(b, n, d, generator=torch.Generator().manual_seed(0))
        out = {name: fn(x) for name, fn in calls.items()}  # warm-up (builds the compiled kernel once)
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(args.repeats):
            for name, fn in calls.items():
                t0 = time.perf_counter()
                fn(x)
                times[name].append(time.perf_counter() - t0)
        same = all(torch.equal(o, out["compiled"]) for o in out.values())
        print(f"[{b}, {n}, {d}]: " + ", ".join(f"{name} {statistics.median(t) * 1e3:.1f} ms" for name, t in times.items())
              + f"; same indices: {same}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
