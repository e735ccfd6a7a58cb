"""Generate the benchmark pages: every speed and memory number of the project, measured side by side in one run.

    python benchmarks/make_benchmarks.py run                 # all sections (about an hour on 2 CPU cores)
    python benchmarks/make_benchmarks.py run --only fna vit   # some sections
    python benchmarks/make_benchmarks.py render              # the generated blocks of every page from benchmarks/results/
    python benchmarks/make_benchmarks.py render --check      # exit 1 (and print a diff) when a page is stale
    python benchmarks/make_benchmarks.py render --output DIR # write the pages under DIR instead of in place

``run`` writes one JSON per section (and the PNG plots) under ``benchmarks/results/<device>/``;
``render`` turns whatever sections exist, per results folder, into tables with the machine description and
date each section was measured on.  ``--device cuda`` runs the same sections on a GPU
(longer lengths: ``--long``) into ``benchmarks/results/cuda/``.

The pages are BENCHMARKS.md (the front page: the headline figures of each area) and every ``docs/benchmarks/*.md``
(one page per area, with the full tables).  They are mostly hand-written (dated entries, each naming its command and
result files).  ``render`` rewrites only the text between ``<!-- generated:NAME -->`` and ``<!-- /generated:NAME -->``
on every page: ``toc`` (the page's table of contents), ``intro``, and one block per results folder (``cpu``, ``cuda``,
``compile``: the report of ``benchmarks/triton_compile.py``, ...), on whichever page holds its markers; everything
else is kept byte for byte.  A result file's optional ``"note"`` is printed under its section's machine line.

Sections:
  fna      bench attention, non-causal, random q/k/v, DINOv2-S geometry (6 heads x 64), N = 256 .. 16384
  anchor   bench attention, causal, q/k/v captured from SmolLM2-135M (8k) and Qwen2.5-0.5B (32k)
  vit      bench model, DINOv2-S at 224 / 448 / 896 px, plus the fidelity eval's CLS cosine at each size
  llm      bench model, SmolLM2-135M prefill at 1k .. 8k
  qwen     bench model, Qwen2.5-Coder-0.5B prefill at 32k, unpatched vs defaults and theta 8 (slow: three 32k prefills)
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import posixpath
import re
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"
SECTIONS = ("fna", "anchor", "vit", "llm", "qwen")
ANCHOR_SETTINGS = [
    ("anchor_attention", {}),
    ("anchor_attention", {"pool_stride": 8}),
    ("anchor_attention", {"pool_stride": 8, "dense_last": 64, "min_recall": 0.0}),
    ("anchor_attention", {"pool_stride": None, "dense_last": 0, "min_recall": 0.0}),
    ("anchor_attention", {"theta": 8.0, "pool_stride": 8, "dense_last": 64, "min_recall": 0.75, "select_dtype": "bfloat16"}),
]
ANCHOR_LABELS = {
    "anchor_attention": "defaults",
    "anchor_attention (pool_stride=8)": "stride 8",
    "anchor_attention (pool_stride=8, dense_last=64, min_recall=0.0)": "stride 8, no guard",
    "anchor_attention (pool_stride=None, dense_last=0, min_recall=0.0)": "paper",
    "anchor_attention (theta=8.0, pool_stride=8, dense_last=64, min_recall=0.75, select_dtype=bfloat16)": "theta 8, stride 8, guard 0.75, bf16 selection",
}


def _say(msg: str) -> None:
    print(f"[bench {dt.datetime.now():%H:%M:%S}] {msg}", file=sys.stderr, flush=True)


def _save(out: Path, name: str, result: dict) -> None:
    from attnpatch.evals.run.report import machine_info, write_json

    result["machine"] = machine_info()
    result["date"] = dt.datetime.now().isoformat(timespec="minutes")
    write_json(out / f"{name}.json", result)
    _say(f"wrote {out / name}.json")


def run_fna(out: Path, device: str, long: bool) -> None:
    from attnpatch.evals.bench import bench_attention, plot_attention

    lengths = [256, 512, 1024, 2048, 4097, 8192, 16384] + ([32768, 65536] if long else [])
    res = bench_attention([("fna", {"s": 64})], lengths=lengths, heads=6, head_dim=64, device=device, repeats=5, progress=_say)
    _save(out, "fna", res)
    plot_attention(res, out / "fna.png", title="non-causal attention, DINOv2-S geometry, s=64")


def _capture(model_name: str, length: int, layers: list[int], path: Path) -> None:
    if path.is_file():
        return
    from attnpatch.checkpoints import load_causal_lm
    from attnpatch.evals.bench import capture_qkv, prefill_ids

    model, tok = load_causal_lm(model_name)
    _say(f"capturing q/k/v of {model_name} at {length} tokens, layers {layers}")
    torch.save(capture_qkv(model, prefill_ids(tok, length), layers), path)


def run_anchor(out: Path, device: str, long: bool) -> None:
    from attnpatch.evals.bench import bench_attention, load_qkv, plot_attention

    cache = RESULTS / "qkv"
    cache.mkdir(parents=True, exist_ok=True)
    smol, qwen = cache / "smollm2_8k.pt", cache / "qwen05_32k.pt"
    _capture("smollm2-135m-instruct", 8192, [15], smol)
    _capture("qwen2.5-coder-0.5b-instruct", 32768, [11], qwen)
    for name, path, lengths in (("anchor_smollm2", smol, [2048, 4096, 8192]), ("anchor_qwen", qwen, [4096, 8192, 16384, 32768])):
        entry, layer = load_qkv(path)
        res = bench_attention(ANCHOR_SETTINGS, lengths=lengths, causal=True, qkv=entry, device=device,
                              repeats=3 if lengths[-1] <= 8192 else 2, progress=_say)
        res["config"].update(qkv=path.name, layer=layer)
        _save(out, name, res)
        plot_attention(res, out / f"{name}.png", title=f"causal prefill attention, {path.stem} layer {layer}")


def run_vit(out: Path, device: str, long: bool) -> None:
    from attnpatch.checkpoints import load_vision_model
    from attnpatch.evals.bench import bench_vision_model
    from attnpatch.evals.vision.images import load_image_set
    from attnpatch.evals.vision.preprocess import make_preprocess
    from attnpatch.evals.vision.runner import run_feature_eval

    model, proc = load_vision_model("dinov2-small")
    images = load_image_set(None)
    pics = [images[i][0] for i in range(len(images))]
    settings = [("fna", {}), ("fna", {"s": 128}), ("fna", {"s": 5000})]  # s >= N: approximates nothing (overhead guard)
    res = bench_vision_model(model, proc, settings, resolutions=[224, 448, 896], batch=4, repeats=3, device=device,
                             images=pics, progress=_say)
    fid = {}
    for r in (224, 448, 896):
        _say(f"fidelity at {r} px on the embedded set ({len(images)} images)")
        f = run_feature_eval(model, images, make_preprocess(proc, r), settings=settings[:2], tasks=["fidelity"], batch_size=4,
                             layer_error_images=0, compute_metrics=False)
        fid[r] = {("fna" + (f" (s={x['options']['s']})" if x["options"]["s"] != 64 else "")): {
            "cls_cosine": x["cls_cosine"], "cls_cosine_min": x["cls_cosine_min"]} for x in f["runs"]}
    res["fidelity"] = fid
    _save(out, "vit", res)


def run_llm(out: Path, device: str, long: bool) -> None:
    from attnpatch.checkpoints import load_causal_lm
    from attnpatch.evals.bench import bench_causal_lm

    model, tok = load_causal_lm("smollm2-135m-instruct", device=device)
    settings = ANCHOR_SETTINGS + [("anchor_attention", {"theta": float("inf")})]
    res = bench_causal_lm(model, tok, settings, lengths=[1024, 2048, 4096, 8192], repeats=1, warmup=1, device=device, progress=_say)
    _save(out, "llm", res)


def run_qwen(out: Path, device: str, long: bool) -> None:
    from attnpatch.checkpoints import load_causal_lm
    from attnpatch.evals.bench import bench_causal_lm

    model, tok = load_causal_lm("qwen2.5-coder-0.5b-instruct", device=device)
    res = bench_causal_lm(model, tok, [ANCHOR_SETTINGS[0], ANCHOR_SETTINGS[-1]], lengths=[32768], repeats=1, warmup=0,
                          device=device, include_dense=False, stats=False, progress=_say)
    _save(out, "qwen", res)


# ---------------------------------------------------------------------------------------------
# rendering


def _load(folder: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}


def _machine_line(res: dict) -> str:
    m = res["machine"]
    cap = f" ({m['cpu_capability']})" if m.get("cpu_capability") else ""
    dev = m.get("cuda") or f"{m['cpu']}{cap}, {m['cores']} cores, {m['torch_threads']} torch threads"
    return f"*Measured {res['date']} on {dev}; torch {m['torch']}, transformers {m['transformers']}, Python {m['python']}.*"


def _head(title: str, r: dict) -> list[str]:
    """A section's heading and machine line."""
    return [f"### {title}", "", _machine_line(r), ""]


