"""The PNG every eval writes (``--plot PATH``, default next to the JSON): each eval once through the CLI on the tiny
models (the PNG at the default path or at ``--plot``, a valid image, the points it draws equal to the JSON's), the
drawn data of hand-made results, a bad ``--plot`` refused before anything runs, and an interrupted run's plot."""

from __future__ import annotations

import json

import numpy as np
import pytest

from attnpatch.cli import main
from attnpatch.evals.clip.plots import clip_panels
from attnpatch.evals.run.plots import Point, draw_vs_speedup, pyplot, setting_points
from attnpatch.evals.tune.plots import tune_panels
from attnpatch.evals.vision.plots import headline_points, layer_error_curves
from conftest import write_image_folder

VISION = ["--resolution", "70", "--k", "3", "--batch-size", "6"]


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return write_image_folder(tmp_path_factory.mktemp("plot-imgs"), 12)


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    """The tiny open_clip CLIP (65 image tokens) as a transformers directory."""
    from attnpatch.clip_convert import open_clip_to_hf
    from tiny_models import tiny_open_clip

    hf, proc = open_clip_to_hf(tiny_open_clip())
    d = tmp_path_factory.mktemp("plot-clip")
    hf.save_pretrained(d)
    proc.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def captions(tmp_path_factory):
    from PIL import Image

    root = tmp_path_factory.mktemp("plot-caps")
    (root / "train").mkdir()
    rows = []
    for i in range(6):
        Image.fromarray(np.full((20, 20, 3), 40 * i, np.uint8)).save(root / "train" / f"im{i}.jpg")
        rows.append({"file_name": f"im{i}.jpg", "caption": f"a square of grey level {i}."})
    (root / "train" / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def _png_shape(path) -> tuple[int, ...]:
    from matplotlib.image import imread

    pyplot()
    return imread(path).shape


def _xy(points):
    return [(p.label, p.speedup, p.value) for p in points]


def _check_png(rc, capsys, json_path, png, other=None):
    """The run succeeded, wrote its JSON and ``png`` (an RGBA image) and said so; ``other`` (the path not chosen) is absent."""
    assert rc == 0
    printed = capsys.readouterr().out
    assert f"wrote {json_path}" in printed and f"wrote {png}" in printed
    h, w, c = _png_shape(png)
    assert h > 300 and w > 500 and c in (3, 4)
    if other is not None:
        assert not other.exists()
    return json.loads(json_path.read_text())


# --------------------------------------------------------------------------- each eval once through the CLI


@pytest.mark.parametrize("task, key", [("knn", "knn_top1"), ("linear-probe", "linear_probe"), ("retrieval", "map_at_r")])
def test_vision_eval_plot(task, key, tiny_vit_dir, images, tmp_path, capsys):
    out = tmp_path / "r.json"
    given = tmp_path / "plots" / "mine.png" if task == "retrieval" else None  # one at --plot, the others at the default
    rc = main(["eval", task, "--model", str(tiny_vit_dir), "--data", str(images), *VISION, "--method", "fna:s=9", "sink_mask",
               "--json", str(out), *(["--plot", str(given)] if given else [])])
    res = _check_png(rc, capsys, out, given or tmp_path / "r.png", other=tmp_path / "r.png" if given else None)
    pts = headline_points(res)
    assert _xy(pts) == [("dense", 1.0, res["dense"][key]), ("fna (s=9)", res["runs"][0]["speedup"], res["runs"][0][key]),
                        ("sink_mask", res["runs"][1]["speedup"], res["runs"][1][key])]
    assert pts[0].dense and not pts[1].dense
    if task == "linear-probe":
        assert [p.err for p in pts] == [res["dense"]["linear_probe_std"]] + [r["linear_probe_std"] for r in res["runs"]]


def test_fidelity_plot_two_panels(tiny_vit_dir, images, tmp_path, capsys):
    out = tmp_path / "f.json"
    rc = main(["eval", "fidelity", "--model", str(tiny_vit_dir), "--data", str(images), *VISION, "--layer-error-images", "6",
               "--method", "fna:s=9", "tome", "--json", str(out)])
    res = _check_png(rc, capsys, out, tmp_path / "f.png")
    fna, tome = res["runs"]
    assert _xy(headline_points(res)) == [("dense", 1.0, 1.0), ("fna (s=9)", fna["speedup"], fna["cls_cosine"]),
                                         (tome["method"], tome["speedup"], tome["cls_cosine"])]
    curves = layer_error_curves(res)
    assert curves[0] == {"label": "fna (s=9)", "teacher": fna["layer_error_teacher"], "free": fna["layer_error_free"], "index": 0}
    assert len(curves[0]["teacher"]) == 4 and curves[0]["teacher"][:2] == [0.0, 0.0] and curves[0]["teacher"][3] > 0
    assert curves[1]["teacher"] == [] and curves[1]["free"] == []  # ToMe merges tokens: no per-layer error
    assert _png_shape(tmp_path / "f.png")[1] > 1200  # two panels side by side


def test_zeroshot_plot(clip_dir, images, tmp_path, capsys):
    out, png = tmp_path / "z.json", tmp_path / "z-plot.png"
    rc = main(["eval", "zeroshot", "--model", str(clip_dir), "--data", str(images), "--method", "fna:s=16", "--device", "cpu",
               "--json", str(out), "--plot", str(png)])
    res = _check_png(rc, capsys, out, png, other=tmp_path / "z.png")
    (panel,) = clip_panels(res)
    run = res["runs"][0]
    assert panel["key"] == "top1" and panel["chance"] == res["chance"]["top1"] == pytest.approx(1 / 3)
    assert _xy(panel["points"]) == [("dense", 1.0, res["dense"]["top1"]), ("fna (s=16)", run["speedup"], run["top1"])]


def test_clip_retrieval_plot(clip_dir, captions, tmp_path, capsys):
    out = tmp_path / "c.json"
    rc = main(["eval", "clip-retrieval", "--model", str(clip_dir), "--data", str(captions), "--method", "fna:s=16",
               "--ks", "1", "5", "--device", "cpu", "--json", str(out)])
    res = _check_png(rc, capsys, out, tmp_path / "c.png")
    panels = clip_panels(res)
    assert [p["key"] for p in panels] == ["t2i_recall@1", "i2t_recall@1"]
    run = res["runs"][0]
    for p in panels:
        assert p["chance"] == res["chance"][p["key"]]
        assert _xy(p["points"]) == [("dense", 1.0, res["dense"][p["key"]]), ("fna (s=16)", run["speedup"], run[p["key"]])]


def test_tune_plot(tiny_vit_dir, images, tmp_path, capsys):
    rep, png = tmp_path / "t.json", tmp_path / "t.png"
    rc = main(["tune", "--model", str(tiny_vit_dir), "--kind", "vision", "--data", str(images), "--resolution", "70",
               "--calibration", "4", "--candidate", "s=4,sample_layer=0,min_tokens=0", "--candidate", "s=9,sample_layer=2,min_tokens=0",
               "--target-cos", "0.99", "--repeats", "1", "--holdout", "0", "--out", str(tmp_path / "cfg.json"), "--json", str(rep)])
    res = _check_png(rc, capsys, rep, png)
    (panel,) = tune_panels(res)
    assert panel["key"] == "cls_cos" and panel["target"] == 0.99
    rows = res["rows"]
    assert _xy(panel["points"]) == [(lab, r["speedup"], r["cls_cos"]) for lab, r in
                                    zip(["s=4, sample_layer=0, min_tokens=0", "s=9, sample_layer=2, min_tokens=0", "exact (unpatched)"], rows)]
    assert [p.chosen for p in panel["points"]] == [r == res["chosen"] for r in rows] and sum(p.chosen for p in panel["points"]) == 1
    assert [p.dense for p in panel["points"]] == [False, False, True] and panel["points"][2].speedup == 1.0


def test_compare_plot_defaults_next_to_the_json(tiny_vit_dir, images, tmp_path, capsys):
    out = tmp_path / "cmp.json"
    rc = main(["compare", "--eval", "knn", "--model", str(tiny_vit_dir), "--data", str(images), *VISION, "--method", "fna:s=9",
               "--json", str(out)])
    res = _check_png(rc, capsys, out, tmp_path / "cmp.png")
    assert [r["method"] for r in res["rows"]] == ["dense", "fna"]


@pytest.mark.parametrize("argv", [
    ["eval", "knn", "--model", "MODEL", "--data", "IMAGES"],
    ["eval", "fidelity", "--model", "MODEL", "--data", "IMAGES"],
    ["eval", "zeroshot", "--model", "MODEL", "--data", "IMAGES"],
    ["eval", "clip-retrieval", "--model", "MODEL", "--data", "IMAGES"],
    ["tune", "--model", "MODEL", "--kind", "vision", "--data", "IMAGES", "--out", "OUT"],
    ["compare", "--eval", "knn", "--model", "MODEL", "--data", "IMAGES", "--method", "fna"],
])
def test_a_plot_path_not_png_is_refused_before_anything_runs(argv, tiny_vit_dir, images, tmp_path, capsys, monkeypatch):
    import attnpatch.checkpoints
    import attnpatch.clip_models

    def no_load(*a, **k):
        raise AssertionError("a model was loaded")

    for mod, name in ((attnpatch.checkpoints, "load_vision_model"), (attnpatch.clip_models, "load_clip")):
        monkeypatch.setattr(mod, name, no_load)
    where = {"MODEL": str(tiny_vit_dir), "IMAGES": str(images), "OUT": str(tmp_path / "cfg.json")}
    rc = main([where.get(a, a) for a in argv] + ["--json", str(tmp_path / "r.json"), "--plot", str(tmp_path / "x.txt")])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"attnpatch: error: --plot {tmp_path / 'x.txt'}: give a .png path"]
    assert list(tmp_path.iterdir()) == []


