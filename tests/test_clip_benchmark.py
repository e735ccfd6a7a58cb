"""``attnpatch eval clip-benchmark``: CLIP_benchmark's own evaluate functions on a patched CLIP, against our
``eval zeroshot`` / ``eval clip-retrieval`` on the same inputs; CLIP_benchmark's keys in our JSON; the numpy shim.

The model is open_clip's ViT-B-32 with random weights built at 128 px (17 image tokens); its scores are
near-tied, so the two paths are compared per sample (top-1 class per image, rank of each query's match).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("clip_benchmark")
pytest.importorskip("open_clip")

from attnpatch.cli import main  # noqa: E402
from attnpatch.clip_models import load_clip  # noqa: E402
from attnpatch.evals import clip as ce  # noqa: E402
from attnpatch.evals import clipbench as cb  # noqa: E402

QUIET = dict(log=lambda m: None)
NAMES = ["cat", "dog", "frog", "car", "tree", "boat", "house", "bird", "fish", "lamp"]
TEMPLATES = ["a photo of a {}.", "a drawing of the {}."]
FNA = ("fna", {"s": 8, "sample_layer": 0, "min_tokens": 0})  # 8 landmarks of 17 tokens, every layer from 0 approximated


def _pattern(i: int, rng) -> np.ndarray:
    """Flat colours, stripes, noise and half-white images: a random CLIP ranks classes differently for them."""
    a = np.zeros((64, 64, 3), np.uint8)
    kind = i % 4
    if kind == 0:
        a[:] = rng.integers(0, 256, 3)
    elif kind == 1:
        a[:: 4 + i % 5] = 255
    elif kind == 2:
        a = rng.integers(0, 256, (64, 64, 3)).astype(np.uint8)
    else:
        a[:, : 16 + 2 * i] = 255
        a[:, 16 + 2 * i :, i % 3] = rng.integers(0, 256)
    return a


def _folder(root: Path, n: int, captions: bool) -> Path:
    from PIL import Image

    (root / "train").mkdir(parents=True)
    rng = np.random.default_rng(0)
    rows = []
    for i in range(n):
        Image.fromarray(_pattern(i, rng)).save(root / "train" / f"im{i:02d}.png")
        row = {"file_name": f"im{i:02d}.png"}
        row.update({"captions": [f"a photo of {NAMES[i % 10]} number {i}.", f"picture {i}: a {NAMES[(3 * i) % 10]} at dusk"]}
                   if captions else {"label": i % 6})
        rows.append(row)
    (root / "train" / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


@pytest.fixture(scope="module")
def vitb32():
    return load_clip("ViT-B-32:random", resolution=128, **QUIET)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    d = tmp_path_factory.mktemp("cb")
    (d / "names.json").write_text(json.dumps(NAMES))
    (d / "templates.txt").write_text("\n".join(TEMPLATES) + "\n")
    return _folder(d / "cls", 12, captions=False), _folder(d / "caps", 8, captions=True), d


# --------------------------------------------------------------------------- the numpy shim


def test_upstream_accuracy_still_fails_under_numpy_2_4_so_the_shim_stays():
    """Retires the shim: when CLIP_benchmark's accuracy works again, this fails and says so."""
    from clip_benchmark.metrics import zeroshot_classification as zc

    assert zc.accuracy is not cb.shim.accuracy  # the shim is only in place inside numpy_shim()
    logits, target = torch.tensor([[0.1, 0.9, 0.0], [0.8, 0.2, 0.0]]), torch.tensor([1, 1])
    try:
        got = zc.accuracy(logits, target, topk=(1, 2))
    except TypeError as err:
        assert "only 0-dimensional arrays can be converted to Python scalars" in str(err)
    else:
        pytest.fail(f"clip_benchmark's zeroshot_classification.accuracy works now ({got}; LAION-AI/CLIP_benchmark issue 147 fixed "
                    "for this numpy): remove the shim (attnpatch/evals/clipbench/shim.py) and this test")
    with cb.shim.numpy_shim():
        assert zc.accuracy(logits, target, topk=(1, 2)) == [0.5, 1.0]
    assert zc.accuracy is not cb.shim.accuracy