def _note(r: dict) -> list[str]:
    """The result file's ``note``, where it has one: what was different on the day it was measured (e.g. what the
    defaults were then), printed under the section's description."""
    return [r["note"], ""] if r.get("note") else []


def _same_page(target: str) -> str:
    """A link target as written from the repository root (the default of ``link``: a page at the root, every heading
    on the page itself)."""
    return target


def render_folder(name: str, folder: Path, link=_same_page) -> str:
    """The tables of one results folder (``benchmarks/results/<name>/``): one section per result file that ``run``
    writes (``fna``, ``anchor_smollm2``, ``anchor_qwen``, ``vit``, ``llm``, ``qwen``), in that order, whatever the
    device; other files in the folder are read by the hand-written sections.  Empty when the folder has none.
    ``link`` turns a repository path or a ``#heading`` into a link from the page the block is written into."""
    from attnpatch.evals.bench.table import BENCH_ATTENTION_COLUMNS, BENCH_LM_COLUMNS, BENCH_VISION_COLUMNS
    from attnpatch.evals.run.report import rows_to_markdown
    data = _load(folder)
    if name == "compile":
        if "triton_compile" not in data:
            return ""
        return "\n".join(["## The Triton kernels compiled for sm_90 and sm_80", "",
                           *compile_tables(data["triton_compile"], data.get("triton_compile_before"))])
    out: list[str] = []
    if "fna" in data:
        r = data["fna"]
        out += [*_head("FNA attention vs SDPA (non-causal, one layer)", r),
                "Random q/k/v, batch 1, 6 heads x 64 (DINOv2-S), s = 64 landmarks by FPS.  `time` / `vs SDPA`: Nyström plus "
                f"the FPS amortised over the {r['config']['reuse_layers']} layers that reuse one sampling (DINOv2-S, "
                "sample layer 6 of 12); `vs SDPA (1 FPS/layer)`: a whole FPS in every layer; `Nyström only`: landmarks given.  "
                "`peak extra mem`: what the call allocates above its inputs; `N×N scores`: one score matrix.", "",
                *_note(r), rows_to_markdown(r["rows"], BENCH_ATTENTION_COLUMNS), "",
                "Scaling exponents (least-squares slope of log time vs log N): "
                + ", ".join(f"{k} {v:.2f}" for k, v in r["exponents"].items() if v is not None) + ".", "",
                f"![time]({link(f'benchmarks/results/{name}/fna_time.png')}) "
                f"![speed-up]({link(f'benchmarks/results/{name}/fna_speedup.png')})", ""]
    for key, what in (("anchor_smollm2", "SmolLM2-135M (9 heads, 3 KV heads, head dim 64)"),
                      ("anchor_qwen", "Qwen2.5-Coder-0.5B (14 heads, 2 KV heads, head dim 64)")):
        if key in data:
            r = data[key]
            rows = [{**x, "method": ANCHOR_LABELS.get(x["method"], x["method"])} for x in r["rows"]]
            out += [*_head(f"AnchorAttention vs causal SDPA (one layer), {what}", r),
                    f"q/k/v captured at layer {r['config']['layer']} on natural prose (`attnpatch bench capture`); "
                    "the first N tokens of the capture are exactly the N-token prefill.  `defaults` = the method's "
                    "defaults on the day of the run; `stride 8` = the same with pool_stride 8; `stride 8, no guard` = "
                    "pool_stride 8, dense_last 64, no recall guard (the defaults before the guard); `paper` = theta 12, one "
                    "pool per 128-query block, no dense tail, no guard; `theta 8, stride 8, guard 0.75, bf16 selection` = "
                    "theta 8, pool_stride 8, dense_last 64, min_recall 0.75, select_dtype bfloat16 (the fastest measured "
                    "setting with mean recall >= 0.95 at 16k and 32k on the Qwen layer).  Every setting runs the attention "
                    "over kept stripes in the compiled CPU kernel (`kernel=auto`).  "
                    "`selection` is the stripe selection alone; sparsity and recall (exact softmax mass on the kept keys, "
                    "mean over heads and queries) are measured on the same inputs.  AnchorAttention's peak extra memory is "
                    "its stripe mask (one bool per head, query block and key: H·N²/128 bytes) plus work buffers bounded "
                    "by a fixed chunk size (about 100 MiB), so at small N it exceeds one N×N score matrix and at 32k it "
                    "is about 1/100 of one.", "",
                    *_note(r), rows_to_markdown(rows, BENCH_ATTENTION_COLUMNS), "",
                    f"![time]({link(f'benchmarks/results/{name}/{key}_time.png')}) "
                    f"![speed-up]({link(f'benchmarks/results/{name}/{key}_speedup.png')})", ""]
    if "vit" in data:
        r = data["vit"]
        out += [*_head("DINOv2-S end to end (images/s), dense vs FNA", r),
                f"Batch {r['config']['batch']}, `unpatched` is the model as loaded; `dense` routes the model's own attention "
                "through the patch (the cost of the machinery); `fna (s=5000)` has s >= N at every size, so it approximates "
                "nothing (overhead guard).  `attention share`: fraction of the forward spent in the patched attention calls.", "",
                *_note(r), rows_to_markdown(r["rows"], BENCH_VISION_COLUMNS), ""]
        fid = r.get("fidelity", {})
        if fid:
            out += ["Mean final-CLS cosine to dense (fidelity eval, embedded 21-image set):", "",
                    "| resolution | " + " | ".join(next(iter(fid.values())).keys()) + " |",
                    "|---|" + "---|" * len(next(iter(fid.values()))),
                    *[f"| {res} | " + " | ".join(f"{v['cls_cosine']:.3f}" for v in d.values()) + " |" for res, d in fid.items()], ""]
    for key, what in (("llm", "SmolLM2-135M"), ("qwen", "Qwen2.5-Coder-0.5B")):
        if key in data:
            r = data[key]
            rows = [{**x, "setting": ANCHOR_LABELS.get(x["setting"], x["setting"])} for x in r["rows"]]
            names = {x["setting"] for x in rows}
            notes = ["One forward over the prompt (natural prose), last position's logits only."]
            if "dense" in names:
                notes.append("`dense` routes the model's own attention through the patch.")
            if any("theta=inf" in x for x in names):
                notes.append("`theta=inf` keeps every key (overhead guard).")
            if key == "qwen":
                notes.append("Unpatched vs two AnchorAttention settings only (one 32k prefill takes about 7 minutes here); "
                             "no sparsity pass.")
            out += [*_head(f"{what} prefill latency, dense vs AnchorAttention", r), "  ".join(notes), "",
                    *_note(r), rows_to_markdown(rows, BENCH_LM_COLUMNS), ""]
    if "gpu_check" in data:
        out += gpu_check_tables(data["gpu_check"], link)
    if not out:
        return ""
    return "\n".join([f"## Device: {name}", "", *out])


