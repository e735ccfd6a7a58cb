"""The block-sparse baselines (``a_shape``, ``vertical_slash``, ``block_topk``) on FlexAttention vs their gather
paths, side by side with causal SDPA, one attention layer per length.

    python benchmarks/flex_cpu.py                                   # this machine's CPU, float32
    python benchmarks/flex_cpu.py --lengths 1024 2048 4096 --heads 8 --kv-heads 2 --head-dim 64
    python benchmarks/flex_cpu.py --device cuda --dtype bfloat16 --lengths 8192 32768 --heads 32 --kv-heads 8 --head-dim 128

Each (method, length) runs the method's whole attention call (selection included, which is the same for both
kernels) with ``kernel="gather"`` and with ``kernel="flex"`` on the same random inputs, after an untimed first call
(for flex: the compilation of that length bucket, printed as ``compile_s``), and reports the median of
``--repeats`` timed calls (each timer synchronises the device: :class:`attnpatch.timing.Stopwatch`),
the kept share of causal pairs (``density``), the ratios, and the largest difference of the two outputs.  SDPA,
gather and flex calls are interleaved (one of each per repeat), so that a change of the machine's load during a
row hits all three; the ratios are of the medians.
The settings aim at about half of the causal pairs kept: ``a_shape`` ``window = N / 4`` (128 initial tokens),
``vertical_slash`` ``vertical = slash = N / 4`` (64 estimation queries), ``block_topk`` ``threshold = 0.5``
(random inputs give nearly uniform block masses, so the kept share follows the threshold).  Random inputs are
fine for kernel speed at a given density, not for what a method keeps on a real model.

The kernel rule this measures is the ``CPU_FLEX_MIN_KEYS`` constant of each method's module (``kernel="auto"``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attnpatch.attention.sparse.block_topk import block_topk_attention  # noqa: E402
from attnpatch.attention.backends.flex import FLEX_STATS, bucket_length  # noqa: E402
from attnpatch.attention.sparse.a_shape import a_shape_attention  # noqa: E402
from attnpatch.attention.sparse.vertical_slash import vertical_slash_attention  # noqa: E402
from attnpatch.timing import Stopwatch, time_call  # noqa: E402


def layer_calls(method: str, n: int, q, k, v, scale: float, kernel: str):
    """``(call, stats)``: the method's attention call at ``n`` tokens with ``kernel`` (the settings above), and an
    untimed call that returns the kept share of causal pairs."""
    if method == "a_shape":
        kw = dict(init_tokens=128, window=n // 4, scale=scale)

        def call():
            return a_shape_attention(q, k, v, kernel=kernel, **kw)[0]

        def density():
            kept = a_shape_attention(q, k, v, kernel="gather", return_counts=True, **kw)[1]
            return float(kept.mean()) / (n * (n + 1) / 2)
    elif method == "vertical_slash":
        kw = dict(vertical=n // 4, slash=n // 4, last_q=64, scale=scale)

        def call():
            return vertical_slash_attention(q, k, v, kernel=kernel, **kw)[0]

        def density():
            kept = vertical_slash_attention(q, k, v, kernel="gather", return_counts=True, **kw)[1]
            return float(kept.mean()) / (n * (n + 1) / 2)
    elif method == "block_topk":
        kw = dict(scale=scale, block_size=128, stride=8, threshold=0.5)

        def call():
            return block_topk_attention(q, k, v, kernel=kernel, **kw)[0]

        def density():
            st = block_topk_attention(q, k, v, kernel="gather", return_stats=True, **kw)[1]
            return float(st.kept_pairs.sum() / st.causal_pairs.sum())
    else:
        raise ValueError(method)
    return call, density


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--methods", nargs="+", default=["a_shape", "vertical_slash", "block_topk"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    dev, dtype = torch.device(args.device), getattr(torch, args.dtype)
    print(f"torch {torch.__version__}, {dev}, {args.dtype}, threads {torch.get_num_threads()}, B={args.batch} "
          f"H={args.heads} Hkv={args.kv_heads} D={args.head_dim}, median of {args.repeats}")
    print(f"{'method':15} {'N':>6} {'bucket':>6} {'density':>7} {'sdpa_ms':>8} {'gather_ms':>9} {'flex_ms':>8} "
          f"{'compile_s':>9} {'gather/sdpa':>11} {'flex/sdpa':>9} {'flex/gather':>11} {'max|diff|':>9}")
    gen = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():
        for n in args.lengths:
            def rnd(h):
                return torch.randn(args.batch, h, n, args.head_dim, generator=gen).to(device=dev, dtype=dtype)

            q, k, v = rnd(args.heads), rnd(args.kv_heads), rnd(args.kv_heads)
            scale = args.head_dim ** -0.5

            def sdpa():
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                                        enable_gqa=args.heads != args.kv_heads)

            sdpa()  # warm-up
            for method in args.methods:
                gather, density = layer_calls(method, n, q, k, v, scale, "gather")
                flex, _ = layer_calls(method, n, q, k, v, scale, "flex")
                with Stopwatch(dev) as first:
                    out_f = flex()  # compiles this length bucket (or loads it from Inductor's cache)
                out_g = gather()
                diff = float((out_f.float() - out_g.float()).abs().max())
                ts = {"sdpa": [], "gather": [], "flex": []}
                for _ in range(args.repeats):  # interleaved, so that a change of the machine's load hits all three
                    for name, fn in (("sdpa", sdpa), ("gather", gather), ("flex", flex)):
                        ts[name] += time_call(fn, repeats=1, warmup=0, device=dev)
                t_sdpa, t_g, t_f = (statistics.median(ts[x]) for x in ("sdpa", "gather", "flex"))
                print(f"{method:15} {n:>6} {bucket_length(n):>6} {density():>7.3f} {t_sdpa * 1e3:>8.1f} {t_g * 1e3:>9.1f} "
                      f"{t_f * 1e3:>8.1f} {first.seconds:>9.1f} {t_g / t_sdpa:>11.2f} {t_f / t_sdpa:>9.2f} "
                      f"{t_f / t_g:>11.2f} {diff:>9.1e}", flush=True)
    print(f"flex calls {FLEX_STATS['calls']}, fallbacks to the gather path {FLEX_STATS['fallbacks']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
