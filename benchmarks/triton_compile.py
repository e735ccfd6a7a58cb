"""Every Triton kernel of the project compiled for Hopper (sm_90a) and Ampere (sm_80) with no GPU, through the
project's own launchers at the shapes ``benchmarks/gpu_check.py`` runs, in float32 and bfloat16: registers, spill
bytes, stack frame and shared memory of each variant, from ``ptxas -v`` (the one in the Triton wheel).

    python benchmarks/triton_compile.py --json benchmarks/results/compile/triton_compile.json
    python benchmarks/triton_compile.py --arch 90 --only anchor          # a part, one target

The launchers run on CPU tensors inside :func:`attnpatch.attention.backends.aot.compile_only`: each launch is bound and
specialised by Triton as on the GPU and compiled, never run.  The launches (:func:`launches`):

* ``fps``: farthest-point sampling (``landmarks.fps_triton``) on FNA's features at DINOv2-S geometry (``[1, N, 6 x 64]``,
  ``s = 64``, N = 1025 and 65537: one launch with the per-step grid barrier, and ``stepwise``), and on the check's
  ``[2, 513, 64]`` (``s = 32``).
* ``pinv``: the landmark pseudo-inverse (``nystrom.pinv_triton``) at every padded side it takes (``s`` = 16, 32, 64).
* ``anchor``: AnchorAttention's kernels (``triton_select``, ``triton_attend``) through ``anchor_attention`` at
  SmolLM2-135M geometry (9 query heads, 3 KV heads of 64) at 8192 tokens with the defaults and the ``fast`` and
  ``paper`` presets (``min_len=0``), the check's geometry (4 / 2 heads of 32, blocks of 64) at ``theta`` = 1e30 and
  2.5, and the variants a model adds (padding inside the keys, the recall guard's dense blocks, ``dense_last`` rows,
  ``select_dtype="bfloat16"``).

Needs Triton, no GPU; must run without ``TRITON_INTERPRET=1`` (it sets ``TRITON_INTERPRET=0`` for itself).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # before any kernel is decorated: this is about the compiled kernels

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from attnpatch.attention.backends.aot import SUPPORTED_ARCHS  # noqa: E402 - after TRITON_INTERPRET=0 above

PARTS = ("fps", "pinv", "anchor")
DTYPES = (torch.float32, torch.bfloat16)


def _randn(*shape, dtype, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def fps_launches(dtype):
    from attnpatch.attention.landmarks.fps_triton import farthest_point_sampling_triton

    for n in (1025, 65537):  # DINOv2-S: keys of 6 heads x 64 concatenated, s = 64 (gpu_check's fna section)
        x = _randn(1, n, 384, dtype=dtype)
        yield f"fps [1, {n}, 384] s=64", lambda x=x: farthest_point_sampling_triton(x, 64, 1)
        yield f"fps [1, {n}, 384] s=64 stepwise", lambda x=x: farthest_point_sampling_triton(x, 64, 1, stepwise=True)
    x = _randn(2, 513, 64, dtype=dtype)  # gpu_check's check
    yield "fps [2, 513, 64] s=32", lambda: farthest_point_sampling_triton(x, 32, 1)


def pinv_launches(dtype):
    from attnpatch.attention.nystrom.pinv_triton import landmark_pinv_triton

    for s in (16, 32, 64):
        a = torch.softmax(_randn(1, 6, s, s, dtype=torch.float32), -1).to(dtype)
        yield f"pinv [1, 6, {s}, {s}]", lambda a=a: landmark_pinv_triton(a, 1e-2)


def anchor_launches(dtype):
    from attnpatch.attention.anchor import AnchorConfig, anchor_attention
    from attnpatch.attention.anchor.select import call_geometry
    from attnpatch.attention.anchor.triton_attend import attend_bits, block_masses
    from attnpatch.attention.anchor.triton_select import select_bits
    from attnpatch.patchers.methods.anchor_attention import PRESETS

    n = 8192  # SmolLM2-135M: 9 query heads, 3 KV heads of 64 (gpu_check's anchor section)
    q, k, v = _randn(1, 9, n, 64, dtype=dtype), _randn(1, 3, n, 64, dtype=dtype, seed=1), _randn(1, 3, n, 64, dtype=dtype, seed=2)
    for name in ("defaults", "fast", "paper"):
        opts = {} if name == "defaults" else dict(PRESETS[name].options)
        if opts.get("select_dtype") == "auto":  # "auto" times a product on this CPU: not the target's answer, and
            opts["select_dtype"] = "float32"  # it varies with the load; the bfloat16 selection is compiled below
        cfg = AnchorConfig(**{**opts, "min_len": 0, "kernel": "triton"})
        yield (f"anchor 9/3x64 N={n} {name}",
               lambda cfg=cfg: anchor_attention(q, k, v, cfg, scale=0.125, return_stats=True, compute_recall=True))
    # the check's geometry (gpu_check's anchor checks): 4 / 2 heads of 32, blocks of 64
    n = 1024
    qc, kc, vc = _randn(1, 4, n, 32, dtype=dtype), _randn(1, 2, n, 32, dtype=dtype, seed=1), _randn(1, 2, n, 32, dtype=dtype, seed=2)
    small = dict(block_size=64, init_block=64, local_window=64, min_len=0, dense_last=32, min_recall=0.0, pool_stride=8,
                 kernel="triton")
    for theta in (1e30, 2.5):
        cfg = AnchorConfig(**small, theta=theta)
        yield (f"anchor 4/2x32 N={n} theta={theta:g}",
               lambda cfg=cfg: anchor_attention(qc, kc, vc, cfg, scale=32 ** -0.5, return_stats=True, compute_recall=True))
    # what a model adds: padding inside the keys, the guard's dense blocks, bfloat16 selection, theta = -inf
    bf16_select = AnchorConfig(min_len=0, kernel="triton", select_dtype="bfloat16")
    yield "anchor 9/3x64 select_dtype=bfloat16", lambda: anchor_attention(q, k, v, bf16_select, scale=0.125)
    window_only = AnchorConfig(min_len=0, kernel="triton", theta=-float("inf"))
    yield "anchor 9/3x64 theta=-inf", lambda: anchor_attention(q, k, v, window_only, scale=0.125)
    cfg = AnchorConfig(min_len=0, kernel="triton")
    valid = torch.ones(1, q.shape[2], dtype=torch.bool)
    valid[0, 1000:1100] = False  # a hole inside the keys

    def launchers(key_valid, cfg=cfg):
        # the launchers one by one: the guard's dense blocks (flags) and dense rows, and neither
        geo = call_geometry(q, k, cfg.block_size, 0, key_valid)
        bits = select_bits(q, k, cfg, 0.125, geo)
        flags = torch.zeros(1, 9, geo.nb, dtype=torch.bool)
        attend_bits(q, k, v, bits, geo, cfg, 0.125, dense_from=q.shape[2] - 256, dense_blocks=flags)
        attend_bits(q, k, v, bits, geo, cfg, 0.125)
        block_masses(q, k, bits, geo, cfg, 0.125, [3, 9], dense_blocks=flags)
        block_masses(q, k, bits, geo, cfg, 0.125, [3, 9])

    yield "anchor 9/3x64 padded keys, guard flags", lambda: launchers(valid)
    yield "anchor 9/3x64 guard flags, no dense rows", lambda: launchers(None)
    # head_dim 128 (Llama-3-8B, Qwen2.5-7B: 32 query heads, 8 KV heads of 128)
    ql, kl, vl = _randn(1, 32, 2048, 128, dtype=dtype), _randn(1, 8, 2048, 128, dtype=dtype, seed=1), _randn(1, 8, 2048, 128, dtype=dtype, seed=2)
    for sel in ("float32", "bfloat16"):
        wide = AnchorConfig(min_len=0, kernel="triton", select_dtype=sel)
        yield (f"anchor 32/8x128 N=2048 select_dtype={sel}",
               lambda cfg=wide: anchor_attention(ql, kl, vl, cfg, scale=128 ** -0.5, return_stats=True, compute_recall=True))


def launches(parts=PARTS, dtypes=DTYPES):
    """``[(label, callable)]``: the launches of :mod:`this script's docstring <__main__>`, per dtype."""
    makers = {"fps": fps_launches, "pinv": pinv_launches, "anchor": anchor_launches}
    out = []
    for dtype in dtypes:
        for part in parts:
            for label, fn in makers[part](dtype):
                out.append((f"{label} [{str(dtype).removeprefix('torch.')}]", fn))
    return out


def input_dtype(signature: dict) -> str:
    """The dtype of a variant's first tensor argument (``*bf16`` -> ``bf16``)."""
    for ty in signature.values():
        if isinstance(ty, str) and ty.startswith("*"):
            return ty[1:]
    return "-"