def _cell(x, fmt: str = "{:.3f}") -> str:
    return "–" if x is None else fmt.format(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else str(x)


def _table(header: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows), ""]


def gpu_check_tables(r: dict, link=_same_page) -> list[str]:
    """The tables of ``benchmarks/gpu_check.py``'s ``gpu_check.json``: exactness checks, FNA, AnchorAttention's Triton
    path and the FlexAttention baselines against SDPA (flash), and the calibrated break-even lengths; a section that
    failed shows its error."""
    m = r["machine"]
    out = ["### GPU check (`benchmarks/gpu_check.py`)", "",
           f"*Measured {r['date']} on {m.get('cuda') or m.get('cpu')}; torch {m['torch']}, triton {m.get('triton')}, "
           f"transformers {m['transformers']}, Python {m['python']}; {r['dtype']}; SDPA restricted to the flash backend.*", ""]
    for name in ("checks", "fna", "break_even", "anchor", "flex", "kernels"):
        sec = r.get(name)
        if isinstance(sec, dict) and "error" in sec:
            out += [f"`{name}` failed: `{sec['error']}`", ""]
    if isinstance(r.get("checks"), list):
        out += ["Exactness on the device (relative Frobenius error against float64; FPS: share of equal landmark indices; "
                "AnchorAttention's kept set: share of equal kept bits):", ""]
        out += _table(["check", "dtype", "value", "limit", "ok"],
                      [[c["check"], c["dtype"], (c["error"][:80] if "error" in c else _cell(c.get("rel_err", c.get("agreement")), "{:.2e}")), _cell(c["limit"], "{:g}"),
                        "yes" if c["ok"] else "**no**"] for c in r["checks"]])
    if isinstance(r.get("fna"), list):
        out += ["FNA `s = 64`, one layer (batch 1, 6 heads of 64), against SDPA; `graph`: the same layer replayed from a "
                "CUDA graph; target: the issue's ratio at that length.", ""]
        out += _table(["N", "SDPA ms", "FNA ms", "vs SDPA", "graph ms", "graph vs SDPA", "target", "peak extra (MiB)"],
                      [[str(x["N"]), _cell(x.get("sdpa_ms")), _cell(x.get("fna_ms")), _cell(x.get("speedup"), "{:.2f}x"),
                        _cell(x.get("fna_graph_ms")), _cell(x.get("speedup_graph"), "{:.2f}x"),
                        _cell(x.get("target"), "≥ {:g}x"),
                        _cell(None if x.get("peak_extra_fna") is None else x["peak_extra_fna"] / 2**20, "{:.1f}")]
                       for x in r["fna"] if "skipped" not in x])
    if isinstance(r.get("break_even"), list):
        out += ["Break-even lengths calibrated on the device (`min_tokens=\"auto\"`, `min_len=\"auto\"` / `\"auto-fast\"`; "
                "`never`: slower than SDPA at every length measured):", ""]
        out += _table(["method", "heads / KV heads × dim", "dtype", "break-even", "source", "lengths measured"],
                      [[b["method"], f"{b['heads']} / {b['kv_heads']} × {b['head_dim']}", b["dtype"],
                        "never" if b["tokens"] is None else str(b["tokens"]), b["source"],
                        ", ".join(f"{t[0]}: {t[2] / t[1]:.2f}x" for t in b.get("timings", []))] for b in r["break_even"]])
    if isinstance(r.get("anchor"), list):
        out += ["AnchorAttention with `kernel=\"triton\"` (the defaults and the `fast` and `paper` presets, each with "
                "`min_len=0`) against causal SDPA; input `synthetic`: the synthetic prefill (`synthetic_prefill`, 9 "
                "query heads, 3 KV heads of 64), `captured`: a layer captured from SmolLM2-135M on natural prose "
                "(`--qkv`); `first call`: the first call of the setting (Triton compilation included); recall: the "
                "exact softmax mass on the kept keys, mean over heads (and the lowest head), where measured.", ""]
        out += _table(["setting", "input", "N", "sparsity", "recall (min head)", "SDPA ms", "anchor ms", "vs SDPA",
                       "first call s", "peak extra (MiB)"],
                      [[x["setting"], x.get("input", "synthetic"), str(x["N"]), _cell(x.get("sparsity")),
                        "–" if x.get("recall") is None else f"{x['recall']:.4f} ({x['recall_min_head']:.4f})",
                        _cell(x.get("sdpa_ms")), _cell(x.get("anchor_ms")),
                        _cell(x.get("speedup"), "{:.2f}x") if "error" not in x else f"error: {x['error'][:60]}",
                        _cell(x.get("first_call_s"), "{:.1f}"),
                        _cell(None if x.get("peak_extra_anchor") is None else x["peak_extra_anchor"] / 2**20, "{:.1f}")]
                       for x in r["anchor"] if "skipped" not in x])
        cap = [x for x in r["anchor"] if x.get("input") == "captured" and "skipped" not in x and "error" not in x]
        if cap:
            out += [f"The captured layer (`{cap[0].get('qkv')}`) beside the synthetic prefill at the same length: "
                    "sparsity and mean recall.", ""]
            out += _table(["setting", "N", "captured sparsity", "captured recall", "generator sparsity", "generator recall"],
                          [[x["setting"], str(x["N"]), _cell(x.get("sparsity")), _cell(x.get("recall"), "{:.4f}"),
                            _cell(x.get("generator_sparsity")), _cell(x.get("generator_recall"), "{:.4f}")] for x in cap])
    if isinstance(r.get("flex"), list):
        out += ["The block-sparse baselines with `kernel=\"flex\"` (32 heads, 8 KV heads of 128; about half of the causal "
                "pairs kept) against causal SDPA; `compile`: the first call of the length bucket.", ""]
        out += _table(["method", "N", "density", "SDPA ms", "flex ms", "vs SDPA", "compile s", "peak extra (MiB)"],
                      [[x["method"], str(x["N"]), _cell(x.get("density")), _cell(x.get("sdpa_ms")), _cell(x.get("flex_ms")),
                        _cell(x.get("speedup"), "{:.2f}x") if "error" not in x else f"error: {x['error'][:60]}",
                        _cell(x.get("compile_s"), "{:.1f}"),
                        _cell(None if x.get("peak_extra_flex") is None else x["peak_extra_flex"] / 2**20, "{:.1f}")]
                       for x in r["flex"] if "skipped" not in x])
    if r.get("kernels"):
        out += ["Every Triton kernel variant the run compiled, as the driver reports it (`spilled`: registers spilled to "
                "local memory; compare the no-GPU compile report, [The Triton kernels compiled for sm_90 and sm_80]"
                f"({link('#the-triton-kernels-compiled-for-sm_90-and-sm_80')})):", ""]
        out += _table(["kernel", "warps", "registers", "spilled", "shared (B)"],
                      [[x["kernel"], _cell(x.get("num_warps"), "{}"), _cell(x.get("registers"), "{}"),
                        _cell(x.get("spills"), "{}") if "error" not in x else f"error: {x['error'][:60]}",
                        _cell(x.get("shared"), "{}")] for x in r["kernels"]])
    return out


