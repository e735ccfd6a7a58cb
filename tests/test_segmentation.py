"""``attnpatch eval segmentation``: the source map of token merging, per-patch features of every adapter, the three
data layouts and their refusals, the read-outs, the metrics, and the eval end to end on tiny random ViTs (and, slow,
on the real checkpoint and tuxpaint-seg)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import attnpatch
from attnpatch.attention.merge import apply_merge, merge_destinations, merge_plan, unmerge
from attnpatch.errors import DataError, OptionError, UnsupportedModelError
from attnpatch.evals.segmentation import load_segmentation_set, run_segmentation, square_preprocess
from attnpatch.evals.segmentation.data import VOID
from attnpatch.evals.segmentation.heads import KnnBank, load_head, patch_label_shares, train_linear_head
from attnpatch.evals.segmentation.metrics import bootstrap_delta, image_counts, scores
from attnpatch.patchers.adapters import adapter_for

from tiny_models import NARROW_DINOV2, tiny_dinov2, tiny_hf_clip, tiny_hf_vit, tiny_open_clip, tiny_timm_vit

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "tuxpaint-seg"
PALETTE = [0, 0, 0, 128, 0, 0, 0, 128, 0] + [0] * (768 - 9)


# --------------------------------------------------------------------------- the source map of token merging


@pytest.mark.parametrize("prefix", [0, 1, 2, 5])
@pytest.mark.parametrize("extra", [7, 10])
def test_merge_destinations_send_each_token_to_the_token_that_averages_it(prefix, extra):
    """Every output token of one merge step is the mean of exactly the input tokens the map sends to it (sizes 1)."""
    torch.manual_seed(prefix + extra)
    n = prefix + extra
    x, metric = torch.randn(2, n, 4), torch.randn(2, n, 3)
    plan = merge_plan(metric, 3, prefix)
    out, size = apply_merge(x, torch.ones(2, n), plan, prefix)
    dest = merge_destinations(plan, n, prefix)
    assert dest.shape == (2, n) and int(dest.max()) == out.shape[1] - 1
    for b in range(2):
        for j in range(out.shape[1]):
            sel = dest[b] == j
            torch.testing.assert_close(x[b, sel].mean(0), out[b, j], rtol=1e-5, atol=1e-6)
            assert size[b, j] == sel.sum()
    assert merge_destinations(None, n, prefix) is None
    torch.testing.assert_close(unmerge(out, dest)[:, :prefix], x[:, :prefix])  # the prefix maps to itself


def test_unmerge_of_a_merge_built_by_hand():
    """One CLS and six patches, merged by a plan written out: A = patches at positions 2, 4, 6 (absolute even), B = 1, 3, 5;
    A-token 0 (position 2) is merged into B-token 2 (position 5), A-tokens 1, 2 stay.  Output order: CLS, the kept A
    tokens (positions 4, 6), then B (1, 3, 5+2).  Every input patch reads its merged token's output."""
    plan = (torch.tensor([[1, 2]]), torch.tensor([[0]]), torch.tensor([[2]]))
    dest = merge_destinations(plan, 7, prefix=1)
    assert dest.tolist() == [[0, 3, 5, 4, 1, 5, 2]]
    out = torch.arange(6.0).reshape(1, 6, 1) * 10  # the merged model's 6 output tokens
    assert unmerge(out, dest)[0, :, 0].tolist() == [0, 30, 50, 40, 10, 50, 20]
    x = torch.arange(7.0).reshape(1, 7, 1)
    merged, size = apply_merge(x, torch.ones(1, 7), plan, prefix=1)
    assert merged[0, :, 0].tolist() == [0, 4, 6, 1, 3, 3.5] and size[0].tolist() == [1, 1, 1, 1, 1, 2]


@pytest.mark.parametrize("registers", [0, 2])
def test_tome_source_map_composes_over_blocks(registers):
    """After a forward with merges in every block, the source map's counts are the output tokens' sizes, the prefix
    maps to itself, and the model's own output keeps its merged tokens."""
    model = tiny_dinov2(registers, **NARROW_DINOV2, num_hidden_layers=3, image_size=56)
    x = torch.randn(2, 3, 56, 56)
    with attnpatch.patched(model, "tome", r=4), torch.no_grad():
        out = model(pixel_values=x).last_hidden_state
        src, sizes = attnpatch.token_source(model), attnpatch.token_sizes(model)
    prefix = 1 + registers
    assert out.shape[1] == prefix + 16 - 12 and src.shape == (2, prefix + 16)
    for b in range(2):
        counts = torch.bincount(src[b], minlength=out.shape[1]).float()
        torch.testing.assert_close(counts, sizes[b])
    assert src[:, :prefix].tolist() == [list(range(prefix))] * 2


