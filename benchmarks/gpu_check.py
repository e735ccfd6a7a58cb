"""The prepared GPU check: exactness on the device, FNA and the FlexAttention baselines against SDPA, the calibrated
break-even lengths, in one run of at most about 8 minutes.

    PYTHONPATH=. python benchmarks/gpu_check.py --out "$OUT"          # on a CUDA machine (bf16, flash SDPA)
    python benchmarks/gpu_check.py --dry-run --out /tmp/gpu_check     # on the CPU: Triton interpreter, tiny sizes

What it measures, every ratio side by side in one run (the baseline and the method back to back on the same inputs,
warm-up excluded, median of the repeats, every timer synchronising the device):

* ``checks``: the GPU kernels against float64 references on the device: FPS (one Triton launch) against the
  explicit float64 FPS (landmark indices), the matmul-only pseudo-inverse against the same filter in float64,
  Nyström with every token a landmark against float64 exact attention, one FNA layer against float64 given the
  same landmarks, and each FlexAttention baseline against its
  gather path and, at its exact limit, against causal SDPA; in float32 and bfloat16 (relative Frobenius errors).
  FPS on exact copies of tokens (every distinct token first, then the copies in index order).  AnchorAttention's
  Triton path (``kernel="triton"``, the public call) at ``theta = 1e30`` (every causal key kept by the kernels' own
  rule; ``theta = inf`` hands back to dense attention and never reaches them) against float64 causal SDPA at head
  dims 32 and 128, and at a finite threshold against the PyTorch path on the same inputs (kept sets and outputs).
* ``fna``: one FNA layer (``s = 64``, DINOv2-S geometry: 6 heads of 64, batch 1) at N = 1025 / 4097 / 16385 /
  65537 against SDPA (flash backend on CUDA): eager, and replayed from a CUDA graph; peak extra memory.
* ``anchor``: AnchorAttention with ``kernel="triton"``, the defaults and the ``fast`` and ``paper`` presets (each with
  ``min_len=0``, so that every length runs sparse), on ``synthetic_prefill`` inputs (SmolLM2-135M geometry: 9 query
  heads, 3 KV heads of 64) at 8k / 32k / 64k / 128k against causal SDPA; sparsity (and recall up to 32k), peak extra
  memory (rows ``"input": "synthetic"``).  With ``--qkv FILE`` (default ``benchmarks/results/qkv/smollm2_l10_8k_bf16.pt``
  where it exists; ``--qkv none``: none) also the three settings on that captured layer (``{"q", "k", "v"}`` tensors
  ``[1, H, N, D]``, optional ``"scale"``; its first 8k tokens, the shortest length of the section), rows ``"input":
  "captured"``, each with the generator's sparsity and recall at the same length beside the layer's
  (``generator_sparsity``, ``generator_recall``): how well ``synthetic_prefill``, fitted to captured layers
  (``benchmarks/fit_synthetic_prefill.py``), stands in for a real layer at the longer lengths.
* ``flex``: ``a_shape``, ``vertical_slash``, ``block_topk`` with ``kernel="flex"`` at 8k / 32k / 128k (32 query
  heads, 8 KV heads of 128), at about half of the causal pairs kept (the settings of ``benchmarks/flex_cpu.py``)
  against causal SDPA; the compile time of each length bucket; peak extra memory.
* ``break_even``: ``min_tokens="auto"`` / ``min_len="auto"`` / ``"auto-fast"`` calibrated on this device (a fresh
  cache), for DINOv2-S and SmolLM2-135M geometry.
* ``kernels``: every Triton kernel variant the run compiled, with the registers, spilled registers and shared memory
  the driver reports (the device's side of ``benchmarks/triton_compile.py``, which compiles them with no GPU).

Results go to ``<out>/gpu_check.json`` after every section (a stopped run keeps what it finished), which
``python benchmarks/make_benchmarks.py render`` turns into the tables of docs/benchmarks/gpu.md when copied to
``benchmarks/results/cuda/``.  ``--budget`` seconds (default 420) bounds the run: a section that would start past it
is skipped and said so.  Needs only torch (2.11 or later) and triton from the environment: ``import attnpatch``
needs none of faiss, open_clip, gguf or datasets.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

if "--dry-run" in sys.argv:  # Triton reads the variable when a kernel is decorated: before attnpatch is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from attnpatch.attention.nystrom.layer import fna_layer_case  # noqa: E402
from attnpatch.attention.backends.flex import FLEX_STATS, bucket_length  # noqa: E402
from attnpatch.attention.landmarks import farthest_point_sampling, farthest_point_sampling_reference  # noqa: E402
from attnpatch.attention.nystrom import landmark_pinv_matmul, landmark_pinv_work  # noqa: E402
from attnpatch.timing import Stopwatch, time_call  # noqa: E402
from flex_cpu import layer_calls  # noqa: E402

SIZES = {
    "cuda": dict(dtypes=("float32", "bfloat16"), fna=(1025, 4097, 16385, 65537), s=64, fna_heads=6, fna_dim=64,
                 flex=(8192, 32768, 131072), flex_heads=32, flex_kv=8, flex_dim=128, check_n=1024, repeats=10, density_max_n=8192,
                 flex_methods=("a_shape", "vertical_slash", "block_topk"), anchor=(8192, 32768, 65536, 131072),
                 anchor_heads=9, anchor_kv=3, anchor_dim=64, recall_max_n=32768,
                 anchor_settings=("defaults", "fast", "paper")),
    "dry-run": dict(dtypes=("float32",), fna=(129, 257), s=16, fna_heads=2, fna_dim=16,
                    flex=(256,), flex_heads=2, flex_kv=1, flex_dim=16, check_n=256, repeats=2, density_max_n=256,
                    flex_methods=("a_shape",), anchor=(512,), anchor_heads=2, anchor_kv=1, anchor_dim=16,
                    recall_max_n=512, anchor_settings=("defaults", "paper")),
}
TARGETS = {"fna": {4097: 1.0, 16385: 3.0, 65537: 8.0}, "flex_at_least": 1.0}
#: The captured layer the ``anchor`` section measures besides the synthetic input, where the file exists (carried to
#: the GPU machine; ``benchmarks/results/qkv/`` is not committed): SmolLM2-135M layer 10 at 8192 tokens, bfloat16.
DEFAULT_QKV = ROOT / "benchmarks" / "results" / "qkv" / "smollm2_l10_8k_bf16.pt"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b||_F / ||b||_F`` in float64 (NaN when ``a`` has a NaN)."""
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def randn(*shape, seed: int, device, dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device=device, dtype=dtype)