def _dtype(v: dict) -> str:
    sig = v["signature"]
    return str(sig.get("q_ptr", sig.get("x_ptr", sig.get("a_ptr", "-")))).lstrip("*")


def _width(v: dict):
    """A variant's tile width: the head dim tile (AnchorAttention), the padded side (pseudo-inverse), the feature tile
    (FPS)."""
    c = v["constexprs"]
    return c.get("BD", c.get("S", c.get("BLOCK_D")))


def compile_tables(after: dict, before: dict | None) -> list[str]:
    """``benchmarks/triton_compile.py``'s reports as tables: per target, kernel, input dtype and tile width, the most
    spill bytes of any variant and the most registers, before (``triton_compile_before.json``, the kernels as they were
    when the report was first made) and now."""
    def worst(res: dict | None) -> dict:
        out: dict = {}
        for arch, variants in ((res or {}).get("archs") or {}).items():
            for v in variants:
                key = (int(arch), v["kernel"], _dtype(v), _width(v))
                spill, regs = v.get("spill_stores"), v.get("registers")
                cur = out.setdefault(key, [0, 0, 0, None])
                if v.get("error"):
                    cur[3] = v["error"][:60]
                    continue
                cur[0] = max(cur[0], spill or 0)
                cur[1] = max(cur[1], regs or 0)
                cur[2] += 1
        return out

    now, then = worst(after), worst(before)
    lines = [f"*Compiled {after['date']} with triton {after['triton']} ({after.get('ptxas') or 'ptxas'}), no GPU: "
             f"`python benchmarks/triton_compile.py --json benchmarks/results/compile/triton_compile.json`; "
             f"{sum(len(v) for v in after['archs'].values())} variants.*", "",
             "Each row: the variants of one kernel for one target, input dtype and tile width (AnchorAttention: head "
             "dim; pseudo-inverse: padded side; FPS: feature tile), the most spill-store bytes per thread and the most "
             "registers of any of them, before this report's fixes and now.  The variants and the budgets the suite "
             "holds them to: `tests/test_triton_compile.py`.", ""]
    rows = []
    for key in sorted(set(now) | set(then)):
        arch, kernel, dtype, width = key
        b, a = then.get(key), now.get(key)
        cell = lambda x: "–" if x is None else (f"error: {x[3]}" if x[3] else f"{x[0]:,} B ({x[1]} regs)")  # noqa: E731
        rows.append([f"sm_{arch}", kernel, dtype, _cell(width, "{}"), _cell(a[2] if a else None, "{}"), cell(b), cell(a)])
    return lines + _table(["target", "kernel", "input", "width", "variants", "spill stores before", "spill stores now"], rows)