# --------------------------------------------------------------------------- per-patch features of every adapter


def _hf_dinov2():
    return tiny_dinov2(**NARROW_DINOV2, num_hidden_layers=3, image_size=56)


def _reference_tokens(name, model, x):
    """The model's own last-layer patch tokens (after its final norm), read without the adapter."""
    with torch.no_grad():
        return _reference(name, model, x)


def _reference(name, model, x):
    if name == "dinov2":
        return model(pixel_values=x).last_hidden_state[:, 1:]
    if name == "hf_clip":
        vm = model.vision_model
        return vm.post_layernorm(vm(pixel_values=x).last_hidden_state)[:, 1:]
    if name == "hf_vit":
        return model(pixel_values=x).last_hidden_state[:, 1:]
    if name == "timm":
        return model.forward_features(x)[:, model.num_prefix_tokens:]
    visual = model.visual
    visual.output_tokens = True
    try:
        return visual(x)[1]
    finally:
        visual.output_tokens = False


ADAPTED = {
    "dinov2": (_hf_dinov2, 56, 14),
    "hf_clip": (lambda: tiny_hf_clip("clip"), None, None),
    "hf_vit": (lambda: tiny_hf_vit(), 32, 8),
    "timm": (lambda: tiny_timm_vit(), 48, 8),
    "open_clip": (lambda: tiny_open_clip(), 64, 8),
}


def _size_of(model, name):
    res, patch = ADAPTED[name][1:]
    if res is None:
        cfg = model.config.vision_config
        res, patch = cfg.image_size, cfg.patch_size
    return res, patch


@pytest.mark.parametrize("name", list(ADAPTED))
def test_patch_tokens_are_the_models_own_and_exact_at_the_limit(name):
    """Dense: the last block's patch tokens equal the model's own (after its final norm) bit for bit; with ``last=2``
    the last block's are the second half.  ToMe at r = 0 and FNA at s >= N (its exact limit) give the same; ToMe at
    r > 0 still gives one feature per input patch."""
    model = ADAPTED[name][0]()
    res, patch = _size_of(model, name)
    g = res // patch
    x = torch.randn(2, 3, res, res)
    ad = adapter_for(model)
    dense = ad.patch_tokens(model, x)
    ref = _reference_tokens(name, model, x)
    assert dense.shape == (2, g, g, ref.shape[-1])
    torch.testing.assert_close(dense.reshape(2, g * g, -1), ref.float(), rtol=0, atol=0)
    two = ad.patch_tokens(model, x, last=2)
    assert two.shape[-1] == 2 * ref.shape[-1]
    torch.testing.assert_close(two[..., ref.shape[-1]:], dense, rtol=0, atol=0)
    for method, opts in [("tome", {"r": 0}), ("fna", {"s": g * g + 1, "min_tokens": 0})]:
        with attnpatch.patched(model, method, **opts):
            torch.testing.assert_close(ad.patch_tokens(model, x), dense, rtol=1e-5, atol=1e-5)
    with attnpatch.patched(model, "tome", r=4):
        merged = ad.patch_tokens(model, x, last=2)
    assert merged.shape == two.shape and torch.isfinite(merged).all()
    assert not torch.allclose(merged, two, atol=1e-3)  # merging ran


def test_patch_tokens_refuse_what_has_none():
    from tiny_models import tiny_causal_lm

    lm = tiny_causal_lm("llama")
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM: per-patch features needs a vision tower"):
        adapter_for(lm).patch_tokens(lm, torch.randn(1, 3, 32, 32))
    oc = tiny_open_clip()
    with pytest.raises(UnsupportedModelError, match=r"positional embedding is for \(64, 64\) px.*use --resolution 64"):
        adapter_for(oc).patch_tokens(oc, torch.randn(1, 3, 128, 128))
    model = _hf_dinov2()
    with pytest.raises(OptionError, match=r"last=4: must be an int from 1 to 3"):
        adapter_for(model).patch_tokens(model, torch.randn(1, 3, 56, 56), last=4)


# --------------------------------------------------------------------------- data