def peak_extra(fn, device: torch.device) -> int | None:
    """Bytes ``fn()`` allocates above what is allocated before it (CUDA only; ``None`` elsewhere)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device) - base)


def sdpa_context(device: torch.device):
    """SDPA restricted to the flash backend on CUDA (what the targets compare against); unrestricted elsewhere."""
    import contextlib

    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION])


def medians(calls: dict, device: torch.device, repeats: int) -> dict[str, float]:
    """Median seconds of each call, interleaved (one of each per repeat) after one warm-up each."""
    for fn in calls.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            times[name] += time_call(fn, repeats=1, warmup=0, device=device)
    return {name: statistics.median(t) for name, t in times.items()}


# --------------------------------------------------------------------------- sections


def section_checks(dev: torch.device, cfg: dict) -> list[dict]:
    rows = []

    def add(name, dtype, value, limit, kind="rel_err"):
        ok = value == value and (value <= limit if kind == "rel_err" else value >= limit)
        rows.append({"check": name, "dtype": dtype, kind: value, "limit": limit, "ok": bool(ok)})

    def check_fps():
        # FPS: one Triton launch against the explicit float64 FPS (same indices; near-ties aside)
        x = randn(2, 513, 64, seed=1, device="cpu", dtype=torch.float32)
        ref = farthest_point_sampling_reference(x, 32, 1)
        got = farthest_point_sampling(x.to(dev), 32, 1, kernel="triton").cpu()
        add("fps_triton_indices_equal_float64", "float32", float((got == ref).float().mean()), 1.0, kind="agreement")
        # exact copies: every distinct token before any copy, then the copies in index order
        base = randn(20, 64, seed=9, device="cpu", dtype=torch.float32)
        dup = base[torch.arange(60) % 20][None]
        got = farthest_point_sampling(dup.to(dev), 32, 1, kernel="triton").cpu()
        add("fps_triton_copies_equal_float64", "float32",
            float((got == farthest_point_sampling_reference(dup, 32, 1)).float().mean()), 1.0, kind="agreement")

    def check_pinv():
        # the matmul-only pseudo-inverse of a landmark kernel (float32 work; on CUDA one Triton launch) against the same
        # filter computed in float64 on the CPU from the same input values
        for dt in cfg["dtypes"]:
            ql = randn(1, 2, 64, 32, seed=2, device=dev, dtype=torch.float32)
            a = torch.softmax(ql @ ql.transpose(-1, -2) * 32 ** -0.5, -1).to(getattr(torch, dt))
            want = landmark_pinv_matmul(a.double().cpu(), rtol=1e-2)
            got = landmark_pinv_work(a, "rtol", 1e-2, 6, kernel="triton")  # what CUDA's "auto" runs at s <= 64
            add("pinv_matmul_vs_float64_same_filter", dt, rel(got, want), 1e-3)

    def check_fna():
        # FNA: every token a landmark on a well-conditioned kernel is exact attention; and one layer (s landmarks by
        # the device's FPS) against the same landmarks and the same pseudo-inverse filter in float64 on the CPU
        import attnpatch.attention.nystrom as ny

        # the CUDA path's pseudo-inverse (one Triton launch at s <= 64; the same filter from products in float64 on the
        # CPU for the reference), by name so that the dry run computes the same
        dev_pinv, ref_pinv = dict(pinv_kernel="triton"), dict(pinv_kernel="products")
        for dt in cfg["dtypes"]:
            dtype = getattr(torch, dt)
            q = randn(1, 2, 48, 16, seed=3, device="cpu", dtype=torch.float32) * 2.0
            v = randn(1, 2, 48, 16, seed=4, device="cpu", dtype=torch.float32)
            want = torch.softmax(q.double() @ q.double().transpose(-1, -2) * 0.25, -1) @ v.double()
            got = ny.nystrom_attention(q.to(dev, dtype), q.to(dev, dtype), v.to(dev, dtype), torch.arange(48, device=dev)[None],
                                       scale=0.25, **dev_pinv)
            add("nystrom_all_landmarks_vs_float64_exact", dt, rel(got, want), 2e-2 if dt != "float32" else 1e-4)
            n = cfg["check_n"] + 1
            q, k, v = (randn(1, 2, n, 32, seed=s, device=dev, dtype=dtype) for s in (5, 6, 7))
            lm = farthest_point_sampling(k.transpose(1, 2).reshape(1, n, 64), cfg["s"], 1)
            got = ny.nystrom_attention(q, k, v, lm, scale=32 ** -0.5, **dev_pinv)
            want = ny.nystrom_attention(q.double().cpu(), k.double().cpu(), v.double().cpu(), lm.cpu(), scale=32 ** -0.5,
                                        **ref_pinv)
            add("fna_layer_vs_float64_same_landmarks", dt, rel(got, want), 3e-2 if dt != "float32" else 1e-3)

    def check_flex():
        # FlexAttention baselines: flex against gather, and at the exact limit against causal SDPA (float64 on the CPU)
        n = cfg["check_n"]
        for dt in cfg["dtypes"]:
            dtype = getattr(torch, dt)
            q = randn(1, 4, n, 32, seed=6, device=dev, dtype=dtype)
            k, v = (randn(1, 2, n, 32, seed=s, device=dev, dtype=dtype) for s in (7, 8))
            scale = 32 ** -0.5
            want = torch.nn.functional.scaled_dot_product_attention(
                q.double().cpu(), k.double().cpu(), v.double().cpu(), is_causal=True, scale=scale, enable_gqa=True)
            for method in ("a_shape", "vertical_slash", "block_topk"):
                gather, _ = layer_calls(method, n, q, k, v, scale, "gather")
                flex, _ = layer_calls(method, n, q, k, v, scale, "flex")
                add(f"{method}_flex_vs_gather", dt, rel(flex(), gather().float()), 2e-2 if dt != "float32" else 1e-4)
            from attnpatch.attention.sparse.a_shape import a_shape_attention

            limit = a_shape_attention(q, k, v, init_tokens=0, window=n, scale=scale, kernel="flex")[0]
            add("a_shape_flex_exact_limit_vs_float64_sdpa", dt, rel(limit, want), 2e-2 if dt != "float32" else 1e-4)

    for group in (check_fps, check_pinv, check_fna, check_flex, lambda: anchor_checks(dev, cfg, add)):
        try:
            group()
        except Exception as err:  # noqa: BLE001 - recorded as a failed check; the other groups still run
            name = getattr(group, "__name__", "check_anchor").replace("<lambda>", "check_anchor")
            rows.append({"check": name, "dtype": "-", "error": f"{type(err).__name__}: {str(err)[:300]}", "limit": None,
                         "ok": False})
    return rows


def anchor_checks(dev: torch.device, cfg: dict, add) -> None:
    """AnchorAttention's Triton path on the device, through the public call: at ``theta = 1e30`` (every causal key kept
    by the kernels' own rule; ``theta = inf`` never reaches them, it hands back to dense attention) against float64
    causal SDPA, at head dims 32 and 128 (float32 at 128 multiplies in three bfloat16 products); at a finite threshold
    against the PyTorch path on the same inputs: the share of equal kept (block, key) bits, and the outputs."""
    from attnpatch.attention.anchor import AnchorConfig, anchor_attention
    from attnpatch.attention.anchor.select import call_geometry, select_kept
    from attnpatch.attention.anchor.triton_select import select_bits, unpack_bits

    n = cfg["check_n"]
    opts = dict(block_size=64, init_block=64, local_window=64, min_len=0, dense_last=32, min_recall=0.0, pool_stride=8)
    for dt in cfg["dtypes"]:
        dtype = getattr(torch, dt)
        for d in (32, 128):
            scale = d ** -0.5
            q = randn(1, 4, n, d, seed=20, device=dev, dtype=dtype)
            k, v = (randn(1, 2, n, d, seed=s, device=dev, dtype=dtype) for s in (21, 22))
            every = AnchorConfig(**opts, theta=1e30, kernel="triton")
            out, st = anchor_attention(q, k, v, every, scale=scale, return_stats=True)
            want = torch.nn.functional.scaled_dot_product_attention(
                q.double().cpu(), k.double().cpu(), v.double().cpu(), is_causal=True, scale=scale, enable_gqa=True)
            kept_all = float(st.kept_pairs.sum()) == float(st.causal_pairs.sum())
            add(f"anchor_triton_theta_1e30_d{d}_vs_float64_sdpa", dt, rel(out, want) if kept_all else float("nan"),
                2e-2 if dt != "float32" else 1e-4)
        q = randn(1, 4, n, 32, seed=20, device=dev, dtype=dtype)
        k, v = (randn(1, 2, n, 32, seed=s, device=dev, dtype=dtype) for s in (21, 22))
        scale = 32 ** -0.5
        sparse = AnchorConfig(**opts, theta=2.5, kernel="triton")
        torch_cfg = AnchorConfig(**opts, theta=2.5, kernel="torch")
        geo = call_geometry(q, k, sparse.block_size, 0, None)
        kept = unpack_bits(select_bits(q, k, sparse, scale, geo), n)
        add("anchor_triton_kept_set_equals_torch", dt,
            float((kept == select_kept(q, k, torch_cfg, scale, geo)).float().mean()), 0.999, kind="agreement")
        got = anchor_attention(q, k, v, sparse, scale=scale)[0]
        ref = anchor_attention(q.float(), k.float(), v.float(), torch_cfg, scale=scale)[0]
        add("anchor_triton_vs_torch_path", dt, rel(got, ref), 2e-2 if dt != "float32" else 1e-4)


def section_fna(dev: torch.device, cfg: dict, dtype: torch.dtype, deadline: float) -> list[dict]:
    rows = []
    for n in cfg["fna"]:
        if time.perf_counter() > deadline:
            rows.append({"N": n, "skipped": "budget"})
            continue
        case = fna_layer_case(n, cfg["s"], dtype, dev, heads=cfg["fna_heads"], head_dim=cfg["fna_dim"])
        with torch.no_grad(), sdpa_context(dev):
            calls = {"sdpa": case["sdpa"], "fna": case["fna"]}
            graph_error = None
            if dev.type == "cuda":
                try:
                    case["fna"]()  # warm (Triton compile, cuBLAS handles) before capture
                    stream = torch.cuda.Stream()
                    stream.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(stream):
                        case["fna"]()
                    torch.cuda.current_stream().wait_stream(stream)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        case["fna"]()
                    calls["fna_graph"] = graph.replay
                except Exception as err:  # noqa: BLE001 - reported, not fatal
                    graph_error = f"{type(err).__name__}: {err}"
            t = medians(calls, dev, cfg["repeats"])
            row = {"N": n, "s": cfg["s"], "sdpa_ms": t["sdpa"] * 1e3, "fna_ms": t["fna"] * 1e3,
                   "speedup": t["sdpa"] / t["fna"], "peak_extra_fna": peak_extra(case["fna"], dev),
                   "peak_extra_sdpa": peak_extra(case["sdpa"], dev), "target": TARGETS["fna"].get(n)}
            if "fna_graph" in t:
                row.update(fna_graph_ms=t["fna_graph"] * 1e3, speedup_graph=t["sdpa"] / t["fna_graph"])
            if graph_error:
                row["graph_error"] = graph_error
        rows.append(row)
        print(f"fna N={n}: sdpa {row['sdpa_ms']:.3f} ms, fna {row['fna_ms']:.3f} ms ({row['speedup']:.2f}x)"
              + (f", graph {row['fna_graph_ms']:.3f} ms ({row['speedup_graph']:.2f}x)" if "fna_graph_ms" in row else ""),
              flush=True)
    return rows


def failed_row(ident: dict, what: str, err: Exception, dev: torch.device) -> dict:
    """The row of a timing that raised (e.g. out of memory at 128k): ``ident`` plus the error, printed as one line;
    the CUDA cache is emptied so the next row starts clean."""
    row = {**ident, "error": f"{type(err).__name__}: {str(err)[:300]}"}
    print(f"{what}: {row['error']}", flush=True)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return row


def section_flex(dev: torch.device, cfg: dict, dtype: torch.dtype, deadline: float) -> list[dict]:
    rows = []
    h, hkv, d = cfg["flex_heads"], cfg["flex_kv"], cfg["flex_dim"]
    scale = d ** -0.5
    for n in cfg["flex"]:
        q = randn(1, h, n, d, seed=10, device=dev, dtype=dtype)
        k, v = (randn(1, hkv, n, d, seed=s, device=dev, dtype=dtype) for s in (11, 12))

        def sdpa(q=q, k=k, v=v):  # the baseline alone is held to the flash backend (the methods use masks)
            with sdpa_context(dev):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                                        enable_gqa=h != hkv)

        for method in cfg["flex_methods"]:
            if time.perf_counter() > deadline:
                rows.append({"method": method, "N": n, "skipped": "budget"})
                continue
            try:
                with torch.no_grad():
                    flex, density = layer_calls(method, n, q, k, v, scale, "flex")
                    with Stopwatch(dev) as first:
                        flex()  # compiles this length bucket
                    t = medians({"sdpa": sdpa, "flex": flex}, dev, cfg["repeats"])
                    row = {"method": method, "N": n, "bucket": bucket_length(n),
                           "density": density() if n <= cfg["density_max_n"] else None,  # the gather path counts
                           "sdpa_ms": t["sdpa"] * 1e3, "flex_ms": t["flex"] * 1e3, "speedup": t["sdpa"] / t["flex"],
                           "compile_s": first.seconds, "peak_extra_flex": peak_extra(flex, dev)}
            except Exception as err:  # noqa: BLE001 - e.g. out of memory at 128k: recorded, the next row still runs
                rows.append(failed_row({"method": method, "N": n}, f"{method} N={n}", err, dev))
                continue
            rows.append(row)
            print(f"{method} N={n}: sdpa {row['sdpa_ms']:.3f} ms, flex {row['flex_ms']:.3f} ms ({row['speedup']:.2f}x), "
                  f"compile {row['compile_s']:.1f} s", flush=True)
        del q, k, v
    return rows


def anchor_settings(names) -> dict:
    """``{name: AnchorConfig}``: the defaults and the named presets of the method file, each with ``min_len=0`` (sparse
    at every length) and ``kernel="triton"``."""
    from attnpatch.attention.anchor import AnchorConfig
    from attnpatch.patchers.methods.anchor_attention import PRESETS

    out = {}
    for name in names:
        options = {} if name == "defaults" else dict(PRESETS[name].options)
        out[name] = AnchorConfig(**{**options, "min_len": 0, "kernel": "triton"})
    return out


def load_captured(path: str | os.PathLike) -> dict:
    """A captured layer: ``{"q": [1, H, N, D], "k", "v": [1, Hkv, N, D], "scale": float}`` on the CPU (``scale``
    ``D ** -0.5`` where the file has none); also takes a file of ``attnpatch bench capture`` (its first layer)."""
    data = torch.load(path, map_location="cpu")
    if isinstance(data, dict) and "q" not in data:
        data = data[min(data)]
    return {"q": data["q"], "k": data["k"], "v": data["v"], "scale": float(data.get("scale", data["q"].shape[-1] ** -0.5))}


def anchor_rows(dev: torch.device, cfg: dict, q, k, v, scale: float, n: int, settings: dict, deadline: float,
                source: str) -> list[dict]:
    """One row per setting: AnchorAttention against causal SDPA on ``q, k, v`` (``[1, H, n, D]``, ``[1, Hkv, n, D]``, on
    the device), ``source`` ``"synthetic"`` or ``"captured"``."""
    from attnpatch.attention.anchor import anchor_attention

    h, hkv = q.shape[1], k.shape[1]
    rows = []

    def sdpa():  # the baseline alone is held to the flash backend (the method's dense parts use masks)
        with sdpa_context(dev):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                                    enable_gqa=h != hkv)

    for name, acfg in settings.items():
        if time.perf_counter() > deadline:
            rows.append({"setting": name, "input": source, "N": n, "skipped": "budget"})
            continue
        try:
            with torch.no_grad():
                def anchor(acfg=acfg):
                    return anchor_attention(q, k, v, acfg, scale=scale)[0]

                with Stopwatch(dev) as first:
                    anchor()  # compiles the kernels' variants for this setting
                t = medians({"sdpa": sdpa, "anchor": anchor}, dev, cfg["repeats"])
                recall = n <= cfg["recall_max_n"]
                _, st = anchor_attention(q, k, v, acfg, scale=scale, return_stats=True, compute_recall=recall)
                row = {"setting": name, "input": source, "N": n, "sdpa_ms": t["sdpa"] * 1e3,
                       "anchor_ms": t["anchor"] * 1e3, "speedup": t["sdpa"] / t["anchor"], "first_call_s": first.seconds,
                       "sparsity": float(1.0 - st.kept_pairs.sum() / st.causal_pairs.sum().clamp(min=1)),
                       "recall": float(st.recall.mean()) if recall else None,
                       "recall_min_head": float(st.recall.min()) if recall else None,
                       "peak_extra_anchor": peak_extra(anchor, dev), "peak_extra_sdpa": peak_extra(sdpa, dev)}
        except Exception as err:  # noqa: BLE001 - e.g. out of memory at 128k: recorded, the next row still runs
            rows.append(failed_row({"setting": name, "input": source, "N": n}, f"anchor {name} ({source}) N={n}", err, dev))
            continue
        rows.append(row)
        print(f"anchor {name} ({source}) N={n}: sdpa {row['sdpa_ms']:.3f} ms, anchor {row['anchor_ms']:.3f} ms "
              f"({row['speedup']:.2f}x), sparsity {row['sparsity']:.3f}"
              + (f", recall {row['recall']:.4f}" if row["recall"] is not None else ""), flush=True)
    return rows


def section_anchor(dev: torch.device, cfg: dict, dtype: torch.dtype, deadline: float, qkv: str | None = None) -> list[dict]:
    """The synthetic rows at every length of ``cfg["anchor"]``; with ``qkv``, right after the shortest length's, the
    captured layer's rows at that length (its first tokens), each with the synthetic row's sparsity and recall beside
    it (``generator_sparsity``, ``generator_recall``)."""
    from attnpatch.patchers.methods.anchor_attention import synthetic_prefill

    rows = []
    h, hkv, d = cfg["anchor_heads"], cfg["anchor_kv"], cfg["anchor_dim"]
    settings = anchor_settings(cfg["anchor_settings"])
    captured = load_captured(qkv) if qkv else None
    for n in cfg["anchor"]:
        q, k, v = synthetic_prefill(n, h, hkv, d, dtype=dtype, device=dev)
        synthetic = anchor_rows(dev, cfg, q, k, v, d ** -0.5, n, settings, deadline, "synthetic")
        rows += synthetic
        del q, k, v
        if captured is not None and n == cfg["anchor"][0]:
            m = min(n, captured["q"].shape[2])
            q, k, v = (captured[x][:, :, :m].to(dev, dtype).contiguous() for x in "qkv")
            gen = {x["setting"]: x for x in synthetic if x["N"] == m}
            for row in anchor_rows(dev, cfg, q, k, v, captured["scale"], m, settings, deadline, "captured"):
                g = gen.get(row["setting"], {})
                rows.append({**row, "qkv": Path(qkv).name, "generator_sparsity": g.get("sparsity"),
                             "generator_recall": g.get("recall")})
            del q, k, v
    return rows


def section_break_even(dev: torch.device, cfg: dict, dtype: torch.dtype) -> list[dict]:
    from attnpatch.attention.anchor import AnchorConfig
    from attnpatch.patchers import break_even
    from attnpatch.patchers.methods import anchor_attention as anchor_method
    from attnpatch.patchers.methods import fna as fna_method
    from attnpatch.patchers.methods.fna import hooks as fna_hooks

    os.environ.pop("ATTNPATCH_FNA_BREAK_EVEN", None)
    os.environ.pop("ATTNPATCH_ANCHOR_BREAK_EVEN", None)
    os.environ["ATTNPATCH_CACHE"] = tempfile.mkdtemp(prefix="attnpatch-gpu-check-")  # a fresh calibration
    if dev.type == "cpu":  # the dry run: the CPU has tables; calibrate as a device without one would, briefly
        fna_method.BREAK_EVEN.pop("cpu", None)
        for table in anchor_method.BREAK_EVEN_BY_WORD.values():
            table.pop("cpu", None)
        break_even.BUDGET_SECONDS = 3.0
        fna_hooks.CALIBRATION_LENGTHS = (65, 129)
        anchor_method.CALIBRATION_LENGTHS = (256, 512)
    with torch.no_grad():
        q, k = (randn(1, 6, 8, 64, seed=0, device=dev, dtype=dtype) for _ in range(2))
        fna_method.min_tokens_for(fna_method.FNAConfig(), q, k)
        q, k = randn(1, 9, 8, 64, seed=0, device=dev, dtype=dtype), randn(1, 3, 8, 64, seed=0, device=dev, dtype=dtype)
        anchor_method.resolved(AnchorConfig(), q, k)
        anchor_method.resolved(AnchorConfig(**anchor_method.PRESETS["fast"].options), q, k)
    out = break_even.resolved_break_evens()
    for r in out:
        print(f"break-even {r['method']} ({r['heads']}/{r['kv_heads']}x{r['head_dim']}, {r['dtype']}): "
              f"{r['tokens'] if r['tokens'] is not None else 'never'} [{r['source']}]", flush=True)
    return out


def section_kernels(dev: torch.device) -> list[dict]:
    """Every variant of the project's Triton kernels this run compiled and loaded on the device, as the driver reports
    it (registers, spilled registers, shared memory): the device's counterpart of ``benchmarks/triton_compile.py``'s
    ``ptxas`` report, under the device's Triton.  ``[]`` under the interpreter (nothing is compiled)."""
    if dev.type != "cuda":
        return []
    from attnpatch.attention.anchor import triton_attend, triton_select
    from attnpatch.attention.landmarks import fps_triton as landmarks_triton
    from attnpatch.attention.nystrom import pinv_triton

    rows = []
    for mod, name in ((landmarks_triton, "_fps_kernel"), (pinv_triton, "_pinv_kernel"), (triton_select, "_select_kernel"),
                      (triton_attend, "_attend_kernel"), (triton_attend, "_mass_kernel")):
        fn = getattr(mod, name)
        for entry in getattr(fn, "device_caches", {}).values():
            cache = entry[0] if isinstance(entry, tuple) else entry
            for key, kernel in list(cache.items()):
                try:
                    kernel._init_handles()
                    meta = kernel.metadata
                    rows.append({"kernel": name, "registers": int(kernel.n_regs), "spills": int(kernel.n_spills),
                                 "shared": int(meta.shared), "num_warps": int(meta.num_warps),
                                 "variant": str(key)[:400]})
                except Exception as err:  # noqa: BLE001 - recorded, the others still listed
                    rows.append({"kernel": name, "error": f"{type(err).__name__}: {str(err)[:200]}", "variant": str(key)[:400]})
    for r in rows:
        print(f"kernel {r['kernel']}: " + (r["error"] if "error" in r else
              f"{r['registers']} registers, {r['spills']} spilled, {r['shared']} B shared, {r['num_warps']} warps"), flush=True)
    return rows