def test_an_interrupted_run_draws_what_finished(tiny_vit_dir, images, tmp_path, capsys, monkeypatch):
    import attnpatch.evals.vision.image_pass as ip

    real, calls = ip._batch, []

    def second_batch_ctrl_c(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(ip, "_batch", second_batch_ctrl_c)
    out = tmp_path / "k.json"
    rc = main(["eval", "knn", "--model", str(tiny_vit_dir), "--data", str(images), *VISION, "--method", "fna:s=9", "--json", str(out)])
    assert rc == 130
    res = json.loads(out.read_text())
    assert res["interrupted"] is True and res["n_images"] == 6
    assert f"{tmp_path / 'k.png'}" in capsys.readouterr().err and _png_shape(tmp_path / "k.png")[2] in (3, 4)
    assert _xy(headline_points(res)) == [("dense", 1.0, res["dense"]["knn_top1"]), ("fna (s=9)", res["runs"][0]["speedup"],
                                                                                   res["runs"][0]["knn_top1"])]


# --------------------------------------------------------------------------- the drawn data of hand-made results


def test_setting_points_read_the_result():
    res = {"dense": {"knn_top1": 0.8, "seconds": 2.0},
           "runs": [{"method": "fna", "options": {"s": 64, "sample_layer": 3}, "shown_options": {"s": "64"}, "knn_top1": 0.75,
                     "speedup": 1.6},
                    {"method": "sink_mask", "options": {}, "knn_top1": 0.8, "speedup": None}]}
    assert setting_points(res, "knn_top1") == [Point("dense", 1.0, 0.8, dense=True), Point("fna (s=64)", 1.6, 0.75),
                                               Point("sink_mask", None, 0.8)]
    assert headline_points({**res, "eval": "knn"}) == setting_points(res, "knn_top1")
    fid = {"eval": "fidelity", "dense": {"seconds": 1.0}, "runs": [{"method": "fna", "options": {}, "cls_cosine": 0.99, "speedup": 2.0,
                                                                     "layer_error_teacher": [0.0, 0.1], "layer_error_free": [0.0, None]}]}
    assert _xy(headline_points(fid)) == [("dense", 1.0, 1.0), ("fna", 2.0, 0.99)]  # a cosine to dense: 1.0 by definition
    assert layer_error_curves(fid) == [{"label": "fna", "teacher": [0.0, 0.1], "free": [0.0, None], "index": 0}]


def test_a_result_without_timing_says_so_and_places_nothing():
    plt = pyplot()
    res = {"dense": {"top1": 0.5}, "runs": [{"method": "fna", "options": {}, "top1": 0.4}]}
    fig, ax = plt.subplots()
    try:
        placed = draw_vs_speedup(ax, setting_points(res, "top1"), "top-1", percent=True)
        texts = " ".join(t.get_text() for t in ax.texts)
    finally:
        plt.close(fig)
    assert placed == []
    assert "no timing in this result" in texts and "fna: not timed (40.0%)" in texts and "dense: not timed" in texts


def test_clip_retrieval_panels_at_the_smallest_cut_off():
    res = {"ks": [5, 1], "chance": {"t2i_recall@1": 0.1, "i2t_recall@1": 0.2},
           "dense": {"t2i_recall@1": 0.5, "i2t_recall@1": 0.6, "t2i_recall@5": 0.9, "i2t_recall@5": 0.9, "seconds": 1.0},
           "runs": [{"method": "fna", "options": {"s": 16}, "towers": ["vision", "text"], "t2i_recall@1": 0.4, "i2t_recall@1": 0.55,
                     "speedup": 1.2}]}
    panels = clip_panels(res)
    assert [(p["key"], p["chance"]) for p in panels] == [("t2i_recall@1", 0.1), ("i2t_recall@1", 0.2)]
    assert _xy(panels[1]["points"]) == [("dense", 1.0, 0.6), ("fna (s=16)", 1.2, 0.55)]
    assert _xy(clip_panels({"dense": {"top1": 0.3}, "runs": []})[0]["points"]) == [("dense", None, 0.3)]


def test_tune_panels_of_a_causal_search():
    rows = [{"options": {"theta": 4, "dense_heads": ((0, 1),)}, "dense_heads": 1, "recall_mean": 0.9, "recall_worst": 0.5,
             "meets": False, "seconds": None, "speedup": None},
            {"options": {"theta": 8, "dense_heads": ()}, "dense_heads": 0, "recall_mean": 0.97, "recall_worst": 0.85, "meets": True,
             "seconds": 1.0, "speedup": 1.5},
            {"options": {"theta": float("inf")}, "exact": True, "dense_heads": 0, "recall_mean": 1.0, "recall_worst": 1.0, "meets": True,
             "seconds": 1.5, "speedup": 1.0}]
    res = {"kind": "causal_lm", "target": {"recall_mean": 0.95, "recall_worst": 0.8, "worst_fraction": 0.05}, "rows": rows,
           "chosen": rows[1]}
    mean, worst = tune_panels(res)
    assert (mean["key"], mean["target"], worst["key"], worst["target"]) == ("recall_mean", 0.95, "recall_worst", 0.8)
    assert _xy(worst["points"]) == [("theta=4, dense_heads=1", None, 0.5), ("theta=8", 1.5, 0.85), ("exact (unpatched)", 1.0, 1.0)]
    assert [p.chosen for p in mean["points"]] == [False, True, False] and [p.dense for p in mean["points"]] == [False, False, True]
    assert mean["points"][0].why == "not timed: misses the target" and mean["points"][1].why is None


def test_a_setting_that_ran_exact_attention_says_so_on_the_plot():
    from attnpatch.evals.run.plots import setting_label, setting_points
    from attnpatch.evals.vision.image_pass import exact_note

    assert exact_note({"sparse"}) is None and exact_note({"dense:short", "sparse"}) is None and exact_note(set()) is None
    note = exact_note({"dense:s>=N"})
    assert note == "exact attention: s >= N tokens"
    result = {"dense": {"seconds": 2.0, "top1": 0.5},
              "runs": [{"method": "fna", "shown_options": {"s": 64}, "speedup": 1.2, "top1": 0.5, "note": note},
                       {"method": "fna", "shown_options": {"s": 8}, "speedup": 1.5, "top1": 0.4}]}
    assert setting_label(result["runs"][0]) == "fna (s=64) [exact attention]"
    assert [p.label for p in setting_points(result, "top1")] == ["dense", "fna (s=64) [exact attention]", "fna (s=8)"]