def write_voc(root: Path, n_train: int = 6, n_val: int = 4, size: int = 56, classes=("background", "red", "green"), seed: int = 0):
    """A VOC-layout set: a coloured square of class 1 or 2 on noise, a void rim row, ``classes.json``."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for d in ("JPEGImages", "SegmentationClass", "ImageSets/Segmentation"):
        (root / d).mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("val", n_val)):
        ids = []
        for i in range(n):
            name = f"{split}_{i:03d}"
            ids.append(name)
            lab = np.zeros((size, size), np.uint8)
            y, x = rng.integers(0, size // 2, 2)
            lab[y:y + size // 2, x:x + size // 2] = 1 + i % 2
            lab[y, x:x + size // 2] = 255
            img = rng.integers(0, 60, (size, size, 3), dtype=np.uint8)
            img[lab == 1], img[lab == 2] = [200, 30, 30], [30, 200, 30]
            Image.fromarray(img).save(root / "JPEGImages" / f"{name}.jpg")
            m = Image.fromarray(lab, mode="P")
            m.putpalette(PALETTE)
            m.save(root / "SegmentationClass" / f"{name}.png")
        (root / "ImageSets" / "Segmentation" / f"{split}.txt").write_text("\n".join(ids) + "\n")
    (root / "classes.json").write_text(json.dumps([{"index": i, "name": c} for i, c in enumerate(classes)]))
    return root


def test_voc_layout_reads_classes_labels_and_void(tmp_path):
    d = load_segmentation_set(str(write_voc(tmp_path / "voc")))
    assert (d.layout, d.classes, len(d.train), len(d.val)) == ("voc", ["background", "red", "green"], 6, 4)
    lab = d.val.labels(0)
    assert lab.dtype == np.int16 and set(np.unique(lab)) == {VOID, 0, 1}
    assert d.val.image(0).size == (56, 56)


def _broken(tmp_path, how):
    from PIL import Image

    root = write_voc(tmp_path / "voc")
    if how == "size":
        m = Image.new("P", (40, 56))
        m.save(root / "SegmentationClass" / "val_002.png")
    elif how == "label":
        arr = np.zeros((56, 56), np.uint8)
        arr[3, 3] = 7
        Image.fromarray(arr).save(root / "SegmentationClass" / "train_001.png")  # grayscale: the value is the label
    elif how == "split":
        (root / "ImageSets" / "Segmentation" / "val.txt").unlink()
    elif how == "empty":
        (root / "ImageSets" / "Segmentation" / "val.txt").write_text("\n")
    elif how == "truncated":
        f = root / "JPEGImages" / "val_001.jpg"
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    elif how == "void":
        for i in range(4):
            m = Image.fromarray(np.full((56, 56), 255, np.uint8), mode="P")
            m.putpalette(PALETTE)
            m.save(root / "SegmentationClass" / f"val_{i:03d}.png")
    elif how == "layout":
        import shutil

        shutil.rmtree(root / "SegmentationClass")
    return root


@pytest.mark.parametrize("how,says", [
    ("size", r"val_002\.png: label map of 40x56 px for an image of 56x56 px \(val_002\.jpg\); they must match"),
    ("label", r"train_001\.png: label values \[7\] are neither classes nor void; allowed: 0\.\.2 and 255 \(void\)"),
    ("split", r"Segmentation/val\.txt: missing split file; the splits there: train"),
    ("empty", r"voc/val: the split is empty"),
    ("truncated", r"val_001\.jpg: a truncated or corrupt JPEG file"),
    ("void", r"voc/val: every label pixel is void; nothing to fit or score"),
    ("layout", r"voc: a Pascal VOC folder without SegmentationClass/; expected a Pascal VOC folder"),
])
def test_bad_sets_are_refused_in_one_line_naming_the_file(tmp_path, how, says):
    with pytest.raises(DataError, match=says) as err:
        load_segmentation_set(str(_broken(tmp_path, how)))
    assert "\n" not in str(err.value)


def test_a_missing_path_or_a_folder_of_no_layout_is_named(tmp_path):
    with pytest.raises(DataError, match=r"/nope: no such folder; expected a Pascal VOC folder"):
        load_segmentation_set(str(tmp_path / "nope"))
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "a.jpg").write_bytes(b"x")
    with pytest.raises(DataError, match=r"pics: not a segmentation set \(it holds a\.jpg\); expected a Pascal VOC folder"):
        load_segmentation_set(str(tmp_path / "pics"))


def test_ade20k_layout_maps_zero_to_void(tmp_path):
    from PIL import Image

    root = tmp_path / "ADEChallengeData2016"
    for split in ("training", "validation"):
        (root / "images" / split).mkdir(parents=True)
        (root / "annotations" / split).mkdir(parents=True)
        for i in range(2):
            Image.new("RGB", (20, 16), (i * 50, 0, 0)).save(root / "images" / split / f"ADE_{split}_{i}.jpg")
            arr = np.zeros((16, 20), np.uint8)
            arr[:, 10:] = 150
            arr[:4, :4] = 1
            Image.fromarray(arr).save(root / "annotations" / split / f"ADE_{split}_{i}.png")
    d = load_segmentation_set(str(tmp_path))
    assert d.layout == "ade20k" and len(d.classes) == 150 and d.void == 0
    lab = d.val.labels(1)
    assert lab[0, 0] == 0 and lab[0, 15] == 149 and lab[10, 2] == VOID


def test_datasets_layout_with_mask_column(tmp_path):
    datasets = pytest.importorskip("datasets")
    from PIL import Image

    rows = {"image": [Image.new("RGB", (16, 12), (i * 60, 0, 0)) for i in range(3)],
            "mask": [np.where(np.arange(16)[None, :] < 8, 0, 1).repeat(12, 0).astype(np.uint8).tolist() for _ in range(3)]}
    feats = datasets.Features({"image": datasets.Image(), "mask": datasets.Array2D((12, 16), "uint8")})
    ds = datasets.Dataset.from_dict(rows, features=feats)
    datasets.DatasetDict({"train": ds, "validation": ds}).save_to_disk(str(tmp_path / "set"))
    with pytest.raises(OptionError, match="needs --classnames"):
        load_segmentation_set(str(tmp_path / "set"), mask_column="mask")
    with pytest.raises(DataError, match="no column 'annotation'; its columns: image, mask"):
        load_segmentation_set(str(tmp_path / "set"), classnames=["a", "b"])
    d = load_segmentation_set(str(tmp_path / "set"), mask_column="mask", classnames=["a", "b"])
    assert d.layout == "datasets" and len(d.val) == 3 and d.val.labels(0)[0, 12] == 1
    with pytest.raises(DataError, match=r"label values \[1\] are neither classes nor void; allowed: 0\.\.0 and 255"):
        load_segmentation_set(str(tmp_path / "set"), mask_column="mask", classnames=["a"])


# --------------------------------------------------------------------------- read-outs and metrics


def test_patch_label_shares():
    lab = np.zeros((16, 16), np.int16)
    lab[:8, :8] = 1
    lab[8:, 8:] = VOID
    lab[:8, 8:12] = 2
    shares, valid = patch_label_shares(lab, (2, 2), 3)
    np.testing.assert_allclose(shares, [[0, 1, 0], [0.5, 0, 0.5], [1, 0, 0], [0, 0, 0]])
    np.testing.assert_allclose(valid, [1, 1, 1, 0])


def test_metrics_on_known_maps():
    gt = np.array([[0, 0, 1, 1], [0, 0, 1, VOID]], np.int16)
    pred = np.array([[0, 1, 1, 1], [0, 0, 2, 2]], np.int16)
    c = image_counts(pred, gt, 3, dense=gt)
    s = scores([c], ["a", "b", "c"])
    # class a: inter 3, union 4 -> 0.75; class b: inter 2, union 4 -> 0.5; class c: not labelled -> not in the mean
    assert s["miou"] == pytest.approx((0.75 + 0.5) / 2)
    assert s["per_class_iou"] == {"a": 0.75, "b": 0.5, "c": 0.0}
    assert s["pixel_accuracy"] == pytest.approx(5 / 7) and s["agreement"] == pytest.approx(5 / 7)
    same = bootstrap_delta([c, c], [c, c], resamples=50)
    assert (same["delta"], same["low"], same["high"]) == (0.0, 0.0, 0.0)


def test_one_class_image_with_a_perfect_prediction_has_iou_one():
    gt = np.full((6, 5), 3, np.int16)
    gt[0, 0] = VOID
    s = scores([image_counts(gt.copy(), gt, 4)], ["a", "b", "c", "d"])
    assert s["miou"] == 1.0 and s["per_class_iou"] == {"a": None, "b": None, "c": None, "d": 1.0} and s["pixel_accuracy"] == 1.0


def test_a_released_head_file_gives_the_logits_its_keys_say(tmp_path):
    """A state dict with DINOv2's key names (written by hand, as mmsegmentation saves a ``BNHead``, under
    ``state_dict``): logits = conv_seg(BN(x)) with the file's running statistics, computed here by formula."""
    g = torch.Generator().manual_seed(0)
    c, k = 6, 3
    sd = {"decode_head.conv_seg.weight": torch.randn(k, c, 1, 1, generator=g), "decode_head.conv_seg.bias": torch.randn(k, generator=g),
          "decode_head.bn.weight": torch.rand(c, generator=g) + 0.5, "decode_head.bn.bias": torch.randn(c, generator=g),
          "decode_head.bn.running_mean": torch.randn(c, generator=g), "decode_head.bn.running_var": torch.rand(c, generator=g) + 0.5,
          "decode_head.bn.num_batches_tracked": torch.tensor(100), "backbone.x": torch.zeros(1)}
    torch.save({"meta": {}, "state_dict": sd}, tmp_path / "dinov2_head.pth")
    head = load_head(tmp_path / "dinov2_head.pth", c, k)
    x = torch.randn(2, 4, 5, c, generator=g)
    bn = (x - sd["decode_head.bn.running_mean"]) / torch.sqrt(sd["decode_head.bn.running_var"] + 1e-5) * sd["decode_head.bn.weight"] \
        + sd["decode_head.bn.bias"]
    want = (bn @ sd["decode_head.conv_seg.weight"][:, :, 0, 0].T + sd["decode_head.conv_seg.bias"]).permute(0, 3, 1, 2)
    torch.testing.assert_close(head(x), want, rtol=1e-5, atol=1e-5)


