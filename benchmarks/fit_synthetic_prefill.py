"""Fit AnchorAttention's synthetic prefill (``synthetic_prefill`` in ``attnpatch/patchers/methods/anchor_attention.py``)
to prefill layers captured from a real model, and show how closely it matches.

    attnpatch bench capture --model smollm2-135m-instruct --length 8192 --layers 3 10 20 \\
        -O benchmarks/results/qkv/smollm2_8k_l3_l10_l20.pt
    python benchmarks/fit_synthetic_prefill.py                 # about 6 minutes on 2 CPU cores

1. On each captured layer (``q`` ``[1, H, N, D]``, ``k, v`` ``[1, Hkv, N, D]``, the first ``--n`` tokens), the
   sparsity (share of the causal (query, key) pairs skipped) and the mean recall (exact softmax mass on the kept keys,
   averaged over queries and heads) of the defaults, ``fast`` and ``paper`` settings (``AnchorConfig(**PRESETS[name]
   .options)`` with ``min_len=0``), by the CPU path of ``anchor_attention`` (the compiled kernel where it builds,
   else PyTorch) with ``return_stats=True, compute_recall=True``.  The targets: their means over the layers.
2. A coarse grid over the generator's parameters (sink, stripe margin, per-key column bias, local boost, score
   noise; stripe period and local span fixed), each point measured the same way on ``synthetic_prefill`` at ``--n``
   tokens with ``--fit-heads`` / ``--fit-kv-heads`` heads of ``D`` (the heads are independent draws, so fewer heads
   estimate the same means for less time); the loss: ``sum over settings of |d sparsity| + 10 |d recall|``.
3. The best point measured at the captured geometry (``H`` / ``Hkv`` heads): the table of captured against generator
   sparsity and recall per setting, and the fitted parameters (``SYNTHETIC_PREFILL`` in the method file holds them).

The method and its selection rule: AnchorAttention, arXiv 2505.23520, Sec. 3.  The output is printed (the tables go to
docs/benchmarks/gpu.md by hand).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from attnpatch.attention.anchor import AnchorConfig, anchor_attention  # noqa: E402
from attnpatch.evals.bench import load_qkv  # noqa: E402
from attnpatch.patchers.methods.anchor_attention import PRESETS, SYNTHETIC_PREFILL, synthetic_prefill  # noqa: E402

DEFAULT_QKV = ROOT / "benchmarks" / "results" / "qkv" / "smollm2_8k_l3_l10_l20.pt"
SETTINGS = ("defaults", "fast", "paper")
#: The coarse grid (logit units); the stripe period and the local span stay at their values in ``FIXED``.
GRID = dict(sink=(6.0, 10.0), stripe=(8.0, 12.0), column=(1.5, 2.5), local=(6.0, 10.0), noise=(2.5, 3.5))
FIXED = dict(stripe_every=256, local_span=1024)
RECALL_WEIGHT = 10.0


def settings() -> dict[str, AnchorConfig]:
    """``{name: AnchorConfig}``: the defaults and the ``fast`` and ``paper`` presets, each with ``min_len=0``."""
    return {name: AnchorConfig(**{**({} if name == "defaults" else PRESETS[name].options), "min_len": 0})
            for name in SETTINGS}


def measure(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> dict[str, tuple[float, float]]:
    """``{setting: (sparsity, mean recall)}`` of one layer's ``q, k, v`` (float32, CPU)."""
    out = {}
    with torch.no_grad():
        for name, cfg in settings().items():
            _, st = anchor_attention(q, k, v, cfg, scale=scale, return_stats=True, compute_recall=True)
            out[name] = (float(1.0 - st.kept_pairs.sum() / st.causal_pairs.sum().clamp(min=1)), float(st.recall.mean()))
    return out


def generator(params: dict, n: int, heads: int, kv_heads: int, d: int) -> dict[str, tuple[float, float]]:
    q, k, v = synthetic_prefill(n, heads, kv_heads, d, dtype=torch.float32, device="cpu", **params)
    return measure(q, k, v, d ** -0.5)


def loss(got: dict, want: dict) -> float:
    return sum(abs(got[s][0] - want[s][0]) + RECALL_WEIGHT * abs(got[s][1] - want[s][1]) for s in SETTINGS)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--qkv", default=str(DEFAULT_QKV), help="a file of `attnpatch bench capture` (every layer in it is used)")
    ap.add_argument("--n", type=int, default=8192, help="tokens (the first N of the capture; default 8192)")
    ap.add_argument("--fit-heads", type=int, default=3, help="query heads of the generator during the grid (default 3)")
    ap.add_argument("--fit-kv-heads", type=int, default=1, help="KV heads of the generator during the grid (default 1)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    data = torch.load(args.qkv, map_location="cpu")
    layers = sorted(data)
    captured = {}
    for layer in layers:
        e, _ = load_qkv(args.qkv, layer)
        q, k, v = (e[x][:, :, : args.n].float().contiguous() for x in "qkv")
        captured[layer] = measure(q, k, v, e["scale"])
        print(f"captured layer {layer}: " + ", ".join(f"{s} {captured[layer][s][0]:.3f} / {captured[layer][s][1]:.4f}"
                                                      for s in SETTINGS), flush=True)
    heads, kv_heads, d = q.shape[1], k.shape[1], q.shape[-1]
    want = {s: tuple(sum(captured[layer][s][i] for layer in layers) / len(layers) for i in (0, 1)) for s in SETTINGS}

    best = None
    for values in itertools.product(*GRID.values()):
        params = {**dict(zip(GRID, values)), **FIXED}
        got = generator(params, args.n, args.fit_heads, args.fit_kv_heads, d)
        err = loss(got, want)
        print(f"grid {params}: loss {err:.3f} (" + ", ".join(f"{s} {got[s][0]:.3f} / {got[s][1]:.4f}" for s in SETTINGS)
              + ")", flush=True)
        if best is None or err < best[0]:
            best = (err, params)
    params = best[1]
    got = generator(params, args.n, heads, kv_heads, d)
    before = generator({}, args.n, heads, kv_heads, d) if {**SYNTHETIC_PREFILL} != params else None

    print(f"\nAnchorAttention on SmolLM2-135M layers {', '.join(map(str, layers))} captured at {args.n} tokens "
          f"({heads} heads, {kv_heads} KV heads of {d}), float32, CPU path; sparsity / mean recall:")
    print("\n| layer | " + " | ".join(f"{s} sparsity | {s} recall" for s in SETTINGS) + " |")
    print("|---|" + "---:|---:|" * len(SETTINGS))
    for layer in layers:
        print(f"| {layer} | " + " | ".join(f"{captured[layer][s][0]:.3f} | {captured[layer][s][1]:.4f}" for s in SETTINGS) + " |")
    print(f"\nThe generator at {args.n} tokens ({heads} / {kv_heads} heads of {d}), fitted parameters {params} "
          f"(grid loss {best[0]:.3f} at {args.fit_heads} / {args.fit_kv_heads} heads; {loss(got, want):.3f} here):")
    print("\n| setting | captured sparsity | captured recall | generator sparsity | generator recall |"
          + (" generator before the fit: sparsity / recall |" if before else ""))
    print("|---|---:|---:|---:|---:|" + ("---:|" if before else ""))
    for s in SETTINGS:
        print(f"| {s} | {want[s][0]:.3f} | {want[s][1]:.4f} | {got[s][0]:.3f} | {got[s][1]:.4f} |"
              + (f" {before[s][0]:.3f} / {before[s][1]:.4f} |" if before else ""))
    print(f"\nfit_synthetic_prefill: {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