def render_intro(folder_names: list[str], link=_same_page) -> str:
    """The intro: where the generated tables come from; ``folder_names`` are the results folders with tables."""
    out = ["Generated parts (between `<!-- generated:NAME -->` markers, here and on the pages under `docs/benchmarks/`) "
           "come from `python benchmarks/make_benchmarks.py render`, which reads the JSON that `python "
           "benchmarks/make_benchmarks.py run` writes under `benchmarks/results/<device>/`; every ratio in them is "
           "measured side by side in one run (each length or resolution times the exact baseline and every method back "
           "to back on the same inputs, warm-up excluded, median of the repeats).  The same tables come from the CLI: "
           "`attnpatch bench attention`, `attnpatch bench model`.  Everything outside the markers is hand-written (dated "
           "entries, each naming its command and result files) and `render` keeps it verbatim; `render --check` says "
           "whether every page is what the results files make.", ""]
    if "cuda" not in folder_names:
        out += ["No generated GPU tables yet (`benchmarks/results/cuda/` is empty; the one GPU run so far is the "
                f"hand-written [On a GPU]({link('#on-a-gpu-nvidia-h200-2026-11-30')}) entry, which predates the GPU "
                f"kernels: see [The GPU check]({link('#the-gpu-check-prepared-not-yet-run-on-a-gpu-2026-12-03')})).  "
                "On a GPU machine, `PYTHONPATH=. python benchmarks/gpu_check.py` (at most about 8 minutes) writes "
                "`benchmarks/results/cuda/gpu_check.json`, and `python benchmarks/make_benchmarks.py run --device cuda "
                "--long` the full tables (FNA up to N = 65536; the captured AnchorAttention inputs up to 32k); `render` "
                "adds both to the `generated:cuda` block.", ""]
    return "\n".join(out)