def test_linear_head_keys_round_trip_and_refusals(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(600, 8)).astype(np.float32)
    y = (x[:, 0] > 0).astype(int)
    shares = np.eye(2, dtype=np.float32)[y]
    head, info = train_linear_head(x, shares, np.ones(600, np.float32), steps=300, batch_size=128, lr=1e-2)
    assert info["loss_last"] < 0.5 * info["loss_first"] and info["steps"] == 300
    acc = (head(torch.from_numpy(x)[:, None, None, :]).argmax(1)[:, 0, 0].numpy() == y).mean()
    assert acc > 0.95
    assert set(head.state_dict()) >= {"decode_head.bn.weight", "decode_head.bn.running_mean", "decode_head.conv_seg.weight"}
    torch.save({"state_dict": head.state_dict()}, tmp_path / "h.pth")
    back = load_head(tmp_path / "h.pth", 8, 2)
    f = torch.randn(1, 3, 3, 8)
    torch.testing.assert_close(back(f), head(f))
    with pytest.raises(DataError, match="a head for 8 channels and 2 classes; the features have 16 channels"):
        load_head(tmp_path / "h.pth", 16, 2)
    torch.save({"x": torch.zeros(1)}, tmp_path / "bad.pth")
    with pytest.raises(DataError, match="not a DINOv2 linear head; missing decode_head.conv_seg.weight"):
        load_head(tmp_path / "bad.pth", 8, 2)


