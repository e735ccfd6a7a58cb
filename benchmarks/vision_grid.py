"""FNA / sink masking on a real ViT: the dense-vs-patched grid over resolutions and settings.

Two stages, so the forward passes can run on a machine that has a GPU but no faiss /
scikit-learn / datasets, and the metrics where those libraries are:

    # 1. features + fidelity + timings (any device); --labels selects a label range of the set
    python benchmarks/vision_grid.py features --model dinov2-small --data ../shared/data/imagenet-det-200x5 \
        --resolutions 224 448 896 --out out/grid_a --labels 0:100
    # 2. metrics (k-NN, linear probe, retrieval, k-NN agreement) over one or more feature folders
    python benchmarks/vision_grid.py metrics out/grid_a out/grid_b --markdown out/grid.md

Stage 1 writes, per resolution, ``res<R>.npz`` (labels, dense and per-setting final CLS
features) and ``res<R>.json`` (timings, cosines, per-layer errors, sampled layers); with
``--sweep`` it also runs the defaults sweep (sample layer, pseudo-inverse, features,
strategy) on the first ``--sweep-images`` images at ``--sweep-resolution``; with
``--sinks`` the sink diagnostic.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

GRID = [
    ("fna", {"s": 32}),
    ("fna", {"s": 64}),
    ("fna", {"s": 128}),
    ("fna", {"s": 32, "sample_layer": 0}),
    ("fna", {"s": 64, "sample_layer": 0}),
    ("fna", {"s": 128, "sample_layer": 0}),
    ("fna", {"s": 64, "resample": True}),
    ("sink_mask", {}),
]
SWEEP = (
    [("fna", {"s": 64, "sample_layer": li}) for li in (0, 2, 3, 4, 5, 6, 7, 8, 10)]
    + [("fna", {"s": 64, "sample_layer": 6, "pinv": p, **extra}) for p, extra in
       [("exact", {}), ("newton", {}), ("newton", {"newton_iters": 12}), ("rtol", {"rtol": 1e-1}), ("rtol", {"rtol": 1e-3})]]
    + [("fna", {"s": 64, "sample_layer": 6, "features": "hidden"})]
    + [("fna", {"s": 64, "sample_layer": 6, "strategy": st}) for st in ("random", "strided")]
    + [("sink_mask", {"mask_layers": m, "detect": d}) for m in (1, 2, 4) for d in ("attention",)]
    + [("sink_mask", {"mask_layers": 2, "renormalize": True}), ("fna+sink_mask", {"s": 64})]
)

SWEEP_KEY = (  # the decisions that matter most, for a larger N
    [("fna", {"s": 64, "sample_layer": li}) for li in (4, 5, 6, 7)]
    + [("fna", {"s": 64, "sample_layer": 6, "pinv": p, **extra}) for p, extra in
       [("newton", {}), ("rtol", {"rtol": 1e-1}), ("rtol", {"rtol": 1e-3})]]
    + [("fna", {"s": 64, "sample_layer": 6, "features": "hidden"})]
)


class FolderImages:
    """A labelled imagefolder (``train/metadata.jsonl`` + JPEGs) read with PIL alone (no ``datasets``)."""

    def __init__(self, root: str, labels: tuple[int, int] | None = None, limit: int | None = None, per_class: int | None = None):
        from PIL import Image

        self._open = Image.open
        folder = Path(root) / "train"
        rows = [json.loads(line) for line in (folder / "metadata.jsonl").read_text().splitlines() if line.strip()]
        rows.sort(key=lambda r: (r["label"], r["file_name"]))
        if labels is not None:
            rows = [r for r in rows if labels[0] <= r["label"] < labels[1]]
        if per_class:
            seen: dict[int, int] = {}
            kept = []
            for r in rows:
                if seen.get(r["label"], 0) < per_class:
                    seen[r["label"]] = seen.get(r["label"], 0) + 1
                    kept.append(r)
            rows = kept
        if limit:
            rows = rows[:limit]
        self.rows, self.folder = rows, folder
        self.labels = np.array([r["label"] for r in rows], dtype=np.int64)
        self.name = Path(root).name

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int):
        with self._open(self.folder / self.rows[i]["file_name"]) as im:
            return im.convert("RGB"), int(self.labels[i])


def _setting_name(method: str, opts: dict) -> str:
    return method + (" (" + ", ".join(f"{k}={v}" for k, v in opts.items()) + ")" if opts else "")


def load_timm_dir(folder: str):
    """timm ``vit_small_patch14_dinov2`` from ``folder/timm_model.safetensors`` (a timm state dict, any float
    dtype) + ``folder/preprocessor_config.json``: how the catalogue model travels to a machine whose
    transformers version differs (the state dict is what ``load_vision_model(..., backend="timm")`` builds)."""
    import types

    import timm
    from safetensors.torch import load_file
    from transformers import AutoImageProcessor

    from attnpatch.checkpoints import timm_pos_embed_plain_bicubic

    sd = {k: v.float() for k, v in load_file(f"{folder}/timm_model.safetensors").items()}
    grid = int(round((sd["pos_embed"].shape[1] - 1) ** 0.5))
    model = timm.create_model("vit_small_patch14_dinov2", pretrained=False, num_classes=0, dynamic_img_size=True, img_size=grid * 14)
    model.load_state_dict(sd, strict=True)
    model._pos_embed = types.MethodType(timm_pos_embed_plain_bicubic, model)
    return model.eval(), AutoImageProcessor.from_pretrained(folder)


def cmd_features(args) -> int:
    from attnpatch.evals.vision.preprocess import make_preprocess
    from attnpatch.evals.vision.runner import run_feature_eval

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    if args.model.startswith("timm-dir:"):
        model, proc = load_timm_dir(args.model[len("timm-dir:"):])
    else:
        from attnpatch.checkpoints import load_vision_model

        model, proc = load_vision_model(args.model, backend=args.backend)
    model = model.to(args.device, torch.float32 if args.upcast else dtype)
    lab = tuple(int(x) for x in args.labels.split(":")) if args.labels else None
    images = FolderImages(args.data, lab, args.limit, args.per_class)
    meta = {"model": args.model, "backend": args.backend, "device": args.device, "dtype": str(next(model.parameters()).dtype),
            "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None,
            "images": len(images), "labels": args.labels, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    print(json.dumps(meta), flush=True)
    if args.sinks:
        from attnpatch.evals.vision.sinks import sink_diagnostic

        for r in args.resolutions:
            x = make_preprocess(proc, r)([images[i][0] for i in range(min(8, len(images)))])
            rep = sink_diagnostic(model, x)
            (out / f"sinks_res{r}.json").write_text(json.dumps(rep, default=str))
            print(f"sinks res {r}: first massive layer {rep['first_massive_layer']}; CLS received x uniform per layer:",
                  [round(e["cls_received_x_uniform"], 1) for e in rep["layers"]],
                  "max/median norm per layer:", [round(e.get("norm_max_over_median", 0), 1) for e in rep["layers"]], flush=True)
    for r in args.resolutions:
        t0 = time.time()
        res = run_feature_eval(
            model, images, make_preprocess(proc, r), settings=GRID, tasks=("fidelity",), batch_size=args.batch_size,
            layer_error_images=args.layer_error_images, compute_metrics=False, return_features=True,
            feature_layers=args.feature_layers,
            progress=lambda d, t: print(f"  res {r}: {d}/{t} images ({time.time() - t0:.0f} s)", flush=True),
        )
        feats = res.pop("features")
        extra = {}
        for li, d in feats["layers"].items():
            extra[f"L{li}_dense"] = d["dense"].astype(np.float16)
            extra.update({f"L{li}_run{i}": f.astype(np.float16) for i, f in enumerate(d["runs"])})
        np.savez_compressed(out / f"res{r}.npz", labels=feats["labels"], dense=feats["dense"].astype(np.float16),
                            **{f"run{i}": f.astype(np.float16) for i, f in enumerate(feats["runs"])}, **extra)
        (out / f"res{r}.json").write_text(json.dumps({**meta, **res}, default=str))
        print(f"res {r} ({time.time() - t0:.0f} s): dense {res['dense']['images_per_s']:.1f} img/s; " + "; ".join(
            f"{_setting_name(x['method'], x['shown_options'])}: cos {x['cls_cosine']:.4f} err {x['mean_layer_error_teacher']:.3f} "
            f"x{x['speedup']:.2f}" for x in res["runs"]), flush=True)
    if args.sweep:
        sub = FolderImages(args.data, lab, args.sweep_images, args.per_class)
        for r in args.sweep_resolution:
            res = run_feature_eval(
                model, sub, make_preprocess(proc, r), settings=SWEEP if args.sweep_set == "full" else SWEEP_KEY,
                tasks=("fidelity",), batch_size=args.batch_size,
                layer_error_images=args.sweep_images, compute_metrics=False,
            )
            (out / f"sweep_res{r}.json").write_text(json.dumps({**meta, **res}, default=str))
            for x in res["runs"]:
                print(f"sweep res {r} {_setting_name(x['method'], x['shown_options'])}: CLS cos {x['cls_cosine']:.4f} "
                      f"(min {x['cls_cosine_min']:.3f}) patch cos {x['patch_cosine']:.4f} layer err teacher "
                      f"{x['mean_layer_error_teacher']:.3f} free {x['mean_layer_error_free']:.3f} x{x['speedup']:.2f}", flush=True)
    return 0


def cmd_metrics(args) -> int:
    from attnpatch.evals.vision import metrics as frozen

    dirs = [Path(d) for d in args.dirs]
    resolutions = sorted({int(p.stem[3:]) for p in dirs[0].glob("res*.npz")})
    md = []
    for r in resolutions:
        parts = [np.load(d / f"res{r}.npz") for d in dirs]
        metas = [json.loads((d / f"res{r}.json").read_text()) for d in dirs]
        labels = np.concatenate([p["labels"] for p in parts])
        n = len(labels)

        def metrics(f):
            f = f.astype(np.float32)
            knn = frozen.knn_classify(f, labels, k=args.k)
            lp = frozen.linear_probe(f, labels, folds=args.folds, seed=0)
            ret = frozen.image_retrieval(f, labels, ks=(1, 5))
            return knn, {"knn_top1": knn["top1"], "knn_top5": knn["top5"], "linear_probe": lp["mean"], "map_at_r": ret["map_at_r"],
                         "recall_at_1": ret["recall@1"]}

        pre = f"L{args.layer}_" if args.layer is not None else ""
        dk, dm = metrics(np.concatenate([p[pre + "dense"] for p in parts]))
        extra_dense = {}
        for li in args.also_layers:
            extra_dense[li] = metrics(np.concatenate([p[f"L{li}_dense"] for p in parts]))
            dm.update({f"{k}@L{li}": v for k, v in extra_dense[li][1].items() if k in ("knn_top1", "linear_probe", "map_at_r")})
        dsec = sum(m["dense"]["seconds"] for m in metas)
        rows = [{"setting": "dense", **dm, "images_per_s": n / dsec}]
        for i, run in enumerate(metas[0]["runs"]):
            pk, pm = metrics(np.concatenate([p[f"{pre}run{i}"] for p in parts]))
            for li in args.also_layers:
                lk, lm = metrics(np.concatenate([p[f"L{li}_run{i}"] for p in parts]))
                pm.update({f"{k}@L{li}": v for k, v in lm.items() if k in ("knn_top1", "linear_probe", "map_at_r")})
                pm[f"knn_agreement@L{li}"] = float(np.mean(lk["predictions"] == extra_dense[li][0]["predictions"]))
            rs = [m["runs"][i] for m in metas]
            ns = [m["n_images"] for m in metas]
            sec = sum(x["seconds"] for x in rs)
            sampled = {}
            for x in rs:
                for k_, v in x["sampled_at"].items():
                    sampled[k_] = sampled.get(k_, 0) + v
            rows.append({
                "setting": _setting_name(run["method"], run["shown_options"]), **pm,
                "knn_agreement": float(np.mean(pk["predictions"] == dk["predictions"])),
                "cls_cosine": float(np.average([x["cls_cosine"] for x in rs], weights=ns)),
                "cls_cosine_min": min(x["cls_cosine_min"] for x in rs),
                "patch_cosine": float(np.average([x["patch_cosine"] for x in rs], weights=ns)),
                "mean_layer_error_teacher": float(np.mean([x["mean_layer_error_teacher"] for x in rs])),
                "mean_layer_error_free": float(np.mean([x["mean_layer_error_free"] for x in rs])),
                "images_per_s": n / sec, "speedup": dsec / sec, "sampled_at": sampled,
            })
        which = "final CLS" if args.layer is None else f"CLS of block {args.layer} (final norm applied)"
        head = (f"#### {which} — {metas[0]['model']} at {r} px (N = {metas[0]['tokens']} tokens), {n} images of "
                f"{len(set(labels.tolist()))} classes; {metas[0].get('gpu') or metas[0]['device']}, {metas[0]['dtype']}, "
                f"torch {metas[0]['torch']}, {metas[0]['date']}")
        cols = ["setting", "knn_top1", "linear_probe", "map_at_r", "recall_at_1", "knn_agreement"]
        for li in args.also_layers:
            cols += [f"knn_top1@L{li}", f"linear_probe@L{li}", f"map_at_r@L{li}", f"knn_agreement@L{li}"]
        cols += ["cls_cosine", "cls_cosine_min", "patch_cosine", "mean_layer_error_teacher", "mean_layer_error_free", "images_per_s", "speedup"]
        lines = [head, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for row in rows:
            cells = []
            for c in cols:
                v = row.get(c)
                cells.append("-" if v is None else v if isinstance(v, str) else f"{100 * v:.1f}%" if c.split("@")[0] in (
                    "knn_top1", "linear_probe", "recall_at_1", "knn_agreement") else f"{v:.2f}" if c in ("images_per_s", "speedup") else f"{v:.4f}")
            lines.append("| " + " | ".join(cells) + " |")
        md.append("\n".join(lines))
        print("\n".join(lines) + "\n", flush=True)
        print("sampled at (layer: images):", {row["setting"]: row.get("sampled_at") for row in rows[1:] if row.get("sampled_at")}, "\n")
    if args.markdown:
        Path(args.markdown).write_text("\n\n".join(md) + "\n")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="stage", required=True)
    f = sub.add_parser("features")
    f.add_argument("--model", default="dinov2-small")
    f.add_argument("--backend", default="hf")
    f.add_argument("--data", required=True)
    f.add_argument("--labels", help="label range LO:HI (half-open)")
    f.add_argument("--limit", type=int, help="first LIMIT images (sorted by label, file name)")
    f.add_argument("--per-class", type=int, help="at most this many images per class")
    f.add_argument("--resolutions", nargs="*", type=int, default=[224, 448, 896])
    f.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    f.add_argument("--dtype", default="fp32", choices=["fp32", "fp16", "bf16"])
    f.add_argument("--upcast", action="store_true", help="compute in fp32 whatever the stored weights")
    f.add_argument("--batch-size", type=int, default=32)
    f.add_argument("--layer-error-images", type=int, default=32)
    f.add_argument("--sweep", action="store_true")
    f.add_argument("--sweep-images", type=int, default=128)
    f.add_argument("--sweep-set", choices=["full", "key"], default="full")
    f.add_argument("--sweep-resolution", nargs="+", type=int, default=[448])
    f.add_argument("--sinks", action="store_true")
    f.add_argument("--feature-layers", nargs="*", type=int, default=[], help="also keep these blocks' CLS tokens (final norm applied)")
    f.add_argument("--out", required=True)
    f.set_defaults(func=cmd_features)
    m = sub.add_parser("metrics")
    m.add_argument("dirs", nargs="+")
    m.add_argument("--k", type=int, default=20)
    m.add_argument("--folds", type=int, default=5)
    m.add_argument("--markdown")
    m.add_argument("--layer", type=int, help="metrics on this block's CLS features (saved with --feature-layers)")
    m.add_argument("--also-layers", nargs="*", type=int, default=[], help="add accuracy columns for these blocks' CLS features")
    m.set_defaults(func=cmd_metrics)
    f.add_argument("--threads", type=int)
    args = ap.parse_args(argv)
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