# --------------------------------------------------------------------------- main


def machine(dev: torch.device) -> dict:
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"cuda": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None, "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "triton": triton_version, "transformers": transformers.__version__, "python": platform.python_version()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cuda"), help="folder of gpu_check.json")
    ap.add_argument("--dry-run", action="store_true", help="on the CPU: Triton interpreter, tiny sizes, float32")
    ap.add_argument("--budget", type=float, default=420.0, help="seconds; sections past it are skipped (default 420)")
    ap.add_argument("--qkv", default=str(DEFAULT_QKV) if DEFAULT_QKV.is_file() else "none",
                    help="a captured layer the anchor section also measures ({'q', 'k', 'v'} [1, H, N, D]); 'none': "
                         "synthetic input only (default: benchmarks/results/qkv/smollm2_l10_8k_bf16.pt where it exists)")
    ap.add_argument("--sections", nargs="+", default=["checks", "fna", "break_even", "anchor", "flex", "kernels"],
                    choices=["checks", "fna", "break_even", "anchor", "flex", "kernels"])
    args = ap.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run with --dry-run on the CPU", file=sys.stderr)
        return 2
    qkv = None if args.qkv.lower() == "none" else args.qkv
    if qkv and not Path(qkv).is_file():
        print(f"gpu_check: --qkv {qkv}: no such file", file=sys.stderr)
        return 2
    dev = torch.device("cpu" if args.dry_run else "cuda")
    cfg = SIZES["dry-run" if args.dry_run else "cuda"]
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    deadline = time.perf_counter() + args.budget
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"date": time.strftime("%Y-%m-%d"), "dry_run": args.dry_run, "dtype": str(dtype).removeprefix("torch."),
              "machine": machine(dev), "qkv": qkv, "targets": {"fna": {str(k): v for k, v in TARGETS["fna"].items()},
                                                    "flex_at_least": TARGETS["flex_at_least"]}, "skipped": []}
    sections = {
        "checks": lambda: section_checks(dev, cfg),
        "fna": lambda: section_fna(dev, cfg, dtype, deadline),
        "anchor": lambda: section_anchor(dev, cfg, dtype, deadline, qkv),
        "flex": lambda: section_flex(dev, cfg, dtype, deadline),
        "break_even": lambda: section_break_even(dev, cfg, dtype),
        "kernels": lambda: section_kernels(dev),
    }
    status = 0
    for name in args.sections:
        if time.perf_counter() > deadline:
            result["skipped"].append(name)
            print(f"{name}: skipped (past the budget of {args.budget:.0f} s)", flush=True)
            continue
        t0 = time.perf_counter()
        try:
            result[name] = sections[name]()
        except Exception as err:  # noqa: BLE001 - recorded; the other sections still run
            result[name] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
            print(f"{name}: {type(err).__name__}: {err}", flush=True)
            status = 1
        result.setdefault("seconds", {})[name] = time.perf_counter() - t0
        result["flex_stats"] = dict(FLEX_STATS)
        (out / "gpu_check.json").write_text(json.dumps(result, indent=2))
    checks = result.get("checks")
    if isinstance(checks, list):
        bad = [c for c in checks if not c["ok"]]
        for c in checks:
            value = c.get("rel_err", c.get("agreement"))
            print(f"check {c['check']} [{c['dtype']}]: " + (c["error"] if "error" in c else f"{value:.2e}")
                  + f" ({'ok' if c['ok'] else 'FAILED'}, limit {c['limit']})")
        status = status or (1 if bad else 0)
    print(f"gpu_check: wrote {out / 'gpu_check.json'} ({'dry run' if args.dry_run else result['machine']['cuda']}); "
          f"flex fallbacks {FLEX_STATS['fallbacks']}; exit {status}")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