def test_bad_head_files_are_refused_in_one_line(tmp_path):
    from attnpatch.evals.segmentation.heads import read_head

    sd = {"decode_head.conv_seg.weight": torch.zeros(3, 8, 1, 1), "decode_head.conv_seg.bias": torch.zeros(3),
          **{f"decode_head.bn.{n}": torch.zeros(4) for n in ("weight", "bias", "running_mean", "running_var")}}
    torch.save(sd, tmp_path / "bn.pth")
    (tmp_path / "junk.pth").write_bytes(b"not a torch file at all")
    for path, says in [(tmp_path / "bn.pth", r"decode_head.bn.weight has shape \(4,\); the head's conv_seg \(3 classes, 8 channels\) needs \[8\]"),
                       (tmp_path / "junk.pth", r"not a file torch.load reads \(UnpicklingError\); expected a DINOv2 linear head"),
                       (tmp_path / "none.pth", r"none.pth: no such file")]:
        with pytest.raises(DataError, match=says) as err:
            read_head(path)
        assert "\n" not in str(err.value)


def test_patch_sample_spreads_over_every_image():
    """max_patches below the number of images: every other image gives one, not the first ones all."""
    from attnpatch.evals.segmentation.heads import PatchSample

    s = PatchSample(3, 6, 2)
    lab = np.zeros((8, 8), np.int16)
    for i in range(6):
        s.add(i, torch.full((2, 2, 4), float(i)), lab)
    feats, _, _ = s.arrays()
    assert s.count == 3 and sorted(set(feats[:, 0].tolist())) == [1.0, 3.0, 5.0]


def test_knn_bank_votes_for_the_nearest_labels():
    feats = np.array([[1, 0], [0.9, 0.1], [0, 1], [0.1, 0.9]], np.float32)
    shares = np.array([[1, 0], [1, 0], [0, 1], [0, 1]], np.float32)
    bank = KnnBank(feats, shares, k=2, temperature=0.02)
    votes = bank(torch.tensor([[[[2.0, 0.1]], [[0.0, 3.0]]]]))  # [1, 2, 1, 2]
    assert votes.shape == (1, 2, 2, 1)
    assert votes[0, :, 0, 0].argmax() == 0 and votes[0, :, 1, 0].argmax() == 1
    torch.testing.assert_close(votes.sum(1), torch.ones(1, 2, 1))