# --------------------------------------------------------------------------- the pages: generated blocks + hand-written rest

REPO = ROOT.parent
#: The front page, and the folder of the per-area pages (every ``*.md`` in it is rendered), relative to the repository.
FRONT = "BENCHMARKS.md"
PAGE_DIR = "docs/benchmarks"
BENCHMARKS = REPO / FRONT
BLOCK = re.compile(r"<!-- generated:(?P<name>[\w./-]+) -->\n(?P<body>.*?)<!-- /generated:(?P=name) -->", re.S)
FENCE = re.compile(r"^(```|~~~)")
DEFAULT_TEMPLATE = ("# Benchmarks\n\n<!-- generated:toc -->\n<!-- /generated:toc -->\n\n"
                    "<!-- generated:intro -->\n<!-- /generated:intro -->\n")


def slug(heading: str, seen: dict[str, int]) -> str:
    """GitHub's anchor for a heading: lower case, punctuation other than '-' and '_' removed, spaces to '-';
    the second heading with the same slug gets '-1', the third '-2'."""
    text = re.sub(r"`|\*\*|<[^>]+>", "", heading).strip().lower()
    base = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
    n = seen.get(base, 0)
    seen[base] = n + 1
    return base if n == 0 else f"{base}-{n}"


def headings(markdown: str) -> list[tuple[int, str]]:
    """(level, text) of every ATX heading outside fenced code blocks."""
    out, fenced = [], False
    for line in markdown.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and (m := re.match(r"^(#{1,6}) (.+?)\s*#*\s*$", line)):
            out.append((len(m.group(1)), m.group(2)))
    return out