def compile_all(archs=(90, 80), parts=PARTS, dtypes=DTYPES, log=print) -> dict:
    """Compile every launch for each target: ``{"archs": {"90": [variant dicts]}, "launch_errors": [...], ...}``."""
    import triton

    from attnpatch.attention.backends.aot import compile_only

    result = {"date": time.strftime("%Y-%m-%d"), "triton": triton.__version__, "torch": torch.__version__,
              "ptxas": _ptxas_version(), "archs": {}, "launch_errors": [], "seconds": {}}
    for arch in archs:
        t0 = time.perf_counter()
        with torch.no_grad(), compile_only(arch) as compiled:
            for label, fn in launches(parts, dtypes):
                try:
                    fn()
                except Exception as err:  # noqa: BLE001 - a launcher that fails is a result
                    result["launch_errors"].append({"arch": arch, "launch": label, "error": f"{type(err).__name__}: {err}"})
                    log(f"sm_{arch}: {label}: {type(err).__name__}: {err}")
        result["archs"][str(arch)] = [v.as_dict() for v in compiled]
        result["seconds"][str(arch)] = time.perf_counter() - t0
        log(f"sm_{arch}: {len(compiled)} variants in {result['seconds'][str(arch)]:.0f} s")
    return result


def _ptxas_version() -> str | None:
    import subprocess

    try:
        from triton.backends.nvidia.compiler import get_ptxas

        out = subprocess.run([get_ptxas(90).path, "--version"], capture_output=True, text=True).stdout
        return out.strip().splitlines()[-1] if out.strip() else None
    except Exception:  # noqa: BLE001
        return None