# --------------------------------------------------------------------------- the eval end to end


@pytest.fixture(scope="module")
def voc(tmp_path_factory):
    return load_segmentation_set(str(write_voc(tmp_path_factory.mktemp("seg") / "voc")))


def test_run_exact_limit_agrees_with_dense_and_approximations_run(voc):
    """FNA at s >= N (its exact limit) agrees with dense on every pixel with a zero mIoU difference; FNA at s = 4
    (min_tokens=0, so it runs) and ToMe report their own numbers; the JSON says how the read-outs were fitted."""
    model = _hf_dinov2()
    pre = square_preprocess((0.5,) * 3, (0.25,) * 3, 56)
    r = run_segmentation(model, voc, pre, settings=[("fna", {"s": 17, "min_tokens": 0}), ("fna", {"s": 4, "min_tokens": 0}),
                                                    ("tome", {"r": 4})],
                         max_patches=300, probe_steps=100, resamples=50, batch_size=3, examples=2)
    assert r["fit"] == "unpatched" and r["n_images"] == 4 and r["tokens"] == 17
    exact, approx, tome = r["runs"]
    for ro in ("linear", "knn"):
        assert exact[ro]["agreement"] == 1.0 and exact[ro]["miou"] == r["dense"][ro]["miou"]
        assert exact[ro]["miou_delta"]["delta"] == 0.0
        assert 0 <= approx[ro]["agreement"] <= 1 and 0 <= tome[ro]["agreement"] <= 1
    assert exact["note"].startswith("exact attention") and "note" not in approx
    assert len(r["examples"]["ids"]) == 2 and r["examples"]["dense"]["linear"][0].shape == (56, 56)
    assert r["patches"]["dense"] <= 300


def test_run_per_setting_fit_and_refusals(voc):
    model = _hf_dinov2()
    pre = square_preprocess((0.5,) * 3, (0.25,) * 3, 56)
    r = run_segmentation(model, voc, pre, settings=[("fna", {"s": 17, "min_tokens": 0})], fit="per-setting", readouts=["knn"],
                         max_patches=200, resamples=20)
    assert r["fit"] == "per-setting" and set(r["patches"]) == {"dense", "0"} and r["runs"][0]["knn"]["agreement"] == 1.0
    with pytest.raises(OptionError, match=r"fit='both': choose from unpatched, per-setting"):
        run_segmentation(model, voc, pre, settings=[], fit="both")
    with pytest.raises(OptionError, match=r"readouts=\['svm'\]: choose from linear, knn"):
        run_segmentation(model, voc, pre, settings=[], readouts=["svm"])


def test_a_method_without_per_patch_output_is_refused_before_loading(monkeypatch):
    """A registered method that changes the token count without a source map is refused by the CLI in one line
    before any model loads (the model path does not exist)."""
    import dataclasses

    from attnpatch.cli import main
    from attnpatch.patchers import registry

    tome = registry.get_method("tome")
    monkeypatch.setitem(registry.METHODS, "drop_tokens", dataclasses.replace(tome, name="drop_tokens", token_map=False))
    with pytest.raises(UnsupportedModelError, match="drop_tokens: changes the token count without a source map"):
        from attnpatch.evals.segmentation import check_dense_methods

        check_dense_methods(["fna", "drop_tokens"])
    assert main(["eval", "segmentation", "--data", "/nonexistent", "--model", "/nonexistent/model", "--method", "drop_tokens"]) == 2