def anchors(markdown: str) -> list[str]:
    """The anchors of every heading of ``markdown``, in order."""
    seen: dict[str, int] = {}
    return [slug(text, seen) for _, text in headings(markdown)]


def render_toc(markdown: str, levels: tuple[int, ...] = (2, 3)) -> str:
    """A table of contents of the ``##`` and ``###`` headings (nested), with GitHub's anchors."""
    lines = ["**Contents**", ""]
    for (level, text), anchor in zip(headings(markdown), anchors(markdown)):
        if level in levels:
            label = re.sub(r"([][])", r"\\\1", text)
            lines.append("  " * (level - levels[0]) + f"- [{label}](#{anchor})")
    return "\n".join(lines) + "\n"


def folders_of(results: Path) -> list[str]:
    """Every results folder but the captured q/k/v cache, in name order."""
    return [d.name for d in sorted(results.iterdir()) if d.is_dir() and d.name != "qkv"] if results.is_dir() else []


def linker(page: str, where: dict[str, str]):
    """``link(target)`` for generated text written into ``page`` (a path relative to the repository): ``target`` is a
    repository path (``benchmarks/results/cpu/fna_time.png``) or ``#anchor``, the anchor of a heading on whichever
    page holds it (``where``: anchor -> page; this page first, else the same page)."""
    here = posixpath.dirname(page) or "."

    def link(target: str) -> str:
        path, _, anchor = target.partition("#")
        if not path:
            path = where.get(anchor, page)
        rel = "" if path == page else posixpath.relpath(path, here)
        return rel + (f"#{anchor}" if anchor else "")
    return link


def _where(pages: dict[str, str], first: str) -> dict[str, str]:
    """anchor -> the page that has a heading with it (``first``'s own headings win, then the pages in order)."""
    out: dict[str, str] = {}
    for name in [first, *pages]:
        for a in anchors(pages[name]):
            out.setdefault(a, name)
    return out


def _render_once(pages: dict[str, str], results: Path, finished: dict[str, str]) -> dict[str, str]:
    names = folders_of(results)
    with_tables = [n for n in names if render_folder(n, results / n)]
    held = {m["name"] for text in pages.values() for m in BLOCK.finditer(text)}
    front = FRONT if FRONT in pages else next(iter(pages))
    out = {}
    for page, template in pages.items():
        link = linker(page, _where(finished, page))

        def fill(m: re.Match) -> str:
            name = m["name"]
            if name == "toc":
                return m.group(0)
            if name == "intro":
                return _block(name, render_intro(with_tables, link))
            return _block(name, render_folder(name, results / name, link) if name in names else "")

        doc = BLOCK.sub(fill, template)
        if page == front:
            for name in with_tables:
                if name not in held:
                    _say(f"results folder {name!r} had no block on any page: appended at the end of {page}")
                    doc = doc.rstrip("\n") + "\n\n" + _block(name, render_folder(name, results / name, link)) + "\n"
        # the table of contents last, from the finished page (the toc block itself holds no headings)
        out[page] = BLOCK.sub(lambda m: _block("toc", render_toc(doc)) if m["name"] == "toc" else m.group(0), doc)
    return out