#: The constexprs that tell a variant's role, per kernel (the table's "variant" column).
ROLE = {
    "_fps_kernel": ("BLOCK_N", "BLOCK_D", "SYNC"),
    "_pinv_kernel": ("S", "DOT_PRECISION"),
    "_select_kernel": ("BQ", "BN", "BD", "NP", "SCORE", "KEEP_ALL", "SEL_BF16", "HAS_PAD"),
    "_attend_kernel": ("BQ", "BN", "BD", "DENSE", "HAS_FLAGS", "HAS_PAD"),
    "_mass_kernel": ("BQ", "BN", "BD", "HAS_FLAGS", "HAS_PAD"),
}


def variant_text(v: dict) -> str:
    """The constexprs that tell a variant's role, and the integer arguments Triton specialised (``step_lo=1``)."""
    c = v["constexprs"]
    text = " ".join(f"{k}={c[k]}" for k in ROLE.get(v["kernel"], sorted(c)) if k in c)
    spec = v.get("specialised") or {}
    return text + (" (" + ", ".join(f"{k}={x}" for k, x in sorted(spec.items())) + ")" if spec else "")


def table(result: dict) -> list[str]:
    """Markdown rows of every variant (errors included)."""
    lines = ["| arch | kernel | input | variant | warps | registers | spill stores / loads (B) | stack (B) | shared (B) |",
             "|---|---|---|---|---:|---:|---:|---:|---:|"]
    for arch, variants in result["archs"].items():
        for v in sorted(variants, key=lambda v: (v["kernel"], input_dtype(v["signature"]), variant_text(v))):
            if v.get("error"):
                lines.append(f"| sm_{arch} | {v['kernel']} | {input_dtype(v['signature'])} | {variant_text(v)} | "
                             f"{v['num_warps']} | compile error: {v['error'][:120]} | | | |")
                continue
            lines.append(f"| sm_{arch} | {v['kernel']} | {input_dtype(v['signature'])} | {variant_text(v)} | {v['num_warps']} | "
                         f"{v['registers']} | {v['spill_stores']} / {v['spill_loads']} | {v['stack_frame']} | {v['shared']} |")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, nargs="+", default=[90, 80], choices=SUPPORTED_ARCHS, metavar="ARCH",
                    help=f"compute capabilities, of {', '.join(map(str, SUPPORTED_ARCHS))} (default: 90 80)")
    ap.add_argument("--only", nargs="+", choices=PARTS, default=list(PARTS), help="kernel families (default: all)")
    ap.add_argument("--dtype", nargs="+", choices=["float32", "bfloat16"], default=["float32", "bfloat16"])
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args(argv)
    if args.json:
        target = Path(args.json)
        if target.is_dir():
            ap.error(f"--json {args.json}: a folder, not a file path")
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            ap.error(f"--json {args.json}: its folder cannot be made ({err.strerror})")
        if not os.access(target.parent, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
            ap.error(f"--json {args.json}: cannot be written")
    result = compile_all(tuple(args.arch), tuple(args.only), tuple(getattr(torch, d) for d in args.dtype))
    print("\n".join(table(result)))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")
    bad = [v for vs in result["archs"].values() for v in vs if v.get("error")] + result["launch_errors"]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