# --------------------------------------------------------------------------- CLIP_benchmark's keys on the same embeddings


class _Fixed:
    """A CLIP whose embeddings are given: an image is its index, a text its index in ``texts``."""

    def __init__(self, images, texts_emb, texts):
        self.images, self.texts_emb, self.index = images, texts_emb, {t: i for i, t in enumerate(texts)}

    def tokenizer(self, texts):
        return torch.tensor([self.index[t] for t in texts])

    def encode_image(self, idx):
        return self.images[idx]

    def encode_text(self, idx):
        return self.texts_emb[idx]


def test_our_clip_benchmark_keys_equal_clip_benchmark_on_the_same_embeddings():
    from clip_benchmark.datasets.builder import image_captions_collate_fn
    from clip_benchmark.metrics import zeroshot_classification as zc
    from clip_benchmark.metrics import zeroshot_retrieval as zr

    g = torch.Generator().manual_seed(0)
    n, c, d = 40, 7, 16
    labels = torch.arange(n) % c
    proto = torch.randn(c, d, generator=g)
    img = proto[labels] + 1.5 * torch.randn(n, d, generator=g)  # some signal: accuracy neither chance nor perfect
    prompts = [f"{t} {k}" for k in range(c) for t in ("a", "b")]
    txt = proto.repeat_interleave(2, 0) + torch.randn(len(prompts), d, generator=g)
    fixed = _Fixed(img, txt, prompts)
    ds = torch.utils.data.TensorDataset(torch.arange(n), labels)
    ds.classes = [str(k) for k in range(c)]
    loader = torch.utils.data.DataLoader(ds, batch_size=16)
    with cb.shim.numpy_shim():
        theirs = zc.evaluate(fixed, loader, fixed.tokenizer, ds.classes, ["{t} {c}".replace("{t}", t) for t in ("a", "b")], "cpu", amp=False)
    clf = ce.zeroshot_classifier(txt, c)
    acc = ce.zeroshot_accuracy(img, clf, labels.numpy(), (1, 5))
    ours = ce.classification_metrics(labels.numpy(), acc["predictions"], acc["top5"], c)
    assert 0.3 < ours["acc1"] < 1 and ours["mean_per_class_recall"] != ours["acc1"]
    assert ours.keys() == theirs.keys() and all(math.isclose(ours[k], theirs[k], abs_tol=1e-12) for k in ours), (ours, theirs)
    assert math.isnan(ce.classification_metrics([0, 1], [0, 0], 1.0, 4)["acc5"])  # CLIP_benchmark: acc5 NaN under 5 classes

    # retrieval: 10 images, 2-3 captions each
    counts = [2, 3] * 5
    caps = [[f"im{i} cap{j}" for j in range(m)] for i, m in enumerate(counts)]
    flat = [t for cs in caps for t in cs]
    t2i = np.repeat(np.arange(10), counts)
    img_r = torch.randn(10, d, generator=g)
    txt_r = img_r[t2i] + 1.5 * torch.randn(len(flat), d, generator=g)
    fixed = _Fixed(img_r, txt_r, flat)
    pairs = list(zip(range(10), caps))
    loader = torch.utils.data.DataLoader(pairs, batch_size=4, collate_fn=image_captions_collate_fn)
    theirs = zr.evaluate(fixed, loader, fixed.tokenizer, "cpu", amp=False, recall_k_list=[1, 3, 5])
    ours = ce.retrieval_metrics(ce.retrieval_recall(img_r, txt_r, t2i, (1, 3, 5)))
    assert list(ours) == list(theirs) and all(math.isclose(ours[k], theirs[k], abs_tol=1e-7) for k in ours), (ours, theirs)
    assert len(set(ours.values())) > 2  # not all 0 or 1


# --------------------------------------------------------------------------- the two paths on one model