def render_pages(pages: dict[str, str], results: Path = RESULTS) -> dict[str, str]:
    """Every page (path relative to the repository -> its committed text) with every ``<!-- generated:NAME -->``
    block rendered anew from ``results``; the text outside the blocks is kept as it is.

    Blocks: ``toc`` (the table of contents of the page's own headings), ``intro``, and one per results folder
    (``cpu``, ``cuda``, ``compile``, ...; empty for a folder without the files ``run`` writes), each on whichever page
    holds its markers.  A folder with tables but no block on any page gets one at the end of the front page (move it
    where it belongs: render keeps it there from then on).  Links in generated text are written relative to the page,
    and a link to a heading goes to the page that has it; a second pass resolves links to headings the first one
    generated, so rendering a rendered set changes nothing.
    """
    first = _render_once(pages, results, pages)
    return _render_once(pages, results, first)


def render(template: str, results: Path = RESULTS, page: str = FRONT) -> str:
    """One page (``template``, at ``page`` in the repository) rendered on its own: :func:`render_pages` of it alone."""
    return render_pages({page: template}, results)[page]


def _block(name: str, body: str) -> str:
    body = body.strip("\n")
    return f"<!-- generated:{name} -->\n" + (f"{body}\n\n" if body else "") + f"<!-- /generated:{name} -->"


def page_names(repo: Path = REPO) -> list[str]:
    """The front page and every page under ``docs/benchmarks/``, relative to ``repo``."""
    return [FRONT, *sorted(f"{PAGE_DIR}/{p.name}" for p in (repo / PAGE_DIR).glob("*.md"))]


def read_pages(repo: Path = REPO) -> dict[str, str]:
    """The committed text of every page (a missing front page: :data:`DEFAULT_TEMPLATE`)."""
    return {n: (repo / n).read_text() if (repo / n).is_file() else DEFAULT_TEMPLATE for n in page_names(repo)}


def stale_pages(repo: Path = REPO, results: Path = RESULTS) -> dict[str, str]:
    """The pages whose committed text differs from what ``render`` writes, each with a unified diff (rendered in
    memory; nothing is written).  Empty when every page is up to date."""
    import difflib

    current = read_pages(repo)
    rendered = render_pages(current, results)
    return {n: "".join(difflib.unified_diff(current[n].splitlines(True), rendered[n].splitlines(True), n, "rendered"))
            for n in current if rendered[n] != current[n] or not (repo / n).is_file()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    r.add_argument("--device", default="cpu")
    r.add_argument("--long", action="store_true", help="longer FNA lengths (GPU)")
    r.add_argument("--threads", type=int)
    pr = sub.add_parser("render", help="rewrite the generated blocks of BENCHMARKS.md and docs/benchmarks/*.md from "
                                       "benchmarks/results/")
    pr.add_argument("--output", type=Path, metavar="DIR",
                    help="write the pages under DIR (BENCHMARKS.md, docs/benchmarks/*.md) instead of in place; the "
                         "templates are still the committed pages")
    pr.add_argument("--check", action="store_true",
                    help="write nothing; exit 1 with a diff per page when a page is not what render would write")
    a = p.parse_args()
    if a.cmd == "run":
        if a.threads:
            torch.set_num_threads(a.threads)
        out = RESULTS / ("cuda" if a.device.startswith("cuda") else "cpu")
        out.mkdir(parents=True, exist_ok=True)
        for s in a.only:
            _say(f"section {s}")
            globals()[f"run_{s}"](out, a.device, a.long)
    if getattr(a, "check", False):
        stale = stale_pages()
        if not stale:
            _say(f"every page is up to date ({', '.join(page_names())})")
            return 0
        for diff in stale.values():
            sys.stdout.write(diff)
        _say(f"{', '.join(stale)} {'differs' if len(stale) == 1 else 'differ'} from what render writes (diff above): run "
             "`python benchmarks/make_benchmarks.py render`")
        return 1
    root = getattr(a, "output", None) or REPO
    for name, text in render_pages(read_pages()).items():
        dest = root / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(text)
        _say(f"wrote {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