@pytest.mark.parametrize("how,says", [
    ("size", "val_002.png: label map of 40x56 px"), ("label", "label values [7] are neither classes nor void"),
    ("split", "val.txt: missing split file"), ("empty", "voc/val: the split is empty"),
])
def test_cli_refuses_a_bad_set_before_the_model_loads(tmp_path, capsys, how, says):
    """Each bad set is refused in one line; the model path does not exist, so nothing was loaded before it."""
    from attnpatch.cli import main

    root = _broken(tmp_path, how)
    rc = main(["eval", "segmentation", "--data", str(root), "--model", "/nonexistent/model", "--json", str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    assert rc == 2 and says in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("extra,says", [
    (["--temperature", "-1"], "argument --temperature: -1: must be a positive finite number"),
    (["--examples", "-1"], "argument --examples: "),
    (["--head", "/nonexistent/head.pth"], "--head /nonexistent/head.pth: no such file"),
    (["--method", "anchor_attention"], "anchor_attention"),
])
def test_cli_refuses_bad_options_before_the_model_loads(tmp_path, capsys, extra, says):
    from attnpatch.cli import main

    root = write_voc(tmp_path / "voc")
    try:
        rc = main(["eval", "segmentation", "--data", str(root), "--model", "/nonexistent/model", *extra])
    except SystemExit as stop:  # argparse's own refusal
        rc = stop.code
    err = capsys.readouterr().err
    assert rc == 2 and says in err and "/nonexistent/model" not in err, err


def test_cli_end_to_end_and_compare_on_a_datasets_dataset(tmp_path, tiny_vit_dir, capsys):
    """The CLI on a VOC folder writes the JSON (no arrays in it), the Markdown and both PNGs; compare takes a datasets
    dataset with its columns and class names."""
    datasets = pytest.importorskip("datasets")
    from attnpatch.cli import main

    root = write_voc(tmp_path / "voc", size=70)
    out = tmp_path / "seg.json"
    rc = main(["eval", "segmentation", "--data", str(root), "--model", str(tiny_vit_dir), "--resolution", "70", "--method",
               "fna:s=26,min_tokens=0", "tome:r=2", "--max-patches", "500", "--probe-steps", "50", "--examples", "2",
               "--json", str(out), "--markdown", str(tmp_path / "seg.md")])
    assert rc == 0, capsys.readouterr().err
    res = json.loads(out.read_text())
    assert res["fit"] == "unpatched" and res["example_ids"] == ["val_000", "val_001"] and "examples" not in res
    assert res["runs"][0]["linear"]["agreement"] == 1.0 and res["linear"]["training"]["dense"]["steps"] == 50
    assert (tmp_path / "seg.png").is_file() and (tmp_path / "seg_examples.png").is_file() and (tmp_path / "seg.md").is_file()
    d = load_segmentation_set(str(root))
    rows = {"image": [d.train.image(i) for i in range(4)], "mask": [d.train.labels(i).clip(0).astype(np.uint8).tolist() for i in range(4)]}
    feats = datasets.Features({"image": datasets.Image(), "mask": datasets.Array2D((70, 70), "uint8")})
    ds = datasets.Dataset.from_dict(rows, features=feats)
    datasets.DatasetDict({"train": ds, "validation": ds}).save_to_disk(str(tmp_path / "set"))
    rc = main(["compare", "--eval", "segmentation", "--data", str(tmp_path / "set"), "--mask-column", "mask", "--classnames", "bg,red,green",
               "--model", str(tiny_vit_dir), "--resolution", "70", "--method", "tome:r=2", "--max-patches", "300",
               "--json", str(tmp_path / "c.json")])
    assert rc == 0, capsys.readouterr().err
    assert json.loads((tmp_path / "c.json").read_text())["rows"][0]["metric"] is not None


def test_cli_refuses_a_model_without_patch_tokens_before_any_image_is_encoded(tmp_path, capsys, tiny_lm_dir):
    from attnpatch.cli import main

    root = write_voc(tmp_path / "voc")
    rc = main(["eval", "segmentation", "--data", str(root), "--model", str(tiny_lm_dir), "--json", str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    assert rc == 2 and "is a causal LM (LlamaForCausalLM), not a ViT image encoder" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow
@pytest.mark.skipif(not SHARED.is_dir(), reason="needs ../shared/data/tuxpaint-seg")
def test_real_checkpoint_on_tuxpaint_seg(dinov2_small, tmp_path):
    """dinov2-small on 16 train / 16 val images of tuxpaint-seg at 224 px: the dense linear probe and k-NN beat the
    all-background prediction (mIoU about 0.86 / 9 classes = 0.096; measured 0.175 and 0.148 when written) and find the
    background (IoU 0.90 and 0.90), FNA at its exact limit agrees with dense on every pixel, and ToMe (r = 16) gives a
    prediction per pixel that mostly agrees with dense."""
    model, processor = dinov2_small
    data = load_segmentation_set(str(SHARED), limit=16)
    ad = adapter_for(model)
    pc = ad.preprocess_config(model, processor)
    r = run_segmentation(model, data, square_preprocess(pc.mean, pc.std, 224),
                         settings=[("fna", {"s": 257, "min_tokens": 0}), ("tome", {"r": 16})], max_patches=4000, resamples=100)
    for ro in ("linear", "knn"):
        assert r["dense"][ro]["miou"] > 0.12 and r["dense"][ro]["per_class_iou"]["background"] > 0.8
        assert r["runs"][0][ro]["agreement"] == 1.0
        assert r["runs"][1][ro]["agreement"] > 0.8


def test_readouts_fitted_once_give_what_a_fresh_run_gives_on_any_share_of_val(voc):
    """``fit_readouts`` + ``run_segmentation(fitted=)`` is the run without it (same head, same seed); a val subset
    scores its own images; read-outs not fitted are refused."""
    import dataclasses

    from attnpatch.evals.segmentation import fit_readouts

    model = _hf_dinov2()
    pre = square_preprocess((0.5,) * 3, (0.25,) * 3, 56)
    kw = dict(max_patches=300, probe_steps=50, resamples=0, batch_size=2, examples=0)
    settings = [("tome", {"r": 4})]
    fresh = run_segmentation(model, voc, pre, settings=settings, readouts=["linear"], **kw)
    fitted = fit_readouts(model, voc, pre, readouts=["linear"], max_patches=300, probe_steps=50, batch_size=2)
    again = run_segmentation(model, voc, pre, settings=settings, readouts=["linear"], fitted=fitted, **kw)
    assert again["runs"][0]["linear"]["agreement"] == fresh["runs"][0]["linear"]["agreement"]
    assert again["dense"]["linear"]["miou"] == fresh["dense"]["linear"]["miou"]
    share = dataclasses.replace(voc, val=voc.val.subset([3, 1]))
    assert share.val.ids == [voc.val.ids[3], voc.val.ids[1]] and (share.val.labels(0) == voc.val.labels(3)).all()
    part = run_segmentation(model, share, pre, settings=settings, readouts=["linear"], fitted=fitted, **kw)
    assert part["n_images"] == 2
    with pytest.raises(OptionError, match="fitted: read-outs fitted once"):
        run_segmentation(model, voc, pre, settings=settings, readouts=["knn"], fitted=fitted, **kw)


def test_tune_on_segmentation_agreement_searches_a_val_share_and_reports_the_rest(voc):
    from attnpatch.evals.tune.targets import seg_agreement, tune_seg_agreement
    from attnpatch.evals.segmentation import fit_readouts

    model = _hf_dinov2()
    pre = square_preprocess((0.5,) * 3, (0.25,) * 3, 56)
    res = tune_seg_agreement(model, voc, pre, "tome", target=0.8, batch_size=2, max_patches=300, probe_steps=50,
                             max_candidates=3, repeats=3)
    assert res["calibration"] == 2 and res["held_out"] == 2 and len(res["measured"]) <= 3
    for w in res["winners"]:
        assert w["agreement"] >= 0.8
    if not res["chosen"].get("exact"):
        assert 0 <= res["held_out_result"]["agreement"] <= 1
    # the measure is the eval's agreement, approximations included; dense's maps are computed once and kept
    fitted = fit_readouts(model, voc, pre, readouts=["linear"], max_patches=300, probe_steps=50, batch_size=2)
    measure = seg_agreement(model, voc, pre, fitted, batch_size=2)
    calls = []
    hook = model.register_forward_hook(lambda *a: calls.append(1))
    try:
        assert measure([("fna", {"s": 17, "min_tokens": 0})]) == [1.0]  # FNA's exact limit agrees on every pixel
        batches = -(-len(voc.val) // 2)
        assert len(calls) == 2 * batches  # dense, then the setting
        settings = [("tome", {"r": 6}), ("fna", {"s": 6, "min_tokens": 0, "sample_layer": 0})]
        got = measure(settings)
        assert len(calls) == 4 * batches  # the settings alone
    finally:
        hook.remove()
    ev = run_segmentation(model, voc, pre, settings=settings, readouts=["linear"], fitted=fitted, batch_size=2,
                          resamples=0, examples=0)
    assert got == [r["linear"]["agreement"] for r in ev["runs"]]
    assert got[0] < 1.0 or got[1] < 1.0  # the approximations ran


def test_tome_fna_reads_out_one_feature_per_patch_and_is_dense_at_its_exact_limits(voc):
    model = _hf_dinov2()
    pre = square_preprocess((0.5,) * 3, (0.25,) * 3, 56)
    r = run_segmentation(model, voc, pre, settings=[("tome+fna", {"r": 0, "s": 17, "min_tokens": 0}),
                                                    ("tome+fna", {"r": 2, "s": 6, "min_tokens": 0, "sample_layer": 0})],
                         readouts=["linear"], max_patches=300, probe_steps=50, resamples=0, batch_size=2, examples=0)
    exact, approx = r["runs"]
    assert exact["linear"]["agreement"] == 1.0 and exact["linear"]["miou"] == r["dense"]["linear"]["miou"]
    assert 0 <= approx["linear"]["agreement"] <= 1