def test_clip_benchmark_zeroshot_equals_eval_zeroshot_dense_and_patched(vitb32, folders, tmp_path, monkeypatch, capsys):
    from attnpatch.evals.vision.images import load_image_set

    cls, _, d = folders
    images = load_image_set(cls, **QUIET)
    ours = ce.run_zeroshot_eval(vitb32, images, NAMES, TEMPLATES, settings=[FNA], batch_size=6, ks=(1, 5), **QUIET)
    monkeypatch.setattr("attnpatch.clip_models.load_clip", lambda *a, **k: vitb32)  # the same loaded model
    out = tmp_path / "cb.json"
    rc = main(["eval", "clip-benchmark", "--model", "ViT-B-32:random", "--dataset", str(cls), "--classnames", str(d / "names.json"),
               "--templates", str(d / "templates.txt"), "--method", "fna:s=8,sample_layer=0,min_tokens=0", "--batch-size", "6",
               "--device", "cpu", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["task"] == "zeroshot_classification" and res["amp"] is False and res["n_images"] == 12 and res["n_classes"] == 10
    assert res["n_templates"] == 2 and res["harness"].startswith("clip_benchmark ")
    run = ours["runs"][0]
    assert run["embed_cosine"] < 1 - 1e-7  # the patched setting really approximates
    for mine, theirs in ((ours["dense"], res["dense"]), (run, res["runs"][0])):
        assert theirs["predictions"] == mine["predictions"]
        assert theirs["metrics"].keys() == mine["metrics"].keys() == {"acc1", "acc5", "mean_per_class_recall"}
        for k, v in mine["metrics"].items():
            assert math.isclose(theirs["metrics"][k], v, abs_tol=1e-12), (k, theirs["metrics"][k], v)
        assert mine["metrics"]["acc1"] == pytest.approx(mine["top1"]) and mine["metrics"]["acc5"] == pytest.approx(mine["top5"])
    assert len(set(ours["dense"]["predictions"])) > 1  # the images are not all given one class
    for name, mine, theirs in (("dense", ours["dense"], res["dense"]), ("fna s=8", run, res["runs"][0])):
        with capsys.disabled():  # shown with -s
            print(f"zeroshot {name}: ours {mine['metrics']} predictions {mine['predictions']}\n"
                  f"zeroshot {name}: CLIP_benchmark {theirs['metrics']} predictions {theirs['predictions']}")
    assert res["runs"][0]["agreement"] == run["agreement"]
    assert res["runs"][0]["diff"]["acc1"] == pytest.approx(res["runs"][0]["metrics"]["acc1"] - res["dense"]["metrics"]["acc1"])
    assert res["dense"]["images_per_s"] > 0 and res["runs"][0]["speedup"] > 0
    # one file per setting, in clip_benchmark eval's layout
    files = [Path(res["dense"]["file"]), Path(res["runs"][0]["file"])]
    assert [f.name for f in files] == ["cb.dense.json", "cb.fna_s-8_sample_layer-0_min_tokens-0.json"]
    for f, entry in zip(files, (res["dense"], res["runs"][0])):
        up = json.loads(f.read_text())
        assert list(up)[:6] == ["dataset", "model", "pretrained", "task", "metrics", "language"]
        assert (up["model"], up["pretrained"], up["task"], up["language"], up["amp"]) == ("ViT-B-32", "random", "zeroshot_classification", "en", False)
        assert up["metrics"] == entry["metrics"] and up["method"] == entry["method"]
    printed = capsys.readouterr().out
    assert "acc1" in printed and "fna (s=8" in printed and f"wrote {files[1]}" in printed
    # the PNG next to the JSON: acc1 against the image-tower speed-up, dense at 1.0
    from matplotlib.image import imread

    from attnpatch.evals.clipbench.plots import clipbench_panels

    assert f"wrote {out.with_suffix('.png')}" in printed and imread(out.with_suffix(".png")).shape[0] > 200
    (panel,) = clipbench_panels(res)
    dense, fna = panel["points"]
    assert panel["key"] == "acc1" and (dense.speedup, dense.value) == (1.0, res["dense"]["metrics"]["acc1"])
    assert (fna.speedup, fna.value) == (res["runs"][0]["speedup"], res["runs"][0]["metrics"]["acc1"])


def test_clip_benchmark_retrieval_equals_eval_clip_retrieval_dense_and_patched(vitb32, folders):
    _, caps, _ = folders
    captions = ce.load_caption_set(caps, **QUIET)
    ours = ce.run_retrieval_eval(vitb32, captions, settings=[FNA], batch_size=3, ks=(1, 3, 5), **QUIET)
    data = cb.load_bench_data(str(caps), preprocess=vitb32.preprocess, **QUIET)
    assert data.task == "zeroshot_retrieval"
    theirs = cb.run_clip_benchmark(vitb32, data, settings=[FNA], ks=(1, 3, 5), batch_size=3, **QUIET)
    assert (theirs["n_images"], theirs["n_texts"]) == (8, 16)
    for mine, up in ((ours["dense"], theirs["dense"]), (ours["runs"][0], theirs["runs"][0])):
        assert up["predictions"] == mine["predictions"]
        assert list(up["metrics"]) == list(mine["metrics"])
        for k, v in mine["metrics"].items():
            assert math.isclose(up["metrics"][k], v, abs_tol=1e-7), (k, up["metrics"][k], v)
    for name, mine, up in (("dense", ours["dense"], theirs["dense"]), ("fna s=8", ours["runs"][0], theirs["runs"][0])):  # -s
        print(f"retrieval {name}: ours {mine['metrics']} t2i ranks {mine['predictions']['t2i_rank']}\n"
              f"retrieval {name}: CLIP_benchmark {up['metrics']} t2i ranks {up['predictions']['t2i_rank']}")
    ranks = ours["dense"]["predictions"]["t2i_rank"]
    assert len(ranks) == 16 and len(set(ranks)) > 2  # the ranks differ between queries
    assert ours["runs"][0]["metrics"]["image_retrieval_recall@1"] == ours["runs"][0]["t2i_recall@1"]
    from attnpatch.evals.clipbench.plots import clipbench_panels

    panels = clipbench_panels(theirs)  # what the PNG draws: recall@1 both ways against the speed-up
    assert [p["key"] for p in panels] == ["image_retrieval_recall@1", "text_retrieval_recall@1"]
    for p in panels:
        assert [(q.speedup, q.value) for q in p["points"]] == [
            (1.0, theirs["dense"]["metrics"][p["key"]]), (theirs["runs"][0]["speedup"], theirs["runs"][0]["metrics"][p["key"]])]


# --------------------------------------------------------------------------- errors before the long work


def test_without_clip_benchmark_one_line_before_loading(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "clip_benchmark", None)  # import clip_benchmark -> ImportError

    def no_load(*a, **k):
        raise AssertionError("loaded a model")

    monkeypatch.setattr("attnpatch.clip_models.load_clip", no_load)
    assert main(["eval", "clip-benchmark", "--model", "ViT-B-32:random", "--dataset", "cifar10"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["attnpatch: error: attnpatch eval clip-benchmark needs CLIP_benchmark: pip install 'attnpatch[clip-benchmark]'"]


def test_bad_inputs_fail_before_the_long_work(vitb32, folders, monkeypatch, capsys, tmp_path):
    cls, caps, _ = folders
    monkeypatch.setattr("attnpatch.clip_models.load_clip", lambda *a, **k: vitb32)
    monkeypatch.chdir(tmp_path)
    assert main(["eval", "clip-benchmark", "--dataset", str(cls), "--method", "fna:s=0"]) == 2
    assert main(["eval", "clip-benchmark", "--dataset", str(caps), "--ks", "9", "--method", "dense"]) == 2
    assert main(["eval", "clip-benchmark", "--dataset", "cifar10", "--classnames", "x.json", "--method", "dense"]) == 2
    assert main(["eval", "clip-benchmark", "--dataset", "./nowhere", "--method", "dense"]) == 2
    assert main(["eval", "clip-benchmark", "--dataset", str(cls), "--method", "fna:s=8", "fna", "-o", "s=8"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("attnpatch: error:")]
    assert len(err) == 5
    assert "s=0" in err[0] and "--ks 9: above the 8 images" in err[1] and "--classnames x.json: only for a local folder" in err[2]
    assert "no such folder" in err[3] and "is given twice" in err[4]
    assert not list(tmp_path.glob("*.json"))


def test_the_routed_dense_setting_never_takes_the_unpatched_rows_name():
    from attnpatch.evals.clipbench.runner import setting_label

    assert setting_label(None, {}) == "dense" and setting_label("dense", {}) == "dense-routed"
    assert setting_label("fna", {"s": 8}) == "fna (s=8)"
